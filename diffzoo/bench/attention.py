"""One attention layer alone: every differential variant against `timm.layers.Attention` with SDPA.

At ViT-B width (768) the baseline has 12 heads and the differential layers 6 differential heads
(the project's convention, so both compute 12 score maps except *duplicate*, which computes 6); at
another width (`--smoke` uses 128) the baseline has width / 64 heads and the differential half that:

    sdpa            timm.layers.Attention(768, 12 heads), fused_attn=True
    split-fused     DifferentialAttention(768, 6, variant='split'), fused_attn=True with the run's
                    --split-kernel (default 'auto': by device, dtype and tokens, kernels.auto_split_kernel), the
                    path the models train with and the one the targets read
    split-<kernel>  the same with each split_kernel: two_calls, one_call, padded, four_calls, and
                    triton on CUDA (under Triton's CPU interpreter it is a correctness tool, not timed)
    split-explicit  the same layer with fused_attn=False (explicit A1 − λ·A2)
    duplicate       variant='duplicate', fused
    v2              variant='v2', fused

For each token count N the batch is B = max(1, tokens_per_batch // N), so 4096 tokens fits; the
token counts in `causal_tokens` are measured again with `is_causal=True` (the text tower's 77), each
ratio against the baseline at the same N and masking. Each
layer is timed forward + backward (input and parameter gradients) and forward only
(`inference_mode`), repeats interleaved across layers. One profiled forward + backward gives the
transient peak memory and the SDPA backend. `nn_bytes` = B · maps · N² · element size (2 in bf16,
4 in fp32) is one score matrix per map in the compute dtype, the least a path that holds all of them
at once must allocate. The verdict `materialises_nn`:
    False  peak < nn_bytes: the matrices cannot all have been held
    True   peak ≥ nn_bytes + the sdpa layer's peak P at the same N (its linear-in-N activations),
           and nn_bytes ≥ P, so linear-size overheads (fp32 copies) cannot account for the excess
    None   otherwise: inconclusive, as at small N where activations outweigh N×N
"""
from typing import Dict, List, Optional, Sequence

import torch
from timm.layers import Attention

from diffzoo.layers import DifferentialAttention, kernels
from diffzoo.layers.kernels import SPLIT_KERNELS

from .measure import BenchError, Probe, autocast, calibrate, summarize, time_call

DIM = 768  # ViT-B
HEAD_DIM = 64  # baseline head width: 768 → 12 heads, differential 6
VARIANTS = ('sdpa', 'split-fused', *(f'split-{k}' for k in SPLIT_KERNELS), 'split-explicit', 'duplicate', 'v2')
BASELINE = 'sdpa'
DEFAULT_PATH = 'split-fused'  # what diffclip-* train with


def heads(variant: str, dim: int) -> int:
    """Baseline heads (dim / 64) for sdpa, half as many differential heads for the others."""
    return dim // HEAD_DIM if variant == BASELINE else dim // HEAD_DIM // 2


def variants(device: torch.device, wanted: Optional[Sequence[str]] = None) -> List[str]:
    """The rows measured on `device`: every variant (or those `wanted`, with the baseline), `split-triton`
    only where Triton compiles."""
    triton = device.type == 'cuda' and kernels.HAS_TRITON
    return [v for v in VARIANTS if (v != 'split-triton' or triton) and (not wanted or v in wanted or v == BASELINE)]


def build(variant: str, dim: int, device: torch.device, split_kernel: str = 'auto') -> torch.nn.Module:
    if variant == BASELINE:
        layer = Attention(dim, num_heads=heads(variant, dim), qkv_bias=True)
        layer.fused_attn = True
    else:
        kind = variant.split('-')[0]
        layer = DifferentialAttention(dim, num_heads=heads(variant, dim), qkv_bias=True, variant=kind,
                                      lambda_init=0.8)
        layer.fused_attn = variant != 'split-explicit'
        kernel = variant.partition('-')[2]
        layer.split_kernel = kernel if kernel in SPLIT_KERNELS else split_kernel
    return layer.to(device)


def score_maps(variant: str, dim: int) -> int:
    """How many N×N score matrices per sample the layer's math computes."""
    return heads(variant, dim) if variant in (BASELINE, 'duplicate') else 2 * heads(variant, dim)


def materialises(peak: int, nn_bytes: int, baseline_peak: int):
    """True / False / None (inconclusive): see the module docstring."""
    if peak < nn_bytes:
        return False
    return True if nn_bytes >= baseline_peak and peak >= nn_bytes + baseline_peak else None


