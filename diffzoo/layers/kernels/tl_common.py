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
