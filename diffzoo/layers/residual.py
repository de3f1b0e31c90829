"""open_clip's residual attention blocks with a differential attention layer: the blocks of diffzoo's CLIP text
tower (`diffzoo.clip.text_tower`) and of an open_clip tower made differential (`diffzoo.differentialize`)."""
from collections import OrderedDict
from typing import Optional, Type

import torch
import torch.nn as nn
from open_clip.transformer import LayerNorm, LayerScale

from .diff_attention import diff_attn_layer


class DiffResidualAttentionBlock(nn.Module):
    """open_clip's `ResidualAttentionBlock` layout (ln_1, attn, ls_1, ln_2, mlp.c_fc/c_proj, ls_2)
    with a differential attention layer: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(
            self,
            d_model: int,
            n_head: int,
            mlp_ratio: float = 4.0,
            ls_init_value: Optional[float] = None,
            act_layer: Type[nn.Module] = nn.GELU,
            norm_layer: Type[nn.Module] = LayerNorm,
            attn_layer: Type[nn.Module] = diff_attn_layer(),
            depth: int = 0,
            is_causal: bool = False,
    ):
        super().__init__()
        self.is_causal = is_causal  # attends causally when given no mask
        self.ln_1 = norm_layer(d_model)
        self.attn = attn_layer(d_model, num_heads=n_head, qkv_bias=True, proj_bias=True, depth=depth)
        self.ls_1 = LayerScale(d_model, ls_init_value) if ls_init_value is not None else nn.Identity()
        self.ln_2 = norm_layer(d_model)
        mlp_width = int(d_model * mlp_ratio)
        self.mlp = nn.Sequential(OrderedDict([
            ('c_fc', nn.Linear(d_model, mlp_width)),
            ('gelu', act_layer()),
            ('c_proj', nn.Linear(mlp_width, d_model)),
        ]))
        self.ls_2 = LayerScale(d_model, ls_init_value) if ls_init_value is not None else nn.Identity()

    def get_weight_dtype(self) -> torch.dtype:
        return self.mlp.c_fc.weight.dtype

    def forward(
            self,
            q_x: torch.Tensor,
            k_x: Optional[torch.Tensor] = None,
            v_x: Optional[torch.Tensor] = None,
            attn_mask: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        # open_clip's block signature: its Transformer calls checkpoint(block, x, None, None, mask)
        is_causal = self.is_causal and attn_mask is None
        x = q_x + self.ls_1(self.attn(self.ln_1(q_x), attn_mask=attn_mask, is_causal=is_causal))
        return x + self.ls_2(self.mlp(self.ln_2(x)))


class DiffCustomResidualAttentionBlock(nn.Module):
    """open_clip's `CustomResidualAttentionBlock` layout (ln_1, attn, ln_attn, ls_1, ln_2, mlp.c_fc/ln/c_proj,
    ls_2) with a differential attention layer: x + ln_attn(attn(ln_1(x))), then x + mlp(ln_2(x)). Its options
    are open_clip's: `qk_norm` and `scale_attn_inner` are the attention layer's q/k norms and its norm before
    the output projection, `scale_attn` the norm after attention, `scale_fc` the MLP's inner norm, each a
    `norm_layer`."""

    def __init__(
            self,
            d_model: int,
            n_head: int,
            mlp_ratio: float = 4.0,
            ls_init_value: Optional[float] = None,
            act_layer: Type[nn.Module] = nn.GELU,
            norm_layer: Type[nn.Module] = LayerNorm,
            attn_layer: Type[nn.Module] = diff_attn_layer(),
            depth: int = 0,
            is_causal: bool = False,
            qk_norm: bool = False,
            scale_attn_inner: bool = False,
            scale_attn: bool = False,
            scale_fc: bool = False,
    ):
        super().__init__()
        self.is_causal = is_causal  # attends causally when given no mask
        self.ln_1 = norm_layer(d_model)
        self.attn = attn_layer(d_model, num_heads=n_head, qkv_bias=True, proj_bias=True, depth=depth,
                               qk_norm=qk_norm, scale_norm=scale_attn_inner, norm_layer=norm_layer)
        self.ln_attn = norm_layer(d_model) if scale_attn else nn.Identity()
        self.ls_1 = LayerScale(d_model, ls_init_value) if ls_init_value is not None else nn.Identity()
        self.ln_2 = norm_layer(d_model)
        mlp_width = int(d_model * mlp_ratio)
        self.mlp = nn.Sequential(OrderedDict([
            ('c_fc', nn.Linear(d_model, mlp_width)),
            ('gelu', act_layer()),
            ('ln', norm_layer(mlp_width) if scale_fc else nn.Identity()),
            ('c_proj', nn.Linear(mlp_width, d_model)),
        ]))
        self.ls_2 = LayerScale(d_model, ls_init_value) if ls_init_value is not None else nn.Identity()

    def get_weight_dtype(self) -> torch.dtype:
        return self.mlp.c_fc.weight.dtype

    def forward(
            self,
            q_x: torch.Tensor,
            k_x: Optional[torch.Tensor] = None,
            v_x: Optional[torch.Tensor] = None,
            attn_mask: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        # open_clip's block signature: its Transformer calls checkpoint(block, x, None, None, mask)
        is_causal = self.is_causal and attn_mask is None
        x = q_x + self.ls_1(self.ln_attn(self.attn(self.ln_1(q_x), attn_mask=attn_mask, is_causal=is_causal)))
        return x + self.ls_2(self.mlp(self.ln_2(x)))
