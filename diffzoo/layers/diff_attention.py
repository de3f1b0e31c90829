"""Differential attention: one family for every tower (ViT blocks, CLIP text blocks, analysis).

`DifferentialAttention` subclasses `timm.layers.DiffAttention` and adds what timm lacks: a λ_init
policy (constant or by depth), the *duplicate* and *v2* variants, fp32 softmax/λ/sub-norm on every
path, and the differential maps (A1 − λ·A2) from the explicit path.

Heads follow timm/unilm: `num_heads` counts *differential* heads h. With C = dim:

    variant     query heads      q/k head dim   value head dim   output per head
    split       2h (pairs)       C / h / 2      C / h            C / h, sub-norm
    duplicate   h                C / h          C / h            C / h, sub-norm
    v2          2h (GQA on h)    C / h          C / h            C / h, no sub-norm

DiffCLIP's ViT-B/16 (12 ordinary heads) is therefore `num_heads=6`: q/k 64, v 128.

split (Ye et al., Differential Transformer; DiffCLIP). Query head 2i is Q1 and 2i+1 is Q2 of
differential head i (likewise K); V of head i is the contiguous slice of width C/h:

    DiffAttn(X) = (softmax(Q1 K1ᵀ/√d) − λ·softmax(Q2 K2ᵀ/√d)) V
    λ = exp(λ_q1·λ_k1) − exp(λ_q2·λ_k2) + λ_init
    head_i = (1 − λ_init) · RMSNorm(DiffAttn_i),    out = Concat(head_1..h) W_O

duplicate (Differential PaliGemma, Eq. 5): both maps come from the same, undivided Q and K, so
A1 = A2 = softmax(QKᵀ/√d) and DiffAttn = (A1 − λ·A2) V = (1 − λ)·A V; sub-norm and (1 − λ_init)
as in split. This keeps a pretrained model's heads intact.

v2 (Differential Transformer V2): 2h query heads share h key/value heads (GQA, group of 2), one
attention call; λ is per token and head, projected from the input; no sub-norm, no (1 − λ_init):

    O = Attn(Q, K, V) over 2h query heads;  O1, O2 = O[:, 0::2], O[:, 1::2]
    head_i = O1_i − sigmoid(W_λ x)_i · O2_i

λ_init policy: a float (DiffCLIP: 0.8 in every layer) or "depth":
λ_init(l) = 0.8 − 0.6·exp(−0.3·l) with l the 0-based block index (Differential Transformer, DiffCLIP*).

`fused_attn=True` (default) uses `F.scaled_dot_product_attention`; `False` uses explicit math and
passes each differential map (B, h, N, N) through `self.diff_map` (an identity), where forward
hooks or `capture_attention_maps` can read it.

Fused split attention: q/k heads are d = C/2h wide and v heads 2d, and SDPA's flash kernels need
one width, so `split_kernel` chooses how the two maps are computed (all exact; `auto` follows
SPLIT_KERNEL_AUTO, chosen with `python -m diffzoo.bench`: two_calls was fastest on an H100 (cuDNN
takes the unequal widths), padded on CPU keeps the flash kernel, where the others fall back to
the math kernel and hold the N×N matrices):

    two_calls    SDPA(Q1, K1, V) and SDPA(Q2, K2, V): cuDNN / memory-efficient kernels (unequal widths)
    one_call     one SDPA over the 2h query heads, V repeated for each pair: same kernels, one launch
    padded       one SDPA over 2h heads with Q, K zero-padded to 2d (Q·K unchanged, scale 1/√d):
                 equal widths, so flash kernels (CUDA and CPU) apply
    four_calls   one SDPA over 4h heads of width d: (Q1|Q2) × (V[:d]|V[d:]), flash-eligible

The fused path keeps activations in their dtype: SDPA's softmax is fp32 inside its kernel, λ is
computed in fp32, A1V − λ·A2V is one fused multiply-add and the sub-norm statistics are fp32 (the
RMSNorm kernel's accumulation), with (1 − λ_init) folded into the norm weight. The explicit path
computes the maps, the product and the sub-norm in fp32.
"""
import functools
import math
from typing import Optional, Type, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import DiffAttention, RmsNorm
from timm.layers.attention import resolve_self_attn_mask

LambdaInit = Union[float, str]
VARIANTS = ('split', 'duplicate', 'v2')
SPLIT_KERNELS = ('two_calls', 'one_call', 'padded', 'four_calls')
SPLIT_KERNEL_AUTO = {'cuda': 'two_calls', 'cpu': 'padded'}  # measured by python -m diffzoo.bench


