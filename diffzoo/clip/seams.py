"""Every place diffzoo reaches into open_clip, in one module: the table `SEAMS` (`diffzoo.seam`), applied for
the process by `install()` (idempotent; `import diffzoo` calls it) and undone by `uninstall()`.

open_clip 3.3 offers public hooks for configs only (`add_model_config`). The rest are narrow
wrappers around module-level functions and its pretrained registry, all checked before any is replaced,
so that a change in open_clip's internals fails here, by name, instead of somewhere deep in a forward pass:

- `open_clip.model._build_text_tower` (and CoCa's own reference to it): a `text_cfg` holding a
  `diffzoo` key ({"variant": …, "lambda_init": …}) builds `DiffTextTransformer` through open_clip's own
  builder, from the whole `CLIPTextCfg`, with `open_clip.model.TextTransformer` bound to it for that one
  call (`differential_text_transformer`); with `"convert": true` it builds open_clip's own tower and
  converts it (`diffzoo.differentialize`, its settings in the key); anything else goes to open_clip unchanged.
- `open_clip.model._build_vision_tower` (and CoCa's reference): a `vision_cfg` holding a `diffzoo` key
  builds open_clip's tower (native or timm) and converts it with `diffzoo.differentialize`.
- `create_model(name, …, diffzoo={"vision": {…}, "text": {…}})`: those keys put into the named config.
- `open_clip.factory.load_state_dict`: reads pickles with `weights_only=True` plus the globals
  official DiffCLIP files need, and converts the official DiffCLIP layout to open_clip keys.
- `open_clip.factory.load_checkpoint`: a converted model's checkpoint (layers saved with their conversion
  settings) converts those blocks of the model first, so it reloads under the plain model name;
  a checkpoint for another architecture fails with the first missing/unexpected keys instead of torch's full
  list; the non-persistent buffers that a scripted model's checkpoint (open_clip_train's `--torchscript`) also
  holds are not unexpected.
- `open_clip.pretrained._PRETRAINED`: DiffCLIP's pretrained tags (`cc3m`, `cc12m`).
- `open_clip.factory.create_model` (and the `open_clip.create_model` it is exported as): a
  checkpoint file gets the preprocessing it was trained with (`diffzoo.checkpoint.preprocess_record`:
  its metadata, or its training run's settings) under any the caller forces; a file with no record
  keeps open_clip's defaults and warns once, naming them; `hf-hub:<an official DiffCLIP repo>`
  (whose repos hold no open_clip config) is read as the matching tag (`diffclip-b16`, `cc3m`).
"""
import contextlib
import contextvars
import functools
import os
import threading
import warnings
from importlib import resources

import open_clip
import open_clip.coca_model
import open_clip.factory
import open_clip.model
import open_clip.pretrained
import torch
from open_clip.model import CLIPTextCfg, set_model_preprocess_cfg
from open_clip.transformer import TextTransformer

from diffzoo import seam
from diffzoo.checkpoint import (
    CheckpointError, first_keys, is_official_diffclip, official_diffclip_to_open_clip, preprocess_record,
    read_state_dict,
)
from diffzoo.differential import SETTINGS, differentialize, prepare_for
from diffzoo.layers.pretrained import RECORD
from diffzoo.seam import LibraryChanged, Seam
from .pretrained import PRETRAINED
from .text_tower import DiffTextTransformer

TESTED_OPEN_CLIP = '3.3.x'
DIFFZOO_KEY = 'diffzoo'


class OpenClipChanged(LibraryChanged):
    library = f'open_clip {open_clip.__version__}'
    tested = f'open_clip_torch {TESTED_OPEN_CLIP}: pip install "open_clip_torch>=3.3,<3.4"'


def _conversion(where: str, settings) -> dict:
    """`differentialize` keywords from a config's `diffzoo` entry (`convert` dropped), unknown keys refused."""
    settings = {k: v for k, v in dict(settings).items() if k != 'convert'}
    unknown = set(settings) - set(SETTINGS)
    if unknown:
        raise ValueError(f'{where}.{DIFFZOO_KEY}: unknown key(s) {sorted(unknown)}; expected some of {SETTINGS}')
    return settings


