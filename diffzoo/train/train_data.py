"""A recipe's `train_data` as open_clip_train will read it: the shards it names (a directory, a brace pattern or a `::`
list), their sample counts from sizes.json, whether they feed every data worker of every process a batch, and the
optimizer steps an epoch of them makes, each counted as open_clip_train counts it. A problem is a RecipeError naming
the data and the fix, raised before anything is built."""
import functools
import math
import os
from pathlib import Path
from typing import List, Optional, Tuple

from diffzoo.data.shards import SIZES_FILE, DataError, list_shards, listed_but_gone, read_sizes, sizes_from_stats
from diffzoo.recipes import RecipeError


def _is_remote(url: str) -> bool:
    return '://' in url or url.startswith('pipe:')


def shard_pattern(shards: List[str]) -> str:
    """Shard paths as brace ranges joined by `::`: [.../00000.tar … .../00009.tar] -> .../{00000..00009}.tar."""
    runs: List[List[str]] = []
    for path in shards:
        stem = Path(path).stem
        if runs and stem.isdigit():
            prev = Path(runs[-1][-1])
            if (prev.parent == Path(path).parent and prev.stem.isdigit() and len(prev.stem) == len(stem)
                    and int(stem) == int(prev.stem) + 1):
                runs[-1].append(path)
                continue
        runs.append([path])
    parts = []
    for run in runs:
        if len(run) == 1:
            parts.append(run[0])
        else:
            first, last = Path(run[0]), Path(run[-1])
            parts.append(str(first.parent / f'{{{first.stem}..{last.stem}}}.tar'))
    return '::'.join(parts)


def expand_shards(train_data: str) -> Tuple[str, List[str]]:
    """(open_clip --train-data value, shard list) for a directory, brace pattern or `::` list."""
    import braceexpand

    if os.path.isdir(train_data):
        shards = [str(p) for p in list_shards(train_data)]
        folders = [s for s in shards if not os.path.isfile(s)]
        if folders:
            raise RecipeError(f'train_data {train_data!r}: {len(folders)} of its *.tar are not files '
                              f'({os.path.basename(folders[0])}, …: folders named like shards); move them out of '
                              f'the shard folder')
        return shard_pattern(shards), shards
    try:
        shards = [s for part in train_data.split('::') for s in braceexpand.braceexpand(part)]
    except braceexpand.UnbalancedBracesError:
        raise RecipeError(f'train_data {train_data!r}: unbalanced braces; write a range as '
                          f'DIR/{{00000..00003}}.tar, or pass the shard directory') from None
    local = [s for s in shards if not _is_remote(s)]
    missing = [s for s in local if not os.path.isfile(s)]
    if local and len(missing) == len(local):
        parent = os.path.dirname(local[0]) or '.'
        if shards == [train_data]:  # one path, neither a directory nor a file
            hint = f'{train_data} does not exist'
        elif not os.path.isdir(parent):
            hint = f'{parent} does not exist'
        else:
            hint = f'{parent} holds {len(list(Path(parent).glob("*.tar")))} *.tar files'
        raise RecipeError(f'train_data {train_data!r} matches no shard ({hint}); pass --train_data DIR')
    if missing:
        raise RecipeError(f'train_data {train_data!r}: {len(missing)} of {len(shards)} shards are missing '
                          f'(first: {missing[0]}); fix the pattern or pass the directory')
    return train_data, shards


def shard_sizes(shards: List[str]) -> List[int]:
    """Samples of each of `shards` from the sizes.json next to the first shard, as open_clip reads it (written
    first from img2dataset's *_stats.json where there is none: `diffzoo.data.shards.sizes_from_stats`)."""
    folder = os.path.dirname(shards[0])
    path = os.path.join(folder, SIZES_FILE)
    if not os.path.exists(path):  # shards from img2dataset's own command: sizes.json from its stats, if it can
        try:
            sizes_from_stats(folder, [os.path.basename(s) for s in shards], log=functools.partial(print, flush=True))
        except DataError as exc:
            raise RecipeError(str(exc)) from None
    try:
        sizes = read_sizes(folder)
    except DataError as exc:
        raise RecipeError(f'{exc}, or pass --train_num_samples N') from None
    missing = [os.path.basename(s) for s in shards if os.path.basename(s) not in sizes]
    if missing:
        raise RecipeError(f'{path} has no entry for {len(missing)} shards (first: {missing[0]}); '
                          f'run python -m diffzoo.data sizes {folder}')
    counts = [int(sizes[os.path.basename(s)]) for s in shards]
    if not sum(counts):
        raise RecipeError(f'{path} counts no sample in its {len(counts)} shard(s): run python -m diffzoo.data sizes '
                          f'{folder} to count their members (shards that hold none are empty: download them again)')
    return counts


