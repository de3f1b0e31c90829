"""Where fp16 rounding puts dL/dλ's error, sample by sample: the tests' layer against itself in fp64.

dL/dλ of a batch is the sum of its samples', so the error of one sample (batch 1) over many draws says what a
batch sums: an rms σ gives σ·√B over B independent samples, a mean β (a bias) gives β·B. For each draw, against
the layer (`tests/layers/test_kernels.py`'s kind: width `dim`, `heads` differential heads) run in fp64:

    fp32       the layer in fp32 (the GPU test's reference)
    inputs     fp64 arithmetic with q, k, v, the sub-norm's output and the projection's input gradient dy
               rounded to fp16, as autocast rounds them for every kernel
    kernel     inputs, and D saved in fp16 for the sub-norm's backward, as the Triton kernel saves it (its dD is
               kept whole by ρ2_lo)
    two_calls  inputs, and SDPA's A1V and A2V rounded to fp16, then their difference rounded to fp16
    triton     with --triton, the Triton kernel itself under autocast fp16 (on CUDA; on the CPU under the
               interpreter, TRITON_INTERPRET=1, a minute a draw at 1,024 tokens)

Neither model rounds the maps before their product with V, which both kernels do as flash attention does:
--triton measures the kernel whole.

With --batch B (above 1), each draw is a batch of B samples instead, and for two_calls (and with --triton the
kernel) the error of the batch's dL/dλ from one call of the layer against the sum of its samples' errors, each
sample called alone: the samples of a batch share nothing but the layer, so the two agree to the last sums' rounding
unless something in a call of B samples adds its own error (the GPU test's error grows from batch 1 to 256 by more
than √256).

    python -m diffzoo.bench.lambda_rounding --tokens 4096 --draws 12 [--triton] [--device cuda] [--out X.json]
    python -m diffzoo.bench.lambda_rounding --tokens 4096 --batch 256 --draws 2 --triton --device cuda
"""
import argparse
import copy
import json
import math
import sys
from pathlib import Path
from typing import Dict, List, Optional

import torch
import torch.nn as nn

PATHS = ('fp32', 'inputs', 'kernel', 'two_calls')


def fp16(t: torch.Tensor) -> torch.Tensor:
    """`t` rounded to fp16, kept in its own dtype."""
    return t.to(torch.float16).to(t.dtype)


def tests_layer(dim: int, heads: int, seed: int, device: torch.device) -> nn.Module:
    """The kernel tests' layer: fp32 parameters drawn N(0, 0.1²) (λ), N(0, 0.3²) (vectors), N(0, 1/dim) (matrices),
    each bf16-exact."""
    from diffzoo.layers import DifferentialAttention
    torch.manual_seed(seed)
    m = DifferentialAttention(dim, num_heads=heads, qkv_bias=True, lambda_init=0.8).to(device)
    with torch.no_grad():
        for name, p in m.named_parameters():
            std = 0.1 if name.startswith('lambda') else 0.3 if p.ndim == 1 else dim ** -0.5
            p.normal_(0, std).copy_(p.to(torch.bfloat16).float())
    return m


def layer_dlambda(m: nn.Module, x: torch.Tensor, grad: torch.Tensor, kernel: Optional[str] = None,
                  dtype: torch.dtype = torch.float16, chunk: Optional[int] = None) -> float:
    """dL/dλ of `m` (explicit path, `chunk` samples at a time if given; or, with `kernel`, that fused kernel under
    autocast in `dtype`, one call) for the output gradient `grad`, read off λ_q1's gradient:
    dL/dλ_q1 = dL/dλ · exp(λ_q1·λ_k1) · λ_k1."""
    m = copy.deepcopy(m)
    m.fused_attn = kernel is not None
    if kernel is None:
        step = chunk or x.shape[0]
        for i in range(0, x.shape[0], step):  # the gradients add up over the chunks
            m(x[i:i + step]).backward(grad[i:i + step])
    else:
        m.split_kernel = kernel
        with torch.autocast(x.device.type, dtype=dtype):
            out = m(x)
        out.backward(grad.to(out.dtype))
    with torch.no_grad():
        factor = torch.exp((m.lambda_q1 * m.lambda_k1).double().sum()) * m.lambda_k1.double()
    i = factor.abs().argmax()
    return (m.lambda_q1.grad.double()[i] / factor[i]).item()


