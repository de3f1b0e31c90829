"""The import order of a process that is about to import timm or open_clip_train: wandb first.

Both import wandb when it is installed (timm.utils, open_clip_train.main), whether or not the run reports
to it. wandb's pydantic models read their fields' docstrings through `inspect.getmodule`, which walks every
module already imported, once per model: wandb's import took 0.8 s before torch and 2.0 s after timm, in
each training process (`python -X importtime -m diffzoo.train`, 2-core machine).
"""
import importlib.util
import sys


def import_wandb_first() -> None:
    """Import wandb now if it is installed and torch is not yet imported (otherwise it gains nothing)."""
    if 'torch' not in sys.modules and importlib.util.find_spec('wandb') is not None:
        import wandb  # noqa: F401
