"""A CLIP text tower with differential attention, in open_clip's own classes and parameter names.

`DiffTextTransformer` is open_clip's `TextTransformer` (token/positional embeddings, causal mask,
`ln_final`, EOT pooling, `text_projection`, intermediates, locking) whose residual blocks use
`DifferentialAttention`. It takes every argument open_clip's takes, and open_clip's own `_build_text_tower`
builds it from the whole `CLIPTextCfg` (`diffzoo.clip.seams`). `text_cfg.heads` keeps open_clip's meaning,
ordinary heads: the tower has heads / 2 differential heads (DiffCLIP's text: 8 heads → 4 differential
heads, q/k 64, v 128). The block options choose the block as open_clip's `Transformer` does: `block_type`
"custom", or any of `qk_norm`, `scale_attn_inner`, `scale_attn`, `scale_fc`, gives open_clip's custom
block layout (`DiffCustomResidualAttentionBlock`); `scaled_cosine_attn` and `scale_heads` have no
differential counterpart and are refused.

A causal tower (open_clip's default) attends with `is_causal=True` where open_clip hands it its
(L, L) causal mask (`CLIP.encode_text`, `TextTransformer`), so the attention kernels skip the
masked half instead of adding −inf to it; a class-token or padding mask, (B·heads, L, L), is
passed on as given.

The tower scripts with `torch.jit.script`, inside the whole model (open_clip's `create_model(..., jit=True)`,
open_clip_train's `--torchscript`); torch.compile(fullgraph=True) and torch.export trace it.
"""
import functools
import inspect
from typing import Optional, Type

import torch
import torch.nn as nn
from open_clip.transformer import LayerNorm, TextTransformer, Transformer
from torch.utils.checkpoint import checkpoint

from diffzoo.layers import diff_attn_layer
from diffzoo.layers.residual import DiffCustomResidualAttentionBlock, DiffResidualAttentionBlock

TEXT_TRANSFORMER = inspect.signature(TextTransformer)
# what open_clip's TextTransformer hands its Transformer: the arguments of both, by name
STACK_ARGS = tuple(name for name in inspect.signature(Transformer).parameters if name in TEXT_TRANSFORMER.parameters)


def is_exactly_causal(mask: torch.Tensor) -> bool:
    """An additive (L, L) mask that is −inf above the diagonal and 0 elsewhere, as
    `TextTransformer.build_causal_mask` makes it (a bool mask: True on and below the diagonal)."""
    L = mask.shape[-1]
    if mask.dim() != 2 or mask.shape[0] != L:
        return False
    lower = torch.ones(L, L, dtype=torch.bool, device=mask.device).tril_()  # (L, L)
    if mask.dtype == torch.bool:
        return torch.equal(mask, lower)
    return bool((mask[lower] == 0).all()) and bool((mask[~lower] == float('-inf')).all())


