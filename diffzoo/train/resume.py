"""Which checkpoint `--resume latest` resumes a CLIP run from, local or on any fsspec filesystem.

open_clip_train's own choice has three gaps that each restart a long run from epoch 0 or from a broken file:
with `--save-most-recent` it looks for `epoch_latest.pt` only, and starts over when that file is missing
although `epoch_K.pt` files are there; without it, it takes the last `*.pt` name in natural order, which is
a `tmp.pt` left by a save cut short; and a remote checkpoint it cannot read ends the run. Here:

- `restore_latest(folder)` (before open_clip_train looks, global rank 0): a missing `epoch_latest.pt` beside
  `epoch_K.pt` files is restored as a hard link to the newest of them that was written whole (a torch.save
  file is a zip archive, whose directory is written last: a save cut short has none; a copy where the
  filesystem has no links), and the run says so on stderr; when none was written whole, a `CheckpointError`
  names them (open_clip_train would start over). open_clip_train replaces `epoch_latest.pt` by rename when it next saves, so
  the linked `epoch_K.pt` is never written through.
- `latest_checkpoint(folder, remote)` replaces open_clip_train's `get_latest_checkpoint`: `epoch_latest.pt`,
  else the highest `epoch_K.pt`, listed with fsspec (s3://, gs://, file://, memory://, a local path).
- `load_resume_checkpoint(path)` replaces its `pt_load` for the resume: read with weights_only=True; when
  unreadable (missing, truncated, not a checkpoint) the newest intact `epoch_K.pt` in the same folder is
  read instead and the log names both; with none intact, a `CheckpointError` naming every file and the fix
  (the run does not start over on its own). A file that would run code is refused, never skipped.
"""
import logging
import os
import posixpath
import re
import shutil
import tempfile
import zipfile
from typing import List, Optional, Tuple

import fsspec

from diffzoo.checkpoint import CheckpointError, UnsafeCheckpointError, read_checkpoint
from diffzoo.files import atomic_write

LATEST = 'epoch_latest.pt'  # open_clip_train.main.LATEST_CHECKPOINT_NAME
EPOCH = re.compile(r'epoch_(\d+)\.pt')


def _is_url(path: str) -> bool:
    return '://' in path


def _join(folder: str, name: str) -> str:
    return posixpath.join(folder, name) if _is_url(folder) else os.path.join(folder, name)


def _names(folder: str) -> List[str]:
    """The file names in `folder` (empty when it does not exist)."""
    fs, root = fsspec.core.url_to_fs(folder)
    try:
        return [posixpath.basename(p.rstrip('/')) for p in fs.ls(root, detail=False)]
    except FileNotFoundError:
        return []


def epoch_checkpoints(folder: str) -> List[str]:
    """The `epoch_K.pt` names in `folder`, newest (highest K) first."""
    found = [(int(m.group(1)), name) for name in _names(folder) for m in [EPOCH.fullmatch(name)] if m]
    return [name for _, name in sorted(found, reverse=True)]


def latest_checkpoint(path: str, remote: bool = False) -> Optional[str]:
    """open_clip_train.main.get_latest_checkpoint(path, remote): the checkpoint `--resume latest` starts from,
    `epoch_latest.pt` if there, else the newest `epoch_K.pt`, else None (never `tmp.pt`, a save cut short)."""
    path = path.rstrip('/')
    names = _names(path)
    if LATEST in names:
        return _join(path, LATEST)
    epochs = epoch_checkpoints(path)
    return _join(path, epochs[0]) if epochs else None


