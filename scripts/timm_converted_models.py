"""Converted timm models under timm names, for running timm's own tests/test_models.py on them.

timm's tests take registered model names, and `diffzoo.differentialize` converts a model after timm built
it; importing this module registers one entrypoint per (family, variant) that builds the timm model and
converts it: `<timm name>_diffzoo_<variant>` for ViT (vit_small_patch16_224), DeiT
(deit_small_distilled_patch16_224), SigLIP (vit_base_patch16_siglip_224) and EVA. timm registers EVA-01's
layout (fused qkv with q and v biases, no RoPE) only as the 1B-parameter eva_giant_patch14_224, so
`eva_small_patch14_224_diffzoo_*` builds that architecture at ViT-S width (384, 6 heads, depth 12).
Each keeps its source's pretrained configuration without weights (nothing is downloaded). Test-only: a
user converts with `diffzoo.differentialize(timm.create_model(name, pretrained=True))`.
"""
import sys

import timm
from timm.models import generate_default_cfgs, register_model

import diffzoo

# name -> (the timm model built, whose configuration it keeps; keyword arguments for timm.create_model)
SOURCES = {
    'vit_small_patch16_224': ('vit_small_patch16_224', {}),
    'deit_small_distilled_patch16_224': ('deit_small_distilled_patch16_224', {}),
    'vit_base_patch16_siglip_224': ('vit_base_patch16_siglip_224', {}),
    'eva_small_patch14_224': ('eva_giant_patch14_224', dict(embed_dim=384, depth=12, num_heads=6, mlp_ratio=4.0)),
}
VARIANTS = ('duplicate', 'split', 'v2')
NAMES = [f'{name}_diffzoo_{variant}' for name in SOURCES for variant in VARIANTS]


def _config(source_cfg: str) -> dict:
    cfg = timm.get_pretrained_cfg(source_cfg).to_dict()
    for key in ('hf_hub_id', 'hf_hub_filename', 'url', 'file', 'state_dict', 'architecture', 'tag'):
        cfg.pop(key, None)
    return cfg


default_cfgs = generate_default_cfgs({n: _config(SOURCES[n.rsplit('_diffzoo_', 1)[0]][0]) for n in NAMES})


def _entrypoint(model_name: str, source: str, build: dict, variant: str):
    def entrypoint(pretrained: bool = False, **kwargs):
        if pretrained:
            raise ValueError(f'{model_name}: registered for timm\'s tests without weights; convert a pretrained model '
                             f'with diffzoo.differentialize(timm.create_model({source!r}, pretrained=True))')
        return diffzoo.differentialize(timm.create_model(source, pretrained=False, **{**build, **kwargs}),
                                       variant=variant)
    entrypoint.__name__ = entrypoint.__qualname__ = model_name
    entrypoint.__module__ = __name__
    return entrypoint


for _name, (_source, _build) in SOURCES.items():
    for _variant in VARIANTS:
        _model = f'{_name}_diffzoo_{_variant}'
        setattr(sys.modules[__name__], _model, register_model(_entrypoint(_model, _source, _build, _variant)))
