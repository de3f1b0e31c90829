"""The split variant of differential attention as Triton kernels: both maps over one pass of K/V.

For differential head i with Q1, Q2, K1, K2 of width d and V of width 2d (layout in
`diffzoo.layers.diff_attention`), per query row:

    P1 = softmax(Q1 K1ᵀ/√d),  P2 = softmax(Q2 K2ᵀ/√d)
    D  = (P1 − λ·P2) V                       one product with V, not two
    y  = D · rstd · w,  rstd = 1/√(mean(D²) + ε)   sub-norm; w holds (1 − λ_init)

Forward, one program per (query tile, batch·head): K1, K2 and V tiles are loaded once and feed
both softmax streams. Up to ONE_TILE_MAX keys (ViT's 197, text's 77) a row's keys fit one tile,
so both softmaxes are exact and P1 − λ·P2 is formed before the single P·V product; beyond, each
stream keeps its own running max, sum and accumulator (online softmax) and D = O1/l1 − λ·O2/l2.
The sub-norm runs in the epilogue with fp32 statistics; y and D are written in (B, N, C), and the
row statistics kept for backward are the two log-sum-exps and rstd. Nothing N×N is stored.

Backward (FlashAttention-2 style, maps recomputed from the saved log-sum-exps), with dD the
gradient reaching D through the sub-norm and dPV = dD Vᵀ computed once:

    dV  = (P1 − λ·P2)ᵀ dD                                      one product
    dS1 = P1 ∘ (dPV − δ1),        δ1 = rowsum(P1 ∘ dPV) = dD·(P1V)
    dS2 = −λ·P2 ∘ (dPV − ρ2),     ρ2 = rowsum(P2 ∘ dPV) = dD·(P2V)
    dQm = dSm Km/√d,  dKm = dSmᵀ Qm/√d,  dλ = −Σ ρ2

δ1 and ρ2 need every key of a row, so the dQ kernel (one program per query tile) forms them
first — in registers when the keys fit one tile, in a first pass otherwise — and stores them for
the dK/dV kernel (one program per key tile).

Masks: `is_causal`, and a key-padding bias (0 or −inf per batch and key). Inputs bf16, fp16 or
fp32; products take the input dtype (fp32 products are IEEE), softmax and statistics are fp32.
"""
from typing import Tuple

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction

from .bwd import _diff_attn_bwd_dkdv, _diff_attn_bwd_dq, _diff_attn_norm_bwd
from .fwd import _diff_attn_fwd

ONE_TILE_MAX = 256  # keys up to this many are one tile: exact softmax, single P·V
LOG2E = 1.4426950408889634
INTERPRETED = isinstance(_diff_attn_fwd, InterpretedFunction)  # TRITON_INTERPRET=1 was set at import


def _pow2(n: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(n))


def _blocks(n_ctx: int) -> Tuple[int, int, bool, int]:
    """(BLOCK_M, BLOCK_N, ONE_TILE, num_warps) of the forward and dQ kernels. Chosen so that, for
    sm_90 at q/k 64 and v 128 wide, ptxas reports no (≤ 40 B) register spills; timings may refine them."""
    if n_ctx <= 128:
        return 32, _pow2(n_ctx), True, 8
    if n_ctx <= ONE_TILE_MAX:
        return 16, ONE_TILE_MAX, True, 16
    return 64, 32, False, 8


DKDV_BLOCKS = (32, 64, 8)  # (BLOCK_M, BLOCK_N, num_warps) of the dK/dV kernel, on the same grounds


def _dot_args(dtype: torch.dtype) -> dict:
    """fp32 products in IEEE precision (not TF32); bf16 operands upcast under the interpreter."""
    return dict(PRECISION='ieee' if dtype == torch.float32 else 'tf32',  # ignored for 16-bit inputs
                DOT_UPCAST=INTERPRETED and dtype == torch.bfloat16)


def _geometry(q, v):
    B, h2, N, d = q.shape
    return B, h2 // 2, N, d, v.shape[-1]


