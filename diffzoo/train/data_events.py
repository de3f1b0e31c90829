"""What the webdataset pipeline trained and skipped in one epoch, counted by sample, reported per epoch.

open_clip_train's pipeline already skips a bad sample (no caption, no image, a member that does
not decode) or shard (missing, truncated, empty) and goes on; it only logs a warning. The functions
here replace its pipeline functions (see `diffzoo.train.seams`) and count as well, per process,
into `$DIFFZOO_DATA_EVENTS/<pid>.json` (rewritten atomically before every batch leaves the process,
so the file is complete once the epoch's last batch has been trained).

A sample is named by its shard url and its position in the shard (0-based, as the tar holds it);
its key names it in examples. Every count is of distinct samples or shards within one epoch, the
union over data-loader workers and ranks (not their sum):

- samples trained: samples in the batches handed to open_clip's training loop.
- repeats: samples trained that were already trained earlier in the same epoch, by any worker or
  rank (the loader starts again from the first shard to fill an epoch that sizes.json or
  --train-num-samples makes longer than the data, and `--dataset-resampled` draws shards with
  replacement); distinct = trained - repeats.
- skipped samples: distinct bad samples (shard url + position), each under one reason; a bad
  sample met again on a re-read is one sample, its extra meetings are counted as repeats.
- skipped shards: distinct shard urls.
- readable samples: distinct samples that reached a batch (caption, image, decoded); the exact
  number the shards hold once every process has read all its shards at least once this epoch.

One difference in what is trained: a blank caption counts as none and its sample is skipped
(img2dataset writes an empty `.txt` where the URL list had no caption; open_clip would train on it).

The replacements are module-level functions and classes that open_clip_train puts into its pipeline
when it builds it, so data-loader workers started by fork, spawn or forkserver all run them. A worker
learns the epoch from `$DIFFZOO_DATA_EVENTS/epoch` (written by `start_epoch`) when it starts a pass
over its shards. A decode error carries no sample key; it is attributed to the last sample that
passed the caption filter, which is the one being decoded (select and decode are consecutive stages).
"""
import json
import os
import tarfile
from collections import Counter
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Optional

import webdataset
from open_clip_train.data import group_by_keys_nothrow
from open_clip_train.data import log_and_continue as _open_clip_log_and_continue
from webdataset.filters import _to_tuple, default_collation_fn
from webdataset.tariterators import tar_file_expander as _webdataset_tar_file_expander
from webdataset.tariterators import url_opener

from diffzoo.data.shards import IMAGE_EXTS  # what open_clip_train renames to `image`

ENV = 'DIFFZOO_DATA_EVENTS'
REPORT_FILE = 'data.jsonl'  # in the run directory, a record per epoch (diffzoo.train.data_report)
EPOCH_FILE = 'epoch'
INDEX = '__index__'  # a sample's position in its shard, set by `tarfile_to_samples_nothrow`
SAMPLE_REASONS = {
    'undecodable_image': 'undecodable image',
    'undecodable_text': 'undecodable caption or json',
    'no_caption': 'without caption',
    'no_image': 'without image',
}
SHARD_REASONS = {
    'unreadable_shard': 'unreadable shard',
    'empty_shard': 'empty shard',
}
REASONS = {**SAMPLE_REASONS, **SHARD_REASONS}
MAX_EXAMPLES = 20


def _mark(bits: Dict[str, int], url: str, position: int) -> None:
    """Set bit `position` of shard `url`'s set of positions (a Python int used as a bit set)."""
    bits[url] = bits.get(url, 0) | (1 << position)


def union(into: Dict[str, int], other: Dict[str, int]) -> None:
    for url, bits in other.items():
        into[url] = into.get(url, 0) | bits


def size(bits: Dict[str, int]) -> int:
    return sum(b.bit_count() for b in bits.values())


