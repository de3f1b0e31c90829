"""The `diffzoo_differential` model type: transformers' Auto classes reload differential decoders.

`differentialize(model, ...)` gives `model.config` the class `Differential<Config>`, a subclass of its
own config class (`DifferentialLlamaConfig(LlamaConfig)`, …) that runs exactly as the base one
(`config.model_type` stays "llama", so transformers' and peft's per-model tables still apply) and saves
as the model type of ours:

    "model_type": "diffzoo_differential",
    "diffzoo_base_model_type": "llama",
    "diffzoo_differential": {"variant": …, "lambda_init": …, "layers": […], "mlp": …},
    "auto_map": {"AutoConfig": "diffzoo_config.DifferentialConfig"}

next to `diffzoo_config.py`, a module of one import (`CODE`). Reloading:

- `import diffzoo` (before or after transformers) registers `diffzoo_differential` with AutoConfig
  (`diffzoo.vlm.hf_auto.DifferentialConfig`, where the model classes live). Its `from_dict` builds the
  base config's differential subclass (here) and registers, with every Auto model class that maps the
  base config (AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText, …), the base model class
  made differential in `__init__`, so λ and the sub-norm load as ordinary weights: no missing or
  unexpected keys.
- Without diffzoo imported, transformers does not know the model type, sees `auto_map` and refuses
  without `trust_remote_code=True`; with it, it runs `diffzoo_config.py`, whose import of diffzoo
  registers everything (where diffzoo is not installed, transformers names it as the missing package).
  Either way a differential checkpoint does not load as a plain model through the Auto classes. A
  concrete class (`LlamaForCausalLM.from_pretrained`) is transformers' own path: it warns that the
  model type differs and drops λ and the sub-norm; use the Auto classes or `diffzoo.vlm.load_differential`.

This module is the config side only (transformers' configuration classes): `differentialize` marks
configs with it, and `diffzoo.vlm.hf_auto` builds on it.
"""
import functools
from pathlib import Path

from transformers import PretrainedConfig

from diffzoo.classes import module_class

MODEL_TYPE = 'diffzoo_differential'
BASE_KEY = 'diffzoo_base_model_type'
SETTINGS_KEY = 'diffzoo_differential'  # differentialize's settings, on the decoder's (text) config
CODE_FILE = 'diffzoo_config.py'
CODE = ('"""Differential attention (diffzoo): `pip install diffzoo`, then `import diffzoo` before loading, or load\n'
        'with trust_remote_code=True, which runs this import."""\n'
        'from diffzoo.vlm.hf_auto import DifferentialConfig  # noqa: F401\n')
AUTO_CONFIG_REF = f'{Path(CODE_FILE).stem}.DifferentialConfig'


class DifferentialConfigMixin:
    """Saves a transformers config as the `diffzoo_differential` model type (module docstring)."""

    base_config_class = None  # the transformers config class this one extends
    model_classes = None  # {architecture name: differential model class}, filled by diffzoo.vlm.hf_auto

    def to_diff_dict(self):
        out = super().to_diff_dict()
        out[BASE_KEY] = out.get('model_type') or self.model_type
        out['model_type'] = MODEL_TYPE
        out['auto_map'] = {**(out.get('auto_map') or {}), 'AutoConfig': AUTO_CONFIG_REF}
        return out

    def save_pretrained(self, save_directory, push_to_hub: bool = False, **kwargs):
        super().save_pretrained(save_directory, push_to_hub=push_to_hub, **kwargs)
        (Path(save_directory) / CODE_FILE).write_text(CODE)

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        return super().from_dict(_base_dict(config_dict), **kwargs)


def _base_dict(config_dict: dict) -> dict:
    """A saved `diffzoo_differential` config as its base model type's dict (unchanged if it is one)."""
    config_dict = dict(config_dict)
    if config_dict.get('model_type') == MODEL_TYPE:
        config_dict['model_type'] = config_dict.pop(BASE_KEY, None)
    config_dict.pop(BASE_KEY, None)
    auto_map = {k: v for k, v in (config_dict.pop('auto_map', None) or {}).items() if v != AUTO_CONFIG_REF}
    if auto_map:
        config_dict['auto_map'] = auto_map
    return config_dict


@functools.lru_cache(maxsize=None)
def differential_config_class(base: type) -> type:
    """`Differential<base>`: `base` saved as the `diffzoo_differential` model type."""
    if issubclass(base, DifferentialConfigMixin):
        return base
    name = f'Differential{base.__name__}'
    return module_class(__name__, name, (DifferentialConfigMixin, base), {'base_config_class': base})


def mark_differential(model) -> None:
    """Give `model.config` its `Differential<Config>` class (called by `differentialize`)."""
    config = getattr(model, 'config', None)
    if isinstance(config, PretrainedConfig) and not isinstance(config, DifferentialConfigMixin):
        config.__class__ = differential_config_class(type(config))


def saved_settings(settings: dict) -> dict:
    """`differentialize` keywords from saved settings: those saved before `head_pairing` existed
    (variant "split", no pairing recorded) ran adjacent pairs, and reload that way."""
    if settings.get('variant') == 'split' and 'head_pairing' not in settings:
        return {**settings, 'head_pairing': 'adjacent'}
    return settings
