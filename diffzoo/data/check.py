"""`python -m diffzoo.data check`: every sample of a shard directory read as open_clip_train's pipeline reads it,
and what training would skip (no image, a blank caption, a member that does not decode), repeated keys, member
names that would leave the directory and captions that hold other rows of the URL list, counted per shard and for the
whole set."""
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
from typing import Dict, Iterable, List, Optional, Tuple

from .keys import repeats_across, shard_keys
from .shards import IMAGE_EXTS, SIZES_FILE, TEXT_EXT, iter_samples, list_shards, listed_but_gone, read_sizes


# Members open_clip_train's pipeline decodes besides images (webdataset's `decode("pilrgb")` runs its
# basic handlers over every member), and how; a sample with one that fails is skipped in training.
TEXT_DECODERS = {
    'txt': 'utf-8', 'text': 'utf-8', 'transcript': 'utf-8',
    'json': 'json', 'jsn': 'json',
    'cls': 'int', 'cls2': 'int', 'index': 'int', 'inx': 'int', 'id': 'int',
}
# A caption with a tab or line break and then a URL holds the rows after it: img2dataset read a TSV caption that
# starts with `"` as a quoted field, which ran on to the next `"` (a TSV row holds neither character).
MERGED_ROWS = re.compile(rb'[\t\r\n]\s*https?://', re.IGNORECASE)


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
    merged: List[str] = field(default_factory=list)  # sample keys whose caption holds other rows of the URL list

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
                and not self.undecodable_text and not self.key_repeats and not self.hostile and not self.merged)


def check_shard(shard: Path, decode: bool = True) -> ShardReport:
    """Read every sample of a shard and skip what open_clip_train's pipeline skips, in its order:
    no image or a blank caption (its caption filter), then a member that does not decode (webdataset's
    decode stage: images with PIL unless `decode` is off, captions as UTF-8, json as JSON). Samples whose key
    an earlier sample of the shard has, members named to leave the directory, and captions holding other rows of the
    URL list (`MERGED_ROWS`) are noted (training keeps them)."""
    from PIL import Image

    report = ShardReport(shard.name)
    keys = []
    try:
        for key, members in iter_samples(shard, hostile=report.hostile):
            report.samples += 1
            keys.append(key)
            has_image = any(e in members for e in IMAGE_EXTS)
            has_caption = bool(members.get(TEXT_EXT, b'').strip())
            if MERGED_ROWS.search(members.get(TEXT_EXT, b'')):
                report.merged.append(key)
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
            if s.merged:
                out.append(f'{s.name}: {len(s.merged)} captions hold other rows of the URL list, a tab or line break '
                           f'and then a URL ({_shown(s.merged)}): img2dataset read a caption starting with " as a '
                           f'quoted field, and the rows it ran over were neither downloaded nor counted; download the '
                           f'list again into a new directory with python -m diffzoo.data download, which hands '
                           f'img2dataset every row as it is')
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
        gone = listed_but_gone(self.sizes, [s.name for s in self.shards], self.directory)
        if gone:
            out.append(f'{SIZES_FILE} {gone}: deleted or moved, their samples are in no epoch or evaluation; put '
                       f'them back, or {fix} to count the shards that are there')
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
