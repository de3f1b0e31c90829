"""Classes made at run time (a layer bound to its settings, a transformers config or model made differential) that
pickle can find: pickle stores a class as its module and qualified name, and looks the name up in that module."""
import sys
from typing import Dict, Tuple


def module_class(module: str, name: str, bases: Tuple[type, ...], namespace: Dict) -> type:
    """`type(name, bases, namespace)` made a class of `module` (its `__module__` and `__qualname__`) and set as the
    module's attribute `name`, so that pickle finds it in this process."""
    cls = type(name, bases, {**namespace, '__module__': module, '__qualname__': name})
    setattr(sys.modules[module], name, cls)
    return cls
