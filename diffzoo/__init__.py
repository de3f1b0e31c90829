"""diffzoo: differential-attention models inside timm and open_clip.

Importing diffzoo registers its models, as importing timm registers timm's:

- `diffzoo.models`: timm's `vit_diff_*` names (`@register_model`);
- `diffzoo.clip`: open_clip's `diffclip-*` and `clip-*-baseline` configs, DiffCLIP's pretrained tags and the
  builders of their towers (`diffzoo.clip.seams`);
- `diffzoo.vlm.hf_auto`: the `diffzoo_differential` model type of saved differential decoders in transformers'
  AutoConfig, where transformers is installed (the `vlm` extra; open_clip imports it when it is there).
"""
import importlib.util

from . import clip, models
from .differential import differentialize
from .layers import DifferentialAttention, capture_attention_maps, diff_attn_layer

__version__ = '0.1.0'
__all__ = ['DifferentialAttention', 'capture_attention_maps', 'diff_attn_layer', 'differentialize', 'layers', 'models',
           '__version__']

clip.install()
if importlib.util.find_spec('transformers') is not None:
    from .vlm import hf_auto
    hf_auto.register()
