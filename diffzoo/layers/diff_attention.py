"""Differential attention (Ye et al., Differential Transformer): one layer for every diffzoo tower.

`DifferentialAttention` is timm's `DiffAttention` with a λ_init policy, the duplicate and v2 variants, and
the differential maps of its explicit path; λ and λ_init are written in `diffzoo.layers.lambdas`.
`num_heads` counts differential heads h (timm/unilm); with C = dim, `LAYOUTS` gives each variant's heads:

    variant     query heads      q/k head dim   value head dim   after the difference
    split       2h (pairs)       C / h / 2      C / h            sub-norm, × (1 − λ_init)
    duplicate   h                C / h          C / h            sub-norm, × (1 − λ_init)
    v2          2h (GQA on h)    C / h          C / h            nothing

DiffCLIP's ViT-B/16 (12 ordinary heads) is therefore `num_heads=6`: q/k 64, v 128.

split (Differential Transformer; DiffCLIP): query head 2i is Q1 and 2i+1 is Q2 of differential head i
(likewise K); V of head i is its contiguous slice of width C/h:

    DiffAttn(X) = (softmax(Q1 K1ᵀ/√d) − λ·softmax(Q2 K2ᵀ/√d)) V
    head_i = (1 − λ_init) · RMSNorm(DiffAttn_i),    out = Concat(head_1..h) W_O

duplicate (Differential PaliGemma, Eq. 5): both maps from the same, undivided Q and K, so A1 = A2 = A and
DiffAttn = (1 − λ)·A V, with λ vectors of width C / h; sub-norm and (1 − λ_init) as in split. It keeps a
pretrained model's heads intact, and as RMSNorm_ε((1 − λ)·x) = sign(1 − λ)·RMSNorm_{ε/(1 − λ)²}(x), λ
reaches the output only through that sign and the effective ε.

v2 (Differential Transformer V2): 2h query heads share h key/value heads in one attention call, λ is per
token and head, projected from the input by W_λ (`lambda_proj`, unilm's `MultiheadFlashDiffV2` init):

    O = Attn(Q, K, V);  O1, O2 = O[:, 0::2], O[:, 1::2];  head_i = O1_i − sigmoid(W_λ x)_i · O2_i

Contract: `fused_attn=True` (default) runs the kernels of `diffzoo.layers.kernels` (SDPA, or the split
variant's `split_kernel`; all exact); `False` computes explicitly and passes each differential map
(B, h, N, N) through `diff_map`, an identity where hooks and `capture_attention_maps` read it. Softmax, λ
and the sub-norm's statistics are computed in torch.promote_types(dtype, float32), then cast back. The
forward branches on what construction fixed, on `fused_attn`, and (not under TorchScript) on whether `proj` is a
plain, unhooked `nn.Linear` the fused op may apply itself; never on tensor values, so TorchScript, torch.fx,
torch.compile(fullgraph=True), torch.export and ONNX take it (tests/layers/test_tracing.py).
"""
import functools
from typing import NamedTuple, Optional, Tuple, Type

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import DiffAttention, RmsNorm, use_fused_attn

from diffzoo.classes import module_class

from .kernels import (SPLIT_KERNELS, add_mask, duplicate_attention, explicit_output, split_attention,
                      v2_attention)
from .lambdas import LAMBDA_VECTORS, LambdaInit, reparameterized_lambda, resolve_lambda_init
from .numerics import stats_dtype

# the kernel functions are fx leaves wherever this module calls them (timm's tracer also knows them)
torch.fx.wrap('split_attention')
torch.fx.wrap('duplicate_attention')
torch.fx.wrap('v2_attention')
torch.fx.wrap('add_mask')
torch.fx.wrap('explicit_output')


class Layout(NamedTuple):
    """A variant's heads, per differential head, and what follows the difference (module docstring)."""
    query_heads: int  # query heads of width d
    key_heads: int  # key heads of width d
    qk_split: int  # d = C / h / qk_split
    sub_norm: bool  # RMSNorm × (1 − λ_init) on each head
    token_lambda: bool  # λ from the input by W_λ, not from the λ vectors