def _vision_tower_builder(original):
    def _build_vision_tower(embed_dim, vision_cfg, quick_gelu=False, cast_dtype=None):
        pending = _PENDING.get().get('vision')
        if not isinstance(vision_cfg, dict) or (DIFFZOO_KEY not in vision_cfg and pending is None):
            return original(embed_dim, vision_cfg, quick_gelu, cast_dtype)
        vision_cfg = dict(vision_cfg)
        settings = _conversion('vision_cfg', vision_cfg.pop(DIFFZOO_KEY, None) or pending)
        return differentialize(original(embed_dim, vision_cfg, quick_gelu, cast_dtype), **settings)
    return _build_vision_tower


def _text_tower_builder(original):
    def _build_text_tower(embed_dim, text_cfg, quick_gelu=False, cast_dtype=None):
        pending = _PENDING.get().get('text')
        if not isinstance(text_cfg, dict) or (DIFFZOO_KEY not in text_cfg and pending is None):
            return original(embed_dim, text_cfg, quick_gelu, cast_dtype)
        text_cfg = dict(text_cfg)
        diff = dict(text_cfg.pop(DIFFZOO_KEY, None) or {**pending, 'convert': True})
        if diff.get('convert'):  # open_clip's own tower, converted (its pretrained weights carry over)
            settings = _conversion('text_cfg', diff)
            return differentialize(original(embed_dim, text_cfg, quick_gelu, cast_dtype), **settings)
        unknown = set(diff) - {'variant', 'lambda_init', 'convert'}
        if unknown:
            raise ValueError(f'text_cfg.{DIFFZOO_KEY}: unknown key(s) {sorted(unknown)}; expected "variant" and '
                             f'"lambda_init" (DiffCLIP\'s text tower), or "convert": true with {SETTINGS}')
        hf_model_name = CLIPTextCfg(**text_cfg).hf_model_name
        if hf_model_name:
            raise ValueError(f'text_cfg.{DIFFZOO_KEY} applies to open_clip\'s own text transformer, '
                             f'not hf_model_name={hf_model_name!r}')
        with differential_text_transformer(lambda_init=diff.get('lambda_init', 'depth'),
                                           variant=diff.get('variant', 'split')):
            tower = original(embed_dim, text_cfg, quick_gelu, cast_dtype)
        if not isinstance(tower, DiffTextTransformer):
            raise OpenClipChanged(f'open_clip {open_clip.__version__}: open_clip.model._build_text_tower built a '
                                  f'{type(tower).__name__}, not open_clip.model.TextTransformer; diffzoo is tested '
                                  f'with open_clip_torch {TESTED_OPEN_CLIP}')
        return tower
    return _build_text_tower


_TEXT_TOWER_BUILDS = threading.Lock()  # one differential text tower built at a time


@contextlib.contextmanager
def differential_text_transformer(**settings):
    """open_clip's builder, while one `_build_text_tower` call runs, building `DiffTextTransformer` with `settings`
    (variant, lambda_init) where it builds its `TextTransformer`: it then maps the whole `CLIPTextCfg` (every
    field it reads, as it reads it) onto the differential tower. diffzoo's builds take turns (a lock); a plain
    open_clip text tower built by another thread in that moment would be differential too, so build models from
    one thread."""
    row = Seam(open_clip.model, 'TextTransformer', seam.constant(functools.partial(DiffTextTransformer, **settings)),
               'no hook for its text tower\'s class: its builder reads every CLIPTextCfg field into this one',
               holds=lambda original: original is TextTransformer, what='open_clip.transformer.TextTransformer')
    with _TEXT_TOWER_BUILDS, seam.patched([row], OpenClipChanged):
        yield


def _state_dict_loader(original):
    def load_state_dict(checkpoint_path, device='cpu', weights_only=True):
        if not weights_only or str(checkpoint_path).endswith(('.npz', '.npy')):
            return original(checkpoint_path, device=device, weights_only=weights_only)
        state_dict = read_state_dict(checkpoint_path)
        if is_official_diffclip(state_dict):
            state_dict = official_diffclip_to_open_clip(state_dict)
        return {k: v.to(device) for k, v in state_dict.items()}
    return load_state_dict


def _prepared(model, checkpoint_path, device) -> bool:
    """Convert the blocks a converted model's checkpoint holds converted (with its saved settings) that `model`
    does not; True when it converted any."""
    return prepare_for(model, open_clip.factory.load_state_dict(checkpoint_path, device=device)) > 0


