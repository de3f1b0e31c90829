"""Webdataset shards as img2dataset writes them: counting, checking, and listing failed URLs.

A shard directory holds `NNNNN.tar` (members `KEY.jpg`, `KEY.txt`, `KEY.json`), and per shard
img2dataset's `NNNNN_stats.json` (success counts) and `NNNNN.parquet` (every URL with its status).
open_clip counts training samples only from a `sizes.json` ({"NNNNN.tar": samples}) next to the
shards; `write_sizes` makes it from the stats files, counting a tar itself where stats are missing.
Sample keys follow webdataset's rule: the member name up to the first dot of its base name.

Members are read into memory (tarfile's stream, as webdataset reads them), never extracted: a member named with a
`..` component or an absolute path is only reported, as the sign of a shard made by something other than
img2dataset, or made to escape a directory.
"""
import json
import os
import re
import socket
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Collection, Dict, Iterator, List, Optional, Tuple

from diffzoo.files import atomic_write_json


IMAGE_EXTS = ('jpg', 'jpeg', 'png', 'webp')
TEXT_EXT = 'txt'
SIZES_FILE = 'sizes.json'
_KEY_RE = re.compile(r'^((?:.*/|)[^./]+)[.]([^/]*)$')


class DataError(ValueError):
    """A dataset directory that cannot be used as it is; the message names the fix."""


def split_member(name: str) -> Tuple[Optional[str], Optional[str]]:
    """'000012.jpg' -> ('000012', 'jpg'); webdataset's base_plus_ext rule."""
    match = _KEY_RE.match(name)
    if not match:
        return None, None
    return match.group(1), match.group(2).lower()


def hostile_name(name: str) -> Optional[str]:
    """Why a tar member's name would leave the directory it was extracted into (None: it would not)."""
    if name.startswith(('/', '\\')) or re.match(r'^[A-Za-z]:', name):
        return 'an absolute path'
    if '..' in re.split(r'[/\\]', name):
        return 'a ../ component'
    return None


def list_shards(directory) -> List[Path]:
    """The `*.tar` shards of a directory, in name order; a clear error if there are none."""
    path = Path(directory)
    if not path.exists():
        raise DataError(f'shard directory {path} does not exist; pass the OUT_DIR given to the download script')
    if not path.is_dir():
        raise DataError(f'{path} is not a directory; pass the directory that holds the NNNNN.tar shards')
    try:
        shards = sorted(p for p in path.iterdir() if p.suffix == '.tar')
    except PermissionError as exc:
        raise DataError(f'shard directory {path} is not readable ({exc.strerror}); fix its permissions') from exc
    if not shards:
        raise DataError(f'no *.tar shards in {path}; run scripts/download_cc3m.sh (or _cc12m.sh) into it first')
    return shards


def read_stats(directory) -> Dict[str, dict]:
    """img2dataset's per-shard statistics, keyed by shard file name ('00003.tar'). A file that is not a JSON object,
    or whose `successes` is not a sample count, is a DataError naming it."""
    stats = {}
    for path in Path(directory).glob('*_stats.json'):
        shard = path.name[:-len('_stats.json')] + '.tar'
        fix = (f'delete it and its shard, then re-run the download into {directory} (it redoes shards without '
               f'_stats.json), or count the tars themselves: python -m diffzoo.data sizes {directory} --recount')
        try:
            stats[shard] = json.loads(path.read_bytes())
        except (OSError, ValueError) as exc:  # a folder of that name, JSONDecodeError, UnicodeDecodeError
            raise DataError(f'{path} is not JSON ({type(exc).__name__}: {exc}); {fix}') from None
        if not isinstance(stats[shard], dict):
            raise DataError(f'{path} holds a JSON {type(stats[shard]).__name__}, not img2dataset\'s statistics; {fix}')
        if 'successes' in stats[shard] and not _is_count(stats[shard]['successes']):
            raise DataError(f'{path}: successes {stats[shard]["successes"]!r} is not a sample count; {fix}')
    return stats


def iter_samples(shard: Path, hostile: Optional[List[Tuple[str, str]]] = None
                 ) -> Iterator[Tuple[str, Dict[str, bytes]]]:
    """(key, {ext: bytes}) for each sample of a tar, grouping consecutive members by key, read in memory.
    `hostile`, a list, gets (member name, why) of each member whose name has a `..` component or is absolute."""
    key, members = None, {}
    with tarfile.open(shard, mode='r|*') as tar:
        for info in tar:
            why = hostile_name(info.name) if hostile is not None else None
            if why:
                hostile.append((info.name, why))
            if not info.isreg():
                continue
            k, ext = split_member(info.name)
            if k is None:
                continue
            if key is not None and (k != key or ext in members):
                yield key, members
                members = {}
            key = k
            members[ext] = tar.extractfile(info).read()
    if key is not None:
        yield key, members


def count_samples(shard: Path) -> int:
    """Samples of a shard that have an image (what a training pipeline can use)."""
    return sum(1 for _, m in iter_samples(shard) if any(e in m for e in IMAGE_EXTS))


@dataclass
class SizesReport:
    sizes: Dict[str, int]
    counted: List[str]  # shards whose size came from reading the tar, not from stats

    @property
    def total(self) -> int:
        return sum(self.sizes.values())


def _rerun_download(directory) -> str:
    return (f're-run the download script into {directory} (it redoes shards without _stats.json), '
            f'or delete the shard to go on without it')


