"""The split kernel's backward: the sub-norm's gradient, then dQ (with the row sums δ1, ρ2) and dK/dV.

dλ = −Σ ρ2 is one sum over every row of terms that cancel to a small fraction of their size, so in
fp16 the rounding of dD to fp16 (ρ2 = dD·(P2V) with dD in the products' dtype) sets its error: with
HAS_LO the dQ kernel adds ρ2_lo = dD_lo·(P2V), the part of dD that rounding lost, as a third row
statistic that only dλ reads (dS2 keeps ρ2 of the dD its products see, so Σ_j dS2 stays 0)."""
import triton
import triton.language as tl

from .tl_common import _dot, _key_tile, _load_rows, _maps_and_dpv, _scores_t, _store_rows


@triton.jit
def _diff_attn_norm_bwd(
        D, G, W, DD, DD_LO, Y, DW,
        n_rows, n_heads, eps,
        HEAD_DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_R: tl.constexpr, WRITE_Y: tl.constexpr,
        WRITE_LO: tl.constexpr,
):
    """dD = rstd·(g∘w − n·mean(g∘w∘n)) with n = D·rstd and rstd recomputed from the stored D, per
    (row tile, head); with WRITE_LO, what rounding dD to D's dtype lost, in that dtype (dD_lo);
    partial Σ g∘n for the weight's gradient; y = n∘w when the output projection's weight gradient
    needs it."""
    pid = tl.program_id(0)
    h = tl.program_id(1)
    rows = (pid * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)  # rows of (B·N)
    cols = tl.arange(0, BLOCK_DV)
    row_ok = rows < n_rows
    col_ok = cols < HEAD_DV
    offs = rows[:, None] * (n_heads * HEAD_DV) + h * HEAD_DV + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    d = tl.load(D + offs, mask=mask, other=0.).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(d * d, 1) / HEAD_DV + eps)  # padded columns are 0
    w = tl.load(W + cols, mask=col_ok, other=0.).to(tl.float32)
    normed = d * rstd[:, None]
    gw = g * w[None, :]
    mean = tl.sum(gw * normed, 1) / HEAD_DV
    dd = rstd[:, None] * (gw - normed * mean[:, None])
    dd_hi = dd.to(DD.dtype.element_ty)
    tl.store(DD + offs, dd_hi, mask=mask)
    if WRITE_LO:
        tl.store(DD_LO + offs, (dd - dd_hi.to(tl.float32)).to(DD_LO.dtype.element_ty), mask=mask)
    if WRITE_Y:
        tl.store(Y + offs, (normed * w[None, :]).to(Y.dtype.element_ty), mask=mask)
    tl.store(DW + (pid * n_heads + h) * BLOCK_DV + cols, tl.sum(g * normed, 0))


