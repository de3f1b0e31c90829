"""The host's time a call of one attention layer takes: the Triton split kernel's path against two_calls and timm's
attention, at sizes where the GPU keeps pace, so the wall clock of back-to-back calls is what the host spends.

After every synchronisation (each step with fp16's gradient scaler, each block of the bench's model section) the
GPU waits on the host until the host is ahead again, so the host's time per layer adds to those steps
(docs/performance.md, "steady steps"). Each layer runs forward and backward (input and parameter gradients) and
forward alone under `inference_mode`, `--reps` calls back to back, timed in `--blocks` blocks interleaved across the
layers; the median block's time per call is reported, each path's beside the baseline's.

    triton      DifferentialAttention(split_kernel='triton'): on CUDA the kernel itself; on the CPU its four
                launches replaced by no-ops (`--stub`, the default there: Triton's interpreter would time numpy),
                so what is timed is the host's work around them
    two_calls   the same layer on SDPA (two calls per map pair and the sub-norm op)
    sdpa        timm.layers.Attention with twice the heads (the baseline)

    python -m diffzoo.bench.host --device cpu              host work alone, launches stubbed, width 128
    python -m diffzoo.bench.host --device cuda             the kernel itself, width 768, 197 tokens, batch 1
"""
import argparse
import contextlib
import json
import statistics
import sys
from pathlib import Path
from typing import Dict, Optional

import torch
from timm.layers import Attention

from diffzoo.layers import DifferentialAttention, kernels

from .measure import BenchError, resolve_device, time_call

LAUNCHES = ('_diff_attn_fwd', '_diff_attn_bwd_dq', '_diff_attn_bwd_dkdv', '_diff_attn_norm_bwd')


class _NoLaunch:
    """Stands in for a Triton kernel: `kernel[grid](...)` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@contextlib.contextmanager
def stubbed_launches():
    """The Triton kernels' launches as no-ops, and the kernel allowed on CPU tensors, for this block only: what is
    left of a call is the host's work around the launches (the outputs are left unwritten)."""
    from diffzoo.layers.kernels import split_triton, triton_op
    saved = {name: getattr(split_triton, name) for name in LAUNCHES}
    unsupported = triton_op.unsupported
    try:
        for name in LAUNCHES:
            setattr(split_triton, name, _NoLaunch())
        triton_op.unsupported = lambda q, attn_mask, dropout_p: None
        yield
    finally:
        for name, kernel in saved.items():
            setattr(split_triton, name, kernel)
        triton_op.unsupported = unsupported


def layers(dim: int, heads: int, device: torch.device, dtype: torch.dtype) -> Dict[str, torch.nn.Module]:
    made = {}
    for kernel in ('triton', 'two_calls'):
        m = DifferentialAttention(dim, num_heads=heads, qkv_bias=True)
        m.split_kernel = kernel
        made[kernel] = m
    made['sdpa'] = Attention(dim, num_heads=2 * heads, qkv_bias=True)
    return {name: m.to(device, dtype) for name, m in made.items()}


def measure(dim: int, heads: int, tokens: int, batch: int, reps: int, blocks: int, device: torch.device,
            dtype: torch.dtype) -> Dict:
    torch.manual_seed(0)
    x = torch.randn(batch, tokens, dim, device=device, dtype=dtype, requires_grad=True)
    made = layers(dim, heads, device, dtype)

    def train(m):
        return lambda: m(x).float().sum().backward()

    def infer(m):
        def call():
            with torch.inference_mode():
                m(x)
        return call
    calls = {(name, kind): make(m) for name, m in made.items() for kind, make in (('train', train), ('infer', infer))}
    for fn in calls.values():  # warm-up: allocator, autotuning, first-call paths
        time_call(fn, device, 3)
    times = {key: [] for key in calls}
    for _ in range(blocks):
        for key, fn in calls.items():
            times[key].append(time_call(fn, device, reps))  # the GPU synchronised around each block
    rows = {}
    for (name, kind), values in times.items():
        rows.setdefault(name, {})[kind] = {'median_us': statistics.median(values) * 1e6,
                                           'blocks_us': [v * 1e6 for v in values]}
    for name, row in rows.items():
        for kind in ('train', 'infer'):
            row[kind]['over_sdpa_us'] = row[kind]['median_us'] - rows['sdpa'][kind]['median_us']
    return rows


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(prog='python -m diffzoo.bench.host', description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--device', default='cpu', help='cpu (default) or cuda')
    p.add_argument('--dim', type=int, default=None,
                   help='layer width (default 768, ViT-B, on CUDA; 128 on the CPU, where the projections would '
                        'outweigh the host work)')
    p.add_argument('--heads', type=int, default=None, help="differential heads (default width / 128: DiffCLIP's "
                                                           'q/k 64 and v 128 a head)')
    p.add_argument('--tokens', type=int, default=None,
                   help="tokens a sample (default 197 on CUDA, ViT-B/16's, whose kernels a training has compiled; "
                        '8 on the CPU)')
    p.add_argument('--batch', type=int, default=1)
    p.add_argument('--dtype', choices=('bf16', 'fp16'), default='bf16')
    p.add_argument('--reps', type=int, default=100, help='calls a block (default 100)')
    p.add_argument('--blocks', type=int, default=5, help='blocks a layer, interleaved (default 5)')
    p.add_argument('--stub', action=argparse.BooleanOptionalAction, default=None,
                   help='replace the Triton launches by no-ops (default: on the CPU only)')
    p.add_argument('--out', default=None, help='JSON of the blocks and medians')
    a = p.parse_args(argv)
    try:
        device = resolve_device(a.device)
    except BenchError as exc:
        print(f'error: {exc}', file=sys.stderr)
        return 2
    stub = device.type != 'cuda' if a.stub is None else a.stub
    if not kernels.HAS_TRITON:
        print('error: Triton is not installed, so the kernel\'s path cannot run here', file=sys.stderr)
        return 2
    if not stub and kernels.unsupported(torch.empty(0, device=device, dtype=torch.bfloat16), None, 0.0):
        print(f'error: the Triton kernel cannot run on {a.device} tensors here; --stub times its host work alone',
              file=sys.stderr)
        return 2
    dtype = {'bf16': torch.bfloat16, 'fp16': torch.float16}[a.dtype]
    a.dim = a.dim or (768 if device.type == 'cuda' else 128)
    a.tokens = a.tokens or (197 if device.type == 'cuda' else 8)
    a.heads = a.heads or max(1, a.dim // 128)
    with stubbed_launches() if stub else contextlib.nullcontext():
        rows = measure(a.dim, a.heads, a.tokens, a.batch, a.reps, a.blocks, device, dtype)
    print(f'host time a call, µs (median of {a.blocks} blocks of {a.reps}; {a.device}, {a.dtype}, width {a.dim}, '
          f'{a.tokens} tokens, batch {a.batch}{", Triton launches stubbed" if stub else ""}):')
    for name, row in rows.items():
        print(f'  {name:<10} forward+backward {row["train"]["median_us"]:8.1f} ({row["train"]["over_sdpa_us"]:+7.1f})'
              f'   forward {row["infer"]["median_us"]:8.1f} ({row["infer"]["over_sdpa_us"]:+7.1f})')
    if a.out:
        result = {'device': a.device, 'dtype': a.dtype, 'dim': a.dim, 'heads': a.heads, 'tokens': a.tokens,
                  'batch': a.batch, 'reps': a.reps, 'stubbed': stub, 'layers': rows}
        Path(a.out).write_text(json.dumps(result, indent=1) + '\n')
    return 0


if __name__ == '__main__':
    sys.exit(main())