def run(tokens: Sequence[int], tokens_per_batch: int, precision: str, reps: int, warmup: int,
        device: torch.device, target_s: float, dim: int = DIM, split_kernel: str = 'auto',
        causal_tokens: Sequence[int] = (), wanted: Optional[Sequence[str]] = None) -> Dict:
    if dim % (2 * HEAD_DIM):
        raise BenchError(f'layer width {dim}: must be a multiple of {2 * HEAD_DIM} (heads of 64, pairs of them)')
    layers = {v: build(v, dim, device, split_kernel) for v in variants(device, wanted)}
    rows: List[Dict] = []
    for n, causal in [(n, False) for n in tokens] + [(n, True) for n in causal_tokens]:
        batch = max(1, tokens_per_batch // n)
        x = torch.randn(batch, n, dim, device=device, requires_grad=True)  # (B, N, C)
        grad = torch.randn(batch, n, dim, device=device)  # (B, N, C)
        if precision == 'bf16':
            grad = grad.to(torch.bfloat16)  # the layer's output dtype under autocast

        def fwd_bwd(layer):
            layer.zero_grad(set_to_none=True)
            x.grad = None
            with autocast(device, precision):
                out = layer(x, is_causal=causal)
            out.backward(grad)

        def fwd(layer):
            with torch.inference_mode(), autocast(device, precision):
                layer(x, is_causal=causal)

        case = f'N={n}{" causal" if causal else ""} B={batch}'
        print(f'  layer {case}: warm-up', flush=True)
        inner = {}
        for v, layer in layers.items():
            for _ in range(warmup):
                fwd_bwd(layer)
                fwd(layer)
            inner[v] = (calibrate(lambda: fwd_bwd(layer), device, target_s),
                        calibrate(lambda: fwd(layer), device, target_s))
        times = {v: ([], []) for v in layers}
        for rep in range(reps):
            for v, layer in layers.items():
                times[v][0].append(time_call(lambda: fwd_bwd(layer), device, inner[v][0]))
                times[v][1].append(time_call(lambda: fwd(layer), device, inner[v][1]))
            line = ', '.join(f'{v} {times[v][0][-1] * 1e3:,.2f}' for v in layers)
            print(f'  layer {case} rep {rep + 1}/{reps} fwd+bwd ms: {line}', flush=True)
        element = 2 if precision == 'bf16' else 4
        peaks = {}
        for v, layer in layers.items():
            layer.zero_grad(set_to_none=True)  # the call starts from parameters and input only
            x.grad = None
            with Probe(device) as p:
                fwd_bwd(layer)
            nn_bytes = batch * score_maps(v, dim) * n * n * element  # causal kernels need half, held ones all
            peaks[v] = p.peak_bytes
            rows.append({
                'variant': v, 'tokens': n, 'causal': causal, 'batch': batch, 'dim': dim,
                'heads': heads(v, dim), 'score_maps': score_maps(v, dim),
                'fwd_bwd_s': summarize(times[v][0]), 'fwd_s': summarize(times[v][1]),
                'inner_calls': {'fwd_bwd': inner[v][0], 'fwd': inner[v][1]},
                'peak_bytes': p.peak_bytes, 'nn_bytes': nn_bytes,
                'materialises_nn': materialises(p.peak_bytes, nn_bytes, peaks[BASELINE]),
                'sdpa_backends': p.backends or (['explicit matmul + softmax'] if v == 'split-explicit' else []),
                'attention_kernels': p.kernels,
            })
        x = grad = None  # free the inputs before the next token count
    base = {(r['tokens'], r['causal']): r for r in rows if r['variant'] == BASELINE}
    for r in rows:
        b = base[r['tokens'], r['causal']]
        r['ratios'] = {
            'fwd_bwd_time': r['fwd_bwd_s']['median'] / b['fwd_bwd_s']['median'],
            'fwd_time': r['fwd_s']['median'] / b['fwd_s']['median'],
            'peak_memory': r['peak_bytes'] / b['peak_bytes'] if b['peak_bytes'] else None,
        }
    return {'dim': dim, 'baseline': BASELINE, 'default_path': DEFAULT_PATH, 'split_kernel': split_kernel,
            'tokens_per_batch': tokens_per_batch, 'causal_tokens': list(causal_tokens), 'rows': rows}
