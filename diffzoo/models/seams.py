"""Every place diffzoo reaches into timm beyond `@register_model`, in one module: the table `SEAMS`
(`diffzoo.seam`), applied for the process by `install()` (idempotent; `import diffzoo` calls it) and undone by
`uninstall()`.

- `timm.models._factory.load_checkpoint`, the function `timm.create_model(…, checkpoint_path=…)` calls:
  for a `vit_diff_*` model it passes timm's own `filter_fn` argument, `checkpoint_path_filter`, so
  `checkpoint_path=` takes a timm, open_clip (diffzoo.convert) or official DiffCLIP file and gives a new
  head where the checkpoint's head does not fit the model's `num_classes` (with one warning naming both),
  as `pretrained=True, pretrained_cfg_overlay=dict(file=…)` does. Every other model, and
  `timm.models.load_checkpoint` called directly, keep timm's strict load.
"""
import functools
import warnings

import timm
import timm.models._factory
import torch

from diffzoo import seam
from diffzoo.checkpoint import SAFE_GLOBALS
from diffzoo.seam import LibraryChanged, Seam
from .vit_diff import MODEL_NAMES, diffclip_filter_fn

HEAD = 'head.'
LOAD_CHECKPOINT = ('model', 'checkpoint_path', 'use_ema', 'device', 'strict', 'remap', 'filter_fn')


class TimmChanged(LibraryChanged):
    library = f'timm {timm.__version__}'
    tested = 'timm 1.0.26-1.0.31'


def checkpoint_path_filter(state_dict, model, checkpoint_path: str = 'the checkpoint'):
    """`diffclip_filter_fn` (layouts), then the model's own freshly initialised head in place of a saved
    head whose shape differs from the model's (or that the model lacks, or that the file lacks)."""
    state_dict = diffclip_filter_fn(state_dict, model)
    own = {k: v for k, v in model.state_dict().items() if k.startswith(HEAD)}
    saved = {k: v for k, v in state_dict.items() if k.startswith(HEAD)}
    if own.keys() == saved.keys() and all(saved[k].shape == v.shape for k, v in own.items()):
        return state_dict
    name = model.pretrained_cfg.get('architecture', type(model).__name__)
    classes = saved['head.weight'].shape[0] if 'head.weight' in saved else 0
    head = 'the head is new' if model.num_classes else 'the model has no head'
    warnings.warn(
        f'{name}: checkpoint_path={checkpoint_path} has a {classes}-class head, this model num_classes='
        f'{model.num_classes}: the trunk is loaded and {head}. To resume or evaluate the saved model, '
        f'pass num_classes={classes}', stacklevel=5)  # the caller of timm.create_model
    return {k: v for k, v in state_dict.items() if not k.startswith(HEAD)} | own


def _checkpoint_loader(original):
    def load_checkpoint(model, checkpoint_path, *args, **kwargs):
        ours = getattr(model, 'pretrained_cfg', {}).get('architecture') in MODEL_NAMES
        if args or kwargs or not ours:  # only create_model's own call (two arguments) for a vit_diff_* model
            return original(model, checkpoint_path, *args, **kwargs)
        with torch.serialization.safe_globals(SAFE_GLOBALS):  # official DiffCLIP pickles hold argparse/numpy
            return original(model, checkpoint_path,
                            filter_fn=functools.partial(checkpoint_path_filter, checkpoint_path=checkpoint_path))
    return load_checkpoint


SEAMS = (
    Seam(timm.models._factory, 'load_checkpoint', seam.wrapping(_checkpoint_loader), '`create_model(…, '
         'checkpoint_path=)` loads strictly with no filter: a `vit_diff_*` model gets timm\'s own `filter_fn`, so '
         'open_clip and official DiffCLIP files load and a head of another size is made new', LOAD_CHECKPOINT),
)


def install() -> None:
    """Apply `SEAMS` for the process (idempotent); a timm whose `load_checkpoint` changed fails here, by name."""
    seam.apply(SEAMS, TimmChanged, keep=True)


def uninstall() -> None:
    """timm's own `load_checkpoint` back."""
    seam.restore(SEAMS)
