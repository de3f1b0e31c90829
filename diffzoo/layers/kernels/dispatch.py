"""The attention kernels of `DifferentialAttention`, and the choice among them at run time.

    split_attention      split variant, fused: A1V and A2V by the SDPA kernel `split_kernel` names
                         (or the Triton kernel), then `sub_normed_difference`
    duplicate_attention  duplicate variant, fused: one SDPA output serves both maps
    v2_attention         v2, fused: one SDPA over 2h query heads on h KV heads, O1 − λ·O2
    add_mask             explicit path: a mask or is_causal added to the (B, h, ·, N, N) scores
    explicit_output      explicit path: the maps times V in fp32 (autocast off), then the sub-norm

Each is a leaf of torch.fx (registered with timm's `register_notrace_function`; the attention module
wraps its names with `torch.fx.wrap`): a symbolic trace records one call, and the choices inside
(`split_kernel="auto"` by device, dtype and length, the Triton kernel's fallbacks, a mask's dtype and
per-head layout) are made on the real tensors when the graph runs, exactly as in eager mode. Each also compiles
with TorchScript; there the Triton kernel and the saved-outputs op (a custom op and an
autograd.Function, which TorchScript cannot compile) give way to the SDPA kernels and the same
sub-norm chain under ordinary autograd. torch.compile and torch.export trace through them.
"""
import warnings
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from timm.layers import register_notrace_function, resolve_self_attn_mask

from ..numerics import autocast_off, stats_dtype
from . import triton_op
from .sub_norm import sub_normed_difference

SPLIT_KERNELS = ('two_calls', 'one_call', 'padded', 'four_calls', 'triton')

# `split_kernel="auto"` on CUDA runs the Triton kernel for a (dtype, most tokens) row below, where its GPU tests
# (tests/layers/test_kernels.py, `pytest -m gpu`) pass, and nowhere else. `python -m diffzoo.bench.gpu OUT tests`
# says which rows a run supports; docs/performance.md says why each row ends where it does.
TRITON_ON_CUDA: Tuple[Tuple[torch.dtype, int], ...] = (
    (torch.bfloat16, 4096),
    (torch.float16, 577),
)


@register_notrace_function
def sdpa_split_kernel(device_type: str) -> str:
    """The SDPA kernel `auto` runs where the Triton kernel does not: two_calls on CUDA (cuDNN takes the unequal
    widths), four_calls on CPU (flash kernels, nothing copied); docs/performance.md compares them."""
    if device_type == 'cpu':
        return 'four_calls'
    return 'two_calls'


@register_notrace_function
def auto_split_kernel(device_type: str, dtype: torch.dtype, n_tokens: int) -> str:
    """`split_kernel="auto"`'s choice, from the device, the dtype and the token count alone: "triton" on CUDA
    for a row of TRITON_ON_CUDA (where Triton is installed), else `sdpa_split_kernel`."""
    if device_type == 'cuda' and triton_op.HAS_TRITON:
        for row_dtype, most in TRITON_ON_CUDA:
            if dtype == row_dtype and n_tokens <= most:
                return 'triton'
    return sdpa_split_kernel(device_type)


@register_notrace_function
def sdpa_mask(attn_mask: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """A mask as SDPA takes it: boolean as it is, additive in the query's dtype."""
    if attn_mask is None or attn_mask.dtype == torch.bool:
        return attn_mask
    return attn_mask.to(dtype)


def _pairwise(attn_mask: Optional[torch.Tensor], heads: int) -> Optional[torch.Tensor]:
    """A per-head mask (B, h, ·, N) onto the 2h query heads (2i and 2i + 1 of differential head i)."""
    if attn_mask is not None and attn_mask.dim() == 4 and heads > 1 and attn_mask.shape[1] == heads:
        return attn_mask.repeat_interleave(2, dim=1)
    return attn_mask


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor], dropout_p: float,
          is_causal: bool, scale: Optional[float] = None) -> torch.Tensor:
    """SDPA, its output as (B, N, heads, ·): the kernels' memory layout, so the transpose copies nothing."""
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                       scale=scale)
    return o.transpose(1, 2)