def resolve_lambda_init(lambda_init: LambdaInit, depth: int) -> float:
    """λ_init for block `depth` (0-based) under a policy: a number, or "depth"."""
    if lambda_init == 'depth':
        return 0.8 - 0.6 * math.exp(-0.3 * depth)
    if isinstance(lambda_init, str):
        raise ValueError(f'lambda_init={lambda_init!r}: expected a float or "depth"')
    return float(lambda_init)


class DifferentialAttention(DiffAttention):
    """Differential attention with a λ_init policy and split / duplicate / v2 variants.

    See the module docstring for the formulas and the head convention.
    """

    def __init__(
            self,
            dim: int,
            num_heads: int = 8,
            qkv_bias: bool = False,
            qk_norm: bool = False,
            scale_norm: bool = False,
            proj_bias: bool = True,
            attn_drop: float = 0.,
            proj_drop: float = 0.,
            norm_layer: Optional[Type[nn.Module]] = None,
            depth: int = 0,
            dual_lambda: bool = False,
            lambda_init: LambdaInit = 'depth',
            variant: str = 'split',
            split_kernel: str = 'auto',
            device=None,
            dtype=None,
    ) -> None:
        if variant not in VARIANTS:
            raise ValueError(f'variant={variant!r}: expected one of {VARIANTS}')
        if split_kernel != 'auto' and split_kernel not in SPLIT_KERNELS:
            raise ValueError(f'split_kernel={split_kernel!r}: expected "auto" or one of {SPLIT_KERNELS}')
        if num_heads < 1 or dim % (2 * num_heads):
            raise ValueError(
                f'num_heads={num_heads} differential heads do not divide dim={dim} into pairs of '
                f'q/k halves: dim must be a multiple of 2 * num_heads')
        resolve_lambda_init(lambda_init, depth)  # validate before building
        # plain attributes read by the parent's __init__ (set_lambda_init, reset_parameters)
        self.variant = variant
        self.lambda_init_policy = lambda_init
        super().__init__(
            dim, num_heads=num_heads, qkv_bias=qkv_bias, qk_norm=qk_norm, scale_norm=scale_norm,
            proj_bias=proj_bias, attn_drop=attn_drop, proj_drop=proj_drop, norm_layer=norm_layer,
            depth=depth, dual_lambda=dual_lambda, device=device, dtype=dtype,
        )
        dd = {'device': device, 'dtype': dtype}
        self.depth = depth
        self.diff_map = nn.Identity()
        self.split_kernel = split_kernel

        if variant != 'split':
            # duplicate and v2 attend with the undivided head: q/k/v head dim C / h
            self.head_dim = dim // num_heads
            self.scale = self.head_dim ** -0.5
            if qk_norm:
                norm_layer = norm_layer or RmsNorm
                self.q_norm = norm_layer(self.head_dim, **dd)
                self.k_norm = norm_layer(self.head_dim, **dd)
        if variant == 'v2':
            # 2h query heads + h key heads + h value heads, λ projected per token and head
            self.qkv = nn.Linear(dim, 4 * dim, bias=qkv_bias, **dd)
            self.lambda_proj = nn.Linear(dim, num_heads, bias=True, **dd)
            self.sub_norm = nn.Identity()
            self.dual_lambda = False
            self.lambda_q1 = self.lambda_k1 = self.lambda_q2 = self.lambda_k2 = None
            self.lambda_a = self.lambda_b = None
            self.reset_parameters()

    def set_lambda_init(self, depth: int) -> None:
        self.lambda_init = resolve_lambda_init(self.lambda_init_policy, depth)

    def reset_parameters(self) -> None:
        """λ parameters: N(0, 0.1) vectors (split, duplicate), zero W_λ so λ starts at 0.5 (v2)."""
        if self.variant != 'v2':
            super().reset_parameters()
        elif hasattr(self, 'lambda_proj'):
            nn.init.zeros_(self.lambda_proj.weight)
            nn.init.zeros_(self.lambda_proj.bias)

    def init_weights(self) -> None:
        """timm's ViT init visits this after its Linear layers: restore the λ init rule."""
        self.reset_parameters()

    def compute_lambda(self, x: torch.Tensor) -> torch.Tensor:
        """λ in fp32: a scalar for split/duplicate, (B, h, N, 1) per token and head for v2."""
        if self.variant == 'v2':
            lam = torch.sigmoid(self.lambda_proj(x).float())  # (B, N, h)
            return lam.transpose(1, 2).unsqueeze(-1)  # (B, h, N, 1)
        return self._compute_lambda().float()

    def _project(self, x: torch.Tensor):
        """q, k, v in head layout; q/k shapes depend on the variant (see module docstring)."""
        B, N, C = x.shape
        h = self.num_heads
        if self.variant == 'v2':
            q, k, v = self.qkv(x).split([2 * C, C, C], dim=-1)
            q = q.reshape(B, N, 2 * h, self.head_dim).transpose(1, 2)  # (B, 2h, N, d)
            k = k.reshape(B, N, h, self.head_dim).transpose(1, 2)  # (B, h, N, d)
        elif self.variant == 'duplicate':
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            q = q.reshape(B, N, h, self.head_dim).transpose(1, 2)  # (B, h, N, d)
            k = k.reshape(B, N, h, self.head_dim).transpose(1, 2)  # (B, h, N, d)
        else:
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            q = q.reshape(B, N, 2 * h, self.head_dim).transpose(1, 2)  # (B, 2h, N, d)
            k = k.reshape(B, N, 2 * h, self.head_dim).transpose(1, 2)  # (B, 2h, N, d)
        v = v.reshape(B, N, h, C // h).transpose(1, 2)  # (B, h, N, C/h)
        return self.q_norm(q), self.k_norm(k), v

    def _split_maps(self, q, k, v, sdpa, attn_mask):
        """A1·V and A2·V of the split variant, (B, h, N, 2d) each, by `split_kernel` (module docstring)."""
        B, h, N, dv = v.shape
        kernel = self.split_kernel if self.split_kernel != 'auto' else SPLIT_KERNEL_AUTO.get(v.device.type, 'two_calls')
        if kernel != 'two_calls' and attn_mask is not None and attn_mask.ndim == 4 and attn_mask.shape[1] == h > 1:
            # a per-head mask onto the 2h (4h) heads of one call
            sdpa = functools.partial(sdpa, attn_mask=attn_mask.repeat_interleave(4 if kernel == 'four_calls' else 2, 1))
        if kernel == 'two_calls':
            q1, q2 = q.view(B, h, 2, N, -1).unbind(2)  # (B, h, N, d) each
            k1, k2 = k.view(B, h, 2, N, -1).unbind(2)
            return sdpa(q1, k1, v), sdpa(q2, k2, v)
        if kernel == 'four_calls':
            d = dv // 2
            q4 = q.view(B, h, 2, 1, N, d).expand(B, h, 2, 2, N, d).reshape(B, 4 * h, N, d)  # (Q1,Q1,Q2,Q2) per head
            k4 = k.view(B, h, 2, 1, N, d).expand(B, h, 2, 2, N, d).reshape(B, 4 * h, N, d)
            v4 = v.view(B, h, 1, N, 2, d).permute(0, 1, 2, 4, 3, 5)  # (B, h, 1, 2, N, d): V[:d], V[d:]
            v4 = v4.expand(B, h, 2, 2, N, d).reshape(B, 4 * h, N, d)
            o = sdpa(q4, k4, v4).view(B, h, 2, 2, N, d)  # (B, h, map, half, N, d)
            o = o.permute(0, 1, 2, 4, 3, 5).reshape(B, h, 2, N, dv)  # (B, h, map, N, 2d)
            return o.unbind(2)
        v2 = v.unsqueeze(2).expand(B, h, 2, N, dv).reshape(B, 2 * h, N, dv)  # V for both maps of a pair
        if kernel == 'padded':
            q, k = F.pad(q, (0, dv - q.shape[-1])), F.pad(k, (0, dv - k.shape[-1]))  # (B, 2h, N, 2d)
            o = sdpa(q, k, v2, scale=self.scale)
        else:  # one_call
            o = sdpa(q, k, v2)
        return o.view(B, h, 2, N, dv).unbind(2)  # (B, h, N, 2d) each

    def _fused(self, q, k, v, lam, attn_mask, is_causal) -> torch.Tensor:
        """(B, h, N, C/h): A1V − λ·A2V in the activation dtype (fp32 for v2, whose λ varies per token)."""
        B, h, N, _ = v.shape
        if attn_mask is not None and attn_mask.dtype != torch.bool:
            attn_mask = attn_mask.to(q.dtype)
        if self.variant == 'v2' and attn_mask is not None and attn_mask.ndim == 4 and attn_mask.shape[1] == h > 1:
            attn_mask = attn_mask.repeat_interleave(2, dim=1)  # per-head mask onto the 2h query heads
        sdpa = functools.partial(
            F.scaled_dot_product_attention,
            attn_mask=attn_mask, dropout_p=self.attn_drop_p if self.training else 0., is_causal=is_causal)
        if self.variant == 'v2':
            o = sdpa(q, k, v, enable_gqa=True).view(B, h, 2, N, -1).float()  # (B, h, 2, N, d)
            return o[:, :, 0] - lam * o[:, :, 1]
        if self.variant == 'duplicate':
            return sdpa(q, k, v) * (1 - lam)
        o1, o2 = self._split_maps(q, k, v, sdpa, attn_mask)
        return torch.addcmul(o1, o2, lam, value=-1)  # o1 − λ·o2, λ a 0-dim fp32 tensor: keeps o1's dtype

    def differential_maps(self, q, k, lam, attn_mask=None, is_causal=False) -> torch.Tensor:
        """Explicit A1 − λ·A2 in fp32, (B, h, N, N); softmax in fp32, dropout on A1 and A2."""
        B, h, N = q.shape[0], self.num_heads, q.shape[2]
        if self.variant == 'duplicate':
            q, k = q.unsqueeze(2), k.unsqueeze(2)  # (B, h, 1, N, d)
        elif self.variant == 'v2':
            q, k = q.view(B, h, 2, N, -1), k.unsqueeze(2)  # (B, h, 2, N, d), (B, h, 1, N, d)
        else:
            q, k = q.view(B, h, 2, N, -1), k.view(B, h, 2, N, -1)  # (B, h, 2, N, d)
        scores = ((q * self.scale) @ k.transpose(-2, -1)).float()  # (B, h, 1|2, N, N)
        bias = resolve_self_attn_mask(N, scores, attn_mask, is_causal=is_causal)
        if bias is not None:
            bias = bias.float()
            scores = scores + (bias.unsqueeze(2) if bias.ndim == 4 else bias)
        attn = self.attn_drop(scores.softmax(dim=-1))
        if self.variant == 'duplicate':
            a1 = a2 = attn[:, :, 0]
        else:
            a1, a2 = attn.unbind(2)  # (B, h, N, N) each
        return a1 - lam * a2

    def _scaled_sub_norm(self, x: torch.Tensor) -> torch.Tensor:
        """(1 − λ_init) · RMSNorm(x) per head, in x's dtype; the statistics are fp32 (rms_norm accumulates in
        fp32 for reduced-precision inputs), the weight × (1 − λ_init) is formed in fp32, autocast is off."""
        norm = self.sub_norm
        with torch.autocast(x.device.type, enabled=False):
            if norm.weight is None:
                return F.rms_norm(x, norm.normalized_shape, None, norm.eps) * (1 - self.lambda_init)
            weight = (norm.weight.float() * (1 - self.lambda_init)).to(x.dtype)
            return F.rms_norm(x, norm.normalized_shape, weight, norm.eps)

    def forward(
            self,
            x: torch.Tensor,
            attn_mask: Optional[torch.Tensor] = None,
            is_causal: bool = False,
    ) -> torch.Tensor:
        B, N, C = x.shape
        q, k, v = self._project(x)
        lam = self.compute_lambda(x)
        if self.fused_attn:
            out = self._fused(q, k, v, lam, attn_mask, is_causal)  # (B, h, N, C/h)
        else:
            attn = self.diff_map(self.differential_maps(q, k, lam, attn_mask, is_causal))
            with torch.autocast(x.device.type, enabled=False):
                out = attn @ v.float()  # (B, h, N, C/h) fp32
        # (B, N, h, C/h): SDPA kernels return this memory layout, so the transpose, the per-head
        # sub-norm and the reshape to (B, N, C) copy nothing on the fused path
        out = out.transpose(1, 2)
        if self.variant != 'v2':
            out = self._scaled_sub_norm(out)
        out = out.type_as(x).reshape(B, N, C)  # (B, N, C)
        out = self.norm(out)
        out = self.proj(out)
        return self.proj_drop(out)

    def extra_repr(self) -> str:
        lam = 'sigmoid(W_λ x)' if self.variant == 'v2' else f'{self.lambda_init:.4f}'
        return f'variant={self.variant}, num_heads={self.num_heads}, lambda_init={lam}'


@functools.lru_cache(maxsize=None)
def diff_attn_layer(variant: str = 'split', lambda_init: LambdaInit = 'depth') -> Type[DifferentialAttention]:
    """A `DifferentialAttention` class with `variant` and `lambda_init` bound as defaults.

    timm's ViT takes `attn_layer=` as a class (it rejects partials), so each configuration is a
    small named subclass, created once and kept in this module so instances pickle.
    """
    if variant not in VARIANTS:
        raise ValueError(f'variant={variant!r}: expected one of {VARIANTS}')
    resolve_lambda_init(lambda_init, 0)
    suffix = 'depth' if lambda_init == 'depth' else f'{float(lambda_init):g}'.replace('.', 'p').replace('-', 'm')
    name = f'DifferentialAttention_{variant}_lambda_{suffix}'

    def __init__(self, *args, **kwargs):
        kwargs.setdefault('variant', variant)
        kwargs.setdefault('lambda_init', lambda_init)
        DifferentialAttention.__init__(self, *args, **kwargs)

    cls = type(name, (DifferentialAttention,), {'__init__': __init__, '__module__': __name__})
    globals()[name] = cls
    return cls