class _ProcessLog:
    """One epoch's counts for one process (a data-loader worker, or the trainer with workers=0)."""

    def __init__(self, directory: str):
        self.directory = Path(directory)
        self.path = self.directory / f'{os.getpid()}.json'
        self.epoch: Optional[int] = None
        self.reset()

    def reset(self) -> None:
        self.shards: Counter = Counter()  # shard url -> times opened
        self.read = 0  # samples read (each time), as the caption filter met them
        self.trained = 0  # samples trained (each time)
        self.trained_bits: Dict[str, int] = {}  # shard url -> positions trained
        self.readable_bits: Dict[str, int] = {}  # shard url -> positions that reached a batch
        self.bad_bits: Dict[str, Dict[str, int]] = {}  # sample reason -> shard url -> positions
        self.bad_shards: Dict[str, set] = {}  # shard reason -> urls
        self.events: Counter = Counter()  # reason -> times met
        self.examples: Dict[tuple, None] = {}  # (reason, url, key), first met first
        self.passes = 0  # passes over this process's shards completed
        self.last_sample = (None, None, None)  # (url, position, key) of the sample being decoded

    def start_pass(self) -> None:
        """A pass over this process's shards begins: a new epoch (as `start_epoch` wrote it) starts afresh."""
        try:
            epoch = int((self.directory / EPOCH_FILE).read_text())
        except (OSError, ValueError):
            epoch = None
        if epoch != self.epoch:
            self.epoch = epoch
            self.reset()

    def skip(self, reason: str, url: Optional[str], position: Optional[int], key: Optional[str]) -> None:
        self.events[reason] += 1
        if reason in SHARD_REASONS:
            self.bad_shards.setdefault(reason, set()).add(url)
        elif position is not None:
            _mark(self.bad_bits.setdefault(reason, {}), url, position)
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.setdefault((reason, url, key), None)

    def flush(self) -> None:
        tmp = self.path.with_suffix('.tmp')
        tmp.write_text(json.dumps({
            'epoch': self.epoch, 'shards': self.shards, 'read': self.read, 'trained': self.trained,
            'trained_bits': {u: format(b, 'x') for u, b in self.trained_bits.items()},
            'readable_bits': {u: format(b, 'x') for u, b in self.readable_bits.items()},
            'bad_bits': {r: {u: format(b, 'x') for u, b in bits.items()} for r, bits in self.bad_bits.items()},
            'bad_shards': {r: sorted(urls, key=str) for r, urls in self.bad_shards.items()},
            'events': self.events, 'examples': list(self.examples), 'passes': self.passes}))
        os.replace(tmp, self.path)


_LOG: Optional[_ProcessLog] = None


def _log() -> Optional[_ProcessLog]:
    global _LOG
    directory = os.environ.get(ENV)
    if not directory:
        return None
    if _LOG is None or _LOG.path.parent != Path(directory) or _LOG.path.stem != str(os.getpid()):
        _LOG = _ProcessLog(directory)  # new process (a forked worker starts with its parent's object)
    return _LOG


def filter_no_caption_or_no_image(sample: Dict) -> bool:
    """open_clip_train's sample filter, counting what it drops; a blank caption counts as none."""
    url, position, key = sample.get('__url__'), sample.get(INDEX), sample.get('__key__')
    has_image = any(ext in sample for ext in IMAGE_EXTS)
    text = sample.get('txt')
    has_caption = text is not None and bool(text.strip())
    log = _log()
    if log is not None:  # (validation shards are read unnumbered: events and examples, no distinct counts)
        log.read += 1
        if not has_image:
            log.skip('no_image', url, position, key)
        elif not has_caption:
            log.skip('no_caption', url, position, key)
        else:
            log.last_sample = (url, position, key)
    return has_image and has_caption


def _shard_url(exn) -> Optional[str]:
    """webdataset appends the shard's url to the args of an exception raised while reading it."""
    return next((a for a in reversed(exn.args) if isinstance(a, str) and a.endswith('.tar')), None)


def log_and_continue(exn) -> bool:
    """open_clip_train's `log_and_continue` (the decode stage's handler), counting what it skips."""
    log = _log()
    if log is not None:
        if isinstance(exn, tarfile.TarError) or _shard_url(exn):  # a shard, read by another handler's stage
            log.skip('unreadable_shard', _shard_url(exn), None, None)
        elif isinstance(exn, (UnicodeDecodeError, json.JSONDecodeError)):
            log.skip('undecodable_text', *log.last_sample)
        else:
            log.skip('undecodable_image', *log.last_sample)
    return _open_clip_log_and_continue(exn)


