"""wandb imported just before timm or open_clip, by diffzoo's post-import hook (diffzoo/__init__.py).

Both import wandb when it is installed (timm.utils, open_clip_train.main), whether or not a run reports to
it. wandb's pydantic models read their fields' docstrings through `inspect.getmodule`, which walks every
module already imported, once per model: after timm and torchvision (torch._dynamo, sympy) that walk is
long. `import torch, timm, open_clip` took 5.0 to 6.8 s of CPU, `import torch, wandb, timm, open_clip`
4.7 to 5.8 s (2-core machine, six runs each, interleaved).
"""
import importlib.util
import sys

IMPORT_WANDB = ('timm', 'open_clip')  # the libraries whose import imports wandb (open_clip through timm)


def import_wandb_first() -> None:
    """Import wandb now if it is installed and not imported yet."""
    if 'wandb' not in sys.modules and importlib.util.find_spec('wandb') is not None:
        import wandb  # noqa: F401
