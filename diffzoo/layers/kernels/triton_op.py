"""The Triton split kernel as a PyTorch custom op, chosen by `DifferentialAttention(split_kernel="triton")`.

`split_diff_attention` runs the split variant's attention, sub-norm and (optionally) output
projection as the Triton kernels of `split_triton` behind one PyTorch custom op with its own
backward, so `torch.compile` and `torch.export` see one opaque node and never graph-break on it. In eager mode
the same functions run without the custom ops' dispatch (`_Eager`, an autograd.Function: less host time a call,
docs/performance.md), under the ops' names in a profile. Triton ships with CUDA builds of PyTorch; without it
`HAS_TRITON` is False and the layer keeps its SDPA kernels.
Kernels run on CUDA tensors, or on CPU tensors under Triton's interpreter (`TRITON_INTERPRET=1`
set before `import diffzoo`), which is how the tests check them on machines without a GPU.
"""
import contextlib
import importlib.util
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch.profiler import record_function

HAS_TRITON = importlib.util.find_spec('triton') is not None  # CUDA builds of torch ship it; CPU-only ones may not
if HAS_TRITON:  # a heavy optional dependency: imported only where it is installed
    from . import split_triton
else:  # pragma: no cover - exercised only where triton is absent
    split_triton = None
INTERPRETED = HAS_TRITON and split_triton.INTERPRETED

DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # fp32: on CPU tensors under the interpreter
OP_NAMES = {'train': 'diffzoo::split_diff_attention', 'inference': 'diffzoo::split_diff_attention_inference',
            'backward': 'diffzoo::split_diff_attention_backward'}


def _named(kind: str):
    """The eager path's range under its op's name (`OP_NAMES`) while a profiler records; nothing otherwise (a range
    costs microseconds a call)."""
    return record_function(OP_NAMES[kind]) if torch.autograd.profiler._is_profiler_enabled else contextlib.nullcontext()


def unsupported(q: torch.Tensor, attn_mask: Optional[torch.Tensor], dropout_p: float) -> Optional[str]:
    """Why the Triton split kernel cannot run this call (None when it can)."""
    if not HAS_TRITON:
        return 'Triton is not installed'
    if q.device.type != 'cuda' and not (INTERPRETED and q.device.type == 'cpu'):
        return f'it runs on CUDA tensors (got {q.device.type}; TRITON_INTERPRET=1 runs it on CPU)'
    if q.dtype not in DTYPES:
        return f'dtype {q.dtype} (bf16, fp16, or fp32 under the interpreter)'
    if q.dtype == torch.float32 and q.device.type == 'cuda':
        return 'fp32 inputs on CUDA (its IEEE fp32 products spill registers; SDPA is the faster fp32 path)'
    if dropout_p > 0:
        return 'attention dropout'
    if attn_mask is not None and (
            attn_mask.requires_grad or attn_mask.ndim != 4 or attn_mask.shape[1:3] != (1, 1)):
        return f'attention mask of shape {tuple(attn_mask.shape)} (it takes key padding, (B, 1, 1, N), and is_causal)'
    return None


def key_padding_bias(attn_mask: Optional[torch.Tensor], batch: int, n: int) -> Optional[torch.Tensor]:
    """A (B, 1, 1, N) boolean (True = attend) or additive mask as the kernel's (B, N) fp32 bias."""
    if attn_mask is None:
        return None
    mask = attn_mask.reshape(attn_mask.shape[0], n)
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, device=mask.device, dtype=torch.float32).masked_fill_(~mask, float('-inf'))
    return mask.float().expand(batch, n).contiguous()


