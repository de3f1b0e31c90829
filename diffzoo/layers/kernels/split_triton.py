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
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

ONE_TILE_MAX = 256  # keys up to this many are one tile: exact softmax, single P·V
LOG2E = 1.4426950408889634


@triton.jit
def _key_bias(KB, b, offs_n, n_ctx, HAS_BIAS: tl.constexpr):
    """(BLOCK_N,) additive bias in log2 units: −inf beyond the sequence or where the key is padding."""
    if HAS_BIAS:
        bias = tl.load(KB + b * n_ctx + offs_n, mask=offs_n < n_ctx, other=float('-inf')) * 1.4426950408889634
    else:
        bias = tl.where(offs_n < n_ctx, 0., float('-inf'))
    return bias


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """a·b accumulated in fp32. DOT_UPCAST (set under Triton's interpreter, whose dot multiplies
    bf16 operands' raw bits) feeds the operands as fp32: the same products, since a product of
    two 16-bit floats is exact in fp32."""
    if DOT_UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision='ieee')
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _scores(q, k, bias, offs_m, offs_n, qk_scale,
            IS_CAUSAL: tl.constexpr, PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """(BLOCK_M, BLOCK_N) scores Q Kᵀ·scale·log2(e) in fp32 with the masks applied."""
    s = _dot(q, tl.trans(k), PRECISION, DOT_UPCAST) * qk_scale + bias[None, :]
    if IS_CAUSAL:
        s = tl.where(offs_m[:, None] >= offs_n[None, :], s, float('-inf'))
    return s


@triton.jit
def _scores_t(k, q, bias, offs_m, offs_n, qk_scale,
              IS_CAUSAL: tl.constexpr, PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """(BLOCK_N, BLOCK_M) transposed scores K Qᵀ·scale·log2(e), as the dK/dV kernel walks them."""
    s = _dot(k, tl.trans(q), PRECISION, DOT_UPCAST) * qk_scale + bias[:, None]
    if IS_CAUSAL:
        s = tl.where(offs_m[None, :] >= offs_n[:, None], s, float('-inf'))
    return s


@triton.jit
def _exact_softmax(s):
    """Row softmax of a whole row in one tile, and its log-sum-exp (log2 units; +inf for a row with
    no visible key, so that exp2(s − lse) is 0 there)."""
    m = tl.max(s, 1)
    m_safe = tl.where(m == float('-inf'), 0., m)
    p = tl.exp2(s - m_safe[:, None])
    l = tl.sum(p, 1)
    l_safe = tl.where(l == 0., 1., l)
    lse = tl.where(l == 0., float('inf'), m_safe + tl.log2(l_safe))
    return p / l_safe[:, None], lse


@triton.jit
def _online_update(s, m, l, acc, v, PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """One key tile of an online softmax stream: running max m, sum l and accumulator Σ p·V."""
    m_new = tl.maximum(m, tl.max(s, 1))
    m_safe = tl.where(m_new == float('-inf'), 0., m_new)
    alpha = tl.exp2(m - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, DOT_UPCAST)
    return m_new, l, acc


@triton.jit
def _diff_attn_fwd(
        Q, K, V, KB, LAM, W, Y, D, LSE, RSTD,
        sq_b, sq_h, sq_n, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n,
        n_ctx, n_heads, qk_scale, eps,
        HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ONE_TILE: tl.constexpr,
        IS_CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    b, h = bh // n_heads, bh % n_heads
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < n_ctx
    q_ptrs = Q + b * sq_b + 2 * h * sq_h + offs_m[:, None] * sq_n + offs_d[None, :]
    q_mask = row_ok[:, None] & (offs_d[None, :] < HEAD_D)
    q1 = tl.load(q_ptrs, mask=q_mask, other=0.)  # (BLOCK_M, BLOCK_D): query head 2h
    q2 = tl.load(q_ptrs + sq_h, mask=q_mask, other=0.)  # query head 2h + 1
    k_base = K + b * sk_b + 2 * h * sk_h
    v_base = V + b * sv_b + h * sv_h
    lam = tl.load(LAM)

    if ONE_TILE:
        offs_n = tl.arange(0, BLOCK_N)
        k_ptrs = k_base + offs_n[:, None] * sk_n + offs_d[None, :]
        k_mask = (offs_n[:, None] < n_ctx) & (offs_d[None, :] < HEAD_D)
        k1 = tl.load(k_ptrs, mask=k_mask, other=0.)
        k2 = tl.load(k_ptrs + sk_h, mask=k_mask, other=0.)
        v = tl.load(v_base + offs_n[:, None] * sv_n + offs_dv[None, :],
                    mask=(offs_n[:, None] < n_ctx) & (offs_dv[None, :] < HEAD_DV), other=0.)
        bias = _key_bias(KB, b, offs_n, n_ctx, HAS_BIAS)
        p1, lse1 = _exact_softmax(_scores(q1, k1, bias, offs_m, offs_n, qk_scale, IS_CAUSAL, PRECISION, DOT_UPCAST))
        p2, lse2 = _exact_softmax(_scores(q2, k2, bias, offs_m, offs_n, qk_scale, IS_CAUSAL, PRECISION, DOT_UPCAST))
        p = p1 - lam * p2
        acc = _dot(p.to(v.dtype), v, PRECISION, DOT_UPCAST)  # (BLOCK_M, BLOCK_DV) = D
    else:
        m1 = tl.full([BLOCK_M], float('-inf'), tl.float32)
        m2 = tl.full([BLOCK_M], float('-inf'), tl.float32)
        l1 = tl.zeros([BLOCK_M], tl.float32)
        l2 = tl.zeros([BLOCK_M], tl.float32)
        acc1 = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
        acc2 = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
        hi = n_ctx
        if IS_CAUSAL:
            hi = tl.minimum(n_ctx, (start_m + 1) * BLOCK_M)
        for start_n in range(0, hi, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            k_ptrs = k_base + offs_n[:, None] * sk_n + offs_d[None, :]
            k_mask = (offs_n[:, None] < n_ctx) & (offs_d[None, :] < HEAD_D)
            k1 = tl.load(k_ptrs, mask=k_mask, other=0.)
            k2 = tl.load(k_ptrs + sk_h, mask=k_mask, other=0.)
            v = tl.load(v_base + offs_n[:, None] * sv_n + offs_dv[None, :],
                        mask=(offs_n[:, None] < n_ctx) & (offs_dv[None, :] < HEAD_DV), other=0.)
            bias = _key_bias(KB, b, offs_n, n_ctx, HAS_BIAS)
            m1, l1, acc1 = _online_update(
                _scores(q1, k1, bias, offs_m, offs_n, qk_scale, IS_CAUSAL, PRECISION, DOT_UPCAST),
                m1, l1, acc1, v, PRECISION, DOT_UPCAST)
            m2, l2, acc2 = _online_update(
                _scores(q2, k2, bias, offs_m, offs_n, qk_scale, IS_CAUSAL, PRECISION, DOT_UPCAST),
                m2, l2, acc2, v, PRECISION, DOT_UPCAST)
        l1_safe = tl.where(l1 == 0., 1., l1)
        l2_safe = tl.where(l2 == 0., 1., l2)
        acc = acc1 / l1_safe[:, None] - lam * (acc2 / l2_safe[:, None])
        lse1 = tl.where(l1 == 0., float('inf'), m1 + tl.log2(l1_safe))
        lse2 = tl.where(l2 == 0., float('inf'), m2 + tl.log2(l2_safe))

    # sub-norm epilogue: padded value columns are 0, so the sum runs over the head's 2d columns
    rstd = tl.rsqrt(tl.sum(acc * acc, 1) / HEAD_DV + eps)
    col_ok = offs_dv < HEAD_DV
    w = tl.load(W + offs_dv, mask=col_ok, other=0.).to(tl.float32)
    y = acc * rstd[:, None] * w[None, :]
    C = n_heads * HEAD_DV
    out_offs = (b * n_ctx + offs_m[:, None]) * C + h * HEAD_DV + offs_dv[None, :]  # (B, N, C)
    out_mask = row_ok[:, None] & col_ok[None, :]
    tl.store(Y + out_offs, y.to(Y.dtype.element_ty), mask=out_mask)
    tl.store(D + out_offs, acc.to(D.dtype.element_ty), mask=out_mask)
    stat = bh * n_ctx + offs_m  # (B, h, N)
    tl.store(LSE + stat, lse1, mask=row_ok)
    tl.store(LSE + tl.num_programs(1) * n_ctx + stat, lse2, mask=row_ok)  # stream 2 of (2, B, h, N)
    tl.store(RSTD + stat, rstd, mask=row_ok)


@triton.jit
def _diff_attn_norm_bwd(
        D, G, RSTD, W, DD, Y, DW,
        n_rows, n_ctx, n_heads,
        HEAD_DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_R: tl.constexpr, WRITE_Y: tl.constexpr,
):
    """dD = rstd·(g∘w − n·mean(g∘w∘n)) with n = D·rstd, per (row tile, head); partial Σ g∘n for the
    weight's gradient; y = n∘w when the output projection's weight gradient needs it."""
    pid = tl.program_id(0)
    h = tl.program_id(1)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)  # rows of (B·N)
    cols = tl.arange(0, BLOCK_DV)
    row_ok = rows < n_rows
    col_ok = cols < HEAD_DV
    offs = rows[:, None] * (n_heads * HEAD_DV) + h * HEAD_DV + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    d = tl.load(D + offs, mask=mask, other=0.).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.).to(tl.float32)
    b, n = rows // n_ctx, rows % n_ctx
    rstd = tl.load(RSTD + (b * n_heads + h) * n_ctx + n, mask=row_ok, other=0.)
    w = tl.load(W + cols, mask=col_ok, other=0.).to(tl.float32)
    normed = d * rstd[:, None]
    gw = g * w[None, :]
    mean = tl.sum(gw * normed, 1) / HEAD_DV
    dd = rstd[:, None] * (gw - normed * mean[:, None])
    tl.store(DD + offs, dd.to(DD.dtype.element_ty), mask=mask)
    if WRITE_Y:
        tl.store(Y + offs, (normed * w[None, :]).to(Y.dtype.element_ty), mask=mask)
    tl.store(DW + (pid * n_heads + h) * BLOCK_DV + cols, tl.sum(g * normed, 0))


@triton.jit
def _diff_attn_bwd_dq(
        Q, K, V, KB, LAM, DD, LSE, DELTA, DQ,
        sq_b, sq_h, sq_n, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, sdq_b, sdq_h, sdq_n,
        n_ctx, n_heads, qk_scale, sm_scale,
        HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ONE_TILE: tl.constexpr,
        IS_CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    b, h = bh // n_heads, bh % n_heads
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < n_ctx
    q_ptrs = Q + b * sq_b + 2 * h * sq_h + offs_m[:, None] * sq_n + offs_d[None, :]
    q_mask = row_ok[:, None] & (offs_d[None, :] < HEAD_D)
    q1 = tl.load(q_ptrs, mask=q_mask, other=0.)
    q2 = tl.load(q_ptrs + sq_h, mask=q_mask, other=0.)
    C = n_heads * HEAD_DV
    dd = tl.load(DD + (b * n_ctx + offs_m[:, None]) * C + h * HEAD_DV + offs_dv[None, :],
                 mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DV), other=0.)  # (BLOCK_M, BLOCK_DV)
    stat = bh * n_ctx + offs_m
    second = tl.num_programs(1) * n_ctx  # offset of stream 2 in (2, B, h, N)
    lse1 = tl.load(LSE + stat, mask=row_ok, other=float('inf'))
    lse2 = tl.load(LSE + second + stat, mask=row_ok, other=float('inf'))
    k_base = K + b * sk_b + 2 * h * sk_h
    v_base = V + b * sv_b + h * sv_h
    lam = tl.load(LAM)

    if ONE_TILE:
        offs_n = tl.arange(0, BLOCK_N)
        k_ptrs = k_base + offs_n[:, None] * sk_n + offs_d[None, :]
        k_mask = (offs_n[:, None] < n_ctx) & (offs_d[None, :] < HEAD_D)
        k1 = tl.load(k_ptrs, mask=k_mask, other=0.)
        k2 = tl.load(k_ptrs + sk_h, mask=k_mask, other=0.)
        v = tl.load(v_base + offs_n[:, None] * sv_n + offs_dv[None, :],
                    mask=(offs_n[:, None] < n_ctx) & (offs_dv[None, :] < HEAD_DV), other=0.)
        bias = _key_bias(KB, b, offs_n, n_ctx, HAS_BIAS)
        p1 = tl.exp2(_scores(q1, k1, bias, offs_m, offs_n, qk_scale, IS_CAUSAL, PRECISION, DOT_UPCAST) - lse1[:, None])
        p2 = tl.exp2(_scores(q2, k2, bias, offs_m, offs_n, qk_scale, IS_CAUSAL, PRECISION, DOT_UPCAST) - lse2[:, None])
        dpv = _dot(dd, tl.trans(v), PRECISION, DOT_UPCAST)  # (BLOCK_M, BLOCK_N)
        delta1 = tl.sum(p1 * dpv, 1)
        rho2 = tl.sum(p2 * dpv, 1)
        ds1 = p1 * (dpv - delta1[:, None])
        ds2 = -lam * p2 * (dpv - rho2[:, None])
        dq1 = _dot(ds1.to(k1.dtype), k1, PRECISION, DOT_UPCAST)
        dq2 = _dot(ds2.to(k2.dtype), k2, PRECISION, DOT_UPCAST)
    else:
        hi = n_ctx
        if IS_CAUSAL:
            hi = tl.minimum(n_ctx, (start_m + 1) * BLOCK_M)
        delta1 = tl.zeros([BLOCK_M], tl.float32)
        rho2 = tl.zeros([BLOCK_M], tl.float32)
        for start_n in range(0, hi, BLOCK_N):  # first pass: the row sums over every key
            offs_n = start_n + tl.arange(0, BLOCK_N)
            k_ptrs = k_base + offs_n[:, None] * sk_n + offs_d[None, :]
            k_mask = (offs_n[:, None] < n_ctx) & (offs_d[None, :] < HEAD_D)
            k1 = tl.load(k_ptrs, mask=k_mask, other=0.)
            k2 = tl.load(k_ptrs + sk_h, mask=k_mask, other=0.)
            v = tl.load(v_base + offs_n[:, None] * sv_n + offs_dv[None, :],
                        mask=(offs_n[:, None] < n_ctx) & (offs_dv[None, :] < HEAD_DV), other=0.)
            bias = _key_bias(KB, b, offs_n, n_ctx, HAS_BIAS)
            p1 = tl.exp2(_scores(q1, k1, bias, offs_m, offs_n, qk_scale, IS_CAUSAL, PRECISION, DOT_UPCAST) - lse1[:, None])
            p2 = tl.exp2(_scores(q2, k2, bias, offs_m, offs_n, qk_scale, IS_CAUSAL, PRECISION, DOT_UPCAST) - lse2[:, None])
            dpv = _dot(dd, tl.trans(v), PRECISION, DOT_UPCAST)
            delta1 += tl.sum(p1 * dpv, 1)
            rho2 += tl.sum(p2 * dpv, 1)
        dq1 = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        dq2 = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for start_n in range(0, hi, BLOCK_N):  # second pass: dQ
            offs_n = start_n + tl.arange(0, BLOCK_N)
            k_ptrs = k_base + offs_n[:, None] * sk_n + offs_d[None, :]
            k_mask = (offs_n[:, None] < n_ctx) & (offs_d[None, :] < HEAD_D)
            k1 = tl.load(k_ptrs, mask=k_mask, other=0.)
            k2 = tl.load(k_ptrs + sk_h, mask=k_mask, other=0.)
            v = tl.load(v_base + offs_n[:, None] * sv_n + offs_dv[None, :],
                        mask=(offs_n[:, None] < n_ctx) & (offs_dv[None, :] < HEAD_DV), other=0.)
            bias = _key_bias(KB, b, offs_n, n_ctx, HAS_BIAS)
            p1 = tl.exp2(_scores(q1, k1, bias, offs_m, offs_n, qk_scale, IS_CAUSAL, PRECISION, DOT_UPCAST) - lse1[:, None])
            p2 = tl.exp2(_scores(q2, k2, bias, offs_m, offs_n, qk_scale, IS_CAUSAL, PRECISION, DOT_UPCAST) - lse2[:, None])
            dpv = _dot(dd, tl.trans(v), PRECISION, DOT_UPCAST)
            ds1 = p1 * (dpv - delta1[:, None])
            ds2 = -lam * p2 * (dpv - rho2[:, None])
            dq1 += _dot(ds1.to(k1.dtype), k1, PRECISION, DOT_UPCAST)
            dq2 += _dot(ds2.to(k2.dtype), k2, PRECISION, DOT_UPCAST)

    tl.store(DELTA + stat, delta1, mask=row_ok)
    tl.store(DELTA + second + stat, rho2, mask=row_ok)
    dq_ptrs = DQ + b * sdq_b + 2 * h * sdq_h + offs_m[:, None] * sdq_n + offs_d[None, :]
    tl.store(dq_ptrs, (dq1 * sm_scale).to(DQ.dtype.element_ty), mask=q_mask)
    tl.store(dq_ptrs + sdq_h, (dq2 * sm_scale).to(DQ.dtype.element_ty), mask=q_mask)


@triton.jit
def _diff_attn_bwd_dkdv(
        Q, K, V, KB, LAM, DD, LSE, DELTA, DK, DV,
        sq_b, sq_h, sq_n, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n,
        sdk_b, sdk_h, sdk_n, sdv_b, sdv_h, sdv_n,
        n_ctx, n_heads, qk_scale, sm_scale,
        HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        IS_CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    start_n = tl.program_id(0) * BLOCK_N
    bh = tl.program_id(1)
    b, h = bh // n_heads, bh % n_heads
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    key_ok = offs_n < n_ctx
    k_mask = key_ok[:, None] & (offs_d[None, :] < HEAD_D)
    v_mask = key_ok[:, None] & (offs_dv[None, :] < HEAD_DV)
    k_ptrs = K + b * sk_b + 2 * h * sk_h + offs_n[:, None] * sk_n + offs_d[None, :]
    k1 = tl.load(k_ptrs, mask=k_mask, other=0.)  # (BLOCK_N, BLOCK_D)
    k2 = tl.load(k_ptrs + sk_h, mask=k_mask, other=0.)
    v = tl.load(V + b * sv_b + h * sv_h + offs_n[:, None] * sv_n + offs_dv[None, :], mask=v_mask, other=0.)
    bias = _key_bias(KB, b, offs_n, n_ctx, HAS_BIAS)
    lam = tl.load(LAM)
    q_base = Q + b * sq_b + 2 * h * sq_h
    C = n_heads * HEAD_DV
    second = tl.num_programs(1) * n_ctx
    dk1 = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dk2 = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    lo = 0
    if IS_CAUSAL:
        lo = (start_n // BLOCK_M) * BLOCK_M  # earlier queries see none of these keys
    for start_m in range(lo, n_ctx, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        row_ok = offs_m < n_ctx
        q_mask = row_ok[:, None] & (offs_d[None, :] < HEAD_D)
        q_ptrs = q_base + offs_m[:, None] * sq_n + offs_d[None, :]
        q1 = tl.load(q_ptrs, mask=q_mask, other=0.)
        q2 = tl.load(q_ptrs + sq_h, mask=q_mask, other=0.)
        dd = tl.load(DD + (b * n_ctx + offs_m[:, None]) * C + h * HEAD_DV + offs_dv[None, :],
                     mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DV), other=0.)
        stat = bh * n_ctx + offs_m
        lse1 = tl.load(LSE + stat, mask=row_ok, other=float('inf'))
        lse2 = tl.load(LSE + second + stat, mask=row_ok, other=float('inf'))
        delta1 = tl.load(DELTA + stat, mask=row_ok, other=0.)
        rho2 = tl.load(DELTA + second + stat, mask=row_ok, other=0.)
        p1t = tl.exp2(_scores_t(k1, q1, bias, offs_m, offs_n, qk_scale, IS_CAUSAL, PRECISION, DOT_UPCAST) - lse1[None, :])
        p2t = tl.exp2(_scores_t(k2, q2, bias, offs_m, offs_n, qk_scale, IS_CAUSAL, PRECISION, DOT_UPCAST) - lse2[None, :])
        pt = p1t - lam * p2t  # (BLOCK_N, BLOCK_M): (P1 − λ·P2)ᵀ
        dv += _dot(pt.to(dd.dtype), dd, PRECISION, DOT_UPCAST)
        dpvt = _dot(v, tl.trans(dd), PRECISION, DOT_UPCAST)  # (BLOCK_N, BLOCK_M)
        ds1t = p1t * (dpvt - delta1[None, :])
        ds2t = -lam * p2t * (dpvt - rho2[None, :])
        dk1 += _dot(ds1t.to(q1.dtype), q1, PRECISION, DOT_UPCAST)
        dk2 += _dot(ds2t.to(q2.dtype), q2, PRECISION, DOT_UPCAST)
    dk_ptrs = DK + b * sdk_b + 2 * h * sdk_h + offs_n[:, None] * sdk_n + offs_d[None, :]
    tl.store(dk_ptrs, (dk1 * sm_scale).to(DK.dtype.element_ty), mask=k_mask)
    tl.store(dk_ptrs + sdk_h, (dk2 * sm_scale).to(DK.dtype.element_ty), mask=k_mask)
    tl.store(DV + b * sdv_b + h * sdv_h + offs_n[:, None] * sdv_n + offs_dv[None, :],
             dv.to(DV.dtype.element_ty), mask=v_mask)


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
