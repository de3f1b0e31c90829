"""`split_kernel="auto"`: the kernel chosen from the device, dtype and token count alone (diffzoo.layers.kernels.dispatch)."""
import re
import warnings
from pathlib import Path

import pytest
import torch

from diffzoo.layers import DifferentialAttention, kernels

PERFORMANCE = Path(__file__).resolve().parents[2] / 'docs' / 'performance.md'
DTYPE_NAMES = {torch.bfloat16: 'bf16', torch.float16: 'fp16', torch.float32: 'fp32'}


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16, torch.float32])
def test_auto_takes_the_triton_kernel_on_cuda_exactly_up_to_its_row(dtype):
    rows = dict(kernels.TRITON_ON_CUDA)
    for n in (1, 77, 197, 577, 578, 4096, 4097, 16384):
        want = 'triton' if kernels.HAS_TRITON and dtype in rows and n <= rows[dtype] else 'two_calls'
        assert kernels.auto_split_kernel('cuda', dtype, n) == want, (dtype, n)
        assert kernels.auto_split_kernel('cpu', dtype, n) == 'four_calls'
    # what the GPU tests passed (docs/performance.md): bf16 to 4096 tokens, fp16 to 577
    assert rows == {torch.bfloat16: 4096, torch.float16: 577}


def test_the_documented_table_is_the_code_s():
    """docs/performance.md's table of the paths `auto` takes names every row of TRITON_ON_CUDA."""
    text = PERFORMANCE.read_text()
    for dtype, most in kernels.TRITON_ON_CUDA:
        name = DTYPE_NAMES[dtype]
        assert re.search(rf'\| CUDA \| {name} \| (1|up) to {most:,} tokens \| `triton` \|', text), (name, most)
        assert re.search(rf'\| CUDA \| {name} \| (above|over) {most:,} tokens \| `two_calls` \|', text), (name, most)


def _ops(fn):
    with torch.profiler.profile(acc_events=True) as prof:
        fn()
    return {e.name for e in prof.events() if e.name.startswith('diffzoo::')}


def test_auto_on_cpu_runs_four_calls_without_a_warning():
    m = DifferentialAttention(64, num_heads=2, qkv_bias=True)
    x = torch.randn(2, 9, 64, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        ops = _ops(lambda: m(x).sum().backward())
    assert 'diffzoo::split_diff_attention' not in ops


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not kernels.HAS_TRITON, reason='the table picks Triton on CUDA')
def test_auto_runs_the_kernel_on_cuda_where_the_table_says_and_sdpa_elsewhere_silently():
    """`auto` (the default) runs the custom op under bf16 and fp16 autocast at 9 tokens, forward and backward, and
    in eval; fp32, fp16 beyond its row, attention dropout and `two_calls` run SDPA, all without a warning."""
    m = DifferentialAttention(64, num_heads=2, qkv_bias=True).cuda()
    assert m.split_kernel == 'auto'
    short, long = torch.randn(2, 9, 64, device='cuda'), torch.randn(1, 600, 64, device='cuda')
    with warnings.catch_warnings():
        warnings.simplefilter('error', UserWarning)
        warnings.filterwarnings('ignore', message='.*Profiler clears events')
        for dtype in (torch.bfloat16, torch.float16):
            with torch.autocast('cuda', dtype):
                assert 'diffzoo::split_diff_attention' in _ops(lambda: m(short).float().sum().backward())
                with torch.no_grad():
                    assert 'diffzoo::split_diff_attention_inference' in _ops(lambda: m.eval()(short))
                m.train()
        with torch.autocast('cuda', torch.bfloat16):
            assert 'diffzoo::split_diff_attention' in _ops(lambda: m(long).float().sum().backward())
        with torch.autocast('cuda', torch.float16):
            assert not _ops(lambda: m(long).float().sum().backward())  # fp16 beyond 577 tokens
        assert not _ops(lambda: m(short).sum().backward())  # fp32
        m.attn_drop_p = 0.1
        with torch.autocast('cuda', torch.bfloat16):
            assert not _ops(lambda: m(short).float().sum().backward())
        m.attn_drop_p, m.split_kernel = 0.0, 'two_calls'
        with torch.autocast('cuda', torch.bfloat16):
            assert not _ops(lambda: m(short).float().sum().backward())