@register_notrace_function
def split_parts(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor], dropout_p: float,
        is_causal: bool, scale: float, kernel: str,
) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """A1·V and A2·V of the split variant by an SDPA-based `kernel` ("auto" and "triton" run
    `sdpa_split_kernel` here): two lists of (B, N, h, ·) parts tiling the value width 2d in order.
    q, k (B, 2h, N, d) with query head 2i = Q1 and 2i + 1 = Q2 of differential head i; v (B, h, N, 2d)."""
    B, h, N, dv = v.shape
    d = q.shape[-1]  # explicit widths in every view: an empty batch cannot infer a -1
    attn_mask = sdpa_mask(attn_mask, q.dtype)
    if kernel == 'auto' or kernel == 'triton':
        kernel = sdpa_split_kernel(q.device.type)
    if kernel == 'four_calls' and dropout_p > 0:
        kernel = 'padded'  # one dropout mask per map over the whole value width, as the formula has it
    q1, q2 = q.view(B, h, 2, N, d).unbind(2)  # (B, h, N, d) each, views
    k1, k2 = k.view(B, h, 2, N, d).unbind(2)
    if kernel == 'two_calls':
        return [_sdpa(q1, k1, v, attn_mask, dropout_p, is_causal)], [_sdpa(q2, k2, v, attn_mask, dropout_p, is_causal)]
    if kernel == 'four_calls':
        va, vb = v.chunk(2, dim=-1)  # (B, h, N, d) each, views
        return ([_sdpa(q1, k1, va, attn_mask, dropout_p, is_causal), _sdpa(q1, k1, vb, attn_mask, dropout_p, is_causal)],
                [_sdpa(q2, k2, va, attn_mask, dropout_p, is_causal), _sdpa(q2, k2, vb, attn_mask, dropout_p, is_causal)])
    attn_mask = _pairwise(attn_mask, h)
    v2 = v.unsqueeze(2).expand(B, h, 2, N, dv).reshape(B, 2 * h, N, dv)  # V for both maps of a pair
    if kernel == 'padded':
        q, k = F.pad(q, (0, dv - d)), F.pad(k, (0, dv - d))  # (B, 2h, N, 2d): Q·K unchanged, scale kept
        o = _sdpa(q, k, v2, attn_mask, dropout_p, is_causal, scale)
    else:  # one_call
        o = _sdpa(q, k, v2, attn_mask, dropout_p, is_causal)
    o1, o2 = o.view(B, N, h, 2, dv).unbind(3)  # (B, N, h, 2d) each
    return [o1], [o2]


