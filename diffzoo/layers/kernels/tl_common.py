"""Triton helpers shared by the split kernel's forward and backward: products, masked scores, softmax."""
import triton
import triton.language as tl


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
def _load_rows(base, rows, stride, n_ctx, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    """(rows, BLOCK) of a head at `base` whose rows are `stride` apart; 0 beyond n_ctx and WIDTH."""
    cols = tl.arange(0, BLOCK)
    mask = (rows[:, None] < n_ctx) & (cols[None, :] < WIDTH)
    return tl.load(base + rows[:, None] * stride + cols[None, :], mask=mask, other=0.)


@triton.jit
def _store_rows(base, rows, stride, n_ctx, value, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    mask = (rows[:, None] < n_ctx) & (cols[None, :] < WIDTH)
    tl.store(base + rows[:, None] * stride + cols[None, :], value.to(base.dtype.element_ty), mask=mask)


@triton.jit
def _key_tile(k_base, v_base, KB, b, offs_n, sk_n, sk_h, sv_n, n_ctx,
              HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
              HAS_BIAS: tl.constexpr):
    """K1, K2 (BLOCK_N, BLOCK_D), V (BLOCK_N, BLOCK_DV) and the key bias of the keys `offs_n`."""
    k1 = _load_rows(k_base, offs_n, sk_n, n_ctx, HEAD_D, BLOCK_D)
    k2 = _load_rows(k_base + sk_h, offs_n, sk_n, n_ctx, HEAD_D, BLOCK_D)
    v = _load_rows(v_base, offs_n, sv_n, n_ctx, HEAD_DV, BLOCK_DV)
    return k1, k2, v, _key_bias(KB, b, offs_n, n_ctx, HAS_BIAS)


@triton.jit
def _maps_and_dpv(q1, q2, k1, k2, v, dd, bias, lse1, lse2, offs_m, offs_n, qk_scale,
                  IS_CAUSAL: tl.constexpr, PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """P1, P2 recomputed from their log-sum-exps and dPV = dD Vᵀ, each (BLOCK_M, BLOCK_N)."""
    p1 = tl.exp2(_scores(q1, k1, bias, offs_m, offs_n, qk_scale, IS_CAUSAL, PRECISION, DOT_UPCAST) - lse1[:, None])
    p2 = tl.exp2(_scores(q2, k2, bias, offs_m, offs_n, qk_scale, IS_CAUSAL, PRECISION, DOT_UPCAST) - lse2[:, None])
    return p1, p2, _dot(dd, tl.trans(v), PRECISION, DOT_UPCAST)
