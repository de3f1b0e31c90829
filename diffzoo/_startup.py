"""What diffzoo does to start its processes quicker.

wandb imported just before timm or open_clip, by diffzoo's post-import hook (diffzoo/__init__.py).

Both import wandb when it is installed (timm.utils, open_clip_train.main), whether or not a run reports to
it. wandb's pydantic models read their fields' docstrings through `inspect.getmodule`, which walks every
module already imported, once per model: after timm and torchvision (torch._dynamo, sympy) that walk is
long. `import torch, timm, open_clip` took 5.0 to 6.8 s of CPU, `import torch, wandb, timm, open_clip`
4.7 to 5.8 s (2-core machine, six runs each, interleaved).

A command running as its own process does its heavy imports with the garbage collector off, then moves what they
made out of its reach (`startup_imports`): torch, timm, open_clip, transformers and wandb leave about half a million
objects that live as long as the process (505,000 tracked by the collector once `diffzoo.train.runner` is imported).
While they are imported, every collection the allocations trigger walks the objects made so far, and once they are
imported every full collection walks them all, the last ones at the interpreter's exit. The collector is switched
back on after the freeze, so objects made later (the model, the data loader, the writers of logs) are collected and
finalized as usual; what the imports left as garbage in reference cycles (about 9 MB) is kept with them, as
Python's documentation of gc.freeze has it for a process that disables the collector early. Measured on a 2-core
machine, interleaved runs:
- `import diffzoo.train.runner`, then the freeze: 5.5 to 6.7 s of CPU with the collector on, 4.2 to 5.2 s off;
- a training of 8 steps of clip-tiny-baseline (`python -m diffzoo.train`, one thread): 9.6 and 10.7 s of CPU with
  neither, 8.5 and 8.0 s with the freeze alone; in later runs 7.8 to 8.3 s with the freeze alone, 7.1 to 7.8 s
  with both.
"""
import contextlib
import gc
import importlib.util
import sys

IMPORT_WANDB = ('timm', 'open_clip')  # the libraries whose import imports wandb (open_clip through timm)


def import_wandb_first() -> None:
    """Import wandb now if it is installed and not imported yet."""
    if 'wandb' not in sys.modules and importlib.util.find_spec('wandb') is not None:
        import wandb  # noqa: F401


@contextlib.contextmanager
def startup_imports(own_process: bool):
    """A command's heavy imports, with the collector off, then gc.freeze, when the command is its process's own
    (`python -m …`, a console script: `main()` called without an argv). A caller's process (a notebook, a test
    calling `main(argv)`) keeps its collector as it is: freezing there would also keep its garbage from being
    collected."""
    if not own_process:
        yield
        return
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()
