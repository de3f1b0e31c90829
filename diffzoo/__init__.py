"""diffzoo: differential-attention models inside timm and open_clip.

After `import diffzoo`, timm knows the `vit_diff_*` models, open_clip the `diffclip-*` and
`clip-*-baseline` models with DiffCLIP's pretrained tags (see `diffzoo.clip.seams`), and
transformers' Auto classes the `diffzoo_differential` model type of saved differential decoders
(see `diffzoo.vlm.hf_auto`), whichever of timm, open_clip, transformers and diffzoo was imported first.

`import diffzoo` itself imports none of torch, timm, open_clip or transformers, so a command's
`--help` answers at once. Registration runs when the library it registers with is there:

- the library already imported: at once;
- otherwise right after the library's own import finishes, through a post-import hook (a finder on
  `sys.meta_path` that wraps the loader of `timm`, `open_clip` and `transformers`; it leaves
  `sys.meta_path` once all three are registered; open_clip imports transformers). When a diffzoo
  module is itself importing one of them (its own import not finished), registration waits for the
  outermost diffzoo module importing to finish, since it imports diffzoo modules itself.

The same finder imports wandb just before timm or open_clip, which import it anyway: the import is
slowest after them (diffzoo/_startup.py).

The public names below (`DifferentialAttention`, `capture_attention_maps`, `diff_attn_layer`,
`differentialize` (any timm / open_clip model made differential, `diffzoo.differential`), the
`layers` and `models` packages) are imported on first use (PEP 562).
"""
import importlib.abc
import sys
import threading

from diffzoo._lazy import lazy_exports
from diffzoo._startup import IMPORT_WANDB, import_wandb_first

__version__ = '0.1.0'
__all__ = ['DifferentialAttention', 'capture_attention_maps', 'diff_attn_layer', 'differentialize', 'layers', 'models',
           '__version__']

__getattr__, __dir__ = lazy_exports(__name__, {  # name -> submodule (None: a submodule itself)
    'DifferentialAttention': 'layers', 'capture_attention_maps': 'layers', 'diff_attn_layer': 'layers',
    'differentialize': 'differential',
    'layers': None, 'models': None})

_LIBRARIES = ('timm', 'open_clip', 'transformers')  # in this order: open_clip's diffclip towers are timm models

_lock = threading.RLock()
_registered = set()  # of _LIBRARIES
_importing = 0  # diffzoo modules whose import has begun and not finished (while the hook is installed)
_loading = set()  # of _LIBRARIES: those whose own import has begun and not finished


def _register(library: str) -> None:
    """Register diffzoo's models with `library` ('timm', 'open_clip' or 'transformers'); idempotent."""
    with _lock:
        if library in _registered:
            return
        if library == 'transformers':
            from .vlm.hf_auto import register  # AutoConfig's entry: transformers' configuration and Auto classes
            register()
        elif library == 'open_clip':
            _register('timm')
            from .clip import install  # imports open_clip, after it finished importing
            install()
        else:
            from . import models  # noqa: F401  @register_model of every vit_diff_* name
        _registered.add(library)
        if _registered == set(_LIBRARIES):
            _remove_hook()


def _register_ready() -> None:
    """Register with each library imported so far, unless a diffzoo module is still importing."""
    if _importing:
        return
    for library in _LIBRARIES:
        if library in sys.modules and library not in _loading:
            _register(library)


class _LoaderAfter:
    """A module's own loader, running `_register_ready` after the module's code; every other loader
    method is the original's. The module keeps the original loader once loaded."""

    def __init__(self, loader, name: str):
        self._loader, self._name = loader, name

    def __getattr__(self, name):
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        global _importing
        if self._name in _LIBRARIES:
            _loading.add(self._name)
        else:
            _importing += 1
        try:
            self._loader.exec_module(module)
        finally:
            if self._name in _LIBRARIES:
                _loading.discard(self._name)
            else:
                _importing -= 1
            module.__loader__ = self._loader
            if getattr(module, '__spec__', None) is not None:
                module.__spec__.loader = self._loader
        _register_ready()


class _PostImportHook(importlib.abc.MetaPathFinder):
    """Wraps the loaders of timm, open_clip, transformers and diffzoo's own modules (see the module docstring)."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _LIBRARIES and not fullname.startswith(f'{__name__}.'):
            return None
        if fullname in IMPORT_WANDB:
            import_wandb_first()
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, 'find_spec'):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, 'exec_module'):
                    spec.loader = _LoaderAfter(spec.loader, fullname)
                return spec
        return None


_hook = _PostImportHook()


def _remove_hook() -> None:
    if _hook in sys.meta_path:
        sys.meta_path.remove(_hook)


def _install() -> None:
    with _lock:
        for library in _LIBRARIES:
            if library in sys.modules:
                _register(library)
        if _registered != set(_LIBRARIES) and _hook not in sys.meta_path:
            sys.meta_path.insert(0, _hook)


_install()
