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
import io
import json
import multiprocessing
import os
import re
import tarfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Optional, Tuple

from .keys import repeats_across, shard_keys

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
    """img2dataset's per-shard statistics, keyed by shard file name ('00003.tar')."""
    stats = {}
    for path in Path(directory).glob('*_stats.json'):
        shard = path.name[:-len('_stats.json')] + '.tar'
        with open(path) as f:
            stats[shard] = json.load(f)
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
    tmp = Path(directory) / (SIZES_FILE + '.tmp')
    tmp.write_text(json.dumps(sizes, indent=1) + '\n')
    os.replace(tmp, Path(directory) / SIZES_FILE)
    return SizesReport(sizes, counted)


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


# Members open_clip_train's pipeline decodes besides images (webdataset's `decode("pilrgb")` runs its
# basic handlers over every member), and how; a sample with one that fails is skipped in training.
TEXT_DECODERS = {
    'txt': 'utf-8', 'text': 'utf-8', 'transcript': 'utf-8',
    'json': 'json', 'jsn': 'json',
    'cls': 'int', 'cls2': 'int', 'index': 'int', 'inx': 'int', 'id': 'int',
}


def undecodable_member(ext: str, data: bytes) -> Optional[str]:
    """Why webdataset's decoder fails on a non-image member (None: it decodes, or is not decoded)."""
    kind = TEXT_DECODERS.get(ext)
    try:
        if kind == 'utf-8':
            data.decode('utf-8')
        elif kind == 'json':
            json.loads(data)
        elif kind == 'int':
            int(data)
    except UnicodeDecodeError as exc:
        return f'.{ext} is not UTF-8 (byte 0x{data[exc.start]:02x} at offset {exc.start})'
    except json.JSONDecodeError as exc:
        return f'.{ext} is not JSON ({exc.msg}: line {exc.lineno} column {exc.colno})'
    except ValueError:
        return f'.{ext} is not a whole number ({data[:20]!r})'
    return None


@dataclass
class ShardReport:
    name: str
    samples: int = 0
    missing: Counter = field(default_factory=Counter)  # 'image' / 'caption' -> samples lacking it
    undecodable: List[str] = field(default_factory=list)  # sample keys of images that do not decode
    undecodable_text: List[Tuple[str, str]] = field(default_factory=list)  # (sample key, reason)
    skipped: int = 0  # samples training skips (each once, for the first reason it meets)
    error: Optional[str] = None  # the tar itself could not be read to the end
    keys: List[list] = field(default_factory=list)  # distinct sample keys (`diffzoo.data.keys` groups)
    key_repeats: List[Tuple[int, str]] = field(default_factory=list)  # (position, key): a key met earlier here
    hostile: List[Tuple[str, str]] = field(default_factory=list)  # (member name, why): would leave the directory

    @property
    def usable(self) -> int:
        """Samples training keeps."""
        return self.samples - self.skipped

    @property
    def images(self) -> int:
        """Samples with an image: what sizes.json counts (`sizes --recount` writes it)."""
        return self.samples - self.missing['image']

    @property
    def ok(self) -> bool:
        return (self.error is None and self.samples > 0 and not self.missing and not self.undecodable
                and not self.undecodable_text and not self.key_repeats and not self.hostile)


def check_shard(shard: Path, decode: bool = True) -> ShardReport:
    """Read every sample of a shard and skip what open_clip_train's pipeline skips, in its order:
    no image or a blank caption (its caption filter), then a member that does not decode (webdataset's
    decode stage: images with PIL unless `decode` is off, captions as UTF-8, json as JSON). Samples whose key
    an earlier sample of the shard has, and members named to leave the directory, are noted (training keeps them)."""
    from PIL import Image

    report = ShardReport(shard.name)
    keys = []
    try:
        for key, members in iter_samples(shard, hostile=report.hostile):
            report.samples += 1
            keys.append(key)
            has_image = any(e in members for e in IMAGE_EXTS)
            has_caption = bool(members.get(TEXT_EXT, b'').strip())
            if not has_image:
                report.missing['image'] += 1
            if not has_caption:
                report.missing['caption'] += 1
            if not (has_image and has_caption):
                report.skipped += 1
                continue
            for ext, data in members.items():  # in member order, as webdataset decodes them
                if ext in IMAGE_EXTS:
                    if not decode:
                        continue
                    try:
                        with Image.open(io.BytesIO(data)) as img:
                            img.convert('RGB')
                    except Exception:
                        report.undecodable.append(key)
                        break
                else:
                    reason = undecodable_member(ext, data)
                    if reason:
                        report.undecodable_text.append((key, reason))
                        break
            else:
                continue
            report.skipped += 1
    except (tarfile.TarError, OSError, EOFError) as exc:
        report.error = f'{type(exc).__name__}: {exc}'
    report.keys, report.key_repeats = shard_keys(keys)
    return report


