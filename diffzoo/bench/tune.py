"""python -m diffzoo.bench.tune: the split kernel's launch configurations, timed on this GPU.

For each token class (a representative N at the layer bench's tokens per batch: 77 causal for the
text tower, 197 for ViT-B/16, 577 for ViT-L/14-336 and 4096), at DiffCLIP's head widths (q/k 64,
v 128, 6 differential heads, bf16, q/k/v as views of one qkv projection as the layer makes them):

1. every candidate launch of each kernel (forward, dQ, dK/dV; tile sizes, warps, pipeline stages,
   one tile or online softmax) is compiled, in parallel worker processes that fill Triton's cache;
2. each is run on the same inputs and checked against the default launch's outputs (a launch
   that computes something else is never chosen), then timed by `triton.testing.do_bench`
   (median of its repeats, L2 flushed between calls);
3. the fastest correct launch per kernel and class is kept, and the chosen forward and backward
   are timed against SDPA's forward and backward at the baseline's 12 heads of 64 on the same tokens.

With --write the choices go into the package's `launch_configs.json` under this GPU's architecture,
where `diffzoo.layers.kernels.split_triton.launch_config` finds them; every timing goes to --out.
"""
import argparse
import datetime
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

HEADS, D, DV = 6, 64, 128  # DiffCLIP ViT-B/16: 6 differential heads, q/k 64 wide, v 128
CLASSES = ((77, True), (197, False), (577, False), (4096, False))  # (N, causal): one per token class
# Candidates kept from sm_90 compiles at these widths where ptxas fits the kernel in registers (at most
# 16 B of stack) and the products run on wgmma or fill a warp's mma tiles: (block_m, block_n, warps,
# stages, one_tile); a one-tile launch's block_n is next_power_of_2(N), and its tiles fit up to 128 or 256 keys.
ONE_TILE = {128: ((16, 0, 4, 1, True), (32, 0, 4, 1, True), (32, 0, 8, 1, True), (64, 0, 8, 1, True)),
            256: ((32, 0, 8, 1, True),)}
ONLINE = ((64, 32, 4, 2, False), (64, 64, 4, 2, False), (64, 64, 4, 3, False), (128, 32, 8, 2, False),
          (128, 64, 8, 2, False), (128, 64, 8, 3, False), (64, 32, 8, 3, False))
DKDV = ((32, 64, 8, 2), (32, 64, 8, 3), (32, 32, 4, 2), (32, 32, 4, 3), (32, 32, 8, 2), (64, 32, 4, 2), (64, 32, 8, 2))


def candidates(kernel: str, n: int):
    """The launches tried for `kernel` at N keys."""
    from diffzoo.layers.kernels.split_triton import Launch, _pow2
    if kernel == 'dkdv':
        return [Launch(*c) for c in DKDV]
    fits = [bound for bound in sorted(ONE_TILE) if n <= bound]
    tiles = [Launch(m, _pow2(n), w, s, one) for m, _, w, s, one in ONE_TILE[fits[0]]] if fits else []
    return tiles + [Launch(*c) for c in ONLINE]


def inputs(n: int, batch: int, device: str, seed: int = 0) -> Dict:
    """q, k (B, 2h, N, d), v (B, h, N, 2d) as views of one (B, N, 3C) projection, λ, the sub-norm weight."""
    import torch
    g = torch.Generator(device=device).manual_seed(seed)
    C = HEADS * DV
    qkv = torch.randn(batch, n, 3 * C, device=device, generator=g).to(torch.bfloat16)  # (B, N, 3C)
    q, k, v = qkv.split(C, dim=-1)
    return dict(q=q.reshape(batch, n, 2 * HEADS, D).transpose(1, 2),  # (B, 2h, N, d)
                k=k.reshape(batch, n, 2 * HEADS, D).transpose(1, 2),
                v=v.reshape(batch, n, HEADS, DV).transpose(1, 2),  # (B, h, N, 2d)
                lam=torch.tensor(0.3, device=device), weight=torch.full((DV,), 0.2, device=device).to(torch.bfloat16),
                dy=torch.randn(batch, n, C, device=device, generator=g).to(torch.bfloat16),
                scale=D ** -0.5, eps=torch.finfo(torch.bfloat16).eps)


def prepare(x: Dict, causal: bool) -> Dict:
    """The forward's outputs and the backward's intermediates with default launches: what dQ and dK/dV read."""
    from diffzoo.layers.kernels import split_triton as st
    y, D_, lse = st.forward(x['q'], x['k'], x['v'], x['lam'], x['weight'], None, x['scale'], x['eps'], causal)
    dD, _, _, _ = st.norm_backward(x['dy'], x['weight'], D_, x['eps'], False)
    dq, delta = st.dq_backward(x['q'], x['k'], x['v'], x['lam'], None, dD, lse, x['scale'], causal)
    return dict(x, D=D_, lse=lse, dD=dD, delta=delta)