LAYOUTS = {
    'split': Layout(query_heads=2, key_heads=2, qk_split=2, sub_norm=True, token_lambda=False),
    'duplicate': Layout(query_heads=1, key_heads=1, qk_split=1, sub_norm=True, token_lambda=False),
    'v2': Layout(query_heads=2, key_heads=1, qk_split=1, sub_norm=False, token_lambda=True),
}
VARIANTS = tuple(LAYOUTS)
LAMBDA_PROJ_INITS = ('unilm', 'zeros')  # v2's W_λ: unilm's (no bias, nn.Linear init) or zero weight and bias
SUB_NORM_EPS = 1e-5  # unilm's and timm's


def check_options(variant: str = 'split', lambda_init: LambdaInit = 'depth', lambda_proj_init: str = 'unilm',
                  split_kernel: str = 'auto') -> None:
    """The layer's options checked: a ValueError naming the first bad one and what it takes."""
    if variant not in VARIANTS:
        raise ValueError(f'variant={variant!r}: expected one of {VARIANTS}')
    resolve_lambda_init(lambda_init, 0)
    if lambda_proj_init not in LAMBDA_PROJ_INITS:
        raise ValueError(f'lambda_proj_init={lambda_proj_init!r}: expected one of {LAMBDA_PROJ_INITS} (v2\'s W_λ: '
                         f'"unilm", no bias and nn.Linear\'s init; "zeros", a bias, weight and bias zero)')
    if split_kernel != 'auto' and split_kernel not in SPLIT_KERNELS:
        raise ValueError(f'split_kernel={split_kernel!r}: expected "auto" or one of {SPLIT_KERNELS}')