@register_notrace_function
def split_attention(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lam: torch.Tensor, weight: torch.Tensor,
        eps: Optional[float], attn_mask: Optional[torch.Tensor], dropout_p: float, is_causal: bool, scale: float,
        kernel: str, proj_weight: Optional[torch.Tensor] = None, proj_bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The split variant's fused path: RMSNorm(A1V − λ·A2V)·weight per head as (B, N, C), or that
    projected, (B, N, C_out), when `proj_weight` is given. `kernel` is "auto" (`auto_split_kernel`) or one
    of SPLIT_KERNELS; the Triton kernel runs where it can take the call, else `sdpa_split_kernel`'s, with a
    warning naming why when "triton" was asked for by name (silently for "auto")."""
    if not torch.jit.is_scripting():
        asked = kernel == 'triton'
        if kernel == 'auto':
            kernel = auto_split_kernel(q.device.type, q.dtype, q.shape[2])
        if kernel == 'triton':
            out = _triton(q, k, v, lam, weight, eps, attn_mask, dropout_p, is_causal, scale, proj_weight, proj_bias,
                          asked)
            if out is not None:
                return out
    o1, o2 = split_parts(q, k, v, attn_mask, dropout_p, is_causal, scale, kernel)
    out = sub_normed_difference(o1, o2, lam, weight, eps, proj_weight, proj_bias)
    return out if proj_weight is not None else out.flatten(-2)


def _triton(q, k, v, lam, weight, eps, attn_mask, dropout_p, is_causal, scale, proj_weight, proj_bias, warn):
    """The Triton kernel's output where it can take the call; else None, with a warning naming why if `warn`."""
    reason = triton_op.unsupported(q, attn_mask, dropout_p)
    if reason is not None:
        if warn:
            warnings.warn(f'split_kernel="triton" cannot take {reason}; running '
                          f'{sdpa_split_kernel(q.device.type)!r} instead')
        return None
    B, N = q.shape[0], q.shape[2]
    eps = torch.finfo(v.dtype).eps if eps is None else eps  # F.rms_norm's default
    return triton_op.split_diff_attention(q, k, v, lam, weight, scale, eps, triton_op.key_padding_bias(attn_mask, B, N),
                                          is_causal, proj_weight, proj_bias)


@register_notrace_function
def duplicate_attention(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lam: torch.Tensor, weight: torch.Tensor,
        eps: Optional[float], attn_mask: Optional[torch.Tensor], dropout_p: float, is_causal: bool,
        proj_weight: Optional[torch.Tensor] = None, proj_bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The duplicate variant's fused path, A1 = A2 = softmax(QKᵀ/√d): RMSNorm(AV − λ·AV)·weight per
    head as (B, N, C), or projected as in `split_attention`. q, k, v (B, h, N, C/h)."""
    o = _sdpa(q, k, v, sdpa_mask(attn_mask, q.dtype), dropout_p, is_causal)  # (B, N, h, C/h)
    out = sub_normed_difference([o], [o], lam, weight, eps, proj_weight, proj_bias)
    return out if proj_weight is not None else out.flatten(-2)


@register_notrace_function
def v2_attention(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lam: torch.Tensor, attn_mask: Optional[torch.Tensor],
        dropout_p: float, is_causal: bool,
) -> torch.Tensor:
    """v2's fused path: one SDPA of the 2h query heads q (B, 2h, N, d) on the h heads of k, v
    (B, h, N, d), then O1 − λ·O2 with λ (B, h, N, 1): (B, N, h, d) in fp32 (fp64 for fp64)."""
    B, h, N, dv = v.shape
    attn_mask = _pairwise(sdpa_mask(attn_mask, q.dtype), h)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                       enable_gqa=True)  # (B, 2h, N, d)
    o = o.view(B, h, 2, N, dv)
    o = o.to(stats_dtype(o.dtype))
    return (o[:, :, 0] - lam * o[:, :, 1]).transpose(1, 2)  # (B, N, h, d)


@register_notrace_function
def add_mask(scores: torch.Tensor, attn_mask: Optional[torch.Tensor], is_causal: bool) -> torch.Tensor:
    """Scores (B, h, P, N, N) plus the additive bias of `attn_mask` (boolean, additive, (N, N) or
    (B, 1 or h, N, N)) or of is_causal, as timm's `resolve_self_attn_mask` forms it."""
    bias = resolve_self_attn_mask(scores.shape[-1], scores, attn_mask, is_causal=is_causal)
    if bias is None:
        return scores
    bias = bias.to(scores.dtype)
    if bias.dim() == 4:
        bias = bias.unsqueeze(2)  # (B, 1 or h, 1, N, N): the same mask for both maps of a pair
    return scores + bias


def _values(attn: torch.Tensor, v: torch.Tensor, weight: Optional[torch.Tensor], eps: Optional[float]) -> torch.Tensor:
    out = (attn @ v.to(attn.dtype)).transpose(1, 2)  # (B, N, h, C/h)
    if weight is None:
        return out
    return F.rms_norm(out, [out.shape[-1]], weight, eps)


@register_notrace_function
def explicit_output(attn: torch.Tensor, v: torch.Tensor, weight: Optional[torch.Tensor],
                    eps: Optional[float]) -> torch.Tensor:
    """The explicit path's heads: (A1 − λ·A2) V in the maps' dtype (fp32, fp64 for fp64) with autocast
    off, then the sub-norm with `weight` ((1 − λ_init) folded in; None for v2, which has none):
    (B, N, h, C/h)."""
    if torch.jit.is_scripting():
        return _values(attn, v, weight, eps)
    else:
        with autocast_off(attn.device.type):
            return _values(attn, v, weight, eps)
