"""Differential-attention ViTs registered with timm.

Every model is timm's own `VisionTransformer` built with `attn_layer=` a `DifferentialAttention`
class; nothing is copied or swapped after construction. The layout is DiffCLIP's vision tower:
class token, token pooling, no pre-norm, biased patch embedding, qkv and output biases, exact GELU
MLP, LayerNorm eps 1e-5 (torch's default; timm's ViTs use 1e-6), RMSNorm eps 1e-5 sub-norm.

Names, per size (`tiny_patch16_224`, `base_patch16_224`, …):
    vit_diff_<size>           DiffCLIP: differential attention, λ_init 0.8 in every block
    vit_diff_dynamic_<size>   DiffCLIP*: λ_init(l) = 0.8 − 0.6·exp(−0.3·l), l the 0-based block index
    vit_diff_baseline_<size>  the same layout with ordinary attention (the CLIP baseline)
`diff_vit_base_patch16_224`, the official DiffCLIP code's name, is `vit_diff_base_patch16_224`
(a timm deprecation alias: it builds the model with a warning and is not listed as a model of its own).

Pretrained tags (`vit_diff_base_patch16_224.diffclip_cc3m`, `.diffclip_cc12m`): DiffCLIP's vision
towers, `checkpoint_best.pt` of the official hub repos, read safely (`diffzoo.checkpoint`) and
filtered to the trunk; the head is the image projection (512 outputs, zero bias), so `num_classes=0`
gives the trunk's features and any other `num_classes` a new head. `pretrained_cfg_overlay=
dict(file=…)` reads a local copy in the official, the open_clip (diffzoo.convert) or this layout.
`create_model(…, checkpoint_path=…)` takes the same files (`diffzoo.models.seams` gives timm's load its
filter): a head that does not fit `num_classes` is replaced by a new one, with a warning naming both
(timm itself loads `checkpoint_path=` strictly, to resume). `model.load_state_dict` stays strict: a
checkpoint with another head or in another layout is refused with a message naming these routes.

Differential models have half the baseline's heads (B/16: 12 → 6 heads of q/k 64, v 128). ViT-Ti's
3 heads cannot be halved, so tiny keeps 3 differential heads (q/k 32, v 64). `micro_patch8_64` is a
64 px, 4-block model for CPU tests and the demo.

Each entrypoint spells its geometry, as timm's do, over `_create_vit_diff` or `_create_baseline`. The
differential models also take `lambda_init` (float or "depth") and `variant` ("split", "duplicate", "v2")
besides timm's usual kwargs; the baseline models refuse both, naming their differential twins.

DiffCLIP* counts l from 0 (λ_init 0.2 in the first block): the DiffCLIP paper writes
λ_init = 0.8 − 0.6·exp(−0.3·l) without saying where l starts, and 0 is where the Differential
Transformer's code (unilm), timm's DiffAttention and transformers' DiffLlama start it.
"""
from functools import partial
from typing import Any, Dict

import timm
import torch
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import LayerNorm
from timm.models import (build_model_with_cfg, generate_default_cfgs, register_model, register_model_deprecations,
                         resolve_pretrained_cfg)
from timm.models.vision_transformer import VisionTransformer, checkpoint_filter_fn
from torch import nn

from diffzoo.checkpoint import (SAFE_GLOBALS, first_keys, is_official_diffclip, model_state_dict,
                                official_diffclip_to_open_clip)
from diffzoo.layers import diff_attn_layer

TRUNK = 'visual.trunk.'  # open_clip's prefix of a timm vision trunk
DIFFCLIP_LAYOUT = dict(  # every model's here, differential or baseline
    class_token=True, global_pool='token', pre_norm=False, qkv_bias=True, proj_bias=True,
    mlp_ratio=4., norm_layer=partial(LayerNorm, eps=1e-5),
)
DIFFERENTIAL_ONLY = ('lambda_init', 'variant')  # what the baseline models refuse


