"""Where the Triton split kernel's dL/dλ error comes from: its arithmetic, row by row, against fp64 on its own inputs.

dL/dλ = −Σ ρ2 over every row (sample, head, token) of the layer, ρ2 = dD·(P2V), with dD the gradient
reaching D = (P1 − λ·P2)V through the sub-norm. A layer of the tests' kind (`tests/layers/test_kernels.py`:
width `dim`, `heads` differential heads, N(0, 0.3) biases, the forward under autocast) gives q, k, v, λ,
the sub-norm weight and dy exactly as the kernel's custom op receives them; then per row:

    fp64       ρ2 in fp64 from those same 16-bit inputs (the maps, D and the sub-norm's backward)
    kernel     the kernel's own ρ2 (its forward's D and log-sum-exps, its norm and dQ backward kernels)
    two_calls  two_calls' arithmetic: SDPA's A1V, A2V in the dtype, their difference in the dtype, the
               sub-norm's backward in fp32 (`kernels.sub_norm`), ρ2 = dD·A2V

For each of kernel and two_calls: the error of dL/dλ, the root mean square of the per-row errors, their
mean as a z-score (a rounding error that keeps its sign from row to row grows with the rows, not with
their square root: |z| of a few and more says so), the share of the squared error in the worst 0.1 % of
rows (a heavy tail), and the error of dL/dλ per head; for the kernel also the error of dL/dλ as its op returns
it, the rows summed in one fp32 sum (the others sum the rows' errors in fp64). The inputs' own rounding, common
to every kernel, is not in these errors (the GPU test's reference is the fp32 layer: it is).

With --as-test, the draws are the GPU test's own (`test_bench_shapes_within_twice_sdpa`: its layer, seed N + B,
and its inputs, seeds N + B + 1000·i), and each draw also takes the layer whole as the test does, dL/dλ read off
λ_q1's gradient: the fp32 layer (the test's reference) and the fp64 one on the unrounded inputs (the truth), both a
sample at a time, and the kernel and two_calls under autocast, one call each. Against the truth: the fp32
reference's error, the 16-bit inputs' (every kernel's, q, k, v and dy rounded: fp64 on the op's inputs), and each
kernel's in the layer; then each kernel against the fp32 reference, which is what the test's rule compares. Where
the kernel's layer error is its op's and the common part is small, the test's figure is the kernel's own; where
not, the excess is named.

    python -m diffzoo.bench.lambda_error --device cuda --tokens 4096 --batch 256 --dtype fp16 --out X.json
    python -m diffzoo.bench.lambda_error --device cuda --tokens 4096 --batch 256 --dtype fp16 --as-test --seeds 1
"""
import argparse
import copy
import json
import math
import sys
from pathlib import Path
from typing import Dict, Optional

import torch

from .lambda_rounding import layer_dlambda, root_mean_square, tests_layer

DTYPES = {'fp16': torch.float16, 'bf16': torch.bfloat16}


def draw(batch: int, tokens: int, dim: int, device: torch.device, seed: int):
    """The layer's input x and its output's gradient, (B, N, C) each, bf16-exact fp32, drawn as the GPU test draws."""
    torch.manual_seed(seed)
    x = torch.randn(batch, tokens, dim, device=device).to(torch.bfloat16).float()
    grad = torch.randn(batch, tokens, dim, device=device).to(torch.bfloat16).float()
    return x, grad


def layer_inputs(batch: int, tokens: int, dim: int, heads: int, dtype: torch.dtype, device: torch.device,
                 seed: int, layer_seed: int = 0) -> Dict:
    """q (B, 2h, N, d), k, v (B, h, N, 2d), λ, the sub-norm weight and dy (B, N, C), as the custom op gets them."""
    m = tests_layer(dim, heads, layer_seed, device)
    x, grad = draw(batch, tokens, dim, device, seed)
    with torch.no_grad(), torch.autocast(device.type, dtype=dtype):
        q, k, v = m._project(x)
        lam = m.compute_lambda(x)
        weight = m._sub_norm_weight(v.dtype, device)
    dy = grad.to(dtype) @ m.proj.weight.to(dtype)  # (B, N, C): the op's backward, dy = grad·W_proj
    return dict(q=q, k=k, v=v, lam=lam.float(), weight=weight, dy=dy, eps=m.sub_norm.eps, scale=m.scale)