def _shown(items: List[str], n: int = 3, sep: str = ', ') -> str:
    return sep.join(items[:n]) + (' …' if len(items) > n else '')


@dataclass
class DatasetReport:
    directory: Path
    shards: List[ShardReport]
    sizes: Optional[Dict[str, int]]
    key_repeats_across: int = 0  # samples whose key another shard holds too, counted once each
    key_repeat_examples: List[Tuple[str, List[str]]] = field(default_factory=list)  # (key, shards holding it)

    @property
    def samples(self) -> int:
        return sum(s.samples for s in self.shards)

    @property
    def key_repeats(self) -> int:
        """Samples whose key another sample has (the first of them, in shard name order, is not one)."""
        return self.key_repeats_across + sum(len(s.key_repeats) for s in self.shards)

    def sizes_disagreements(self) -> Dict[str, List[Tuple[str, Optional[int], int]]]:
        """(shard, sizes.json's count or None, samples with an image) of the shards read to their end that
        sizes.json has no entry for ('absent'), counts fewer samples than they hold ('under'), or more ('over')."""
        out = {'absent': [], 'under': [], 'over': []}
        for s in self.shards:
            declared = (self.sizes or {}).get(s.name)
            if s.error is None and self.sizes is not None and declared != s.images:
                out['absent' if declared is None else 'under' if declared < s.images else 'over'].append(
                    (s.name, declared, s.images))
        return out

    def problems(self) -> List[str]:
        out = []
        for s in self.shards:
            if s.error:
                out.append(f'{s.name}: unreadable after {s.samples} samples ({s.error}); '
                           f'delete it and its _stats.json, then re-run the download script')
            elif s.samples == 0:
                out.append(f'{s.name}: empty shard; delete it and its _stats.json, then re-run the download script')
            for member, n in sorted(s.missing.items()):
                out.append(f'{s.name}: no {member} in {n} of {s.samples} samples')
            if s.undecodable:
                shown = ', '.join(s.undecodable[:3]) + (' …' if len(s.undecodable) > 3 else '')
                out.append(f'{s.name}: {len(s.undecodable)} undecodable images ({shown})')
            if s.undecodable_text:
                shown = '; '.join(f'{k}: {r}' for k, r in s.undecodable_text[:3]) + (
                    ' …' if len(s.undecodable_text) > 3 else '')
                out.append(f'{s.name}: {len(s.undecodable_text)} undecodable captions or json, skipped in '
                           f'training ({shown})')
            if s.key_repeats:
                shown = _shown([f'{k} at sample {p}' for p, k in s.key_repeats])
                out.append(f'{s.name}: {len(s.key_repeats)} samples repeat the key of an earlier sample of the shard '
                           f'({shown}); training trains each of them; re-create the shard with a key of its own '
                           f'for every sample')
            if s.hostile:
                shown = _shown([f'{name!r} ({why})' for name, why in s.hostile], sep='; ')
                out.append(f'{s.name}: {len(s.hostile)} members named to leave the directory they would be extracted '
                           f'into: {shown}; not written by img2dataset (nothing here extracts them: members are '
                           f'read in memory); re-create the shard')
        if self.key_repeats_across:
            shown = _shown([f'{key} in {" and ".join(shards[:3])}' for key, shards in self.key_repeat_examples],
                           sep='; ')
            out.append(f'{self.key_repeats_across} samples repeat the key of a sample of another shard ({shown}); '
                       f'training trains each of them; delete a shard that is a copy of another, or re-create the '
                       f'shards with a key of their own for every sample')
        fix = f'run python -m diffzoo.data sizes {self.directory} --recount'
        if self.sizes is None:
            out.append(f'no {SIZES_FILE}: run python -m diffzoo.data sizes {self.directory}')
            return out
        wrong = self.sizes_disagreements()
        if wrong['absent']:
            out.append(f'{SIZES_FILE} has no entry for {len(wrong["absent"])} shards '
                       f'({_shown([name for name, _, _ in wrong["absent"]])}); {fix}')
        for kind, fewer in (('under', True), ('over', False)):
            if wrong[kind]:
                n = abs(sum(held - declared for _, declared, held in wrong[kind]))
                shown = _shown([f'{name}: {declared:,} in {SIZES_FILE}, {held:,} in the tar'
                                for name, declared, held in wrong[kind]], sep='; ')
                effect = ('an epoch ends that many samples short, and part of the corpus is never trained' if fewer
                          else 'an epoch asks for that many more samples and trains others twice to make them up')
                out.append(f'{SIZES_FILE} counts {n:,} samples {"fewer" if fewer else "more"} than '
                           f'{len(wrong[kind])} shards hold ({shown}): {effect}; {fix}')
        return out