class DifferentialAttention(DiffAttention):
    """Differential attention with a λ_init policy and split / duplicate / v2 variants (module docstring).

    Besides timm's arguments: `lambda_init` (a number in [0, 1) or "depth", with `depth` the block's 0-based
    index), `variant` ("split", "duplicate", "v2"), `split_kernel` ("auto" or one of SPLIT_KERNELS) and, for
    v2's λ projection, `lambda_proj_init`: "unilm" (no bias, nn.Linear's init, as unilm's Differential
    Transformer V2) or "zeros" (a bias, weight and bias zero: λ starts at 0.5). `dual_lambda` is timm's
    two-scalar λ, exp(λ_a) − exp(λ_b) + λ_init (split and duplicate).

    It subclasses timm's layer, so timm's ViT hands it its block index (`depth=`) and its λ init rule applies,
    and builds its modules once from the variant's `LAYOUTS` entry: timm's constructor has the split layout
    only. Parameter names and shapes, their order and, for split, the order of initialisation are timm's.
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
            lambda_proj_init: str = 'unilm',
            device=None,
            dtype=None,
    ) -> None:
        check_options(variant, lambda_init, lambda_proj_init, split_kernel)
        if num_heads < 1 or dim % (2 * num_heads):
            raise ValueError(
                f'num_heads={num_heads} differential heads do not divide dim={dim} into pairs of '
                f'q/k halves: dim must be a multiple of 2 * num_heads')
        nn.Module.__init__(self)  # timm's DiffAttention.__init__ builds the split layout only
        layout = LAYOUTS[variant]
        dd = {'device': device, 'dtype': dtype}
        norm_layer = norm_layer or RmsNorm
        self.variant = variant
        self.lambda_init_policy = lambda_init
        self.lambda_proj_init = lambda_proj_init
        self.depth = depth
        self.split_kernel = split_kernel
        self.fused_attn = use_fused_attn()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads // layout.qk_split  # d, the q/k head width
        self.scale = self.head_dim ** -0.5
        self.qk_heads = (layout.query_heads * num_heads, layout.key_heads * num_heads)
        self.qkv_split = [self.qk_heads[0] * self.head_dim, self.qk_heads[1] * self.head_dim, dim]  # q, k, v widths

        self.qkv = nn.Linear(dim, sum(self.qkv_split), bias=qkv_bias, **dd)
        self.q_norm = norm_layer(self.head_dim, **dd) if qk_norm else nn.Identity()
        self.k_norm = norm_layer(self.head_dim, **dd) if qk_norm else nn.Identity()
        self.attn_drop = nn.Dropout(attn_drop)
        self.attn_drop_p = attn_drop
        self.norm = norm_layer(dim, **dd) if scale_norm else nn.Identity()
        self.proj = nn.Linear(dim, dim, bias=proj_bias, **dd)
        self.proj_drop = nn.Dropout(proj_drop)

        # λ: the vectors (d wide) or timm's dual scalars, fp32 as timm keeps them; or v2's W_λ
        self.dual_lambda = dual_lambda and not layout.token_lambda
        vectors = not (self.dual_lambda or layout.token_lambda)
        for name in LAMBDA_VECTORS:
            setattr(self, name, nn.Parameter(torch.empty(self.head_dim, dtype=torch.float32, device=device))
                    if vectors else None)
        self.lambda_a = nn.Parameter(torch.empty((), dtype=torch.float32, device=device)) if self.dual_lambda else None
        self.lambda_b = nn.Parameter(torch.empty((), dtype=torch.float32, device=device)) if self.dual_lambda else None
        self.sub_norm = RmsNorm(dim // num_heads, eps=SUB_NORM_EPS, **dd) if layout.sub_norm else nn.Identity()
        self.diff_map = nn.Identity()
        self.lambda_proj = (nn.Linear(dim, num_heads, bias=lambda_proj_init == 'zeros', **dd)
                            if layout.token_lambda else None)
        self.set_lambda_init(depth)
        self.reset_parameters()

    def set_lambda_init(self, depth: int) -> None:
        self.lambda_init = resolve_lambda_init(self.lambda_init_policy, depth)

    def reset_parameters(self) -> None:
        """λ's initial values: timm's rule for the vectors (N(0, 0.1)) and dual scalars (0); v2's W_λ by
        `lambda_proj_init`, nn.Linear's init ("unilm") or zero weight and bias ("zeros")."""
        if self.lambda_proj is None:
            super().reset_parameters()
        elif self.lambda_proj_init == 'zeros':
            nn.init.zeros_(self.lambda_proj.weight)
            nn.init.zeros_(self.lambda_proj.bias)
        else:
            self.lambda_proj.reset_parameters()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """A duplicate layer takes λ vectors of width C / 2h (timm's split width) zero-padded to C / h:
        every dot product, so λ and the output, is unchanged."""
        if self.variant == 'duplicate' and self.lambda_q1 is not None:
            for name in LAMBDA_VECTORS:
                saved = state_dict.get(prefix + name)
                if saved is not None and saved.shape == (self.head_dim // 2,):
                    state_dict[prefix + name] = F.pad(saved, (0, self.head_dim - saved.shape[0]))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def init_weights(self) -> None:
        """timm's ViT init visits this after its Linear layers: restore the λ init rule."""
        self.reset_parameters()

    def _compute_lambda(self) -> torch.Tensor:
        """λ from the vectors (`diffzoo.layers.lambdas`) or timm's dual scalars, in fp32 (fp64 for fp64)."""
        if self.lambda_a is not None and self.lambda_b is not None:
            return torch.exp(self.lambda_a) - torch.exp(self.lambda_b) + self.lambda_init
        assert self.lambda_q1 is not None and self.lambda_k1 is not None
        assert self.lambda_q2 is not None and self.lambda_k2 is not None
        return reparameterized_lambda(self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2, self.lambda_init)

    def compute_lambda(self, x: Optional[torch.Tensor] = None) -> torch.Tensor:
        """λ in fp32 (fp64 for fp64): a scalar for split/duplicate (x unused), (B, h, N, 1) per token
        and head for v2 (from x)."""
        if self.lambda_proj is not None:
            assert x is not None, 'v2 projects λ from the input: pass x'
            logits = self.lambda_proj(x)  # (B, N, h)
            lam = torch.sigmoid(logits.to(stats_dtype(logits.dtype)))
            return lam.transpose(1, 2).unsqueeze(-1)  # (B, h, N, 1)
        else:
            lam = self._compute_lambda()
            return lam.to(stats_dtype(lam.dtype))

    def _project(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (B, hq, N, d), k (B, hk, N, d), v (B, h, N, C/h), with (hq, hk) = `qk_heads` (module docstring)."""
        B, N, C = x.shape
        q, k, v = self.qkv(x).split(self.qkv_split, dim=-1)
        q = q.reshape(B, N, self.qk_heads[0], self.head_dim).transpose(1, 2)  # (B, hq, N, d)
        k = k.reshape(B, N, self.qk_heads[1], self.head_dim).transpose(1, 2)  # (B, hk, N, d)
        v = v.reshape(B, N, self.num_heads, C // self.num_heads).transpose(1, 2)  # (B, h, N, C/h)
        return self.q_norm(q), self.k_norm(k), v

    def _folded_proj(self) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """The output projection's weight and bias when the fused op applies it itself: no scale norm,
        and `proj` a plain `nn.Linear` without hooks (a wrapped or hooked `proj` is called); else None."""
        proj = self.proj
        if (isinstance(self.norm, nn.Identity) and type(proj) is nn.Linear
                and not proj._forward_hooks and not proj._forward_pre_hooks):
            return proj.weight, proj.bias
        return None, None

    def differential_maps(self, q: torch.Tensor, k: torch.Tensor, lam: torch.Tensor,
                          attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False) -> torch.Tensor:
        """Explicit A1 − λ·A2 in fp32 (fp64 for fp64), (B, h, N, N); softmax likewise, dropout on A1 and A2."""
        B, h, N, d = q.shape[0], self.num_heads, q.shape[2], q.shape[3]
        q = q.view(B, h, self.qk_heads[0] // h, N, d)  # (B, h, 2 or 1, N, d)
        k = k.view(B, h, self.qk_heads[1] // h, N, d)  # (B, h, 2 or 1, N, d): one K for both maps of v2, duplicate
        scores = (q * self.scale) @ k.transpose(-2, -1)  # (B, h, 2 or 1, N, N)
        scores = add_mask(scores.to(stats_dtype(scores.dtype)), attn_mask, is_causal)
        attn = self.attn_drop(scores.softmax(dim=-1))
        return attn[:, :, 0] - lam * attn[:, :, -1]  # duplicate: index 0 and -1 are its one map

    def _sub_norm_weight(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The sub-norm weight with (1 − λ_init) folded in, formed in fp32 (fp64 for fp64), in `dtype`."""
        weight = self.sub_norm.weight
        if weight is None:
            return torch.full(self.sub_norm.normalized_shape, 1 - self.lambda_init, dtype=dtype, device=device)
        return (weight.to(stats_dtype(weight.dtype)) * (1 - self.lambda_init)).to(dtype)

    def forward(
            self,
            x: torch.Tensor,
            attn_mask: Optional[torch.Tensor] = None,
            is_causal: bool = False,
    ) -> torch.Tensor:
        return self.attend(x, attn_mask, is_causal)

    def attend(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor], is_causal: bool) -> torch.Tensor:
        """The layer's output (B, N, C); `forward` of this class and of subclasses with other signatures.
        Its branches read what construction fixed (v2's `lambda_proj`, the variant), `fused_attn` and the
        module `proj` (`_folded_proj`)."""
        B, N, C = x.shape
        q, k, v = self._project(x)
        lam = self.compute_lambda(x)
        dropout_p = self.attn_drop_p if self.training else 0.
        if self.lambda_proj is not None:  # v2: λ per token and head, no sub-norm
            if self.fused_attn:
                out = v2_attention(q, k, v, lam, attn_mask, dropout_p, is_causal)  # (B, N, h, d) fp32
            else:
                out = explicit_output(self.diff_map(self.differential_maps(q, k, lam, attn_mask, is_causal)), v,
                                      None, None)
        elif self.fused_attn:
            proj_weight: Optional[torch.Tensor] = None
            proj_bias: Optional[torch.Tensor] = None
            if not torch.jit.is_scripting():
                proj_weight, proj_bias = self._folded_proj()
            weight = self._sub_norm_weight(v.dtype, v.device)
            if self.variant == 'duplicate':
                out = duplicate_attention(q, k, v, lam, weight, self.sub_norm.eps, attn_mask, dropout_p, is_causal,
                                          proj_weight, proj_bias)
            else:
                out = split_attention(q, k, v, lam, weight, self.sub_norm.eps, attn_mask, dropout_p, is_causal,
                                      self.scale, self.split_kernel, proj_weight, proj_bias)
            if proj_weight is not None:
                return self.proj_drop(out)  # (B, N, C), projected
        else:
            attn = self.diff_map(self.differential_maps(q, k, lam, attn_mask, is_causal))  # (B, h, N, N) fp32
            weight = self._sub_norm_weight(attn.dtype, attn.device)
            out = explicit_output(attn, v, weight, self.sub_norm.eps)  # (B, N, h, C/h) fp32 (fp64 for fp64)
        out = out.type_as(x).reshape(B, N, C)  # (B, N, C)
        out = self.norm(out)
        out = self.proj(out)
        return self.proj_drop(out)

    def extra_repr(self) -> str:
        lam = 'sigmoid(W_λ x)' if self.variant == 'v2' else f'{self.lambda_init:.4f}'
        return f'variant={self.variant}, num_heads={self.num_heads}, lambda_init={lam}'


def set_split_kernel(model: nn.Module, kernel: str) -> int:
    """Set `split_kernel` ("auto" or one of SPLIT_KERNELS) on every `DifferentialAttention` in
    `model`; returns how many layers it set."""
    check_options(split_kernel=kernel)
    layers = [m for m in model.modules() if isinstance(m, DifferentialAttention)]
    for layer in layers:
        layer.split_kernel = kernel
    return len(layers)


def diff_attn_layer(variant: str = 'split', lambda_init: LambdaInit = 'depth',
                    lambda_proj_init: str = 'unilm') -> Type[DifferentialAttention]:
    """A `DifferentialAttention` class with `variant`, `lambda_init` and `lambda_proj_init` bound as defaults.

    timm's ViT takes `attn_layer=` as a class (it rejects partials), so each configuration is a
    small named subclass, created once and kept in this module so instances pickle. The arguments
    are checked before the cache is consulted (False hashes as 0, and a list does not hash).
    E.g. v2 with a zero-initialised λ projection in a timm model:
    `timm.create_model('vit_diff_small_patch16_224', attn_layer=diff_attn_layer('v2', 0.8, 'zeros'))`.
    """
    check_options(variant, lambda_init, lambda_proj_init)
    return _bound_class(variant, lambda_init, lambda_proj_init)


@functools.lru_cache(maxsize=None)
def _bound_class(variant: str, lambda_init: LambdaInit, lambda_proj_init: str) -> Type[DifferentialAttention]:
    suffix = 'depth' if lambda_init == 'depth' else f'{float(lambda_init):g}'.replace('.', 'p').replace('-', 'm')
    name = f'DifferentialAttention_{variant}_lambda_{suffix}'
    if lambda_proj_init != 'unilm':
        name += f'_lambda_proj_{lambda_proj_init}'

    def __init__(self, *args, **kwargs):
        kwargs.setdefault('variant', variant)
        kwargs.setdefault('lambda_init', lambda_init)
        kwargs.setdefault('lambda_proj_init', lambda_proj_init)
        DifferentialAttention.__init__(self, *args, **kwargs)

    return module_class(__name__, name, (DifferentialAttention,), {'__init__': __init__})
