"""scripts/slurm/train.sbatch run as sbatch runs it (bash, SLURM's variables set), with stand-ins for `scontrol` and
`srun` on PATH: the stand-in scontrol prints the job's host names one a line, as scontrol does; the stand-in srun
prints what it was asked to start and the rendezvous the script exported for it."""
import os
import subprocess
from pathlib import Path

import pytest

SBATCH = Path(__file__).resolve().parents[2] / 'scripts' / 'slurm' / 'train.sbatch'
JOB_ID = 4242
PORT = 20000 + JOB_ID % 20000

SCONTROL = """#!/usr/bin/env bash
# scontrol show hostnames LIST: one name a line; HOSTS of them, or a failure as FAIL says
[ "$1 $2" = "show hostnames" ] || exit 64
if [ -n "${FAIL:-}" ]; then echo "scontrol: error: $FAIL" >&2; exit 1; fi
for ((i = 1; i <= HOSTS; i++)); do printf 'node-%05d\\n' "$i"; done
"""
SRUN = """#!/usr/bin/env bash
echo "srun $*"
echo "RDZV_ENDPOINT=$RDZV_ENDPOINT NNODES=$NNODES"
"""


@pytest.fixture
def slurm(tmp_path):
    bin_dir = tmp_path / 'bin'
    bin_dir.mkdir()
    for name, text in (('scontrol', SCONTROL), ('srun', SRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)

    def sbatch(hosts: int, **env) -> subprocess.CompletedProcess:
        environment = {k: v for k, v in os.environ.items() if not k.startswith('SLURM_')}
        environment.update(PATH=f'{bin_dir}{os.pathsep}{os.environ["PATH"]}', HOSTS=str(hosts),
                           SLURM_JOB_NODELIST=f'node-[00001-{hosts:05d}]', SLURM_NNODES=str(hosts),
                           SLURM_JOB_ID=str(JOB_ID), SLURM_SUBMIT_DIR=str(tmp_path), SLURM_CPUS_PER_TASK='8')
        environment.update(env)
        environment = {k: v for k, v in environment.items() if v is not None}
        return subprocess.run(['bash', str(SBATCH), 'diffclip-b16-cc12m', '--epochs', '1'], env=environment,
                              capture_output=True, text=True, timeout=60)
    return sbatch


def test_the_head_node_of_a_long_node_list_every_time(slurm):
    """2,000 host names: `scontrol … | head -n 1` under pipefail exited 141 without a word whenever scontrol was
    still writing after head had its line."""
    for attempt in range(20):
        result = slurm(2000)
        assert result.returncode == 0, f'run {attempt + 1}: exit {result.returncode}; {result.stderr!r}'
        assert result.stdout.splitlines() == [
            'srun --ntasks-per-node=1 --cpus-per-task=8 --kill-on-bad-exit=1 bash scripts/train.sh '
            'diffclip-b16-cc12m --epochs 1',
            f'RDZV_ENDPOINT=node-00001:{PORT} NNODES=2000']


def test_one_node(slurm):
    result = slurm(1)
    assert result.returncode == 0, result.stderr
    assert f'RDZV_ENDPOINT=node-00001:{PORT} NNODES=1' in result.stdout


@pytest.mark.parametrize('env, status, message', [
    (dict(FAIL='Unable to contact slurm controller'), 1,
     "train.sbatch: 'scontrol show hostnames node-[00001-00004]' failed (exit 1): no head node for the rendezvous"),
    (dict(HOSTS='0'), 1,
     "train.sbatch: 'scontrol show hostnames node-[00001-00004]' printed no host name: no head node for the "
     "rendezvous"),
    (dict(SLURM_JOB_NODELIST=None), 1, 'SLURM_JOB_NODELIST: is not set: submit this script with sbatch'),
])
def test_no_head_node_is_a_message_and_no_srun(slurm, env, status, message):
    result = slurm(4, **env)
    assert result.returncode == status
    assert message in result.stderr
    assert 'srun' not in result.stdout
