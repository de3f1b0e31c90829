"""scripts/train.sh: torchrun across two 'nodes' on this machine (one process each, gloo)."""
import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.factory import free_port, python_env, run, write_shards

ROOT = Path(__file__).resolve().parents[2]
TRAIN_SH = str(ROOT / 'scripts' / 'train.sh')


@pytest.mark.parametrize('rendezvous', ['static', 'c10d'])
def test_two_nodes_train_one_run(tmp_path, rendezvous):
    write_shards(tmp_path / 'shards', 4, 8)
    port = free_port()
    nodes = []
    for node_rank in range(2):
        env = dict(NNODES=2, NPROC_PER_NODE=1)
        if rendezvous == 'static':
            env.update(NODE_RANK=node_rank, MASTER_ADDR='127.0.0.1', MASTER_PORT=port)
        else:
            env.update(RDZV_ENDPOINT=f'127.0.0.1:{port}', RDZV_ID='test')
        cmd = ['bash', TRAIN_SH, 'diffclip-tiny', '--train_data', 'shards', '--epochs', '1', '--global_batch_size', '8',
               '--logs', f'node{node_rank}']  # the same run; a directory per node, as on machines of their own
        nodes.append(subprocess.Popen(cmd, cwd=tmp_path, env=python_env(**env), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs = []
    for node in nodes:
        try:
            outputs.append(node.communicate(timeout=240)[0])
        finally:
            node.kill()
    assert [n.returncode for n in nodes] == [0, 0], '\n'.join(o[-3000:] for o in outputs)
    writers = [d for d in ('node0', 'node1') if (tmp_path / d / 'diffclip-tiny' / 'data.jsonl').exists()]
    assert len(writers) == 1  # global rank 0 alone writes logs and checkpoints
    run_dir = tmp_path / writers[0] / 'diffclip-tiny'
    record = json.loads((run_dir / 'data.jsonl').read_text())
    ranks = [{os.path.basename(u) for u in r['shards']} for r in record['ranks']]
    assert len(ranks) == 2 and not ranks[0] & ranks[1] and len(ranks[0] | ranks[1]) == 4
    assert (run_dir / 'checkpoints' / 'epoch_1.pt').exists()


def test_usage_without_a_recipe(tmp_path):
    result = run(['bash', TRAIN_SH], cwd=tmp_path)
    assert result.returncode == 2 and 'scripts/train.sh RECIPE' in result.stderr


def test_slurm_script_parses():
    subprocess.run(['bash', '-n', str(ROOT / 'scripts' / 'slurm' / 'train.sbatch')], check=True)
