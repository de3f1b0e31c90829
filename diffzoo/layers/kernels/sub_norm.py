"""A1V − λ·A2V, the sub-norm and the output projection as one autograd op over SDPA's outputs.

The fused path of every SDPA-based split kernel, the duplicate variant and `differentialize`'s
decoders: it saves only the SDPA outputs (which SDPA's backward holds anyway) and recomputes the
difference and the normed heads in its hand-written backward (checked against gradcheck in fp64).
Under TorchScript, which cannot compile an autograd.Function, the same forward chain runs under
ordinary autograd (same numbers, the intermediates saved).
"""
import functools
import os
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from timm.layers import register_notrace_function

from ..numerics import autocast_off

# Opt-in until measured and tested on a GPU: the forward and backward chains through torch.compile
# (one fused pass each instead of ~16 eager ones). Set DIFFZOO_COMPILED_SUB_NORM=1, or this flag.
COMPILED = os.environ.get('DIFFZOO_COMPILED_SUB_NORM') == '1'


def _difference(o1: List[torch.Tensor], o2: List[torch.Tensor], lam: torch.Tensor) -> torch.Tensor:
    """A1V − λ·A2V over parts that tile the last dim, as one new tensor (B, N, h, C/h)."""
    if len(o1) == 1:
        return torch.addcmul(o1[0], o2[0], lam, value=-1)  # keeps the parts' dtype
    if torch.jit.is_scripting():
        return torch.cat([torch.addcmul(o1[i], o2[i], lam, value=-1) for i in range(len(o1))], dim=-1)
    else:
        return _written_in_place(o1, o2, lam)


def _written_in_place(o1, o2, lam):
    """The difference of several parts, each written into its slice of one new tensor (no
    concatenation copy); under torch.compile, whose dynamo refuses that strided out=, a concatenation
    that inductor fuses."""
    if torch.compiler.is_compiling():
        return torch.cat([torch.addcmul(a, b, lam, value=-1) for a, b in zip(o1, o2)], dim=-1)
    widths = [a.shape[-1] for a in o1]
    diff = o1[0].new_empty(*o1[0].shape[:-1], sum(widths))
    for a, b, out in zip(o1, o2, diff.split(widths, dim=-1)):
        torch.addcmul(a, b, lam, value=-1, out=out)
    return diff


def _forward(lam: torch.Tensor, weight: torch.Tensor, eps: Optional[float], proj_weight: Optional[torch.Tensor],
             proj_bias: Optional[torch.Tensor], o1: List[torch.Tensor], o2: List[torch.Tensor]) -> torch.Tensor:
    """The forward chain: difference, sub-norm, and the projection when given (see the class)."""
    diff = _difference(o1, o2, lam)  # (B, N, h, D)
    y = F.rms_norm(diff, [diff.shape[-1]], weight, eps)
    if proj_weight is None:
        return y
    bias = None if proj_bias is None else proj_bias.to(y.dtype)
    return F.linear(y.flatten(-2), proj_weight.to(y.dtype), bias)  # (B, N, C_out), as autocast would


def _backward(grad, lam, weight, eps, proj_weight, o1, o2, needs: Tuple[bool, ...], bias_dtype):
    """Gradients of `_forward` for (lam, weight, proj_weight, proj_bias, *o1, *o2), recomputing the
    difference and the normed heads from the SDPA outputs. `needs`: which of the first four are wanted."""
    need_lam, need_weight, need_pw, need_pb = needs
    grad_pw = grad_pb = grad_lam = grad_weight = None
    diff = _difference(o1, o2, lam)  # (B, N, h, D), a new tensor
    dtype, D = diff.dtype, diff.shape[-1]
    acc = torch.promote_types(dtype, torch.float32)  # statistics in fp32 (fp64 stays fp64)
    eps = torch.finfo(dtype).eps if eps is None else eps  # F.rms_norm's default
    x = diff.to(acc)
    rstd = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square_().div_(D).add_(eps).rsqrt_()
    normed = x.mul_(rstd)  # (B, N, h, D) in acc
    del diff, x
    if proj_weight is not None:
        g2 = grad.reshape(-1, grad.shape[-1])  # (B·N, C_out)
        if need_pw:
            # dL/dW = gᵀ·y with y = normed · weight per head: the weight scales W's columns
            n2 = normed.to(dtype).flatten(-2).flatten(0, -2)  # (B·N, C)
            grad_pw = (g2.t() @ n2).to(acc).mul_(weight.to(acc).repeat(normed.shape[-2]))
            grad_pw = grad_pw.to(proj_weight.dtype)
            del n2
        if bias_dtype is not None and need_pb:
            grad_pb = g2.sum(0, dtype=acc).to(bias_dtype)
        grad = (grad @ proj_weight.to(dtype)).unflatten(-1, normed.shape[-2:])  # (B, N, h, D)
    g, w = grad.to(acc), weight.to(acc)
    gn = g * normed  # (B, N, h, D)
    if need_weight:
        grad_weight = gn.flatten(0, -2).sum(0).to(weight.dtype)
    mean = (gn @ w).unsqueeze_(-1).div_(D)  # (B, N, h, 1): mean of g·w·normed over the head
    del gn
    # d RMSNorm: rstd · (g·w − normed · mean(g·w · normed))
    grad_diff = torch.mul(g, w).addcmul_(normed, mean, value=-1).mul_(rstd)  # (B, N, h, D) in acc
    del g
    del normed
    grad_o1 = [grad_diff] if len(o1) == 1 else list(grad_diff.split([p.shape[-1] for p in o1], dim=-1))
    if need_lam:  # dL/dλ = −Σ dL/d(diff) · A2V
        grad_lam = -sum(torch.linalg.vecdot(a, b.to(acc), dim=-1).sum() for a, b in zip(grad_o1, o2))
        grad_lam = grad_lam.to(lam.dtype)
    grad_o1 = [a.to(dtype) for a in grad_o1]
    grad_o2 = [a * -lam for a in grad_o1]
    return grad_lam, grad_weight, grad_pw, grad_pb, grad_o1, grad_o2