def _check_one(args) -> ShardReport:
    return check_shard(*args)


def check_dataset(directory, workers: int = 0, decode: bool = True, progress=print) -> DatasetReport:
    """Check every shard, `workers` processes in parallel (0: one per CPU core)."""
    shards = list_shards(directory)
    sizes = read_sizes(directory)  # a broken sizes.json is an error before any shard is read
    workers = workers or os.cpu_count() or 1
    reports, start, last = [], time.monotonic(), 0.0
    jobs = [(s, decode) for s in shards]
    if workers == 1 or len(shards) == 1:
        results: Iterable[ShardReport] = map(_check_one, jobs)
        pool = None
    else:
        method = 'fork' if 'fork' in multiprocessing.get_all_start_methods() else 'spawn'
        pool = multiprocessing.get_context(method).Pool(min(workers, len(shards)))
        results = pool.imap(_check_one, jobs)
    try:
        for report in results:
            reports.append(report)
            now = time.monotonic()
            if progress and (now - last > 10 or len(reports) == len(shards)):
                last = now
                progress(f'checked {len(reports)}/{len(shards)} shards, '
                         f'{sum(r.samples for r in reports):,} samples ({now - start:.0f} s)')
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    across, examples = repeats_across({r.name: r.keys for r in reports})
    return DatasetReport(Path(directory), reports, sizes, across, examples)


@dataclass
class RetryReport:
    failed: int
    written: int
    excluded: int
    errors: Counter
    unfinished: List[str] = field(default_factory=list)  # shards img2dataset did not finish


def finished_parquets(directory) -> Tuple[List[Path], List[Path]]:
    """img2dataset's NNNNN.parquet files of finished shards (with NNNNN_stats.json), and the others."""
    parquets = sorted(Path(directory).glob('*.parquet'))
    if not parquets:
        raise DataError(f'no NNNNN.parquet files in {directory}; img2dataset writes them next to the shards '
                        f'(is this the download OUT_DIR?)')
    finished = [p for p in parquets if p.with_name(f'{p.stem}_stats.json').exists()]
    return finished, [p for p in parquets if p not in finished]


def failed_urls(parquets: List[Path]) -> Iterator[dict]:
    """Rows of img2dataset's NNNNN.parquet files whose status is not 'success'.

    A URL that later succeeded (a retry downloaded with --extend) is left out."""
    import pyarrow.parquet as pq

    columns = ['url', 'caption', 'status', 'error_message']
    failed, succeeded = [], set()
    for path in parquets:
        table = pq.read_table(path, columns=[c for c in columns if c in pq.read_schema(path).names])
        for row in table.to_pylist():
            if row.get('status') == 'success':
                succeeded.add(row['url'])
            else:
                failed.append(row)
    seen = set()
    for row in failed:
        if row['url'] not in succeeded and row['url'] not in seen:
            seen.add(row['url'])
            yield row


def write_retry(directory, out, exclude: Iterable[str] = ()) -> RetryReport:
    """Write failed URLs as a TSV with a `url<TAB>caption` header (the download script reads it).
    Shards img2dataset did not finish are left out: re-running the download finishes them.

    `exclude`: substrings of error messages to leave out (e.g. 'HTTP Error 404')."""
    exclude = list(exclude)
    finished, unfinished = finished_parquets(directory)
    report = RetryReport(0, 0, 0, Counter(), [p.stem + '.tar' for p in unfinished])
    tmp = Path(str(out) + '.tmp')
    with open(tmp, 'w', encoding='utf-8') as f:
        f.write('url\tcaption\n')
        for row in failed_urls(finished):
            report.failed += 1
            error = row.get('error_message') or row.get('status') or 'unknown'
            report.errors[error] += 1
            if any(e in error for e in exclude):
                report.excluded += 1
                continue
            caption = ' '.join(str(row.get('caption') or '').split())  # no tabs or newlines
            f.write(f"{row['url']}\t{caption}\n")
            report.written += 1
    os.replace(tmp, out)
    return report
