"""Distributed training on CPU: real torchrun processes talking over gloo."""
import json
import sys
from pathlib import Path

import pytest

from tests.factory import run

pytestmark = pytest.mark.slow  # real torchrun processes

HERE = Path(__file__).resolve().parent


def test_a_ddp_step_equals_the_single_process_step_on_the_global_batch(tmp_path):
    out = tmp_path / 'errors.json'
    result = run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc-per-node', '2',
                  str(HERE / 'ddp_gradients.py'), str(out)], cwd=tmp_path, timeout=180)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report['world_size'] == 2
    assert len(report['errors']) == report['parameters'] > 50  # every parameter got a gradient under DDP
    worst = max(report['errors'], key=report['errors'].get)
    assert report['errors'][worst] < 1e-4, (worst, report['errors'][worst])
