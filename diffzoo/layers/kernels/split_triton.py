"""The split variant of differential attention as Triton kernels: both maps over one pass of K/V.

For differential head i with Q1, Q2, K1, K2 of width d and V of width 2d (layout in
`diffzoo.layers.diff_attention`), per query row:

    P1 = softmax(Q1 K1ᵀ/√d),  P2 = softmax(Q2 K2ᵀ/√d)
    D  = (P1 − λ·P2) V                       one product with V, not two
    y  = D · rstd · w,  rstd = 1/√(mean(D²) + ε)   sub-norm; w holds (1 − λ_init)

Forward, one program per (query tile, batch·head): K1, K2 and V tiles are loaded once and feed
both softmax streams. When a row's keys fit one tile (`Launch.one_tile`, up to ONE_TILE_MAX keys:
ViT's 197, text's 77) both softmaxes are exact and P1 − λ·P2 is formed before the single P·V
product; otherwise each stream keeps its own running max, sum and accumulator (online softmax)
and D = O1/l1 − λ·O2/l2. The sub-norm runs in the epilogue with fp32 statistics; y and D are
written in (B, N, C), and the row statistics kept for backward are the two log-sum-exps. Nothing
N×N is stored.

Backward (FlashAttention-2 style, maps recomputed from the saved log-sum-exps), with dD the
gradient reaching D through the sub-norm and dPV = dD Vᵀ computed once:

    dV  = (P1 − λ·P2)ᵀ dD                                      one product
    dS1 = P1 ∘ (dPV − δ1),        δ1 = rowsum(P1 ∘ dPV) = dD·(P1V)
    dS2 = −λ·P2 ∘ (dPV − ρ2),     ρ2 = rowsum(P2 ∘ dPV) = dD·(P2V)
    dQm = dSm Km/√d,  dKm = dSmᵀ Qm/√d,  dλ = −Σ ρ2   (fp16: −Σ (ρ2 + dD_lo·(P2V)), `bwd`)

The sub-norm's backward recomputes rstd from the stored D, as the SDPA kernels' path does, so dD
is orthogonal to the D it was formed from (a stale rstd would leak a radial part into dλ).
δ1 and ρ2 need every key of a row, so the dQ kernel (one program per query tile) forms them
first — in registers when the keys fit one tile, in a first pass otherwise — and stores them for
the dK/dV kernel (one program per key tile).

Launch configurations (tile sizes, warps, pipeline stages) come from `launch_configs.json`, per GPU
architecture, head widths and token class, written by `python -m diffzoo.bench.tune` on that GPU;
shapes it does not cover take `default_launch`, chosen so that ptxas reports no register spills
on sm_90 at DiffCLIP's widths. The interpreter takes sm_90's table too (`arch`).

Masks: `is_causal`, and a key-padding bias (0 or −inf per batch and key). Inputs bf16, fp16 or
fp32; products take the input dtype (fp32 products are IEEE), softmax and statistics are fp32.
"""
import functools
import json
from pathlib import Path
from typing import Dict, NamedTuple, Optional, Tuple

import torch
from triton.runtime.interpreter import InterpretedFunction

from .bwd import _diff_attn_bwd_dkdv, _diff_attn_bwd_dq, _diff_attn_norm_bwd
from .fwd import _diff_attn_fwd

ONE_TILE_MAX = 256  # a one-tile launch holds a row's keys up to this many
LOG2E = 1.4426950408889634
INTERPRETED = isinstance(_diff_attn_fwd, InterpretedFunction)  # TRITON_INTERPRET=1 was set at import
CONFIGS = Path(__file__).with_name('launch_configs.json')
KERNELS = ('fwd', 'dq', 'dkdv')
TOKEN_CLASSES = (128, 256, 1024, None)  # upper bounds of the token classes a table row covers; None: any


class Launch(NamedTuple):
    """One kernel's launch: query rows and keys per tile, warps per program, software-pipeline depth;
    `one_tile` (forward and dQ) holds every key of a row in one tile of next_power_of_2(N)."""
    block_m: int
    block_n: int
    warps: int
    stages: int = 3
    one_tile: bool = False


def _pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << (n - 1).bit_length())  # host arithmetic on ints (triton's helpers cost µs a call)