def restore_latest(folder: str) -> Optional[str]:
    """Before open_clip_train's `--resume latest --save-most-recent` looks for `folder/epoch_latest.pt`: when
    that file is missing and `epoch_K.pt` files are there, put the newest in its place (hard link, else copy)
    and return what was done, for the log; None when nothing was missing."""
    latest = os.path.join(folder, LATEST)
    if os.path.lexists(latest):
        return None
    epochs = epoch_checkpoints(folder)
    if not epochs:
        return None
    whole = [name for name in epochs if zipfile.is_zipfile(os.path.join(folder, name))]
    if not whole:
        raise CheckpointError(
            f'cannot resume from {folder}: {LATEST} is missing and {", ".join(epochs)} '
            f'{"was" if len(epochs) == 1 else "were"} not written whole (saves cut short). Delete the '
            f'checkpoints folder to start the run over, or pass --name NEW for a new run', reason='cut short')
    newest = os.path.join(folder, whole[0])
    try:
        os.link(newest, latest)
    except OSError:  # a filesystem without hard links: a copy, renamed into place whole
        with atomic_write(latest, latest + '.restoring') as restoring:
            shutil.copyfile(newest, restoring)
    cut = epochs[:epochs.index(whole[0])]  # the newer ones, not written whole
    return (f'{latest} is missing; resuming from {whole[0]}, the newest epoch checkpoint beside it written '
            f'whole' + (f' ({", ".join(cut)} {"was" if len(cut) == 1 else "were"} cut short)' if cut else '')
            + f' (put in place as {LATEST})')


def _read(path: str):
    """read_checkpoint for a local path or an fsspec URL (fetched to a temporary file first)."""
    if not _is_url(path) or path.startswith('file://'):
        return read_checkpoint(path[len('file://'):] if path.startswith('file://') else path)
    with tempfile.TemporaryDirectory(prefix='diffzoo-resume-') as tmp:
        local = os.path.join(tmp, posixpath.basename(path))
        try:
            with fsspec.open(path, 'rb') as src, open(local, 'wb') as dst:
                shutil.copyfileobj(src, dst, 1 << 24)
        except FileNotFoundError:
            raise CheckpointError(f'{path}: no such checkpoint file', reason='no such file') from None
        try:
            return read_checkpoint(local)
        except CheckpointError as e:
            raise type(e)(str(e).replace(local, path), reason=e.reason) from None


def _same_file(a: str, b: str) -> bool:
    try:
        return not _is_url(a) and os.path.samefile(a, b)
    except OSError:
        return False


def load_resume_checkpoint(file_path: str, map_location=None):
    """open_clip_train.main's `pt_load(args.resume)`, read safely onto the CPU; an unreadable checkpoint gives
    way to the newest intact `epoch_K.pt` in its folder (local or fsspec). Raises CheckpointError when none is
    intact, UnsafeCheckpointError (no fall-back: a file that would run code was put there) for a refused global, and
    CheckpointError for a file that is not there (no fall-back: a `--resume` path mistyped)."""
    folder = file_path.rsplit('/', 1)[0] if _is_url(file_path) else os.path.dirname(file_path)
    try:
        return _read(file_path)
    except UnsafeCheckpointError:
        raise
    except CheckpointError as e:
        if e.reason == 'no such file':
            beside = epoch_checkpoints(folder or '.')
            raise CheckpointError(f'--resume {file_path}: no such checkpoint file'
                                  + (f' (beside it: {", ".join(beside)})' if beside else '')
                                  + '; give a checkpoint that is there, or leave --resume out to resume the run from '
                                    'its newest', reason=e.reason) from None
        unreadable: List[Tuple[str, str]] = [(posixpath.basename(file_path), e.reason)]
    for name in epoch_checkpoints(folder or '.'):
        candidate = _join(folder, name)
        if name == unreadable[0][0] or _same_file(candidate, file_path):
            continue
        try:
            checkpoint = _read(candidate)
        except UnsafeCheckpointError:
            raise
        except CheckpointError as e:
            unreadable.append((name, e.reason))
            continue
        logging.warning('; '.join(f'{n} is unreadable ({reason})' for n, reason in unreadable)
                        + f'; resuming from {name}')
        return checkpoint
    raise CheckpointError(
        f'cannot resume from {folder}: ' + '; '.join(f'{n} is unreadable ({reason})' for n, reason in unreadable)
        + ('' if len(unreadable) > 1 else '; no epoch_K.pt beside it')
        + '. Delete the checkpoints folder to start the run over, or pass --name NEW for a new run')
