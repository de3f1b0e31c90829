"""A package's public names imported on first use (PEP 562), so importing the package loads no torch."""
import importlib
import sys
from typing import Callable, Dict, Optional, Tuple


def lazy_exports(package: str, exports: Dict[str, Optional[str]]) -> Tuple[Callable, Callable]:
    """The `__getattr__` and `__dir__` of `package`: each name in `exports` is taken from the submodule
    it maps to (None: the name is a submodule), imported when the name is first asked for."""
    def __getattr__(name):
        if name not in exports:
            raise AttributeError(f'module {package!r} has no attribute {name!r}')
        module = importlib.import_module(f'{package}.{exports[name] or name}')
        value = module if exports[name] is None else getattr(module, name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__():
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