def _cdiv(n: int, d: int) -> int:
    return -(-n // d)


def token_class(n_ctx: int) -> str:
    """The table key of a sequence length: the smallest class bound ≥ N ('any' beyond the last)."""
    return str(next(bound for bound in TOKEN_CLASSES if bound is None or n_ctx <= bound) or 'any')


def default_launch(kernel: str, n_ctx: int) -> Launch:
    """The launch where the table has none (see the module docstring)."""
    if kernel == 'dkdv':
        return Launch(32, 64, 8)
    if n_ctx <= 128:
        return Launch(32, _pow2(n_ctx), 8, one_tile=True)
    if n_ctx <= ONE_TILE_MAX:
        return Launch(16, ONE_TILE_MAX, 16, one_tile=True)
    return Launch(64, 32, 8)


@functools.lru_cache(maxsize=None)
def _table() -> Dict:
    return json.loads(CONFIGS.read_text())['configs'] if CONFIGS.is_file() else {}


def arch(device: torch.device) -> str:
    """'sm_90' for an H100 or H200; the interpreter runs sm_90's launches."""
    if device.type != 'cuda':
        return 'sm_90'
    major, minor = torch.cuda.get_device_capability(device)
    return f'sm_{major}{minor}'


@functools.lru_cache(maxsize=None)
def _launch_on(kernel: str, n_ctx: int, d: int, dv: int, device: torch.device) -> Launch:
    """`launch_config` on `device`, once per shape (the table is read once per process)."""
    return launch_config(kernel, n_ctx, d, dv, arch(device))


def widths(d: int, dv: int) -> str:
    return f'{d}x{dv}'


def launch_config(kernel: str, n_ctx: int, d: int, dv: int, arch_name: str) -> Launch:
    """The tuned launch of `kernel` for N keys at head widths d, dv on `arch_name` (`arch`), else the default."""
    row = _table().get(arch_name, {}).get(widths(d, dv), {}).get(kernel, {}).get(token_class(n_ctx))
    if row is None:
        return default_launch(kernel, n_ctx)
    launch = Launch(**row)
    if launch.one_tile:
        if n_ctx > ONE_TILE_MAX:
            return default_launch(kernel, n_ctx)
        launch = launch._replace(block_n=_pow2(n_ctx))
    return launch


def _dot_args(dtype: torch.dtype) -> dict:
    """fp32 products in IEEE precision (not TF32); bf16 operands upcast under the interpreter."""
    return dict(PRECISION='ieee' if dtype == torch.float32 else 'tf32',  # ignored for 16-bit inputs
                DOT_UPCAST=INTERPRETED and dtype == torch.bfloat16)


def _geometry(q, v):
    B, h2, N, d = q.shape
    return B, h2 // 2, N, d, v.shape[-1]


def _strides(q, k, v) -> Tuple[int, ...]:
    return (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2))


def _common(q, v, key_bias, is_causal: bool) -> dict:
    _, _, _, d, dv = _geometry(q, v)
    return _constants(d, dv, is_causal, key_bias is not None, q.dtype)


@functools.lru_cache(maxsize=None)
def _constants(d: int, dv: int, is_causal: bool, has_bias: bool, dtype: torch.dtype) -> dict:
    """The kernels' shared compile-time arguments (read, never changed, by every launch)."""
    return dict(HEAD_D=d, HEAD_DV=dv, BLOCK_D=_pow2(d), BLOCK_DV=_pow2(dv), IS_CAUSAL=is_causal,
                HAS_BIAS=has_bias, **_dot_args(dtype))


def _launch(kernel: str, q, v, given: Optional[Launch]) -> Launch:
    B, h, N, d, dv = _geometry(q, v)
    return given if given is not None else _launch_on(kernel, N, d, dv, q.device)


def forward(q, k, v, lam, weight, key_bias, scale: float, eps: float, is_causal: bool,
            launch: Optional[Launch] = None, for_backward: bool = True):
    """Launch the forward kernel. q, k (B, 2h, N, d) and v (B, h, N, 2d) with unit stride in the
    last dim; lam a 0-dim fp32 tensor; weight (2d,); key_bias None or (B, N) fp32 (0 / −inf).
    Returns y and D, both (B, N, C) in the input dtype, and lse (2, B, h, N), fp32; without
    `for_backward`, only y (D and lse are not written, and come back empty)."""
    B, h, N, d, dv = _geometry(q, v)
    cfg = _launch('fwd', q, v, launch)
    y = v.new_empty(B, N, h * dv)
    D = torch.empty_like(y) if for_backward else y.new_empty(0)
    lse = torch.empty(2, B, h, N, device=q.device, dtype=torch.float32) if for_backward else D
    _diff_attn_fwd[(_cdiv(N, cfg.block_m), B * h)](
        q, k, v, key_bias, lam, weight, y, D, lse, *_strides(q, k, v), N, h, scale * LOG2E, eps,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, ONE_TILE=cfg.one_tile, STORE_STATS=for_backward,
        num_warps=cfg.warps, num_stages=cfg.stages, **_common(q, v, key_bias, is_causal),
    )
    return y, D, lse