def launch(kernel: str, s: Dict, causal: bool, cfg):
    """One launch of `kernel` with `cfg` on the prepared state `s`; its outputs."""
    from diffzoo.layers.kernels import split_triton as st
    if kernel == 'fwd':
        return st.forward(s['q'], s['k'], s['v'], s['lam'], s['weight'], None, s['scale'], s['eps'], causal, cfg)
    if kernel == 'dq':
        return st.dq_backward(s['q'], s['k'], s['v'], s['lam'], None, s['dD'], s['lse'], s['scale'], causal, cfg)
    return st.dkdv_backward(s['q'], s['k'], s['v'], s['lam'], None, s['dD'], s['lse'], s['delta'], s['scale'],
                            causal, cfg)


def _compile(job: Tuple) -> Tuple[Tuple, Optional[str]]:
    """Worker: run one launch at batch 1 (the same specialisation as any batch), filling Triton's cache."""
    import torch
    kernel, n, causal, cfg = job
    try:
        s = prepare(inputs(n, 1, 'cuda'), causal)
        launch(kernel, s, causal, cfg)
        torch.cuda.synchronize()
        return job, None
    except Exception as exc:  # a launch that does not build (shared memory, registers) is reported, not chosen
        return job, f'{type(exc).__name__}: {str(exc).splitlines()[0][:200]}'


def _close(a, b) -> bool:
    """Outputs of two launches agree to bf16 rounding of different summation orders (lse where finite)."""
    import torch
    a, b = a.float(), b.float()
    finite = torch.isfinite(b)
    if not torch.equal(finite, torch.isfinite(a)):
        return False
    a, b = a[finite], b[finite]
    return bool((a - b).abs().max() <= 2e-2 * b.abs().max() + 1e-3) if b.numel() else True


def time_ms(fn, device: str) -> float:
    """Median milliseconds per call: `triton.testing.do_bench` on CUDA; under the interpreter (CPU, a
    check of this program, not a timing of the kernels) the median of three wall-clock calls."""
    if device == 'cuda':
        import triton
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode='median')
    import statistics
    import time
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def sdpa_ms(n: int, batch: int, causal: bool, device: str) -> Dict:
    """SDPA forward and backward at the baseline's 12 heads of 64 on the same tokens (bf16)."""
    import torch
    import torch.nn.functional as F
    q, k, v = (torch.randn(batch, 2 * HEADS, n, D, device=device, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    grad = torch.randn(batch, 2 * HEADS, n, D, device=device, dtype=torch.bfloat16)
    fwd = time_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), device)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    bwd = time_ms(lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True), device)
    return {'fwd_ms': fwd, 'bwd_ms': bwd}


def tune_class(n: int, causal: bool, batch: int, compiled: Dict, device: str, limit: Optional[int] = None) -> Dict:
    from diffzoo.layers.kernels import split_triton as st
    s = prepare(inputs(n, batch, device), causal)
    row = {'tokens': n, 'causal': causal, 'batch': batch, 'candidates': [], 'best': {}}
    for kernel in st.KERNELS:
        default = st.default_launch(kernel, n)
        ref = launch(kernel, s, causal, default)
        timed = []
        for cfg in dict.fromkeys(candidates(kernel, n)[:limit] + [default]):
            entry = {'kernel': kernel, 'launch': cfg._asdict(), 'default': cfg == default}
            error = compiled.get((kernel, n, causal, cfg))
            if error is None:
                out = launch(kernel, s, causal, cfg)
                if all(_close(a, b) for a, b in zip(out, ref)):
                    entry['ms'] = time_ms(lambda: launch(kernel, s, causal, cfg), device)
                    timed.append((entry['ms'], cfg))
                else:
                    error = 'outputs differ from the default launch'
            entry['error'] = error
            row['candidates'].append(entry)
            print(f'  N={n}{" causal" if causal else ""} {kernel} {tuple(cfg)}: '
                  + (f'{entry["ms"]:.4f} ms' if error is None else error), flush=True)
        ms, best = min(timed)
        row['best'][kernel] = {'launch': best._asdict(), 'ms': ms,
                               'default_ms': next(t for t, c in timed if c == default)}
    picks = {k: st.Launch(**row['best'][k]['launch']) for k in st.KERNELS}

    def bwd():
        dD, _, _, _ = st.norm_backward(s['dy'], s['weight'], s['D'], s['eps'], True)
        _, delta = launch('dq', dict(s, dD=dD), causal, picks['dq'])
        launch('dkdv', dict(s, dD=dD, delta=delta), causal, picks['dkdv'])

    row['chain'] = {'fwd_ms': row['best']['fwd']['ms'], 'bwd_ms': time_ms(bwd, device)}
    row['sdpa'] = sdpa_ms(n, batch, causal, device)
    row['chain']['vs_sdpa'] = {'fwd': row['chain']['fwd_ms'] / row['sdpa']['fwd_ms'],
                               'bwd': row['chain']['bwd_ms'] / row['sdpa']['bwd_ms']}
    return row


