"""The vision tower of a VLM as patch tokens: any timm model or open_clip tower, its features at a chosen layer.

Vision towers (`build_vision_tokens`): a timm model (`forward_features`, prefix tokens dropped), an
open_clip model or its `visual` with a timm trunk (diffzoo's DiffCLIP and CLIP towers) or open_clip's
own VisionTransformer (`output_tokens`), or a name: `timm:<model>` or an open_clip model name with
an optional `,pretrained` tag.

Which visual features (`select_layer`, LLaVA-1.5's `mm_vision_select_layer`): an integer names a
transformer block whose output is taken as it leaves the block, without the tower's final norm; it
indexes `hidden_states` = [embeddings, block 1's output, …, block L's output] as LLaVA-1.5 does, the
embeddings excepted: negative counts from the end (-1: the last block's output, -2: the penultimate
block's, LLaVA-1.5's and eRAM-V's choice), positive from 1 (1: the first block's output). The blocks
after it do not run (timm's / open_clip's `forward_intermediates` with `stop_early`).
`select_layer='final_norm'` is the last block's output through the tower's final norm (timm's
`forward_features`, open_clip's `ln_post`): PaliGemma's choice and the default of
`integration="full"`; `integration="eramv"` defaults to -2.
"""
from typing import Optional, Union

import open_clip
import open_clip.transform
import timm
import timm.data
import torch
import torch.nn as nn

from .options import FINAL_NORM, check_select_layer


class VisionTokens(nn.Module):
    """Patch tokens (B, P, D_v) of a vision tower at `select_layer` (module docstring); `dim` = D_v,
    `image_size` = (H, W), `preprocess` the tower's own evaluation transform (PIL image → (3, H, W)):
    open_clip's preprocess configuration (a pretrained tag's mean/std included) or timm's data
    configuration."""

    def __init__(self, tower: nn.Module, kind: str, dim: int, image_size, prefix_tokens: int = 0,
                 preprocess=None, select_layer=FINAL_NORM):
        super().__init__()
        self.tower, self.kind, self.dim = tower, kind, dim
        self.image_size, self.prefix_tokens = tuple(image_size), prefix_tokens
        self.preprocess = preprocess
        check_select_layer(select_layer)
        blocks = self.blocks()
        if select_layer != FINAL_NORM and (blocks is None or not hasattr(tower, 'forward_intermediates')):
            raise ValueError(f'select_layer={select_layer!r}: {type(tower).__name__} has no transformer blocks to '
                             f'take an output from; use select_layer={FINAL_NORM!r} (its forward_features)')
        self.select_layer = select_layer
        self.block_index = None if blocks is None else check_select_layer(select_layer, len(blocks))  # 0-based

    def blocks(self) -> Optional[nn.ModuleList]:
        """The tower's transformer blocks (None for a tower without them, e.g. a timm CNN)."""
        if self.kind == 'timm':
            return getattr(self.tower, 'blocks', None)
        return self.tower.transformer.resblocks

    def feature_block(self) -> nn.Module:
        """The block whose output the features are (the whole tower when it has no blocks)."""
        blocks = self.blocks()
        return self.tower if blocks is None else blocks[self.block_index]

    def select(self, select_layer) -> 'VisionTokens':
        """These tokens at another layer: self when unchanged, else a new `VisionTokens` on the same tower."""
        check_select_layer(select_layer)
        if type(select_layer) is type(self.select_layer) and select_layer == self.select_layer:
            return self
        return VisionTokens(self.tower, self.kind, self.dim, self.image_size, self.prefix_tokens, self.preprocess,
                            select_layer)

    def forward(self, pixel_values: torch.Tensor, prefix: bool = False) -> torch.Tensor:
        """(B, P, D_v) patch tokens; prefix=True: (B, prefix + P, D_v), a timm tower's [CLS] included."""
        if self.select_layer == FINAL_NORM:
            if self.kind == 'timm':
                tokens = self.tower.forward_features(pixel_values)  # (B, prefix + P, D_v)
                return tokens if prefix else tokens[:, self.prefix_tokens:]
            _, tokens = self.tower(pixel_values)  # open_clip VisionTransformer with output_tokens (after ln_post)
            return tokens  # (B, P, D_v)
        if self.kind == 'timm':  # the blocks up to the chosen one, no final norm
            out, = self.tower.forward_intermediates(pixel_values, indices=[self.block_index], return_prefix_tokens=True,
                                                    norm=False, stop_early=True, output_fmt='NLC',
                                                    intermediates_only=True)
            tokens, first = out if self.prefix_tokens else (out, None)  # (B, P, D_v), (B, prefix, D_v)
            return torch.cat([first, tokens], 1) if prefix and first is not None else tokens
        out = self.tower.forward_intermediates(pixel_values, indices=[self.block_index], stop_early=True,
                                               normalize_intermediates=False, intermediates_only=True,
                                               output_fmt='NLC')
        return out['image_intermediates'][0]  # (B, P, D_v), [CLS] split off


def _timm_tokens(model: nn.Module, preprocess=None) -> VisionTokens:
    size = model.patch_embed.img_size if hasattr(model, 'patch_embed') else model.pretrained_cfg['input_size'][1:]
    if preprocess is None:
        preprocess = timm.data.create_transform(**timm.data.resolve_data_config({}, model=model))
    return VisionTokens(model, 'timm', model.num_features, size, getattr(model, 'num_prefix_tokens', 0), preprocess)


def _open_clip_preprocess(visual: nn.Module):
    """open_clip's evaluation transform from the preprocess configuration create_model set on `visual`."""
    cfg = getattr(visual, 'preprocess_cfg', None)
    return None if cfg is None else open_clip.transform.image_transform_v2(open_clip.transform.PreprocessCfg(**cfg), is_train=False)


def build_vision_tokens(vision: Union[str, nn.Module], select_layer=FINAL_NORM) -> VisionTokens:
    """A `VisionTokens` for a timm model, an open_clip model / visual tower, or a name (module docstring),
    its features taken at `select_layer`."""
    return _vision_tokens(vision).select(select_layer)


def _vision_tokens(vision: Union[str, nn.Module]) -> VisionTokens:
    if isinstance(vision, VisionTokens):
        return vision
    if isinstance(vision, str):
        if vision.startswith('timm:'):
            return _timm_tokens(timm.create_model(vision[len('timm:'):], pretrained=False))
        name, _, pretrained = vision.partition(',')
        if open_clip.get_model_config(name) is None:
            raise ValueError(f'vision={vision!r}: not an open_clip model name; use an open_clip name (e.g. '
                             f'diffclip-b16[,pretrained]) or timm:<timm model name>')
        vision = open_clip.create_model(name, pretrained=pretrained or None)
    visual = getattr(vision, 'visual', vision)
    trunk = getattr(visual, 'trunk', None)
    if trunk is not None and hasattr(trunk, 'forward_features'):
        return _timm_tokens(trunk, _open_clip_preprocess(visual))
    if hasattr(visual, 'forward_features') and hasattr(visual, 'num_features'):
        return _timm_tokens(visual)
    if hasattr(visual, 'output_tokens') and hasattr(visual, 'transformer'):
        visual.output_tokens = True
        return VisionTokens(visual, 'open_clip', visual.transformer.width, visual.image_size,
                            preprocess=_open_clip_preprocess(visual))
    raise ValueError(f'vision: {type(vision).__name__} is not a timm model or an open_clip vision tower')