def norm_backward(dy, weight, D, eps: float, want_y: bool):
    """The sub-norm's backward: dD (B, N, C) in D's dtype; for fp16, dD_lo, what rounding dD to fp16
    lost (else None); the weight's gradient (fp32, (2d,)); and, with `want_y`, y recomputed."""
    dy = dy.contiguous()
    h = D.shape[-1] // weight.shape[0]
    dv_width = weight.shape[0]
    rows = D.shape[0] * D.shape[1]
    block_r = 32
    n_row_blocks = _cdiv(rows, block_r)
    block_dv = _pow2(dv_width)
    dD = torch.empty_like(D)
    dD_lo = torch.empty_like(D) if D.dtype == torch.float16 else None
    y = torch.empty_like(D) if want_y else None
    dw_parts = torch.empty(n_row_blocks, h, block_dv, device=D.device, dtype=torch.float32)
    _diff_attn_norm_bwd[(n_row_blocks, h)](
        D, dy, weight, dD, dD_lo, y, dw_parts, rows, h, eps,
        HEAD_DV=dv_width, BLOCK_DV=block_dv, BLOCK_R=block_r, WRITE_Y=want_y, WRITE_LO=dD_lo is not None,
    )
    return dD, dD_lo, dw_parts.sum((0, 1))[:dv_width], y


def dq_backward(q, k, v, lam, key_bias, dD, lse, scale: float, is_causal: bool, launch: Optional[Launch] = None,
                dD_lo: Optional[torch.Tensor] = None):
    """dq (the shape of q, in (B, N, 2h, d) memory) and the row sums δ1, ρ2 as (2, B, h, N) fp32, with
    `dD_lo` (`norm_backward`'s) ρ2_lo = dD_lo·(P2V) as a third, (3, B, h, N)."""
    B, h, N, d, _ = _geometry(q, v)
    cfg = _launch('dq', q, v, launch)
    dq = q.new_empty(B, N, 2 * h, d).transpose(1, 2)
    delta = torch.empty(2 if dD_lo is None else 3, B, h, N, device=q.device, dtype=torch.float32)
    _diff_attn_bwd_dq[(_cdiv(N, cfg.block_m), B * h)](
        q, k, v, key_bias, lam, dD, dD_lo, lse, delta, dq, *_strides(q, k, v),
        dq.stride(0), dq.stride(1), dq.stride(2), N, h, scale * LOG2E, scale,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, ONE_TILE=cfg.one_tile, HAS_LO=dD_lo is not None,
        num_warps=cfg.warps, num_stages=cfg.stages, **_common(q, v, key_bias, is_causal),
    )
    return dq, delta


def dkdv_backward(q, k, v, lam, key_bias, dD, lse, delta, scale: float, is_causal: bool,
                  launch: Optional[Launch] = None):
    """dk, dv in the shapes of k, v ((B, N, heads, width) memory)."""
    B, h, N, d, dv_width = _geometry(q, v)
    cfg = _launch('dkdv', q, v, launch)
    dk = k.new_empty(B, N, 2 * h, d).transpose(1, 2)
    dv = v.new_empty(B, N, h, dv_width).transpose(1, 2)
    _diff_attn_bwd_dkdv[(_cdiv(N, cfg.block_n), B * h)](
        q, k, v, key_bias, lam, dD, lse, delta, dk, dv, *_strides(q, k, v),
        dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
        N, h, scale * LOG2E, scale, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.warps,
        num_stages=cfg.stages, **_common(q, v, key_bias, is_causal),
    )
    return dk, dv


def backward(dy, q, k, v, lam, weight, key_bias, D, lse, scale: float, eps: float, is_causal: bool, want_y: bool):
    """Gradients from dy (B, N, C), the gradient of y: dq, dk, dv in the shapes of q, k, v (as views
    of (B, N, heads, width) memory); dλ (0-dim fp32); the weight's gradient (fp32, (2d,)); and,
    with `want_y`, y recomputed."""
    dD, dD_lo, dweight, y = norm_backward(dy, weight, D, eps, want_y)
    dq, delta = dq_backward(q, k, v, lam, key_bias, dD, lse, scale, is_causal, dD_lo=dD_lo)
    dk, dv = dkdv_backward(q, k, v, lam, key_bias, dD, lse, delta, scale, is_causal)
    dlam = -delta[1:].sum()  # ρ2, and ρ2_lo where there is one
    return dq, dk, dv, dlam, dweight, y