def _checkpoint_loader(original):
    def load_checkpoint(model, checkpoint_path, strict=True, weights_only=True, device='cpu'):
        def load():
            return original(model, checkpoint_path, strict=False, weights_only=weights_only, device=device)
        try:
            try:
                result = load()
            except (RuntimeError, AssertionError):  # e.g. v2's wider qkv in a plain model
                if not _prepared(model, checkpoint_path, device):
                    raise
                result = load()
        except (RuntimeError, AssertionError) as e:  # shape mismatches are raised even when not strict
            lines = [ln.strip() for ln in str(e).splitlines() if 'size mismatch' in ln or 'changed' in ln]
            if not lines:
                raise
            raise CheckpointError(
                f'{checkpoint_path} is not a checkpoint for this {type(model).__name__}: '
                f'{"; ".join(lines[:3])}{" …" if len(lines) > 3 else ""}. Pass the model name it was '
                f'trained as') from None
        if result is not None and any(k.endswith('.attn.' + RECORD) for k in result.unexpected_keys) \
                and _prepared(model, checkpoint_path, device):
            result = load()  # a converted model's checkpoint into the plain model
        if strict and result is not None:
            unexpected = [k for k in result.unexpected_keys if k not in unsaved_buffers(model)]
            if result.missing_keys or unexpected:
                raise CheckpointError(
                    f'{checkpoint_path} is not a checkpoint for this {type(model).__name__}: '
                    f'missing keys [{first_keys(result.missing_keys)}], unexpected keys '
                    f'[{first_keys(unexpected)}]. Pass the model name it was trained as')
        return result
    return load_checkpoint


def unsaved_buffers(model: torch.nn.Module) -> set:
    """The buffers `model` holds but leaves out of its state_dict (persistent=False: open_clip's causal `attn_mask`).
    A scripted model's state_dict holds them too (TorchScript keeps no persistent=False), and so do the checkpoints
    open_clip_train writes under --torchscript; their values are the model's own, rebuilt at construction."""
    saved = model.state_dict().keys()
    return {name for name, _ in model.named_buffers() if name not in saved}


HF_HUB = 'hf-hub:'
OFFICIAL_REPOS = {cfg['hf_hub'].rsplit('/', 1)[0]: (name, tag)  # hub repo → (model, tag)
                  for name, tags in PRETRAINED.items() for tag, cfg in tags.items()}
_WARNED = set()


def _apply_preprocess_record(model, pretrained, forced) -> None:
    """The preprocessing a checkpoint file records, under what the caller forced (module docstring)."""
    if not isinstance(pretrained, (str, os.PathLike)) or not os.path.isfile(pretrained):
        return
    forced = dict(forced or {})
    record = preprocess_record(pretrained)
    current = open_clip.get_model_preprocess_cfg(model)
    if record is None:
        assumed = {k: current.get(k) for k in ('mean', 'std', 'interpolation') if k not in forced}
        if assumed and str(pretrained) not in _WARNED:
            _WARNED.add(str(pretrained))
            warnings.warn(
                f'pretrained={pretrained}: no record of the preprocessing it was trained with (no preprocess_cfg '
                f'in its metadata, no training run beside it); assuming {assumed}. Pass image_mean/image_std/'
                f'image_interpolation, or write it with python -m diffzoo.convert, which records them', stacklevel=3)
        return
    set_model_preprocess_cfg(model, {**current, **record, **forced})


# create_model(…, diffzoo={...}): the settings the tower builders read while that call builds its model (open_clip
# replaces a whole vision_cfg / text_cfg passed as a keyword, after its force_* options, so they do not go there)
_PENDING: contextvars.ContextVar = contextvars.ContextVar('diffzoo_pending_conversion', default={})


def pending_conversion(conversion) -> dict:
    """`create_model`'s `diffzoo=` checked: {'vision': settings, 'text': settings} with differentialize's keys."""
    if not isinstance(conversion, dict) or not conversion or not set(conversion) <= {'vision', 'text'}:
        raise ValueError(f'{DIFFZOO_KEY}={conversion!r}: expected {{"vision": {{...}}, "text": {{...}}}} with '
                         f'differentialize\'s settings {SETTINGS} for either tower')
    return {tower: _conversion(f'{DIFFZOO_KEY}.{tower}', settings) for tower, settings in conversion.items()}


