"""A stage sharded with FSDP2 over 2 real processes (torchrun, gloo on CPU): trained, saved (each shard gathered
by the stage's `whole_tensor`), and resumed on 1 process and on 2 (the stage's `copy_tensors` filling each shard of a
model built anew, in the same two processes): the weights equal a one-process run's at each point
(tests/vlm/fsdp_stage_worker.py runs each)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.factory import free_port
from tests.vlm.fsdp_stage_worker import train
from tests.vlm.models import write_chat_language_model, write_llava_sets

WORKER = Path(__file__).with_name('fsdp_stage_worker.py')
pytestmark = pytest.mark.slow


def _run(root: Path, processes: int, out: str, steps: int, start: str = None, then: tuple = None) -> None:
    """The worker in this process (one), or under torchrun over `processes` real processes; `then`: (OUT2, STEPS2),
    a resume from `out` in the same processes."""
    if processes == 1:
        return train(str(root / 'stage.yaml'), str(root / out), steps, str(root / start) if start else None)
    args = [str(root / 'stage.yaml'), str(root / out), str(steps)] + (['--from-stage', str(root / start)] if start else [])
    args += ['--then', str(root / then[0]), str(then[1])] if then else []
    launch = [sys.executable, '-m', 'torch.distributed.run', '--nproc-per-node', str(processes), '--master-port',
              str(free_port())]
    env = dict(os.environ, OMP_NUM_THREADS='1', HF_HUB_OFFLINE='1')
    done = subprocess.run(launch + [str(WORKER)] + args, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = 2 if then else 1
    assert done.stdout.count("parameters ['DTensor']") == processes * runs, done.stdout  # the parameters were shards


def _close(a: str, b: str, root: Path) -> None:
    x, y = load_file(str(root / a)), load_file(str(root / b))
    assert sorted(x) == sorted(y) and len(x) > 10
    for name in x:
        torch.testing.assert_close(x[name], y[name], rtol=1e-4, atol=1e-5, msg=name)


def test_a_stage_sharded_over_two_processes_saves_and_resumes_as_one_process_does(tmp_path):
    write_chat_language_model(tmp_path / 'lm')
    paths = write_llava_sets(tmp_path, count=8)
    recipe = {'model': {'type': 'build_vlm', 'vision': 'diffclip-tiny', 'language_model': str(tmp_path / 'lm'),
                        'select_layer': -2, 'projector': 'mlp2x_gelu', 'sequence_mask': 'causal'},
              'attention': {'type': 'differential', 'lambda_init': 0.5},
              'data': {'type': 'conversations', 'json': str(paths['instruct']), 'image_folder': str(tmp_path / 'images'),
                       'format': 'qwen2_instruct', 'max_length': 96},
              'train': {'projector': True, 'language_model': 'full'}, 'lr': 1e-3, 'batch_size': 4, 'seed': 0}
    (tmp_path / 'stage.yaml').write_text(yaml.safe_dump(recipe))
    _run(tmp_path, 1, 'one.safetensors', 3)
    _run(tmp_path, 2, 'sharded.safetensors', 3, then=('sharded-resumed-on-two.safetensors', 2))
    _close('one.safetensors', 'sharded.safetensors', tmp_path)  # the sharded stage's output: the same weights
    before = load_file(str(tmp_path / 'one.safetensors'))
    _run(tmp_path, 1, 'one-resumed.safetensors', 2, start='one.safetensors')
    moved = load_file(str(tmp_path / 'one-resumed.safetensors'))
    assert any(not torch.equal(before[k], moved[k]) for k in before)  # the resumed steps trained
    _run(tmp_path, 1, 'sharded-resumed-on-one.safetensors', 2, start='sharded.safetensors')
    _close('one-resumed.safetensors', 'sharded-resumed-on-one.safetensors', tmp_path)
    _close('one-resumed.safetensors', 'sharded-resumed-on-two.safetensors', tmp_path)