def _norm_backward(D: torch.Tensor, g: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """dD of y = RMSNorm(D)·w for the upstream gradient g, in D's dtype: rstd·(g·w − n·mean(g·w·n))."""
    rstd = torch.rsqrt(D.square().mean(-1, keepdim=True) + eps)
    n = D * rstd
    gw = g * w
    return rstd * (gw - n * (gw * n).mean(-1, keepdim=True))


def reference_rows(a: Dict, chunk: int = 1) -> torch.Tensor:
    """ρ2 per row (B, h, N) in fp64 from the inputs `a` (`layer_inputs`), `chunk` samples at a time."""
    q, k, v = a['q'], a['k'], a['v']
    B, h, N, dv = v.shape
    out = []
    for i in range(0, B, chunk):
        qd, kd, vd = (t[i:i + chunk].double() for t in (q, k, v))
        maps = torch.softmax(qd @ kd.transpose(-1, -2) * a['scale'], -1).unflatten(1, (h, 2))  # (b, h, 2, N, N)
        o1, o2 = maps[:, :, 0] @ vd, maps[:, :, 1] @ vd  # (b, h, N, dv)
        g = a['dy'][i:i + chunk].double().unflatten(-1, (h, dv)).transpose(1, 2)  # (b, h, N, dv)
        dD = _norm_backward(o1 - a['lam'].double() * o2, g, a['weight'].double(), a['eps'])
        out.append((dD * o2).sum(-1))
        del maps, o1, o2
    return torch.cat(out)


def kernel_rows(a: Dict) -> torch.Tensor:
    """The Triton kernel's row statistics that dL/dλ sums, (2 or 3, B, h, N) fp32: ρ2 and, where there is one, ρ2_lo
    (its forward, then its norm and dQ backward kernels)."""
    from diffzoo.layers.kernels import split_triton
    _, D, lse = split_triton.forward(a['q'], a['k'], a['v'], a['lam'], a['weight'], None, a['scale'], a['eps'], False)
    dD, dD_lo, _, _ = split_triton.norm_backward(a['dy'], a['weight'], D, a['eps'], False)
    _, delta = split_triton.dq_backward(a['q'], a['k'], a['v'], a['lam'], None, dD, lse, a['scale'], False,
                                        dD_lo=dD_lo)
    return delta[1:]  # ρ2, and ρ2_lo where there is one


def two_calls_rows(a: Dict) -> torch.Tensor:
    """two_calls' ρ2 per row (B, h, N): SDPA's outputs in the dtype, the sub-norm op's backward arithmetic."""
    from diffzoo.layers.kernels import split_parts
    (o1,), (o2,) = split_parts(a['q'], a['k'], a['v'], None, 0.0, False, a['scale'], 'two_calls')  # (B, N, h, dv)
    diff = torch.addcmul(o1, o2, a['lam'], value=-1)  # in the dtype, as kernels.sub_norm forms it
    g = a['dy'].unflatten(-1, o1.shape[-2:]).float()
    dD = _norm_backward(diff.float(), g, a['weight'].float(), a['eps'])
    return (dD * o2.float()).sum(-1).transpose(1, 2)


def error_stats(rows: torch.Tensor, exact: torch.Tensor) -> Dict:
    err = (rows.double() - exact).flatten(1)  # (B, h·N)
    flat = err.flatten()
    rms = flat.square().mean().sqrt().item()
    top = max(1, flat.numel() // 1000)
    worst = (flat.abs().topk(top).values.square().sum() / flat.square().sum()).item() if rms else 0.0
    per_head = err.unflatten(1, (exact.shape[1], -1)).sum((0, 2))  # (h,)
    return {'dlambda_error': -flat.sum().item(), 'row_rms': rms,
            'mean_z': flat.mean().item() / (rms / math.sqrt(flat.numel())) if rms else 0.0,
            'worst_0.1%_share': worst, 'per_head': [-e.item() for e in per_head]}


def layer_errors(a: Dict, on_inputs: float, as_op: float, batch: int, tokens: int, dim: int, heads: int,
                 dtype: torch.dtype, device: torch.device, seed: int, layer_seed: int, chunk: int) -> Dict:
    """The layer whole, as the GPU test runs it (module docstring): dL/dλ of the fp64 layer on the unrounded inputs,
    each path's error against it, and each kernel's against the fp32 layer (the test's rule)."""
    m = tests_layer(dim, heads, layer_seed, device)
    x, grad = draw(batch, tokens, dim, device, seed)
    exact = layer_dlambda(copy.deepcopy(m).double(), x.double(), grad.double(), chunk=chunk)
    reference = layer_dlambda(m, x, grad, chunk=chunk)
    kernels = {k: layer_dlambda(m, x, grad, k, dtype) for k in ('triton', 'two_calls')}
    return {'dlambda': exact, 'lambda': a['lam'].item(),
            'against_fp64': {'fp32 reference': reference - exact, '16-bit inputs': on_inputs - exact,
                             **{k: v - exact for k, v in kernels.items()}},
            'against_fp32_reference': {k: v - reference for k, v in kernels.items()},
            'kernel_in_layer_minus_op': kernels['triton'] - as_op}


def measure(batch: int, tokens: int, dim: int, heads: int, dtype: torch.dtype, device: torch.device, seed: int,
            chunk: int = 1, layer_seed: int = 0, layer: bool = False) -> Dict:
    """One draw: the rows' errors (module docstring) and, with `layer`, the layer whole (`layer_errors`)."""
    a = layer_inputs(batch, tokens, dim, heads, dtype, device, seed, layer_seed)
    exact = reference_rows(a, chunk)
    streams = kernel_rows(a)
    kernel = error_stats(streams.sum(0), exact)
    # the op's own dL/dλ, −Σ over every row in one fp32 sum (split_triton.backward): the rows' error and the sum's
    kernel['dlambda_error_as_op'] = -streams.sum().item() + exact.sum().item()
    result = {'seed': seed, 'dlambda': -exact.sum().item(), 'rows': exact.numel(),
              'kernel': kernel, 'two_calls': error_stats(two_calls_rows(a), exact)}
    if layer:
        result['layer'] = layer_errors(a, -exact.sum().item(), -streams.sum().item(), batch, tokens, dim, heads, dtype,
                                       device, seed, layer_seed, chunk)
    return result


def summary(draws, dtype: str) -> Dict:
    def rms_of(key):
        return {k: root_mean_square([d[k][key] for d in draws]) for k in ('kernel', 'two_calls')}
    rms, row = rms_of('dlambda_error'), rms_of('row_rms')
    as_op = root_mean_square([d['kernel']['dlambda_error_as_op'] for d in draws])
    out = {'dtype': dtype, 'dlambda_error_rms': rms, 'row_error_rms': row, 'kernel_dlambda_error_as_op_rms': as_op,
           'within_twice_two_calls': rms['kernel'] <= 2 * rms['two_calls'],
           'mean_z': {k: [round(d[k]['mean_z'], 2) for d in draws] for k in ('kernel', 'two_calls')}}
    if 'layer' in draws[0]:  # --as-test: each part's rms over the draws
        layers = [d['layer'] for d in draws]
        out['layer'] = {side: {k: root_mean_square([w[side][k] for w in layers]) for k in layers[0][side]}
                        for side in ('against_fp64', 'against_fp32_reference')}
        test = out['layer']['against_fp32_reference']
        out['layer']['test_rule_holds'] = test['triton'] <= 2 * test['two_calls']
    return out


def layer_line(w: Dict) -> str:
    """One draw's layer whole, in words."""
    fp64 = ', '.join(f'{k} {v:+.3e}' for k, v in w['against_fp64'].items())
    ref = ', '.join(f'{k} {v:+.3e}' for k, v in w['against_fp32_reference'].items())
    return (f'  the layer whole (λ {w["lambda"]:.4f}, dL/dλ {w["dlambda"]:.4f}): against fp64 {fp64}; against the fp32 '
            f'reference (the test\'s rule) {ref}; the kernel in the layer minus its op '
            f'{w["kernel_in_layer_minus_op"]:+.2e}')


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(prog='python -m diffzoo.bench.lambda_error', description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--device', default='cuda', help='cuda, or cpu under TRITON_INTERPRET=1 (small shapes)')
    p.add_argument('--tokens', type=int, default=4096)
    p.add_argument('--batch', type=int, default=256)
    p.add_argument('--dim', type=int, default=768, help='layer width (default 768, ViT-B)')
    p.add_argument('--heads', type=int, default=6, help='differential heads (default 6: q/k 64, v 128 wide)')
    p.add_argument('--dtype', choices=tuple(DTYPES), default='fp16')
    p.add_argument('--seeds', type=int, default=3, help='draws of the inputs (default 3, as the GPU test)')
    p.add_argument('--chunk', type=int, default=1, help='samples per fp64 reference chunk (default 1)')
    p.add_argument('--layer-seed', type=int, default=0, help="the layer's draw (default 0; --as-test: the test's)")
    p.add_argument('--as-test', action='store_true',
                   help="the GPU test's own layer and draws, and the layer whole as the test runs it "
                        '(module docstring)')
    p.add_argument('--out', default=None, help='JSON of every draw and the summary')
    a = p.parse_args(argv)
    device = torch.device(a.device)
    from diffzoo.layers import kernels
    if device.type == 'cuda' and not torch.cuda.is_available():
        reason = 'no CUDA device here (torch.cuda.is_available() is False); --device cpu runs the interpreter'
    else:
        reason = kernels.unsupported(torch.empty(0, device=device, dtype=DTYPES[a.dtype]), None, 0.0)
    if reason is not None:
        print(f'error: the Triton kernel cannot run here: {reason}', file=sys.stderr)
        return 2
    draws = []
    base = a.tokens + a.batch if a.as_test else 0  # test_bench_shapes_within_twice_sdpa's seeds
    layer_seed = base if a.as_test else a.layer_seed
    for seed in (base + 1000 * i for i in range(a.seeds)):
        draws.append(measure(a.batch, a.tokens, a.dim, a.heads, DTYPES[a.dtype], device, seed, a.chunk, layer_seed,
                             layer=a.as_test))
        d = draws[-1]
        line = '; '.join(f'{k} {d[k]["dlambda_error"]:+.3e} (rows rms {d[k]["row_rms"]:.2e}, z {d[k]["mean_z"]:+.1f})'
                         for k in ('kernel', 'two_calls'))
        line += f'; the kernel\'s as its op sums the rows in fp32 {d["kernel"]["dlambda_error_as_op"]:+.3e}'
        print(f'draw {seed}: dL/dλ {d["dlambda"]:.4f} over {d["rows"]:,} rows; error {line}', flush=True)
        if a.as_test:
            print(layer_line(d['layer']), flush=True)
    with torch.no_grad():
        lam = tests_layer(a.dim, a.heads, layer_seed, device).compute_lambda(None).item()
    result = {'tokens': a.tokens, 'batch': a.batch, 'dim': a.dim, 'heads': a.heads, 'device': a.device,
              'layer_seed': layer_seed, 'lambda': lam, 'draws': draws, 'summary': summary(draws, a.dtype)}
    s = result['summary']
    print(f'rms over {a.seeds} draws of the dL/dλ error against fp64 on the same inputs: kernel '
          f'{s["dlambda_error_rms"]["kernel"]:.3e}, two_calls {s["dlambda_error_rms"]["two_calls"]:.3e}; per row '
          f'{s["row_error_rms"]["kernel"]:.2e} and {s["row_error_rms"]["two_calls"]:.2e}; the kernel\'s as its op sums '
          f'the rows in fp32 {s["kernel_dlambda_error_as_op_rms"]:.3e}')
    if a.as_test:
        fp64, ref = s['layer']['against_fp64'], s['layer']['against_fp32_reference']
        print('the layer whole, rms: against fp64 ' + ', '.join(f'{k} {v:.3e}' for k, v in fp64.items())
              + '; against the fp32 reference ' + ', '.join(f'{k} {v:.3e}' for k, v in ref.items())
              + '; the test\'s rule (kernel within twice two_calls) '
              + ('holds' if s['layer']['test_rule_holds'] else 'fails'))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + '\n')
    return 0


if __name__ == '__main__':
    sys.exit(main())