def _create_vit_diff(model_name: str, pretrained: bool = False, *, lambda_init, variant: str = 'split',
                     **kwargs) -> VisionTransformer:
    """A differential model: timm's ViT with `attn_layer=` the `DifferentialAttention` class of `variant` and
    `lambda_init` (or the caller's own `attn_layer`)."""
    kwargs.setdefault('attn_layer', diff_attn_layer(variant, lambda_init))
    embed_dim, num_heads = kwargs['embed_dim'], kwargs['num_heads']
    if embed_dim % (2 * num_heads):
        raise ValueError(
            f'{model_name}: num_heads={num_heads} differential heads cannot split '
            f'embed_dim={embed_dim} into q/k halves; pick num_heads dividing {embed_dim // 2}')
    return _create(model_name, pretrained, **kwargs)


def _create_baseline(model_name: str, pretrained: bool = False, **kwargs) -> VisionTransformer:
    """A baseline model: timm's ViT with its own attention, in the differential models' layout."""
    refused = [k for k in DIFFERENTIAL_ONLY if k in kwargs]
    if refused:
        twins = [model_name.replace('vit_diff_baseline_', f'vit_diff_{family}') for family in ('', 'dynamic_')]
        raise ValueError(
            f'{model_name} has ordinary attention and takes no {" or ".join(refused)}: leave '
            f'{"it" if len(refused) == 1 else "them"} out, or build a differential model ({", ".join(twins)})')
    return _create(model_name, pretrained, **kwargs)


def _create(model_name: str, pretrained: bool, **kwargs) -> VisionTransformer:
    if pretrained and not _has_weights(resolve_pretrained_cfg(model_name, kwargs.get('pretrained_cfg'),
                                                              kwargs.get('pretrained_cfg_overlay'))):
        tags = ', '.join(timm.list_pretrained('vit_diff*')) or 'none'
        raise ValueError(
            f'{model_name} has no pretrained weights; tagged ones: {tags}. Or pass '
            f"pretrained_cfg_overlay=dict(file='checkpoint.pt') (official DiffCLIP, open_clip or timm layout); "
            f"open_clip: open_clip.create_model('diffclip-b16', pretrained='cc3m')")
    out_indices = kwargs.pop('out_indices', 3)
    with torch.serialization.safe_globals(SAFE_GLOBALS):  # official DiffCLIP pickles hold argparse/numpy globals
        model = build_model_with_cfg(
            VisionTransformer,
            model_name,
            pretrained=pretrained,
            pretrained_filter_fn=diffclip_filter_fn,
            feature_cfg=dict(out_indices=out_indices, feature_cls='getter'),
            **{**DIFFCLIP_LAYOUT, **kwargs},
        )
    if isinstance(model, VisionTransformer):  # features_only models are wrapped; their keys are not timm's
        model.register_load_state_dict_pre_hook(refuse_foreign_checkpoint)
    return model


def _has_weights(cfg) -> bool:
    """Whether a resolved pretrained cfg names weights to load."""
    return any(getattr(cfg, k, None) for k in ('url', 'hf_hub_id', 'file', 'state_dict'))


def diffclip_filter_fn(state_dict: Dict[str, Any], model: VisionTransformer) -> Dict[str, Any]:
    """A timm state dict for `model` from an official DiffCLIP checkpoint, diffzoo's open_clip state dict
    (the trunk, its projection as the head) or a timm one (timm's own filter)."""
    state_dict = model_state_dict(state_dict)  # a hub download arrives as the whole checkpoint
    if is_official_diffclip(state_dict):
        state_dict = official_diffclip_to_open_clip(state_dict)
    if any(k.startswith(TRUNK) for k in state_dict):
        trunk = {k[len(TRUNK):]: v for k, v in state_dict.items() if k.startswith(TRUNK)}
        projection = state_dict.get('visual.head.proj.weight')
        if projection is not None:  # (embed, width): the head maps the pooled token to CLIP's embedding
            trunk['head.weight'] = projection
            trunk['head.bias'] = state_dict.get('visual.head.proj.bias', projection.new_zeros(projection.shape[0]))
        return trunk
    return checkpoint_filter_fn(state_dict, model)