def write_sizes(directory, recount: bool = False) -> SizesReport:
    """Write open_clip's sizes.json for every shard of `directory`.

    Where img2dataset wrote stats for some shards, a shard without them is one it did not finish
    (a crash, a kill): refused, unless `recount` counts every tar as it is."""
    shards = list_shards(directory)
    stats = {} if recount else read_stats(directory)
    unfinished = [s.name for s in shards if stats and s.name not in stats]
    if unfinished:
        raise DataError(f'{len(unfinished)} shards in {directory} have no _stats.json, so img2dataset did not '
                        f'finish them ({", ".join(unfinished[:3])}); {_rerun_download(directory)}, '
                        f'or pass --recount to count them as they are')
    sizes, counted = {}, []
    for shard in shards:
        if shard.name in stats and 'successes' in stats[shard.name]:
            sizes[shard.name] = int(stats[shard.name]['successes'])
        else:
            try:
                sizes[shard.name] = count_samples(shard)
            except (tarfile.TarError, OSError, EOFError) as exc:
                raise DataError(f'{shard}: unreadable ({exc}); {_rerun_download(directory)}') from exc
            counted.append(shard.name)
    tmp = Path(directory) / f'{SIZES_FILE}.{socket.gethostname()}.{os.getpid()}.tmp'  # processes may race
    atomic_write_json(Path(directory) / SIZES_FILE, sizes, tmp)
    return SizesReport(sizes, counted)


def sizes_from_stats(directory, names: List[str], log=print) -> SizesReport:
    """sizes.json for a directory that has none, written from img2dataset's *_stats.json (as `img2dataset`'s own
    command leaves its shards) when the shards `names` all have one; one line logged. A DataError naming the fix
    when they do not, or when it cannot be written."""
    stats = read_stats(directory)
    fix = f'run python -m diffzoo.data sizes {directory}, or pass --train_num_samples N'
    if not stats:
        raise DataError(f'no {SIZES_FILE} in {directory} and no train_num_samples: {fix}')
    unstated = [n for n in names if 'successes' not in stats.get(n, {})]
    if unstated:
        raise DataError(f'no {SIZES_FILE} in {directory}, and {len(unstated)} of its {len(names)} shards have no '
                        f'img2dataset _stats.json to count them ({", ".join(unstated[:3])}): img2dataset did not '
                        f'finish them; {_rerun_download(directory)}, or run python -m diffzoo.data sizes {directory} '
                        f'--recount to count them as they are')
    total = sum(int(stats[n]['successes']) for n in names)
    try:
        report = write_sizes(directory)
    except DataError as exc:
        raise DataError(f'{exc}; or pass --train_num_samples {total}') from None
    except OSError as exc:
        raise DataError(f'no {SIZES_FILE} in {directory}, and it cannot be written there ({exc.strerror}): '
                        f'img2dataset\'s _stats.json count {total:,} samples in the shards to train; pass '
                        f'--train_num_samples {total}') from None
    log(f'no {SIZES_FILE} in {directory}: wrote it from img2dataset\'s {len(stats)} *_stats.json '
        f'({report.total:,} samples in {len(report.sizes)} shards), as python -m diffzoo.data sizes does')
    return report


def _is_count(value) -> bool:
    """A sample count as open_clip reads it (`int(value)`): a whole number, or its digits as a string."""
    if isinstance(value, bool):
        return False
    return (isinstance(value, int) and value >= 0) or (isinstance(value, str) and value.strip().isdigit())


def read_sizes(directory) -> Optional[Dict[str, int]]:
    """open_clip's sizes.json of `directory` ({"NNNNN.tar": samples}); None if there is none, and a
    DataError naming the file and how to rewrite it if it is not that."""
    path = Path(directory) / SIZES_FILE
    if not path.exists():
        return None
    fix = f'rewrite it with python -m diffzoo.data sizes {directory} (add --recount to count the tars themselves)'
    try:
        data = json.loads(path.read_bytes())
    except OSError as exc:
        raise DataError(f'{path} is not readable ({exc.strerror}); fix its permissions or {fix}') from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise DataError(f'{path} is not JSON ({exc}); {fix}') from None
    if not isinstance(data, dict):
        raise DataError(f'{path} holds a {type(data).__name__}, not {{"NNNNN.tar": samples, ...}}; {fix}')
    bad = [(k, v) for k, v in data.items() if not _is_count(v)]
    if bad:
        raise DataError(f'{path}: {len(bad)} entries are not sample counts (first: {bad[0][0]!r}: {bad[0][1]!r}); '
                        f'{fix}')
    return {k: int(v) for k, v in data.items()}


def listed_but_gone(sizes: Dict[str, int], present: Collection[str], directory) -> Optional[str]:
    """What sizes.json (`sizes`) lists of `directory` that is not `present` there (deleted or moved since it was
    written), in words: 'lists N shards that are not in DIR (a, b, c, …; S samples)'; None for none. Each caller
    names the file and says what that means where it stands (a run, a data check)."""
    gone = sorted(set(sizes) - set(present))
    if not gone:
        return None
    shown = ', '.join(gone[:3]) + (', …' if len(gone) > 3 else '')
    return (f'lists {len(gone)} shards that are not in {directory} ({shown}; '
            f'{sum(sizes[name] for name in gone):,} samples)')