def write_table(rows: List[Dict], env: Dict, command: str, path: Path) -> None:
    """Merge the chosen launches into the table at `path` under this GPU's architecture."""
    from diffzoo.layers.kernels import split_triton as st
    arch = env['arch']
    table = json.loads(path.read_text()) if path.is_file() else {'configs': {}, 'measured': {}}
    widths = table['configs'].setdefault(arch, {}).setdefault(st.widths(D, DV), {})
    for row in rows:
        for kernel, best in row['best'].items():
            widths.setdefault(kernel, {})[st.token_class(row['tokens'])] = best['launch']
    table['measured'][arch] = {'device': env['device'], 'date': env['date'], 'torch': env['torch'],
                               'triton': env['triton'], 'command': command,
                               'classes': {st.token_class(r['tokens']): f'N={r["tokens"]}{" causal" if r["causal"] else ""}'
                                           f' B={r["batch"]}' for r in rows}}
    path.write_text(json.dumps(table, indent=1) + '\n')


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog='python -m diffzoo.bench.tune', description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--tokens', type=int, nargs='+', default=None,
                   help='token counts to tune (default 77 197 577 4096; 77 and below run causal, as the text tower)')
    p.add_argument('--tokens-per-batch', type=int, default=256 * 197, help='batch = max(1, this // N) (default 256*197)')
    p.add_argument('--workers', type=int, default=min(16, os.cpu_count() or 1), help='compiling processes')
    p.add_argument('--device', default='cuda',
                   help='cuda; or cpu under TRITON_INTERPRET=1, which checks this program on small shapes '
                        '(its times are the interpreter\'s, and it writes no table)')
    p.add_argument('--limit', type=int, default=None, help='at most this many candidates per kernel, besides the default')
    p.add_argument('--out', default=None, help='JSON of every timing')
    p.add_argument('--write', action='store_true', help="write the choices into the package's launch_configs.json")
    p.add_argument('--table', default=None, help='the table --write merges into (default: the package\'s)')
    args = p.parse_args(argv)
    # heavy (torch, triton): imported after parsing so that --help answers at once
    import multiprocessing

    import torch
    import triton

    from diffzoo.bench import tune
    from diffzoo.layers.kernels import split_triton as st
    if args.device == 'cuda' and (not torch.cuda.is_available() or st.INTERPRETED):
        print('error: --device cuda times compiled kernels: it needs a CUDA GPU and TRITON_INTERPRET unset',
              file=sys.stderr)
        return 2
    if args.device == 'cpu' and (not st.INTERPRETED or args.write):
        print('error: --device cpu runs the kernels under TRITON_INTERPRET=1 (set it) and writes no table',
              file=sys.stderr)
        return 2
    if args.device not in ('cuda', 'cpu'):
        print(f'error: --device {args.device}: expected cuda or cpu', file=sys.stderr)
        return 2
    classes = [(n, n <= 77) for n in args.tokens] if args.tokens else list(CLASSES)
    compiled: Dict = {}
    if args.device == 'cuda':
        jobs = [(k, n, c, cfg) for n, c in classes for k in st.KERNELS
                for cfg in dict.fromkeys(candidates(k, n)[:args.limit] + [st.default_launch(k, n)])]
        print(f'compiling {len(jobs)} launches in {args.workers} processes', flush=True)
        with ProcessPoolExecutor(args.workers, mp_context=multiprocessing.get_context('spawn')) as pool:
            compiled = dict(pool.map(tune._compile, jobs))
    name = torch.cuda.get_device_name() if args.device == 'cuda' else 'Triton interpreter (CPU)'
    env = {'device': name, 'arch': st.arch(torch.device(args.device)),
           'torch': torch.__version__, 'triton': triton.__version__, 'date': datetime.date.today().isoformat()}
    rows = []
    for n, causal in classes:
        rows.append(tune_class(n, causal, max(1, args.tokens_per_batch // n), compiled, args.device, args.limit))
    result = {'environment': env, 'classes': rows}
    if args.out:
        with open(args.out, 'w') as f:
            json.dump(result, f, indent=1)
    if args.write:
        command = 'python -m diffzoo.bench.tune ' + ' '.join(argv if argv is not None else sys.argv[1:])
        table = Path(args.table) if args.table else st.CONFIGS
        write_table(rows, env, command.strip(), table)
        print(f'launches written to {table}')
    print(f'\n{"N":>12} {"kernel":>6} {"chosen (m, n, warps, stages, one tile)":>40} {"ms":>8} {"default ms":>10}')
    for r in rows:
        for kernel, b in r['best'].items():
            print(f'{r["tokens"]:>5}{" causal" if r["causal"] else "       "} {kernel:>6} '
                  f'{str(tuple(b["launch"].values())):>40} {b["ms"]:8.4f} {b["default_ms"]:10.4f}')
        c = r['chain']
        print(f'{"":>12} chain fwd {c["fwd_ms"]:.4f} ms ({c["vs_sdpa"]["fwd"]:.2f}x SDPA), '
              f'bwd {c["bwd_ms"]:.4f} ms ({c["vs_sdpa"]["bwd"]:.2f}x SDPA)')
    return 0


if __name__ == '__main__':
    sys.exit(main())
