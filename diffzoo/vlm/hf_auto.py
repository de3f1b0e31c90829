"""Model classes of the `diffzoo_differential` model type (`diffzoo.hf_config`).

For a differential config class `Differential<Config>` and each Auto model class that maps `<Config>`
(AutoModel → LlamaModel, AutoModelForCausalLM → LlamaForCausalLM, …), `Differential<Model>` is that
transformers class with `differentialize(self, **settings)` at the end of `__init__`, the settings
being the saved `diffzoo_differential` entry of the (text) config. Its parameters are the saved
model's, names included, so `from_pretrained` loads λ and the sub-norm as ordinary weights.
"""
import functools

from transformers.models.auto import modeling_auto
from transformers.models.auto.auto_factory import _BaseAutoModelClass

from diffzoo.hf_config import SETTINGS_KEY, DifferentialConfigMixin

from .differential import differentialize, saved_settings


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
        model_class.__init__(self, config, *args, **kwargs)
        differentialize(self, **differential_settings(config))

    name = f'Differential{model_class.__name__}'
    cls = type(name, (model_class,), {'__module__': __name__, '__qualname__': name, '__init__': __init__,
                                      'config_class': config_class})
    globals()[name] = cls  # so pickle finds it in this process
    return cls


def _auto_model_classes():
    return [c for c in vars(modeling_auto).values()
            if isinstance(c, type) and issubclass(c, _BaseAutoModelClass) and c._model_mapping is not None]


def register_models(config_class: type) -> None:
    """Register `Differential<Model>` for `config_class` with every Auto model class mapping its base config."""
    if not issubclass(config_class, DifferentialConfigMixin):
        raise TypeError(f'{config_class.__name__} is not a differential config class (diffzoo.hf_config)')
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