@functools.lru_cache(maxsize=None)
def _compiled(fn):
    """`fn` through torch.compile (inductor fuses the elementwise passes); one compiled function per chain."""
    return torch.compile(fn, fullgraph=True)


def _chain(fn):
    """The eager chain, or its torch.compile'd form where `COMPILED` and not already inside a graph."""
    return _compiled(fn) if COMPILED and not torch.compiler.is_compiling() else fn


class _SubNormedDifference(torch.autograd.Function):
    """y = RMSNorm(A1V − λ·A2V) · weight per head, then y·Wᵀ + b when the output projection is
    given, saving only the SDPA outputs: the backward recomputes the difference and y.

    forward(lam, weight, eps, proj_weight, proj_bias, layout, *parts): `parts` are distinct tensors,
    each (B, N, h, ·), and `layout` = (A1V's part indices, A2V's part indices), each tiling the head
    width in order. A tensor serving twice (A2 = A1 in the duplicate variant, [V | V] of one KV head)
    is passed once, as dynamo requires of an autograd.Function, and its gradients are summed.
    """

    @staticmethod
    def forward(ctx, lam, weight, eps, proj_weight, proj_bias, layout, *parts):
        ctx.layout, ctx.eps, ctx.bias_dtype = layout, eps, None if proj_bias is None else proj_bias.dtype
        ctx.save_for_backward(lam, weight, proj_weight, *parts)
        o1, o2 = ([parts[i] for i in indices] for indices in layout)
        with autocast_off(parts[0].device.type):
            return _chain(_forward)(lam, weight, eps, proj_weight, proj_bias, o1, o2)

    @staticmethod
    def backward(ctx, grad):
        lam, weight, proj_weight, *parts = ctx.saved_tensors
        needs = tuple(ctx.needs_input_grad[i] for i in (0, 1, 3, 4))
        o1, o2 = ([parts[i] for i in indices] for indices in ctx.layout)
        with autocast_off(grad.device.type):
            grad_lam, grad_weight, grad_pw, grad_pb, grad_o1, grad_o2 = _chain(_backward)(
                grad, lam, weight, ctx.eps, proj_weight, o1, o2, needs, ctx.bias_dtype)
        grad_parts = [None] * len(parts)
        for i, g in zip(ctx.layout[0] + ctx.layout[1], grad_o1 + grad_o2):
            grad_parts[i] = g if grad_parts[i] is None else grad_parts[i] + g
        return grad_lam, grad_weight, None, grad_pw, grad_pb, None, *grad_parts


def _apply(o1, o2, lam, weight, eps, proj_weight, proj_bias):
    """The autograd op over the distinct tensors of o1 and o2 (identity, which dynamo traces)."""
    parts, layout = [], ([], [])
    for indices, tensors in zip(layout, (o1, o2)):
        for t in tensors:
            index = next((i for i, p in enumerate(parts) if p is t), None)
            if index is None:
                index = len(parts)
                parts.append(t)
            indices.append(index)
    layout = (tuple(layout[0]), tuple(layout[1]))
    return _SubNormedDifference.apply(lam, weight, eps, proj_weight, proj_bias, layout, *parts)


@register_notrace_function
def sub_normed_difference(o1: List[torch.Tensor], o2: List[torch.Tensor], lam: torch.Tensor, weight: torch.Tensor,
                          eps: Optional[float], proj_weight: Optional[torch.Tensor] = None,
                          proj_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """RMSNorm(A1V − λ·A2V) · weight, (B, N, h, C/h) in the parts' dtype; with `proj_weight` (and
    `proj_bias`, an output projection's), that flattened to (B, N, C) and projected, (B, N, C_out).

    o1, o2: A1V and A2V as equal lists of (B, N, h, ·) parts tiling the head width (one tensor may
    serve several places: the duplicate variant passes [AV], [AV]); lam a 0-dim fp32 tensor; weight
    (C/h,) in the parts' dtype. Statistics are fp32. Only the parts are saved for backward (SDPA's
    backward holds them anyway): neither the difference nor the normed heads.
    """
    if torch.jit.is_scripting():
        return _forward(lam, weight, eps, proj_weight, proj_bias, o1, o2)
    else:
        return _apply(o1, o2, lam, weight, eps, proj_weight, proj_bias)