if HAS_TRITON:
    def _split_op_impl(
            q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lam: torch.Tensor, weight: torch.Tensor,
            key_bias: Optional[torch.Tensor], proj_weight: Optional[torch.Tensor], proj_bias: Optional[torch.Tensor],
            scale: float, eps: float, is_causal: bool,
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        y, D, lse = split_triton.forward(q, k, v, lam, weight, key_bias, scale, eps, is_causal)
        return _projected(y, proj_weight, proj_bias), D, lse

    _split_op = torch.library.custom_op('diffzoo::split_diff_attention', mutates_args=())(_split_op_impl)

    def _projected(y: torch.Tensor, proj_weight: Optional[torch.Tensor], proj_bias: Optional[torch.Tensor]):
        if proj_weight is None:
            return y
        bias = None if proj_bias is None else proj_bias.to(y.dtype)
        with torch.autocast(y.device.type, enabled=False):
            return F.linear(y, proj_weight.to(y.dtype), bias)  # (B, N, C_out), as autocast would

    def _fake_out(q, v, proj_weight):
        B, h2, N, _ = q.shape
        return v.new_empty(B, N, h2 // 2 * v.shape[-1] if proj_weight is None else proj_weight.shape[0])

    @_split_op.register_fake
    def _(q, k, v, lam, weight, key_bias, proj_weight, proj_bias, scale, eps, is_causal):
        B, h2, N, _ = q.shape
        return (_fake_out(q, v, proj_weight), v.new_empty(B, N, h2 // 2 * v.shape[-1]),
                q.new_empty(2, B, h2 // 2, N, dtype=torch.float32))

    def _inference_impl(
            q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lam: torch.Tensor, weight: torch.Tensor,
            key_bias: Optional[torch.Tensor], proj_weight: Optional[torch.Tensor], proj_bias: Optional[torch.Tensor],
            scale: float, eps: float, is_causal: bool,
    ) -> torch.Tensor:
        """The forward alone, for calls no gradient will reach: D and the log-sum-exps are not written."""
        y, _, _ = split_triton.forward(q, k, v, lam, weight, key_bias, scale, eps, is_causal, for_backward=False)
        return _projected(y, proj_weight, proj_bias)

    _split_inference_op = torch.library.custom_op('diffzoo::split_diff_attention_inference',
                                                  mutates_args=())(_inference_impl)

    @_split_inference_op.register_fake
    def _(q, k, v, lam, weight, key_bias, proj_weight, proj_bias, scale, eps, is_causal):
        return _fake_out(q, v, proj_weight)

    @torch.library.custom_op('diffzoo::split_diff_attention_backward', mutates_args=())
    def _split_backward_op(
            dy: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lam: torch.Tensor,
            weight: torch.Tensor, key_bias: Optional[torch.Tensor], D: torch.Tensor, lse: torch.Tensor,
            scale: float, eps: float, is_causal: bool, want_y: bool,
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        dq, dk, dv, dlam, dweight, y = split_triton.backward(
            dy, q, k, v, lam, weight, key_bias, D, lse, scale, eps, is_causal, want_y)
        return dq, dk, dv, dlam, dweight, y if want_y else D.new_empty(0)

    @_split_backward_op.register_fake
    def _(dy, q, k, v, lam, weight, key_bias, D, lse, scale, eps, is_causal, want_y):
        stats = dict(device=q.device, dtype=torch.float32)
        return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), q.new_empty((), **stats),
                q.new_empty(weight.shape, **stats), D.new_empty(D.shape if want_y else (0,)))

    def _setup_context(ctx, inputs, output):
        q, k, v, lam, weight, key_bias, proj_weight, proj_bias, scale, eps, is_causal = inputs
        _, D, lse = output
        ctx.scale, ctx.eps, ctx.is_causal = scale, eps, is_causal
        ctx.bias_dtype = None if proj_bias is None else proj_bias.dtype
        ctx.save_for_backward(q, k, v, lam, weight, key_bias, proj_weight, D, lse)

    def _backward(ctx, grad, *_):
        return _gradients(_split_backward_op, ctx, grad)

    def _gradients(kernels, ctx, grad):
        """The op's input gradients from its output's, `kernels` (the backward op, or `split_triton.backward`
        itself in eager mode) running the Triton backward."""
        q, k, v, lam, weight, key_bias, proj_weight, D, lse = ctx.saved_tensors
        grad_pw = grad_pb = None
        dy = grad
        if proj_weight is not None:
            dy = grad @ proj_weight.to(grad.dtype)  # (B, N, C)
        want_y = proj_weight is not None and ctx.needs_input_grad[6]
        dq, dk, dv, dlam, dweight, y = kernels(
            dy, q, k, v, lam, weight, key_bias, D, lse, ctx.scale, ctx.eps, ctx.is_causal, want_y)
        if want_y:
            grad_pw = (grad.flatten(0, -2).t() @ y.flatten(0, -2)).to(proj_weight.dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[7]:
            grad_pb = grad.flatten(0, -2).sum(0, dtype=torch.float32).to(ctx.bias_dtype)
        return (dq, dk, dv, dlam.to(lam.dtype), dweight.to(weight.dtype), None, grad_pw, grad_pb,
                None, None, None)

    _split_op.register_autograd(_backward, setup_context=_setup_context)

    class _Eager(torch.autograd.Function):
        """The training op's forward and backward in eager mode, without the dispatcher's round trips (module
        docstring): the same functions, saved tensors and gradients."""

        @staticmethod
        def forward(ctx, *inputs):
            with _named('train'):
                out, D, lse = _split_op_impl(*inputs)
            _setup_context(ctx, inputs, (out, D, lse))
            return out

        @staticmethod
        def backward(ctx, grad):
            with _named('backward'):
                return _gradients(split_triton.backward, ctx, grad)


def split_diff_attention(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lam: torch.Tensor, weight: torch.Tensor,
        scale: float, eps: float, key_bias: Optional[torch.Tensor] = None, is_causal: bool = False,
        proj_weight: Optional[torch.Tensor] = None, proj_bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """RMSNorm((softmax(Q1K1ᵀ·s) − λ·softmax(Q2K2ᵀ·s)) V) · weight per head as (B, N, C), or that
    projected by an output projection's `proj_weight`, `proj_bias`, (B, N, C_out). q, k (B, 2h, N, d) (query head
    2i is Q1 of differential head i, 2i+1 its Q2), v (B, h, N, 2d); lam a 0-dim fp32 tensor; weight (2d,) in v's dtype;
    key_bias None or (B, N) fp32 from `key_padding_bias`. Saves D (one (B, N, C)) and the log-sum-exps;
    where no gradient will be taken (inference mode, no_grad, nothing requiring grad) the forward-only
    op writes neither.
    """
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    args = (q, k, v, lam, weight, key_bias, proj_weight, proj_bias, scale, eps, is_causal)
    eager = not torch.compiler.is_compiling()  # compile and export: the custom ops, one node each
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in args[:8]):
        if eager:
            return _Eager.apply(*args)
        out, *_ = torch.ops.diffzoo.split_diff_attention(*args)
        return out
    if eager:
        with _named('inference'):
            return _inference_impl(*args)
    return torch.ops.diffzoo.split_diff_attention_inference(*args)