def gone_shards(shards: List[str]) -> Optional[str]:
    """The warning for shards the sizes.json beside `shards` lists that are no longer in its folder (deleted or
    moved since it was written: a run trains without their samples), or None."""
    folder = os.path.dirname(shards[0])
    try:
        sizes = read_sizes(folder)
    except DataError:
        return None  # shard_sizes has refused it already, or the run counts its samples another way
    if sizes is None:
        return None
    gone = listed_but_gone(sizes, [n for n in sizes if os.path.exists(os.path.join(folder, n))], folder)
    if gone is None:
        return None
    return (f'{os.path.join(folder, SIZES_FILE)} {gone}: this run trains without them; put them back, or run '
            f'python -m diffzoo.data sizes {folder} --recount to count the shards that are there')


def dataset_size(shards: List[str]) -> int:
    """Samples in `shards` from the sizes.json next to the first shard, as open_clip reads it."""
    return sum(shard_sizes(shards))


def check_shard_count(shards: int, workers: int, world_size: int) -> None:
    """Without resampling webdataset gives every data worker of every process shards of its own."""
    readers = max(1, workers) * world_size
    if shards < readers:
        fixes = [f'pass --workers {shards // world_size}'] if shards >= world_size else [
            f'write at least {world_size} shards (one per process)', f'run {shards} process(es)']
        raise RecipeError(f'{shards} shards cannot feed {workers} data workers on each of {world_size} processes '
                          f'(webdataset gives each of the {readers} readers shards of its own); '
                          f'{", or ".join(fixes + ["pass --dataset-resampled"])}')


def _least_per_worker(sizes: List[int], workers: int, world_size: int) -> int:
    """The fewest samples one data worker may read in a pass: each of the workers · world_size readers gets
    at least len(sizes) // readers shards (shuffled to them anew each epoch), so the smallest of them."""
    return sum(sorted(sizes)[:len(sizes) // (max(1, workers) * world_size)])


def check_batches_fill(sizes: List[int], batch_size: int, accum: int, workers: int, world_size: int,
                       folder: str) -> None:
    """Without resampling each data worker batches the samples of its own shards, drops the partial batch
    at the end of a pass, and webdataset repeats the pass until the worker has made its batches: a worker
    whose shards hold fewer samples than one per-process batch would look for a full batch forever. And an
    epoch must make at least one optimizer step (open_clip_train's schedule divides by the steps)."""
    total, least = sum(sizes), _least_per_worker(sizes, workers, world_size)

    def works(per_process: int, accumulation: int, data_workers: int) -> bool:
        return (_least_per_worker(sizes, data_workers, world_size) >= per_process
                and steps_per_epoch(total, per_process, world_size, data_workers, accumulation) >= 1)

    if works(batch_size, accum, workers):
        return
    readers = max(1, workers) * world_size
    fewer = [w for w in range(max(1, workers) - 1, 0, -1) if works(batch_size, accum, w)]
    global_batch = batch_size * world_size * accum
    accumulate = (least and global_batch % (least * world_size) == 0
                  and works(least, global_batch // (least * world_size), workers))
    if least < batch_size:
        why = (f'{len(sizes)} shard(s) of {total} samples in {folder} give each of the {max(1, workers)} data '
               f'worker(s) of {world_size} process(es) {len(sizes) // readers} shard(s) a pass, as few as {least} '
               f'samples: fewer than one batch of {batch_size} per process, so the loader would wait for a full '
               f'batch forever')
    else:
        why = (f'{total} samples in {folder} make no optimizer step of global batch {global_batch} '
               f'({batch_size} per process × {world_size} process(es) × {accum} accumulated)')
    fixes = ([f'--max_batch_per_gpu {least} (the same global batch, accumulated)'] if accumulate else []) \
        + ([f'a global batch of at most {least * world_size}'] if least else []) \
        + ([f'--workers {fewer[0]}'] if fewer else []) + ['more data', '--dataset-resampled']
    raise RecipeError(f'{why}. Pass {", ".join(fixes[:-1])} or {fixes[-1]}')


def steps_per_epoch(num_samples: int, per_gpu: int, world_size: int, workers: int, accum: int) -> int:
    """Optimizer steps in one epoch, as open_clip_train's webdataset loader and scheduler count them."""
    num_batches = math.ceil(num_samples / (per_gpu * world_size))
    workers = max(1, workers)
    num_batches = math.ceil(num_batches / workers) * workers
    return num_batches // accum