def refuse_foreign_checkpoint(model: VisionTransformer, state_dict, prefix: str, local_metadata, strict: bool,
                              missing_keys, unexpected_keys, error_msgs) -> None:
    """`load_state_dict` pre-hook: the model's own state dict loads as it is; a checkpoint with another head,
    or in the official / open_clip layout, is refused naming the routes that convert it and give a new
    head (`checkpoint_path=`, or `pretrained=True, pretrained_cfg_overlay=dict(file=…)`), instead of torch's
    size mismatch or key lists."""
    if prefix:
        return  # a part of another model (open_clip's visual.trunk): its keys are that model's business
    name = model.pretrained_cfg.get('architecture', type(model).__name__)
    num_classes = model.num_classes
    route = (f"timm.create_model('{name}', num_classes={num_classes}, checkpoint_path=CHECKPOINT) or "
             f"pretrained=True, pretrained_cfg_overlay=dict(file=CHECKPOINT)")
    official = is_official_diffclip(state_dict)
    if official or any(k.startswith(TRUNK) for k in state_dict):
        layout = 'official DiffCLIP' if official else "open_clip ('visual.trunk.*')"
        raise RuntimeError(
            f'{name}: the checkpoint is in the {layout} layout (keys {first_keys(state_dict)}), '
            f"not this model's timm state dict, which load_state_dict loads as it is. "
            f'Load it with {route}: the tower is converted and the head is new (to keep the image '
            f"projection as the head, pass num_classes=<the projection's width>)")
    head = state_dict.get('head.weight')
    has_head = isinstance(model.head, nn.Linear)
    saved = head.shape[0] if head is not None else 0  # (num_classes, embed_dim) or no head
    if (head is not None and has_head and head.shape != model.head.weight.shape) or (strict and saved != num_classes):
        shape = f' (head.weight {tuple(head.shape)})' if head is not None else ''
        want = (f'to fine-tune the checkpoint with a new {num_classes}-class head' if num_classes else
                "to take the checkpoint's trunk without a head")
        raise RuntimeError(
            f"{name}: the checkpoint's head has {saved} classes{shape}, this model num_classes={num_classes}. "
            f'load_state_dict loads the same model (to resume or evaluate it): build it with num_classes={saved}; '
            f'{want}, use {route}')


def _cfg(input_size=(3, 224, 224), **kwargs) -> Dict[str, Any]:
    return {
        'url': '', 'num_classes': 1000, 'input_size': input_size, 'pool_size': None,
        'crop_pct': 1.0, 'interpolation': 'bilinear', 'fixed_input_size': True,
        'mean': IMAGENET_DEFAULT_MEAN, 'std': IMAGENET_DEFAULT_STD,
        'first_conv': 'patch_embed.proj', 'classifier': 'head', 'license': 'apache-2.0', **kwargs,
    }


def _diffclip_tag(repo: str) -> Dict[str, Any]:
    """DiffCLIP's vision tower on the hub: the official checkpoint, its projection as a 512-class head."""
    return _cfg(hf_hub_id=repo, hf_hub_filename='checkpoint_best.pt', num_classes=512,
                notes=('DiffCLIP (Hammoud & Ghanem, TMLR 2025) vision tower; SLIP-style preprocessing',))


default_cfgs = generate_default_cfgs({
    'vit_diff_micro_patch8_64': _cfg(input_size=(3, 64, 64)),
    'vit_diff_tiny_patch16_224': _cfg(),
    'vit_diff_small_patch16_224': _cfg(),
    'vit_diff_base_patch16_224.diffclip_cc3m': _diffclip_tag('hammh0a/DiffCLIP_ViTB16_CC3M'),
    'vit_diff_base_patch16_224.diffclip_cc12m': _diffclip_tag('hammh0a/DiffCLIP_ViTB16_CC12M'),
    'vit_diff_base_patch32_224': _cfg(),
    'vit_diff_large_patch14_224': _cfg(),
    'vit_diff_dynamic_micro_patch8_64': _cfg(input_size=(3, 64, 64)),
    'vit_diff_dynamic_tiny_patch16_224': _cfg(),
    'vit_diff_dynamic_small_patch16_224': _cfg(),
    'vit_diff_dynamic_base_patch16_224': _cfg(),
    'vit_diff_dynamic_base_patch32_224': _cfg(),
    'vit_diff_dynamic_large_patch14_224': _cfg(),
    'vit_diff_baseline_micro_patch8_64': _cfg(input_size=(3, 64, 64)),
    'vit_diff_baseline_tiny_patch16_224': _cfg(),
    'vit_diff_baseline_small_patch16_224': _cfg(),
    'vit_diff_baseline_base_patch16_224': _cfg(),
    'vit_diff_baseline_base_patch32_224': _cfg(),
    'vit_diff_baseline_large_patch14_224': _cfg(),
})
MODEL_NAMES = frozenset(default_cfgs)  # the architectures registered here


