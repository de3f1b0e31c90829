"""How open_clip_train's checkpoints are written under `python -m diffzoo.train`: whole or not at all.

open_clip_train writes `epoch_K.pt` with `torch.save` straight to its final name, so a save cut short
(a full disk, a kill) leaves a truncated `epoch_K.pt` that looks like a checkpoint, and a full disk ends
the run in torch's `basic_ios::clear: iostream error` with no word of space. Under the seam
(`TorchForCheckpoints`, `diffzoo.train.seams`) every `torch.save` of open_clip_train.main goes through
`save_whole`:

- the free space of the folder is compared with the checkpoint's bytes first (its tensors' bytes: a
  torch.save file holds them and a few kilobytes more); short of them, `NoSpaceError` names the folder
  and both sizes before a byte is written;
- the file is written as `NAME.partial` beside its final name, flushed to disk and renamed into place,
  so a cut save leaves no `epoch_K.pt` (nor `tmp.pt`) under its final name, and the checkpoints already
  there (the last good one the run resumes from) are untouched;
- a write that fails for want of space anyway (the disk filled meanwhile) removes its partial file and
  raises `NoSpaceError`.

`checkpoint_bytes(model_name)` estimates one checkpoint of a model before it is built (weights and
AdamW's two moments, from a model made on the meta device), for the run's check at start.
"""
import errno
import logging
import os
import shutil
from typing import Any, Iterator

import torch

from diffzoo.checkpoint import CheckpointError
from diffzoo.files import atomic_write

MB = 2 ** 20


class NoSpaceError(CheckpointError):
    """A checkpoint does not fit on its disk."""

    def __init__(self, message: str):
        super().__init__(message, reason='no space left')


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value)


def tensor_bytes(obj: Any) -> int:
    """Bytes of the distinct tensor storages in a (nested) checkpoint dict."""
    storages = {}
    for t in _tensors(obj):
        storage = t.untyped_storage()
        storages[(storage.device, storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())


def free_bytes(folder: str) -> int:
    return shutil.disk_usage(folder).free


def no_space_message(folder: str, needed: int, free: int, what: str) -> str:
    return (f'no space left on {folder}: {needed / MB:,.0f} MB needed for {what}, {free / MB:,.0f} MB free. '
            f'Free some space there (epoch_K.pt files other than the newest are not needed to resume) or pass '
            f'--logs DIR on a larger disk; the checkpoints already written are kept and the run resumes from the '
            f'newest of them')


def save_whole(obj: Any, path, *args, **kwargs) -> None:
    """`torch.save(obj, path)` written whole or not at all (module docstring). Paths other than local
    files (a buffer, an fsspec file object) go to torch.save unchanged."""
    if not isinstance(path, (str, os.PathLike)):
        return torch.save(obj, path, *args, **kwargs)
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    needed = tensor_bytes(obj)
    free = free_bytes(folder)
    if free < needed:
        raise NoSpaceError(no_space_message(folder, needed, free, os.path.basename(path)))
    try:
        with atomic_write(path, path + '.partial') as partial, open(partial, 'wb') as f:
            torch.save(obj, f, *args, **kwargs)
            f.flush()
            os.fsync(f.fileno())
    except (OSError, RuntimeError) as exc:  # torch's writer reports a full disk as a RuntimeError from its stream
        with_errno = isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)
        if with_errno or free_bytes(folder) < needed:
            raise NoSpaceError(no_space_message(folder, needed, free_bytes(folder), os.path.basename(path))) from None
        raise


class TorchForCheckpoints:
    """torch as open_clip_train.main sees it under the seam: the same module, but `save` is `save_whole`."""

    save = staticmethod(save_whole)

    def __init__(self, module):
        self._module = module

    def __getattr__(self, name):
        return getattr(self._module, name)


def checkpoint_bytes(model_name: str) -> int:
    """One open_clip_train checkpoint of `model_name`: its state dict and AdamW's two fp32 moments per
    trainable parameter, counted on a model built on the meta device (no memory, no weights read)."""
    import open_clip
    root, quiet = logging.getLogger(), logging.NullHandler()
    # open_clip warns through the root logger; with no handler there yet, logging would install its default
    # stderr handler for the rest of the process, and every line of the run would print twice
    root.addHandler(quiet)
    try:
        with torch.device('meta'):
            model = open_clip.create_model(model_name, device='meta')
    finally:
        root.removeHandler(quiet)
    state = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    moments = sum(2 * p.numel() * 4 for p in model.parameters() if p.requires_grad)
    return state + moments
