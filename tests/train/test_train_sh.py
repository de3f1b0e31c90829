"""scripts/train.sh, starting torchrun itself or started by it (`torchrun … scripts/train.sh -- RECIPE …`, with
Python or --no-python). Across two 'nodes' on this machine (gloo): a job of a process per node whose node is lost
mid-run, then restarted on both, resuming with nothing lost or repeated (c10d rendezvous, then a static master)."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.factory import as_in_a_terminal, free_port, kill_tree, python_env, run, write_shards

pytestmark = pytest.mark.slow  # real torchrun launchers

ROOT = Path(__file__).resolve().parents[2]
TRAIN_SH = str(ROOT / 'scripts' / 'train.sh')


def _launch(tmp_path, node_rank: int, port: int, argv, rendezvous: str):
    """One node's launcher as a SLURM or plain multi-node user starts it: the same command on every node,
    NNODES, its node rank and a c10d rendezvous or a static master; --logs on storage both nodes share."""
    if rendezvous == 'c10d':
        if node_rank:
            time.sleep(2)  # node 0 first, so that its launcher hosts the rendezvous store (the node that lives on)
        env = python_env(NNODES=2, NPROC_PER_NODE=1, NODE_RANK=node_rank, RDZV_ENDPOINT=f'127.0.0.1:{port}',
                         RDZV_ID=f'job{port}')
    else:
        env = python_env(NNODES=2, NPROC_PER_NODE=1, NODE_RANK=node_rank, MASTER_ADDR='127.0.0.1', MASTER_PORT=port)
    return subprocess.Popen(['bash', TRAIN_SH, 'diffclip-tiny', *argv], cwd=tmp_path, env=env, text=True,
                            stdout=open(tmp_path / f'node{node_rank}-{port}.log', 'w'), stderr=subprocess.STDOUT)


def _steps(run_dir) -> list:
    path = run_dir / 'lambda.jsonl'
    return [json.loads(line)['step'] for line in path.read_text().splitlines()] if path.exists() else []


def _optimizer_steps(state) -> set:
    return {int(s['step']) for s in state['optimizer']['state'].values()}


def test_a_lost_node_ends_the_job_clearly_and_a_restart_of_both_resumes(tmp_path):
    """2 nodes × 1 process, 4 shards of 8, batch 8: 4 steps an epoch, 2 epochs, started with a c10d rendezvous.
    Node 1's launcher and its worker are killed (SIGKILL, as a node losing power) a step into epoch 2, three
    before its end; node 0 must stop with a message naming what happened and what to do. The same command on both
    nodes, started this time with a static master (NODE_RANK, MASTER_ADDR, MASTER_PORT), resumes from epoch 1's
    checkpoint, its optimizer state included; the data accounting shows every sample of every epoch trained once,
    and global rank 0 alone prints the plan (node 1's process is a local rank 0 too)."""
    write_shards(tmp_path / 'shards', 4, 8)
    argv = ['--train_data', 'shards', '--epochs', '2', '--global_batch_size', '8', '--logs', 'runs']
    run_dir = tmp_path / 'runs' / 'diffclip-tiny'
    checkpoints = run_dir / 'checkpoints'
    steps_per_epoch = 4
    port = free_port()
    nodes = [_launch(tmp_path, rank, port, argv, 'c10d') for rank in range(2)]
    start = time.monotonic()
    try:
        while time.monotonic() - start < 240 and max(_steps(run_dir), default=0) < steps_per_epoch + 1:
            assert all(n.poll() is None for n in nodes), (tmp_path / f'node0-{port}.log').read_text()[-3000:]
            time.sleep(0.05)
        kill_tree(nodes[1].pid)
        nodes[1].wait()
        nodes[0].wait(timeout=180)
    finally:
        for node in nodes:
            kill_tree(node.pid)
    survivor = (tmp_path / f'node0-{port}.log').read_text()
    assert nodes[0].returncode != 0
    assert 'lost contact with another process of this job' in survivor, survivor[-4000:]
    assert 'run the same command on every node to resume' in survivor
    assert sorted(p.name for p in checkpoints.glob('*.pt')) == ['epoch_1.pt', 'epoch_latest.pt']
    killed = torch.load(checkpoints / 'epoch_latest.pt', map_location='cpu', weights_only=True, mmap=True)
    assert killed['epoch'] == 1 and _optimizer_steps(killed) == {steps_per_epoch}

    port = free_port()
    nodes = [_launch(tmp_path, rank, port, argv, 'static') for rank in range(2)]
    try:
        for node in nodes:
            node.wait(timeout=240)
    finally:
        for node in nodes:
            kill_tree(node.pid)
    logs = [(tmp_path / f'node{rank}-{port}.log').read_text() for rank in range(2)]
    assert [n.returncode for n in nodes] == [0, 0], '\n'.join(log[-3000:] for log in logs)
    assert ['run directory: runs/diffclip-tiny' in log for log in logs] == [True, False]  # node 0 holds rank 0
    assert "=> resuming checkpoint 'runs/diffclip-tiny/checkpoints/epoch_latest.pt' (epoch 1)" in (
        run_dir / 'out.log').read_text()
    records = [json.loads(line) for line in (run_dir / 'data.jsonl').read_text().splitlines()]
    assert [r['epoch'] for r in records] == [1, 2]  # epoch 2 once: the lost run never finished it
    for record in records:
        assert len(record['ranks']) == 2
        assert (record['samples_trained'], record['samples_distinct'], record['samples_repeated']) == (32, 32, 0)
        shards = [{os.path.basename(u) for u in r['shards']} for r in record['ranks']]
        assert all(shards) and len(set().union(*shards)) == sum(map(len, shards)) == 4  # each rank its own shards
    final = torch.load(checkpoints / 'epoch_2.pt', map_location='cpu', weights_only=True, mmap=True)
    assert final['epoch'] == 2
    # AdamW's step count went on from the saved state: the optimizer was restored, not rebuilt
    assert _optimizer_steps(final) == {2 * steps_per_epoch}
    assert _steps(run_dir) == list(range(2 * steps_per_epoch + 1))  # every optimizer step logged once (0: before)


def _epoch(checkpoint):
    return torch.load(checkpoint, map_location='cpu', weights_only=True, mmap=True)['epoch']


def test_ctrl_c_ends_on_one_line_naming_the_checkpoint_and_the_same_command_resumes_from_it(tmp_path):
    """Ctrl-C (SIGINT to the launcher's process group, as a terminal sends it) once epoch 1 is checkpointed: the
    output ends on one line naming the checkpoint, exit 130, no traceback; the same command again says first that
    it resumes from that epoch, and the plan's header names the recipe and the run."""
    write_shards(tmp_path / 'shards', 2, 8)
    cmd = ['bash', TRAIN_SH, 'clip-tiny-baseline', '--train_data', 'shards', '--epochs', '100', '--global_batch_size',
           '8', '--name', 'first']
    latest = tmp_path / 'runs' / 'first' / 'checkpoints' / 'epoch_latest.pt'

    def interrupted(ready, name):
        out, err = tmp_path / f'{name}.out', tmp_path / f'{name}.err'
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=python_env(NPROC_PER_NODE=1), text=True,
                                stdout=open(out, 'w'), stderr=open(err, 'w'), start_new_session=True,
                                preexec_fn=as_in_a_terminal)
        try:
            start = time.monotonic()
            while not ready(out.read_text()) and proc.poll() is None and time.monotonic() - start < 240:
                time.sleep(0.05)
            assert proc.poll() is None, err.read_text()[-3000:]
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(timeout=120)
        finally:
            kill_tree(proc.pid)
        return proc.returncode, out.read_text(), err.read_text()

    code, out, err = interrupted(lambda _: latest.exists(), 'first')
    assert out.startswith(f'diffzoo.train: recipe clip-tiny-baseline ({ROOT}/diffzoo/recipes/clip-tiny-baseline.yaml)'
                          f', run first\n'), out[:300]
    epoch = _epoch(latest)
    assert code == 130 and 'Traceback' not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == (f'interrupted: run the same command again to resume from epoch {epoch} '
                                            f'(checkpoint runs/first/checkpoints/epoch_latest.pt)'), err[-3000:]

    resuming = f'resuming first from epoch {epoch} of 100 (checkpoint runs/first/checkpoints/epoch_latest.pt)'
    code, out, err = interrupted(lambda text: resuming in text, 'again')
    assert out.splitlines()[out.splitlines().index('run directory: runs/first') + 1] == resuming
    assert code == 130 and 'Traceback' not in err, err[-3000:]


