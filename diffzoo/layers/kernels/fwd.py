"""The split kernel's forward (the method: `diffzoo.layers.kernels.split_triton`)."""
import triton
import triton.language as tl

from .tl_common import _dot, _exact_softmax, _key_tile, _load_rows, _online_update, _scores, _store_rows


@triton.jit
def _diff_attn_fwd(
        Q, K, V, KB, LAM, W, Y, D, LSE,
        sq_b, sq_h, sq_n, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n,
        n_ctx, n_heads, qk_scale, eps,
        HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ONE_TILE: tl.constexpr,
        IS_CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
        STORE_STATS: tl.constexpr,
):
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    b, h = (bh // n_heads).to(tl.int64), bh % n_heads  # int64: b·(N·3C) passes 2³¹ at ViT-B, B = 256, N = 4096
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < n_ctx
    q_base = Q + b * sq_b + 2 * h * sq_h
    q1 = _load_rows(q_base, offs_m, sq_n, n_ctx, HEAD_D, BLOCK_D)  # (BLOCK_M, BLOCK_D): query head 2h
    q2 = _load_rows(q_base + sq_h, offs_m, sq_n, n_ctx, HEAD_D, BLOCK_D)  # query head 2h + 1
    k_base = K + b * sk_b + 2 * h * sk_h
    v_base = V + b * sv_b + h * sv_h
    lam = tl.load(LAM)

    if ONE_TILE:
        offs_n = tl.arange(0, BLOCK_N)
        k1, k2, v, bias = _key_tile(k_base, v_base, KB, b, offs_n, sk_n, sk_h, sv_n, n_ctx,
                                    HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, HAS_BIAS)
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
            k1, k2, v, bias = _key_tile(k_base, v_base, KB, b, offs_n, sk_n, sk_h, sv_n, n_ctx,
                                        HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, HAS_BIAS)
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
    out = b * n_ctx * C + h * HEAD_DV  # this head's columns of (B, N, C)
    _store_rows(Y + out, offs_m, C, n_ctx, y, HEAD_DV, BLOCK_DV)
    if STORE_STATS:  # what backward reads; inference leaves them out
        _store_rows(D + out, offs_m, C, n_ctx, acc, HEAD_DV, BLOCK_DV)
        stat = bh * n_ctx + offs_m  # (B, h, N)
        tl.store(LSE + stat, lse1, mask=row_ok)
        tl.store(LSE + tl.num_programs(1) * n_ctx + stat, lse2, mask=row_ok)  # stream 2 of (2, B, h, N)