def _counting_shard_errors(handler, url: str, log: Optional[_ProcessLog], state: dict):
    """A handler for one shard's errors: the shard is unreadable once per reading, however many errors."""
    def shard_handler(exn) -> bool:
        if log is not None and not state['failed']:
            log.skip('unreadable_shard', url, None, None)
        state['failed'] = True
        state['go_on'] = handler(exn)
        return state['go_on']
    return shard_handler


def _numbered_samples(streams: Iterable[Dict], handler, log: Optional[_ProcessLog]) -> Iterator[Dict]:
    """Each opened shard's members grouped into samples (open_clip's grouping, one shard at a time),
    each numbered by its position in the shard; counts shards opened, empty and broken ones."""
    for source in streams:
        url = source.get('url')
        if log is not None:
            log.shards[url] += 1
        state = {'failed': False, 'go_on': True}
        files = _webdataset_tar_file_expander([source], handler=_counting_shard_errors(handler, url, log, state))
        position = -1
        for position, sample in enumerate(group_by_keys_nothrow(files, handler=handler)):
            sample[INDEX] = position
            yield sample
        if log is not None and position < 0 and not state['failed']:
            log.skip('empty_shard', url, None, None)
        if not state['go_on']:
            return


def tarfile_to_samples_nothrow(src, handler=_open_clip_log_and_continue):
    """open_clip_train's shard reader (open, expand, group members into samples), numbering each
    sample by its position in its shard and counting shards opened, empty, and unreadable or missing."""
    log = _log()
    if log is not None:
        log.start_pass()

    def open_failed(exn) -> bool:
        if log is not None:
            log.skip('unreadable_shard', _shard_url(exn), None, None)
        return handler(exn)

    return _numbered_samples(url_opener(src, handler=open_failed), handler, log)


class _Numbered(tuple):
    """A sample as `to_tuple` makes it, still knowing which sample it is: (url, position)."""
    sample_id = None


class NumberedTuples(webdataset.PipelineStage):
    """webdataset's `to_tuple`, counting the samples that reach it as readable and passing on their
    (url, position) to `Batched`."""

    def __init__(self, *args, **kw):
        self.args, self.kw = args, kw

    def run(self, src):
        log = _log()
        for sample in src:
            position = sample.get(INDEX)
            for result in _to_tuple([sample], *self.args, **self.kw):
                if log is not None and position is not None:
                    _mark(log.readable_bits, sample.get('__url__'), position)
                    result = _Numbered(result)
                    result.sample_id = (sample.get('__url__'), position)
                yield result


class Batched(webdataset.PipelineStage):
    """webdataset's `batched` (same batches), counting the samples of each batch as trained and writing
    the process's counts before the batch leaves, and counting the pass when its source is exhausted."""

    def __init__(self, batchsize: int = 20, collation_fn=default_collation_fn, partial: bool = True):
        self.batchsize, self.collation_fn, self.partial = batchsize, collation_fn, partial

    def run(self, src):
        log = _log()
        batch, counted = [], False
        for sample in src:
            batch.append(sample)
            if len(batch) == self.batchsize:
                counted |= self._count(batch, log)
                yield self.collation_fn(batch) if self.collation_fn is not None else batch
                batch = []
        if batch and self.partial:
            counted |= self._count(batch, log)
            yield self.collation_fn(batch) if self.collation_fn is not None else batch
        elif batch:
            counted |= any(getattr(s, 'sample_id', None) for s in batch)
        if log is not None:
            log.passes += counted
            log.flush()

    @staticmethod
    def _count(batch: List, log: Optional[_ProcessLog]) -> bool:
        ids = [s.sample_id for s in batch if getattr(s, 'sample_id', None) is not None]
        if log is None or not ids:
            return False
        for url, position in ids:
            log.trained += 1
            _mark(log.trained_bits, url, position)
        log.flush()
        return True


class CountingWebdataset:
    """The webdataset module as open_clip_train.data sees it: the same, but `to_tuple` and `batched`
    count the samples trained."""

    to_tuple = NumberedTuples
    batched = Batched

    def __init__(self, module):
        self._module = module

    def __getattr__(self, name):
        return getattr(self._module, name)