VENV = ROOT / '.venv' / 'bin' / 'python'


@pytest.fixture(scope='module')
def failed_run(tmp_path_factory):
    """scripts/train.sh on data that does not exist, from a shell without the venv (PATH without a python that has
    torch, no PYTHON or VIRTUAL_ENV) where the project's .venv exists, as after `make demo` / `make test`."""
    env = python_env(NPROC_PER_NODE=1)
    if VENV.exists():
        env = {k: v for k, v in env.items() if k not in ('PYTHON', 'VIRTUAL_ENV')}
        env['PATH'] = '/usr/bin:/bin'  # no python with torch on it
    return subprocess.run(['bash', TRAIN_SH, 'diffclip-tiny', '--train_data', 'missing'],
                          cwd=tmp_path_factory.mktemp('failed'), env=env, capture_output=True, text=True, timeout=300)


def test_a_failed_run_ends_on_its_own_error_and_exit_status(failed_run):
    """torchrun's report of a failed process (ChildFailedError's traceback, its summary) is left out: the last line
    is diffzoo's error, and the exit status the process's own (2: a bad input)."""
    assert failed_run.returncode == 2, failed_run.stderr[-3000:]
    assert failed_run.stderr.strip().splitlines()[-1] == (
        "error: train_data 'missing' matches no shard (missing does not exist); pass --train_data DIR")
    assert 'Traceback' not in failed_run.stderr and 'ChildFailedError' not in failed_run.stderr