class DiffTransformer(Transformer):
    """open_clip's `Transformer` (intermediates, grad checkpointing) over differential blocks, chosen by its block
    options as open_clip chooses its own (module docstring); its forward is written out, as TorchScript compiles
    no `super()` call."""

    def __init__(
            self,
            width: int,
            layers: int,
            heads: int,
            mlp_ratio: float = 4.0,
            ls_init_value: Optional[float] = None,
            act_layer: Type[nn.Module] = nn.GELU,
            norm_layer: Type[nn.Module] = LayerNorm,
            block_type: Optional[str] = None,
            qk_norm: bool = False,
            scaled_cosine_attn: bool = False,
            scale_heads: bool = False,
            scale_attn_inner: bool = False,
            scale_attn: bool = False,
            scale_fc: bool = False,
            lambda_init='depth',
            variant: str = 'split',
            is_causal: bool = False,
    ):
        if heads % 2:
            raise ValueError(
                f'differential text tower: heads={heads} ordinary heads cannot pair into differential '
                f'heads; set text_cfg.heads to an even number (DiffCLIP: 8 → 4 differential heads)')
        for name, value in (('scaled_cosine_attn', scaled_cosine_attn), ('scale_heads', scale_heads)):
            if value:
                raise ValueError(f'differential text tower: text_cfg.{name}=true is an option of open_clip\'s '
                                 f'one-map attention, which differential attention has no counterpart of; leave it out')
        super().__init__(width, layers=0, heads=heads, batch_first=True)  # open_clip state, no blocks
        self.layers = layers
        block = DiffResidualAttentionBlock
        if block_type == 'custom' or (block_type is None and any((qk_norm, scale_attn_inner, scale_attn, scale_fc))):
            block = functools.partial(DiffCustomResidualAttentionBlock, qk_norm=qk_norm,
                                      scale_attn_inner=scale_attn_inner, scale_attn=scale_attn, scale_fc=scale_fc)
        attn_layer = diff_attn_layer(variant, lambda_init)
        self.resblocks = nn.ModuleList([
            block(width, heads // 2, mlp_ratio, ls_init_value=ls_init_value, act_layer=act_layer,
                  norm_layer=norm_layer, attn_layer=attn_layer, depth=i, is_causal=is_causal)
            for i in range(layers)
        ])
        self.is_causal = is_causal
        self._causal_seen = (None, None)  # (mask, its version) last found exactly causal; not a buffer

    def _blocks_mask(self, attn_mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The mask the blocks get: none for an exactly causal (L, L) mask given to a causal tower
        (the blocks then pass is_causal); any other mask unchanged. Eager mode checks the values once
        per mask tensor and version (open_clip hands the same buffer every call, so a GPU run
        synchronises once, not every step); scripted, which keeps no Python state between calls, at
        every call. Under torch.compile, and for a mask on the meta device (which holds no values), a
        causal tower's (L, L) mask is taken to be the causal buffer open_clip hands it, so the graph
        has no data-dependent branch."""
        if attn_mask is None or not self.is_causal or attn_mask.dim() != 2:
            return attn_mask
        if torch.jit.is_scripting():
            causal = attn_mask.is_meta or is_exactly_causal(attn_mask)
        else:
            causal = self._is_causal_buffer(attn_mask)
        return None if causal else attn_mask

    def _is_causal_buffer(self, attn_mask: torch.Tensor) -> bool:
        """`_blocks_mask`'s verdict outside TorchScript, kept per mask tensor and version."""
        if torch.compiler.is_compiling() or attn_mask.is_meta:
            return True
        seen, version = self._causal_seen
        if seen is not attn_mask or version != attn_mask._version:
            self._causal_seen = (attn_mask, attn_mask._version) if is_exactly_causal(attn_mask) else (None, None)
        return self._causal_seen[0] is attn_mask

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None):
        """open_clip's `Transformer.forward` (batch first), with the blocks' mask."""
        attn_mask = self._blocks_mask(attn_mask)
        for block in self.resblocks:
            if self.grad_checkpointing and not torch.jit.is_scripting():
                x = checkpoint(block, x, None, None, attn_mask, use_reentrant=False)  # open_clip's positional call
            else:
                x = block(x, attn_mask=attn_mask)
        return x  # (B, L, width)

    def forward_intermediates(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, **kwargs):
        return super().forward_intermediates(x, attn_mask=self._blocks_mask(attn_mask), **kwargs)


class DiffTextTransformer(TextTransformer):
    """open_clip's `TextTransformer` with a `DiffTransformer` stack; same parameter names except
    attention (`attn.qkv`, `attn.proj`, `attn.lambda_*`, `attn.sub_norm`).

    Takes `TextTransformer`'s arguments (keywords) and `lambda_init`, `variant`: open_clip's class builds the
    embeddings, mask, pooling and projection from all of them, and the stack gets the ones open_clip's class
    hands its `Transformer` (`STACK_ARGS`: width, layers, heads, the MLP, norm and block options)."""

    def __init__(self, *, lambda_init='depth', variant: str = 'split', **kwargs):
        arguments = TEXT_TRANSFORMER.bind(**kwargs)
        arguments.apply_defaults()
        super().__init__(**{**arguments.arguments, 'layers': 0})  # open_clip's embeddings, mask and projection
        self.transformer = DiffTransformer(
            **{name: arguments.arguments[name] for name in STACK_ARGS}, lambda_init=lambda_init, variant=variant,
            is_causal=not arguments.arguments['no_causal_mask'])
        self.init_parameters()

    def init_parameters(self):
        """CLIP's init (as in DiffCLIP's text tower): N(0, width^-½) for q/k/v, residual-scaled N for
        the output and MLP projections, embeddings and projection as open_clip; λ as the layer's own."""
        if not self.transformer.layers:  # open_clip's __init__ calls this before the blocks exist
            return
        nn.init.normal_(self.token_embedding.weight, std=0.02)
        nn.init.normal_(self.positional_embedding, std=0.01)
        if self.cls_emb is not None:
            nn.init.normal_(self.cls_emb, std=0.01)
        width, layers = self.transformer.width, self.transformer.layers
        proj_std = width ** -0.5 * (2 * layers) ** -0.5
        attn_std = width ** -0.5
        fc_std = (2 * width) ** -0.5
        for block in self.transformer.resblocks:
            nn.init.normal_(block.attn.qkv.weight, std=attn_std)
            nn.init.normal_(block.attn.proj.weight, std=proj_std)
            nn.init.normal_(block.mlp.c_fc.weight, std=fc_std)
            nn.init.normal_(block.mlp.c_proj.weight, std=proj_std)
            block.attn.reset_parameters()
        if isinstance(self.text_projection, nn.Linear):
            nn.init.normal_(self.text_projection.weight, std=width ** -0.5)
            if self.text_projection.bias is not None:
                nn.init.zeros_(self.text_projection.bias)
        elif self.text_projection is not None:
            nn.init.normal_(self.text_projection, std=width ** -0.5)