def modelled_dlambda(m64: nn.Module, x: torch.Tensor, grad: torch.Tensor, path: str) -> float:
    """dL/dλ = −Σ dD·(A2V) in fp64 for one sample x, grad (N, C), rounded where `path` rounds (module docstring)."""
    n, dim = x.shape
    h, d = m64.num_heads, m64.head_dim
    rounded = path != 'exact'
    qkv = x.double() @ m64.qkv.weight.T + m64.qkv.bias
    q, k, v = (fp16(qkv) if rounded else qkv).split(m64.qkv_split, -1)
    q, k = (t.view(n, 2 * h, d).transpose(0, 1) for t in (q, k))  # (2h, N, d)
    v = v.view(n, h, dim // h).transpose(0, 1)  # (h, N, 2d)
    dy = (fp16(fp16(grad.double()) @ m64.proj.weight) if rounded else grad.double() @ m64.proj.weight)
    dy = dy.view(n, h, dim // h).transpose(0, 1)
    lam = m64.compute_lambda().item()
    weight = m64.sub_norm.weight * (1 - m64.lambda_init)
    total = 0.
    for i in range(h):
        o1 = torch.softmax(q[2 * i] @ k[2 * i].T * m64.scale, -1) @ v[i]
        o2 = torch.softmax(q[2 * i + 1] @ k[2 * i + 1].T * m64.scale, -1) @ v[i]
        if path == 'two_calls':
            o1, o2 = fp16(o1), fp16(o2)
        D = fp16(o1 - lam * o2) if path in ('kernel', 'two_calls') else o1 - lam * o2
        rstd = torch.rsqrt(D.square().mean(-1, keepdim=True) + m64.sub_norm.eps)
        normed, gw = D * rstd, dy[i] * weight
        dD = rstd * (gw - normed * (gw * normed).mean(-1, keepdim=True))
        total -= (dD * o2).sum().item()
    return total


def draws(tokens: int, dim: int, heads: int, count: int, triton: bool, device: torch.device) -> List[Dict]:
    """Per draw (batch 1): the fp64 layer's dL/dλ and each path's error against it."""
    m = tests_layer(dim, heads, tokens + 1, device)
    m64 = copy.deepcopy(m).double()
    rows = []
    for draw in range(count):
        torch.manual_seed(10_000 + draw)
        x = torch.randn(1, tokens, dim, device=device).to(torch.bfloat16).float()
        grad = torch.randn(1, tokens, dim, device=device).to(torch.bfloat16).float()
        truth = layer_dlambda(m64, x.double(), grad.double())
        row = {'dlambda': truth, 'fp32': layer_dlambda(m, x, grad) - truth}
        row.update({p: modelled_dlambda(m64, x[0], grad[0], p) - truth for p in PATHS[1:]})
        if triton:
            row['triton'] = layer_dlambda(m, x, grad, 'triton') - truth
        rows.append(row)
        print(f'draw {draw}: dL/dλ {truth:+.3f}; errors ' + ', '.join(f'{k} {v:+.2e}' for k, v in row.items()
                                                                          if k != 'dlambda'), flush=True)
    return rows


def batch_draws(tokens: int, dim: int, heads: int, batch: int, count: int, triton: bool,
                device: torch.device) -> List[Dict]:
    """Per draw of `batch` samples: the fp64 layer's dL/dλ (its samples' summed) and, per kernel, the error of one
    call on the whole batch (`batch`), the sum of each sample's error called alone (`samples`) and their
    difference (`interaction`)."""
    m = tests_layer(dim, heads, tokens + 1, device)
    m64 = copy.deepcopy(m).double()
    rows = []
    for draw in range(count):
        torch.manual_seed(20_000 + draw)
        x = torch.randn(batch, tokens, dim, device=device).to(torch.bfloat16).float()
        grad = torch.randn(batch, tokens, dim, device=device).to(torch.bfloat16).float()
        truths = [layer_dlambda(m64, x[i:i + 1].double(), grad[i:i + 1].double()) for i in range(batch)]
        row: Dict = {'dlambda': sum(truths)}
        for kernel in ('two_calls', 'triton') if triton else ('two_calls',):
            whole = layer_dlambda(m, x, grad, kernel) - row['dlambda']
            alone = sum(layer_dlambda(m, x[i:i + 1], grad[i:i + 1], kernel) - t for i, t in enumerate(truths))
            row[kernel] = {'batch': whole, 'samples': alone, 'interaction': whole - alone}
        rows.append(row)
        print(f'draw {draw}: dL/dλ {row["dlambda"]:+.3f} over {batch} samples; ' + '; '.join(
            f'{k}: one call {v["batch"]:+.2e}, its samples alone {v["samples"]:+.2e}, the call adds '
            f'{v["interaction"]:+.2e}' for k, v in row.items() if k != 'dlambda'), flush=True)
    return rows


def root_mean_square(values: List[float]) -> float:
    return math.sqrt(sum(v * v for v in values) / len(values))


def batch_summary(rows: List[Dict]) -> Dict:
    """Per kernel, over the draws: rms of the one-call error, of the samples' summed errors and of what the call
    adds."""
    return {k: {part: root_mean_square([r[k][part] for r in rows]) for part in ('batch', 'samples', 'interaction')}
            for k in rows[0] if k != 'dlambda'}


def summary(rows: List[Dict]) -> Dict:
    """Per path: rms, mean and its standard error over the draws, and what 256 independent samples would sum."""
    out = {}
    for path in rows[0]:
        if path == 'dlambda':
            continue
        e = [r[path] for r in rows]
        mean = sum(e) / len(e)
        sd = math.sqrt(sum((v - mean) ** 2 for v in e) / max(1, len(e) - 1))
        rms = root_mean_square(e)
        out[path] = {'rms': rms, 'mean': mean, 'mean_se': sd / math.sqrt(len(e)), 'batch_256_rms': 16 * rms}
    return out


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(prog='python -m diffzoo.bench.lambda_rounding', description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--tokens', type=int, default=4096)
    p.add_argument('--dim', type=int, default=768, help='layer width (default 768, ViT-B)')
    p.add_argument('--heads', type=int, default=6, help='differential heads (default 6: q/k 64, v 128 wide)')
    p.add_argument('--draws', type=int, default=12, help='samples drawn, or batches with --batch (default 12)')
    p.add_argument('--batch', type=int, default=1,
                   help='samples a draw: above 1, one call on the batch against its samples called alone (module '
                        'docstring; default 1)')
    p.add_argument('--triton', action='store_true', help='the Triton kernel too (CPU: TRITON_INTERPRET=1, slow)')
    p.add_argument('--device', default='cpu', help='cpu (default) or cuda')
    p.add_argument('--out', default=None, help='JSON of every draw and the summary')
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == 'cuda' and not torch.cuda.is_available():
        print('error: --device cuda: no CUDA device here (torch.cuda.is_available() is False)', file=sys.stderr)
        return 2
    if args.triton:
        from diffzoo.layers import kernels
        reason = kernels.unsupported(torch.empty(0, dtype=torch.float16, device=device), None, 0.0)
        if reason is not None:
            print(f'error: --triton: the Triton kernel cannot run here: {reason}', file=sys.stderr)
            return 2
    if args.batch < 1 or args.draws < 1:
        print(f'error: --batch {args.batch} --draws {args.draws}: both take 1 or more', file=sys.stderr)
        return 2
    result = {'tokens': args.tokens, 'dim': args.dim, 'heads': args.heads, 'batch': args.batch}
    if args.batch > 1:
        rows = batch_draws(args.tokens, args.dim, args.heads, args.batch, args.draws, args.triton, device)
        result.update(draws=rows, summary=batch_summary(rows))
        for kernel, s in result['summary'].items():
            print(f'{kernel:>9}: rms over {args.draws} batches of {args.batch}: one call {s["batch"]:.3e}, its samples '
                  f'alone {s["samples"]:.3e}, what the call adds {s["interaction"]:.3e}')
    else:
        rows = draws(args.tokens, args.dim, args.heads, args.draws, args.triton, device)
        result.update(draws=rows, summary=summary(rows))
        for path, s in result['summary'].items():
            print(f'{path:>9}: rms {s["rms"]:.3e} a sample, mean {s["mean"]:+.2e} ± {s["mean_se"]:.1e}; 256 '
                  f'independent samples {s["batch_256_rms"]:.2e}')
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + '\n')
    return 0


if __name__ == '__main__':
    sys.exit(main())