def test_usage_without_a_recipe(tmp_path):
    result = run(['bash', TRAIN_SH], cwd=tmp_path)
    assert result.returncode == 2 and 'scripts/train.sh RECIPE' in result.stderr


def test_the_script_is_bash_and_python():
    """torchrun runs scripts/train.sh with Python unless --no-python: the file parses as both, warning-free."""
    subprocess.run(['bash', '-n', TRAIN_SH], check=True)
    subprocess.run([sys.executable, '-W', 'error', '-c', f'compile(open({TRAIN_SH!r}).read(), "train.sh", "exec")'],
                   check=True)


def test_a_stray_double_dash_is_named(tmp_path):
    """One `--` after the script is dropped (torchrun's form); a second where the recipe belongs is an error."""
    result = run(['bash', TRAIN_SH, '--', '--', 'diffclip-tiny'], cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith("error: scripts/train.sh: '--' where the recipe should be; the recipe comes "
                                    "first, after at most one '--' (torchrun [torchrun flags] scripts/train.sh -- "
                                    "RECIPE"), result.stderr


TORCHRUN = str(Path(sys.executable).parent / 'torchrun')


def _torchrun(flags, args, cwd, timeout=300):
    """torchrun FLAGS scripts/train.sh ARGS, as a user runs it (a free port, this interpreter's torchrun)."""
    return subprocess.run([TORCHRUN, *flags, TRAIN_SH, *args], cwd=cwd, env=python_env(), capture_output=True,
                          text=True, timeout=timeout)


def test_torchrun_runs_the_script_for_help_and_a_failed_run(tmp_path):
    """`torchrun … scripts/train.sh --help` prints the usage once (rank 0) and exits 0; a bad input ends its process
    on the same error line as `scripts/train.sh` itself, exit status 2 (torchrun then adds its own report)."""
    helped = _torchrun(['--standalone', '--nproc-per-node', '2'], ['--help'], tmp_path)
    assert helped.returncode == 0, helped.stderr[-3000:]
    assert helped.stdout.count('Train a recipe through open_clip_train') == 1, helped.stdout
    assert 'torchrun [torchrun flags] scripts/train.sh -- RECIPE' in helped.stdout
    failed = _torchrun(['--standalone', '--nproc-per-node', '1'], ['--', 'diffclip-tiny', '--train_data', 'missing'],
                       tmp_path)
    assert failed.returncode != 0
    assert ("error: train_data 'missing' matches no shard (missing does not exist); pass --train_data DIR\n"
            in failed.stderr), failed.stderr[-3000:]
    assert 'exitcode  : 2' in failed.stderr  # torchrun's report of the process: the launcher's own exit status


def test_torchrun_launches_the_script_on_two_processes_and_no_python_resumes_it(tmp_path):
    """The README's multi-GPU form on CPU (gloo): `torchrun --nproc-per-node 2 scripts/train.sh -- RECIPE … --logs
    runs` trains one epoch on two processes (--logs, which torchrun alone refuses as a prefix of its --logs-specs,
    reaches the recipe), rank 0 alone printing; `torchrun --no-python` (bash runs the script) with --epochs 2
    resumes it from epoch 1 as scripts/train.sh would."""
    write_shards(tmp_path / 'shards', 4, 8)
    args = ['diffclip-tiny', '--train_data', 'shards', '--global_batch_size', '8', '--logs', 'runs']
    first = _torchrun(['--standalone', '--nproc-per-node', '2'], ['--', *args, '--epochs', '1'], tmp_path)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert first.stdout.count('run directory: runs/diffclip-tiny\n') == 1  # the plan: rank 0's
    assert 'derived for 2 process(es)' in first.stdout
    run_dir = tmp_path / 'runs' / 'diffclip-tiny'
    record, = [json.loads(line) for line in (run_dir / 'data.jsonl').read_text().splitlines()]
    assert len(record['ranks']) == 2 and record['samples_trained'] == 32
    assert _epoch(run_dir / 'checkpoints' / 'epoch_1.pt') == 1

    again = _torchrun(['--standalone', '--nproc-per-node', '2', '--no-python'], ['--', *args, '--epochs', '2'],
                      tmp_path)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert ('resuming diffclip-tiny from epoch 1 of 2 (checkpoint runs/diffclip-tiny/checkpoints/epoch_latest.pt)'
            in again.stdout), again.stdout[-3000:]
    assert _epoch(run_dir / 'checkpoints' / 'epoch_2.pt') == 2
    assert [json.loads(line)['epoch'] for line in (run_dir / 'data.jsonl').read_text().splitlines()] == [1, 2]


def test_slurm_script_parses():
    subprocess.run(['bash', '-n', str(ROOT / 'scripts' / 'slurm' / 'train.sbatch')], check=True)


@pytest.mark.skipif(not VENV.exists(), reason='no project .venv (make builds it)')
def test_the_project_venv_is_used_when_no_environment_is_active(failed_run):
    """After `make demo` / `make test`, the README's scripts/train.sh works from a shell without the venv."""
    assert 'No module named' not in failed_run.stderr
    assert failed_run.returncode != 0 and 'matches no shard' in failed_run.stdout + failed_run.stderr
