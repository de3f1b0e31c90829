"""`python -m diffzoo.bench.host`: the host's time a call of one attention layer, the Triton path's launches stubbed
on the CPU."""
import json

import pytest
import torch

from diffzoo.bench import host
from diffzoo.layers import kernels

pytestmark = pytest.mark.skipif(not kernels.HAS_TRITON, reason='needs Triton (the kernel path is timed)')


def test_each_layer_is_timed_in_blocks_and_the_launches_come_back_after(tmp_path, capsys):
    from diffzoo.layers.kernels import split_triton, triton_op
    before = {name: getattr(split_triton, name) for name in host.LAUNCHES}
    unsupported = triton_op.unsupported
    out = tmp_path / 'host.json'
    assert host.main(['--reps', '3', '--blocks', '2', '--out', str(out)]) == 0
    result = json.loads(out.read_text())
    assert result['stubbed'] and (result['dim'], result['heads']) == (128, 1)
    assert set(result['layers']) == {'triton', 'two_calls', 'sdpa'}
    for name, row in result['layers'].items():
        for kind in ('train', 'infer'):
            assert len(row[kind]['blocks_us']) == 2 and row[kind]['median_us'] > 0
            assert row[kind]['over_sdpa_us'] == pytest.approx(
                row[kind]['median_us'] - result['layers']['sdpa'][kind]['median_us'])
    assert 'Triton launches stubbed' in capsys.readouterr().out
    assert all(getattr(split_triton, name) is kernel for name, kernel in before.items())
    assert triton_op.unsupported is unsupported


def test_the_stubbed_layer_runs_the_kernel_path_and_cuda_without_a_gpu_is_refused(capsys):
    """Inside `stubbed_launches` a CPU layer with split_kernel='triton' takes the kernel's path (its backward node
    is the kernel's), where outside it falls back to SDPA."""
    m = host.layers(128, 1, torch.device('cpu'), torch.float32)['triton']
    x = torch.randn(1, 8, 128, requires_grad=True)
    with host.stubbed_launches():
        assert type(m(x).grad_fn).__name__ == '_EagerBackward'
    if not kernels.INTERPRETED:
        with pytest.warns(UserWarning, match='cannot take'):
            assert type(m(x).grad_fn).__name__ != '_EagerBackward'
    if not torch.cuda.is_available():
        assert host.main(['--device', 'cuda']) == 2
        assert '--device cuda: torch.cuda.is_available() is False here' in capsys.readouterr().err