@register_model
def vit_diff_micro_patch8_64(pretrained: bool = False, **kwargs) -> VisionTransformer:
    """A 64 px, 4-block ViT for CPU runs, 2 differential heads (q/k 32, v 64), λ_init 0.8 in every block (DiffCLIP)."""
    model_args = dict(img_size=64, patch_size=8, embed_dim=128, depth=4, num_heads=2, lambda_init=0.8)
    return _create_vit_diff('vit_diff_micro_patch8_64', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def vit_diff_tiny_patch16_224(pretrained: bool = False, **kwargs) -> VisionTransformer:
    """ViT-Ti/16, 3 differential heads (q/k 32, v 64), λ_init 0.8 in every block (DiffCLIP)."""
    model_args = dict(patch_size=16, embed_dim=192, depth=12, num_heads=3, lambda_init=0.8)
    return _create_vit_diff('vit_diff_tiny_patch16_224', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def vit_diff_small_patch16_224(pretrained: bool = False, **kwargs) -> VisionTransformer:
    """ViT-S/16, 3 differential heads (q/k 64, v 128), λ_init 0.8 in every block (DiffCLIP)."""
    model_args = dict(patch_size=16, embed_dim=384, depth=12, num_heads=3, lambda_init=0.8)
    return _create_vit_diff('vit_diff_small_patch16_224', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def vit_diff_base_patch16_224(pretrained: bool = False, **kwargs) -> VisionTransformer:
    """DiffCLIP's ViT-B/16 vision tower: 6 differential heads (q/k 64, v 128), λ_init 0.8 in every block."""
    model_args = dict(patch_size=16, embed_dim=768, depth=12, num_heads=6, lambda_init=0.8)
    return _create_vit_diff('vit_diff_base_patch16_224', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def vit_diff_base_patch32_224(pretrained: bool = False, **kwargs) -> VisionTransformer:
    """ViT-B/32, 6 differential heads (q/k 64, v 128), λ_init 0.8 in every block (DiffCLIP)."""
    model_args = dict(patch_size=32, embed_dim=768, depth=12, num_heads=6, lambda_init=0.8)
    return _create_vit_diff('vit_diff_base_patch32_224', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def vit_diff_large_patch14_224(pretrained: bool = False, **kwargs) -> VisionTransformer:
    """ViT-L/14, 8 differential heads (q/k 64, v 128), λ_init 0.8 in every block (DiffCLIP)."""
    model_args = dict(patch_size=14, embed_dim=1024, depth=24, num_heads=8, lambda_init=0.8)
    return _create_vit_diff('vit_diff_large_patch14_224', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def vit_diff_dynamic_micro_patch8_64(pretrained: bool = False, **kwargs) -> VisionTransformer:
    """A 64 px, 4-block ViT for CPU runs, 2 differential heads (q/k 32, v 64), λ_init by depth (DiffCLIP*)."""
    model_args = dict(img_size=64, patch_size=8, embed_dim=128, depth=4, num_heads=2, lambda_init='depth')
    return _create_vit_diff('vit_diff_dynamic_micro_patch8_64', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def vit_diff_dynamic_tiny_patch16_224(pretrained: bool = False, **kwargs) -> VisionTransformer:
    """ViT-Ti/16, 3 differential heads (q/k 32, v 64), λ_init by depth (DiffCLIP*)."""
    model_args = dict(patch_size=16, embed_dim=192, depth=12, num_heads=3, lambda_init='depth')
    return _create_vit_diff('vit_diff_dynamic_tiny_patch16_224', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def vit_diff_dynamic_small_patch16_224(pretrained: bool = False, **kwargs) -> VisionTransformer:
    """ViT-S/16, 3 differential heads (q/k 64, v 128), λ_init by depth (DiffCLIP*)."""
    model_args = dict(patch_size=16, embed_dim=384, depth=12, num_heads=3, lambda_init='depth')
    return _create_vit_diff('vit_diff_dynamic_small_patch16_224', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def vit_diff_dynamic_base_patch16_224(pretrained: bool = False, **kwargs) -> VisionTransformer:
    """ViT-B/16, 6 differential heads (q/k 64, v 128), λ_init by depth (DiffCLIP*)."""
    model_args = dict(patch_size=16, embed_dim=768, depth=12, num_heads=6, lambda_init='depth')
    return _create_vit_diff('vit_diff_dynamic_base_patch16_224', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def vit_diff_dynamic_base_patch32_224(pretrained: bool = False, **kwargs) -> VisionTransformer:
    """ViT-B/32, 6 differential heads (q/k 64, v 128), λ_init by depth (DiffCLIP*)."""
    model_args = dict(patch_size=32, embed_dim=768, depth=12, num_heads=6, lambda_init='depth')
    return _create_vit_diff('vit_diff_dynamic_base_patch32_224', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def vit_diff_dynamic_large_patch14_224(pretrained: bool = False, **kwargs) -> VisionTransformer:
    """ViT-L/14, 8 differential heads (q/k 64, v 128), λ_init by depth (DiffCLIP*)."""
    model_args = dict(patch_size=14, embed_dim=1024, depth=24, num_heads=8, lambda_init='depth')
    return _create_vit_diff('vit_diff_dynamic_large_patch14_224', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def vit_diff_baseline_micro_patch8_64(pretrained: bool = False, **kwargs) -> VisionTransformer:
    """A 64 px, 4-block ViT for CPU runs, ordinary attention (4 heads): the CLIP baseline's tower."""
    model_args = dict(img_size=64, patch_size=8, embed_dim=128, depth=4, num_heads=4)
    return _create_baseline('vit_diff_baseline_micro_patch8_64', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def vit_diff_baseline_tiny_patch16_224(pretrained: bool = False, **kwargs) -> VisionTransformer:
    """ViT-Ti/16, ordinary attention (3 heads): the CLIP baseline's tower."""
    model_args = dict(patch_size=16, embed_dim=192, depth=12, num_heads=3)
    return _create_baseline('vit_diff_baseline_tiny_patch16_224', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def vit_diff_baseline_small_patch16_224(pretrained: bool = False, **kwargs) -> VisionTransformer:
    """ViT-S/16, ordinary attention (6 heads): the CLIP baseline's tower."""
    model_args = dict(patch_size=16, embed_dim=384, depth=12, num_heads=6)
    return _create_baseline('vit_diff_baseline_small_patch16_224', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def vit_diff_baseline_base_patch16_224(pretrained: bool = False, **kwargs) -> VisionTransformer:
    """ViT-B/16, ordinary attention (12 heads): the CLIP baseline's tower."""
    model_args = dict(patch_size=16, embed_dim=768, depth=12, num_heads=12)
    return _create_baseline('vit_diff_baseline_base_patch16_224', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def vit_diff_baseline_base_patch32_224(pretrained: bool = False, **kwargs) -> VisionTransformer:
    """ViT-B/32, ordinary attention (12 heads): the CLIP baseline's tower."""
    model_args = dict(patch_size=32, embed_dim=768, depth=12, num_heads=12)
    return _create_baseline('vit_diff_baseline_base_patch32_224', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def vit_diff_baseline_large_patch14_224(pretrained: bool = False, **kwargs) -> VisionTransformer:
    """ViT-L/14, ordinary attention (16 heads): the CLIP baseline's tower."""
    model_args = dict(patch_size=14, embed_dim=1024, depth=24, num_heads=16)
    return _create_baseline('vit_diff_baseline_large_patch14_224', pretrained=pretrained, **dict(model_args, **kwargs))


register_model_deprecations(__name__, {'diff_vit_base_patch16_224': 'vit_diff_base_patch16_224'})  # DiffCLIP's name