@triton.jit
def _diff_attn_bwd_dq(
        Q, K, V, KB, LAM, DD, DD_LO, LSE, DELTA, DQ,
        sq_b, sq_h, sq_n, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, sdq_b, sdq_h, sdq_n,
        n_ctx, n_heads, qk_scale, sm_scale,
        HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ONE_TILE: tl.constexpr, HAS_LO: tl.constexpr,
        IS_CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    b, h = (bh // n_heads).to(tl.int64), bh % n_heads
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < n_ctx
    q_base = Q + b * sq_b + 2 * h * sq_h
    q1 = _load_rows(q_base, offs_m, sq_n, n_ctx, HEAD_D, BLOCK_D)
    q2 = _load_rows(q_base + sq_h, offs_m, sq_n, n_ctx, HEAD_D, BLOCK_D)
    C = n_heads * HEAD_DV
    dd = _load_rows(DD + b * n_ctx * C + h * HEAD_DV, offs_m, C, n_ctx, HEAD_DV, BLOCK_DV)  # (BLOCK_M, BLOCK_DV)
    rho2_lo = tl.zeros([BLOCK_M], tl.float32)
    if HAS_LO:
        dd_lo = _load_rows(DD_LO + b * n_ctx * C + h * HEAD_DV, offs_m, C, n_ctx, HEAD_DV, BLOCK_DV)
    stat = bh * n_ctx + offs_m
    second = tl.num_programs(1) * n_ctx  # offset of stream 2 in (2, B, h, N)
    lse1 = tl.load(LSE + stat, mask=row_ok, other=float('inf'))
    lse2 = tl.load(LSE + second + stat, mask=row_ok, other=float('inf'))
    k_base = K + b * sk_b + 2 * h * sk_h
    v_base = V + b * sv_b + h * sv_h
    lam = tl.load(LAM)

    if ONE_TILE:
        offs_n = tl.arange(0, BLOCK_N)
        k1, k2, v, bias = _key_tile(k_base, v_base, KB, b, offs_n, sk_n, sk_h, sv_n, n_ctx,
                                    HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, HAS_BIAS)
        p1, p2, dpv = _maps_and_dpv(q1, q2, k1, k2, v, dd, bias, lse1, lse2, offs_m, offs_n, qk_scale,
                                    IS_CAUSAL, PRECISION, DOT_UPCAST)  # (BLOCK_M, BLOCK_N) each
        delta1 = tl.sum(p1 * dpv, 1)
        rho2 = tl.sum(p2 * dpv, 1)
        if HAS_LO:
            rho2_lo = tl.sum(p2 * _dot(dd_lo, tl.trans(v), PRECISION, DOT_UPCAST), 1)
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
            k1, k2, v, bias = _key_tile(k_base, v_base, KB, b, offs_n, sk_n, sk_h, sv_n, n_ctx,
                                        HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, HAS_BIAS)
            p1, p2, dpv = _maps_and_dpv(q1, q2, k1, k2, v, dd, bias, lse1, lse2, offs_m, offs_n, qk_scale,
                                        IS_CAUSAL, PRECISION, DOT_UPCAST)
            delta1 += tl.sum(p1 * dpv, 1)
            rho2 += tl.sum(p2 * dpv, 1)
            if HAS_LO:
                rho2_lo += tl.sum(p2 * _dot(dd_lo, tl.trans(v), PRECISION, DOT_UPCAST), 1)
        dq1 = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        dq2 = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for start_n in range(0, hi, BLOCK_N):  # second pass: dQ
            offs_n = start_n + tl.arange(0, BLOCK_N)
            k1, k2, v, bias = _key_tile(k_base, v_base, KB, b, offs_n, sk_n, sk_h, sv_n, n_ctx,
                                        HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, HAS_BIAS)
            p1, p2, dpv = _maps_and_dpv(q1, q2, k1, k2, v, dd, bias, lse1, lse2, offs_m, offs_n, qk_scale,
                                        IS_CAUSAL, PRECISION, DOT_UPCAST)
            ds1 = p1 * (dpv - delta1[:, None])
            ds2 = -lam * p2 * (dpv - rho2[:, None])
            dq1 += _dot(ds1.to(k1.dtype), k1, PRECISION, DOT_UPCAST)
            dq2 += _dot(ds2.to(k2.dtype), k2, PRECISION, DOT_UPCAST)

    tl.store(DELTA + stat, delta1, mask=row_ok)
    tl.store(DELTA + second + stat, rho2, mask=row_ok)
    if HAS_LO:
        tl.store(DELTA + 2 * second + stat, rho2_lo, mask=row_ok)
    dq_base = DQ + b * sdq_b + 2 * h * sdq_h
    _store_rows(dq_base, offs_m, sdq_n, n_ctx, dq1 * sm_scale, HEAD_D, BLOCK_D)
    _store_rows(dq_base + sdq_h, offs_m, sdq_n, n_ctx, dq2 * sm_scale, HEAD_D, BLOCK_D)


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
    b, h = (bh // n_heads).to(tl.int64), bh % n_heads
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k1, k2, v, bias = _key_tile(K + b * sk_b + 2 * h * sk_h, V + b * sv_b + h * sv_h, KB, b, offs_n, sk_n, sk_h,
                                sv_n, n_ctx, HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, HAS_BIAS)  # (BLOCK_N, ·)
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
        q1 = _load_rows(q_base, offs_m, sq_n, n_ctx, HEAD_D, BLOCK_D)
        q2 = _load_rows(q_base + sq_h, offs_m, sq_n, n_ctx, HEAD_D, BLOCK_D)
        dd = _load_rows(DD + b * n_ctx * C + h * HEAD_DV, offs_m, C, n_ctx, HEAD_DV, BLOCK_DV)
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
    dk_base = DK + b * sdk_b + 2 * h * sdk_h
    _store_rows(dk_base, offs_n, sdk_n, n_ctx, dk1 * sm_scale, HEAD_D, BLOCK_D)
    _store_rows(dk_base + sdk_h, offs_n, sdk_n, n_ctx, dk2 * sm_scale, HEAD_D, BLOCK_D)
    _store_rows(DV + b * sdv_b + h * sdv_h, offs_n, sdv_n, n_ctx, dv, HEAD_DV, BLOCK_DV)