def forward(q, k, v, lam, weight, key_bias, scale: float, eps: float, is_causal: bool):
    """Launch the forward kernel. q, k (B, 2h, N, d) and v (B, h, N, 2d) with unit stride in the
    last dim; lam a 0-dim fp32 tensor; weight (2d,); key_bias None or (B, N) fp32 (0 / −inf).
    Returns y and D, both (B, N, C) in the input dtype, lse (2, B, h, N) and rstd (B, h, N), fp32."""
    B, h, N, d, dv = _geometry(q, v)
    y = v.new_empty(B, N, h * dv)
    D = torch.empty_like(y)
    lse = torch.empty(2, B, h, N, device=q.device, dtype=torch.float32)
    rstd = torch.empty(B, h, N, device=q.device, dtype=torch.float32)
    block_m, block_n, one_tile, warps = _blocks(N)
    grid = (triton.cdiv(N, block_m), B * h)
    _diff_attn_fwd[grid](
        q, k, v, key_bias, lam, weight, y, D, lse, rstd,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        N, h, scale * LOG2E, eps,
        HEAD_D=d, HEAD_DV=dv, BLOCK_D=_pow2(d), BLOCK_DV=_pow2(dv),
        BLOCK_M=block_m, BLOCK_N=block_n, ONE_TILE=one_tile,
        IS_CAUSAL=is_causal, HAS_BIAS=key_bias is not None, **_dot_args(q.dtype), num_warps=warps,
    )
    return y, D, lse, rstd


def backward(dy, q, k, v, lam, weight, key_bias, D, lse, rstd, scale: float, is_causal: bool, want_y: bool):
    """Gradients from dy (B, N, C), the gradient of y: dq, dk, dv in the shapes of q, k, v;
    dλ (0-dim fp32); the weight's gradient (fp32, (2d,)); and, with `want_y`, y recomputed."""
    B, h, N, d, dv_width = _geometry(q, v)
    dy = dy.contiguous()
    rows = B * N
    block_r = 32
    n_row_blocks = triton.cdiv(rows, block_r)
    block_dv = _pow2(dv_width)
    dD = torch.empty_like(D)
    y = torch.empty_like(D) if want_y else None
    dw_parts = torch.empty(n_row_blocks, h, block_dv, device=q.device, dtype=torch.float32)
    _diff_attn_norm_bwd[(n_row_blocks, h)](
        D, dy, rstd, weight, dD, y, dw_parts, rows, N, h,
        HEAD_DV=dv_width, BLOCK_DV=block_dv, BLOCK_R=block_r, WRITE_Y=want_y,
    )
    dweight = dw_parts.sum((0, 1))[:dv_width]

    # gradients in (B, N, heads, width) memory, handed back as (B, heads, N, width) views like q, k, v
    dq = q.new_empty(B, N, 2 * h, d).transpose(1, 2)
    dk = k.new_empty(B, N, 2 * h, d).transpose(1, 2)
    dv = v.new_empty(B, N, h, dv_width).transpose(1, 2)
    delta = torch.empty(2, B, h, N, device=q.device, dtype=torch.float32)
    block_m, block_n, one_tile, warps = _blocks(N)
    common = dict(HEAD_D=d, HEAD_DV=dv_width, BLOCK_D=_pow2(d), BLOCK_DV=block_dv,
                  IS_CAUSAL=is_causal, HAS_BIAS=key_bias is not None, **_dot_args(q.dtype))
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
               v.stride(0), v.stride(1), v.stride(2))
    _diff_attn_bwd_dq[(triton.cdiv(N, block_m), B * h)](
        q, k, v, key_bias, lam, dD, lse, delta, dq, *strides, dq.stride(0), dq.stride(1), dq.stride(2),
        N, h, scale * LOG2E, scale, BLOCK_M=block_m, BLOCK_N=block_n, ONE_TILE=one_tile,
        num_warps=warps, **common,
    )
    kv_block_m, kv_block_n, kv_warps = DKDV_BLOCKS
    _diff_attn_bwd_dkdv[(triton.cdiv(N, kv_block_n), B * h)](
        q, k, v, key_bias, lam, dD, lse, delta, dk, dv, *strides,
        dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
        N, h, scale * LOG2E, scale, BLOCK_M=kv_block_m, BLOCK_N=kv_block_n, num_warps=kv_warps, **common,
    )
    dlam = -delta[1].sum()
    return dq, dk, dv, dlam, dweight, y
