"""What diffzoo does to start its processes quicker.

wandb imported just before timm or open_clip, by diffzoo's post-import hook (diffzoo/__init__.py).

Both import wandb when it is installed (timm.utils, open_clip_train.main), whether or not a run reports to
it. wandb's pydantic models read their fields' docstrings through `inspect.getmodule`, which walks every
module already imported, once per model: after timm and torchvision (torch._dynamo, sympy) that walk is
long. `import torch, timm, open_clip` took 5.0 to 6.8 s of CPU, `import torch, wandb, timm, open_clip`
4.7 to 5.8 s (2-core machine, six runs each, interleaved).

A command running as its own process moves what its imports made out of the garbage collector's reach
(`freeze_imports`): torch, timm, open_clip, transformers and wandb leave about half a million objects that live
as long as the process (505,000 tracked by the collector once `diffzoo.train.runner` is imported), and each full
collection walks them all, the last ones at the interpreter's exit. A training of 8 steps of clip-tiny-baseline
(`python -m diffzoo.train`, one thread, 2-core machine, interleaved runs) took 9.6 and 10.7 s of CPU without,
8.5 and 8.0 s with. Objects made later (the model, the data loader, the writers of logs) are collected and
finalized as usual.
"""
import gc
import importlib.util
import sys

IMPORT_WANDB = ('timm', 'open_clip')  # the libraries whose import imports wandb (open_clip through timm)


def import_wandb_first() -> None:
    """Import wandb now if it is installed and not imported yet."""
    if 'wandb' not in sys.modules and importlib.util.find_spec('wandb') is not None:
        import wandb  # noqa: F401


def freeze_imports(own_process: bool) -> None:
    """gc.freeze, once a command's imports are done, when the command is its process's own (`python -m …`, a
    console script: `main()` called without an argv). A caller's process (a notebook, a test calling `main(argv)`)
    keeps its collector as it is: freezing there would also keep its garbage from being collected."""
    if own_process:
        gc.freeze()
