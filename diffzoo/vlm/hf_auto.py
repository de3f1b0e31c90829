"""The `diffzoo_differential` model type in transformers' Auto classes (formats: `diffzoo.vlm.hf_config`).

`register()` (run by `import diffzoo` where transformers is installed) gives AutoConfig the entry
`DifferentialConfig`. Reading a saved differential config through it builds the base config's
`Differential<Config>` and registers, through transformers' own `Auto*.register`, with every Auto
model class that maps `<Config>` (AutoModel → LlamaModel, AutoModelForCausalLM → LlamaForCausalLM,
…) `Differential<Model>`: that transformers class with `differentialize(self, **settings)` at the
end of `__init__`, the settings being the saved `diffzoo_differential` entry of the (text) config.
Its parameters are the saved model's, names included, so `from_pretrained` loads λ and the sub-norm
as ordinary weights.
"""
import functools

from transformers import AutoConfig, PretrainedConfig
from transformers.models.auto import modeling_auto
from transformers.models.auto.auto_factory import _BaseAutoModelClass
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from diffzoo.classes import module_class

from .hf_config import (BASE_KEY, MODEL_TYPE, SETTINGS_KEY, DifferentialConfigMixin, differential_config_class,
                        saved_settings)


class DifferentialConfig(PretrainedConfig):
    """AutoConfig's entry for `diffzoo_differential`: `from_dict` returns the base model type's
    differential config (`Differential<Config>`) and registers its model classes."""

    model_type = MODEL_TYPE

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        base = config_dict.get(BASE_KEY)
        if base not in CONFIG_MAPPING:
            raise ValueError(f'config model_type "{MODEL_TYPE}" with {BASE_KEY}={base!r}: expected a transformers '
                             f'model type (e.g. "llama"); the config.json was edited or written by another tool')
        config_class = differential_config_class(CONFIG_MAPPING[base])
        register_models(config_class)
        return config_class.from_dict(config_dict, **kwargs)


def register() -> None:
    """Register `diffzoo_differential` with AutoConfig (idempotent; `import diffzoo` does it)."""
    AutoConfig.register(MODEL_TYPE, DifferentialConfig, exist_ok=True)


def differential_settings(config) -> dict:
    """The `differentialize` keywords a differential config records (`saved_settings`: split without a
    recorded pairing is adjacent)."""
    settings = getattr(config.get_text_config(), SETTINGS_KEY, None) or getattr(config, SETTINGS_KEY, None)
    if not settings:
        raise ValueError(f'{type(config).__name__}: no "{SETTINGS_KEY}" settings; a differential config records '
                         f'them when differentialize() is called; load the checkpoint it was saved with')
    return saved_settings(settings)


@functools.lru_cache(maxsize=None)
def differential_model_class(model_class: type, config_class: type) -> type:
    """`Differential<model_class>`: `model_class`, made differential as its config records."""
    def __init__(self, config, *args, **kwargs):
        # imported on the first differential model built: the modelling side (torch modules, timm) costs
        # seconds that `import transformers` after `import diffzoo` would otherwise pay for every user
        from .differential import differentialize
        model_class.__init__(self, config, *args, **kwargs)
        differentialize(self, **differential_settings(config))

    name = f'Differential{model_class.__name__}'
    return module_class(__name__, name, (model_class,), {'__init__': __init__, 'config_class': config_class})


def _auto_model_classes():
    return [c for c in vars(modeling_auto).values()
            if isinstance(c, type) and issubclass(c, _BaseAutoModelClass) and c._model_mapping is not None]


def register_models(config_class: type) -> None:
    """Register `Differential<Model>` for `config_class` with every Auto model class mapping its base config."""
    if not issubclass(config_class, DifferentialConfigMixin):
        raise TypeError(f'{config_class.__name__} is not a differential config class (diffzoo.vlm.hf_config)')
    base = config_class.base_config_class
    classes = dict(config_class.model_classes or {})
    for auto in _auto_model_classes():
        if base not in auto._model_mapping:
            continue
        models = auto._model_mapping[base]
        several = isinstance(models, (list, tuple))
        differential = tuple(differential_model_class(m, config_class) for m in (models if several else [models]))
        auto.register(config_class, differential if several else differential[0], exist_ok=True)
        for plain, diff in zip(models if several else [models], differential):
            classes.update({plain.__name__: diff, diff.__name__: diff})
    config_class.model_classes = classes