def _model_creator(original):
    def create_model(model_name, pretrained=None, *args, **kwargs):
        if isinstance(model_name, str) and model_name.startswith(HF_HUB) and model_name[len(HF_HUB):] in OFFICIAL_REPOS:
            model_name, pretrained = OFFICIAL_REPOS[model_name[len(HF_HUB):]]  # the repo's tag
        if DIFFZOO_KEY in kwargs:
            token = _PENDING.set(pending_conversion(kwargs.pop(DIFFZOO_KEY)))
            try:
                model = original(model_name, pretrained, *args, **kwargs)
            finally:
                _PENDING.reset(token)
        else:
            model = original(model_name, pretrained, *args, **kwargs)
        _apply_preprocess_record(model, pretrained, kwargs.get('force_preprocess_cfg'))
        return model
    return create_model


def register_configs() -> None:
    configs = resources.files('diffzoo') / 'model_configs'
    if str(configs) not in {str(p) for p in open_clip.factory._MODEL_CONFIG_PATHS}:
        open_clip.add_model_config(str(configs))


class _Registry(dict):
    """open_clip's pretrained registry with DiffCLIP's tags, holding open_clip's own (`seam.ORIGINAL`)."""


def _with_diffclip_tags(registry: dict) -> dict:
    registered = _Registry({name: dict(tags) for name, tags in registry.items()})
    for name, tags in PRETRAINED.items():
        registered.setdefault(name, {}).update(tags)
    return seam.standing_in(registered, registry)


TEXT_TOWER = ('embed_dim', 'text_cfg', 'quick_gelu', 'cast_dtype')
VISION_TOWER = ('embed_dim', 'vision_cfg', 'quick_gelu', 'cast_dtype')
_text_tower, _vision_tower = seam.wrapping(_text_tower_builder), seam.wrapping(_vision_tower_builder)
_create_model = seam.wrapping(_model_creator)
SEAMS = (
    Seam(open_clip.model, '_build_text_tower', _text_tower, 'open_clip has no hook for a text tower of its own: a '
         '`text_cfg` with a `diffzoo` key builds the differential one', TEXT_TOWER),
    Seam(open_clip.coca_model, '_build_text_tower', _text_tower, 'CoCa\'s own reference to that builder', TEXT_TOWER),
    Seam(open_clip.model, '_build_vision_tower', _vision_tower, 'open_clip has no hook on a tower it builds: a '
         '`vision_cfg` with a `diffzoo` key gets its tower converted (`diffzoo.differentialize`)', VISION_TOWER),
    Seam(open_clip.coca_model, '_build_vision_tower', _vision_tower, 'CoCa\'s own reference to that builder',
         VISION_TOWER),
    Seam(open_clip.factory, 'load_state_dict', seam.wrapping(_state_dict_loader), 'open_clip reads its own '
         'layout only and refuses official DiffCLIP pickles under weights_only: their globals allowed, keys mapped',
         ('checkpoint_path', 'device', 'weights_only')),
    Seam(open_clip.factory, 'load_checkpoint', seam.wrapping(_checkpoint_loader), 'a converted model\'s checkpoint '
         'does not fit the plain model open_clip builds: its blocks are converted first; another architecture\'s '
         'checkpoint is named in one line', ('model', 'checkpoint_path', 'strict', 'weights_only')),
    Seam(open_clip.factory, 'create_model', _create_model, 'open_clip gives a checkpoint file its default '
         'preprocessing: diffzoo gives the one it was trained with; `diffzoo=` conversions; official DiffCLIP '
         'hf-hub repos (no open_clip config) read as their tags', ('model_name', 'pretrained')),
    Seam(open_clip, 'create_model', _create_model, 'the package\'s own reference to that function',
         ('model_name', 'pretrained')),
    Seam(open_clip.pretrained, '_PRETRAINED', _with_diffclip_tags, 'open_clip has no public hook for pretrained '
         'tags: DiffCLIP\'s `cc3m` and `cc12m` added', holds=lambda registry: isinstance(registry, dict),
         what='the pretrained registry (a dict)'),
)


def install() -> None:
    """Apply `SEAMS` for the process and register diffzoo's configs (idempotent): a changed open_clip fails here,
    by name, before anything is replaced."""
    seam.apply(SEAMS, OpenClipChanged, keep=True)
    register_configs()


def uninstall() -> None:
    """open_clip's own functions and registry back (the config folder stays registered: open_clip has no removal)."""
    seam.restore(SEAMS)
