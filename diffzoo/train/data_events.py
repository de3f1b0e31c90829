"""What the webdataset pipeline skipped, counted in the data-loader workers, reported per epoch.

open_clip_train's pipeline already skips a bad sample (no caption, no image, a member that does
not decode) or shard (missing, truncated, empty) and goes on; it only logs a warning. The functions
here replace three of its pipeline functions (see `diffzoo.train.seams`) and count as well, per
process, into `$DIFFZOO_DATA_EVENTS/<pid>.json` (cumulative, rewritten atomically). At the end of
an epoch each rank sums its workers' files (`collect`) and subtracts the previous sum.

One difference in what is trained: a blank caption counts as none and its sample is skipped
(img2dataset writes an empty `.txt` where the URL list had no caption; open_clip would train on it).

The replacements are module-level functions that open_clip_train puts into its pipeline when it
builds it, so data-loader workers started by fork, spawn or forkserver all run them. A decode error
carries no sample key; it is attributed to the last sample that passed the caption filter, which is
the one being decoded (select and decode are consecutive pipeline stages).
"""
import json
import os
import tarfile
import time
from collections import Counter
from pathlib import Path
from typing import Dict, Iterable, Iterator, Optional

from open_clip_train.data import group_by_keys_nothrow
from open_clip_train.data import log_and_continue as _open_clip_log_and_continue
from webdataset.tariterators import tar_file_expander as _webdataset_tar_file_expander
from webdataset.tariterators import url_opener

from diffzoo.data.shards import IMAGE_EXTS  # what open_clip_train renames to `image`

ENV = 'DIFFZOO_DATA_EVENTS'
REASONS = {
    'undecodable_image': 'undecodable image',
    'undecodable_text': 'undecodable caption or json',
    'no_caption': 'without caption',
    'no_image': 'without image',
    'unreadable_shard': 'unreadable shard',
    'empty_shard': 'empty shard',
}
MAX_EXAMPLES = 20


class _ProcessLog:
    """Cumulative counts for one process (a data-loader worker, or the trainer with workers=0)."""

    def __init__(self, directory: str):
        self.path = Path(directory) / f'{os.getpid()}.json'
        self.shards: Counter = Counter()  # shard url -> times opened
        self.samples: Counter = Counter()  # shard url -> samples read
        self.skipped: Counter = Counter()  # reason -> count
        self.examples: Counter = Counter()  # (reason, shard url, key) -> times skipped
        self.last_sample = (None, None)
        self._flushed = 0.0

    def skip(self, reason: str, url: Optional[str], key: Optional[str]) -> None:
        self.skipped[reason] += 1
        example = (reason, url, key)
        if example in self.examples or len(self.examples) < MAX_EXAMPLES:
            self.examples[example] += 1  # counted again when a later epoch meets it again
        self.flush()

    def flush(self, every: float = 0.0) -> None:
        now = time.monotonic()
        if now - self._flushed < every:
            return
        self._flushed = now
        tmp = self.path.with_suffix('.tmp')
        tmp.write_text(json.dumps({'shards': self.shards, 'samples': self.samples,
                                   'skipped': self.skipped,
                                   'examples': [[*e, n] for e, n in self.examples.items()]}))
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
    log = _log()
    url, key = sample.get('__url__'), sample.get('__key__')
    has_image = any(ext in sample for ext in IMAGE_EXTS)
    text = sample.get('txt')
    has_caption = text is not None and bool(text.strip())
    if log is not None:
        log.samples[url] += 1
        if not has_image:
            log.skip('no_image', url, key)
        elif not has_caption:
            log.skip('no_caption', url, key)
        else:
            log.last_sample = (url, key)
            log.flush(every=2.0)
    return has_image and has_caption


def _shard_url(exn) -> Optional[str]:
    """webdataset appends the shard's url to the args of an exception raised while reading it."""
    return next((a for a in reversed(exn.args) if isinstance(a, str) and a.endswith('.tar')), None)


def log_and_continue(exn) -> bool:
    """open_clip_train's `log_and_continue` (the decode stage's handler), counting what it skips."""
    log = _log()
    if log is not None:
        if isinstance(exn, tarfile.TarError) or _shard_url(exn):  # a shard, in the resampled pipeline
            log.skip('unreadable_shard', _shard_url(exn), None)
        elif isinstance(exn, (UnicodeDecodeError, json.JSONDecodeError)):
            log.skip('undecodable_text', *log.last_sample)
        else:
            log.skip('undecodable_image', *log.last_sample)
    return _open_clip_log_and_continue(exn)


def _counting_shard_errors(handler, url: str, log: Optional[_ProcessLog], state: dict):
    """A handler for one shard's errors: the shard counts once as unreadable, however many errors."""
    def shard_handler(exn) -> bool:
        if log is not None and not state['failed']:
            log.skip('unreadable_shard', url, None)
        state['failed'] = True
        state['go_on'] = handler(exn)
        return state['go_on']
    return shard_handler


def _tar_file_expander(data: Iterable[Dict], handler) -> Iterator[Dict]:
    """webdataset's `tar_file_expander`, one shard at a time: counts shards opened, empty and broken ones."""
    for source in data:
        url = source.get('url')
        log = _log()
        if log is not None:
            log.shards[url] += 1
            log.flush()
        state = {'failed': False, 'go_on': True}
        files = 0
        shard_handler = _counting_shard_errors(handler, url, log, state)
        for sample in _webdataset_tar_file_expander([source], handler=shard_handler):
            files += 1
            yield sample
        if log is not None and files == 0 and not state['failed']:
            log.skip('empty_shard', url, None)
        if not state['go_on']:
            return


def tarfile_to_samples_nothrow(src, handler=_open_clip_log_and_continue):
    """open_clip_train's shard reader (open, expand, group members into samples), counting shards
    opened, empty, and unreadable or missing."""
    def open_failed(exn) -> bool:
        log = _log()
        if log is not None:
            log.skip('unreadable_shard', _shard_url(exn), None)
        return handler(exn)

    streams = url_opener(src, handler=open_failed)
    files = _tar_file_expander(streams, handler=handler)
    return group_by_keys_nothrow(files, handler=handler)


def collect(directory) -> Dict:
    """Sum of every process file in `directory`."""
    total = {'shards': Counter(), 'samples': Counter(), 'skipped': Counter(), 'examples': Counter()}
    for path in sorted(Path(directory).glob('*.json')):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # being replaced right now; the next collect sees it
        for name in ('shards', 'samples', 'skipped'):
            total[name].update(data.get(name, {}))
        for reason, url, key, n in data.get('examples', []):
            total['examples'][reason, url, key] += n
    return total


def delta(before: Dict, after: Dict) -> Dict:
    """What happened between two `collect` results."""
    return {
        'shards': dict(after['shards'] - before['shards']),
        'samples_read': sum((after['samples'] - before['samples']).values()),  # as last flushed
        'skipped': dict(after['skipped'] - before['skipped']),
        'examples': [list(e) for e, n in after['examples'].items() if n > before['examples'][e]][:MAX_EXAMPLES],
    }


def summary(epoch: int, samples: int, per_rank: list) -> str:
    """One paragraph for the log: shards per rank, samples trained, what was skipped with examples."""
    shards = [sorted(os.path.basename(s) for s in r['shards']) for r in per_rank]
    lines = [f'epoch {epoch} data: {samples:,} samples trained, from '
             f'{len(set().union(*map(set, shards)))} shards read by {len(per_rank)} process(es)']
    if len(per_rank) > 1:
        for rank, names in enumerate(shards):
            lines.append(f'  rank {rank}: ' + ' '.join(names[:12]) + (' …' if len(names) > 12 else ''))
    skipped = Counter()
    for r in per_rank:
        skipped.update(r['skipped'])
    if not skipped:
        lines.append('  nothing skipped')
    for reason, n in sorted(skipped.items()):
        examples = list({tuple(e): e for r in per_rank for e in r['examples'] if e[0] == reason}.values())[:3]
        where = ', '.join(os.path.basename(str(u)) + (f'/{k}' if k else '') for _, u, k in examples)
        lines.append(f'  skipped {n} {REASONS.get(reason, reason)}{"s" if n != 1 and reason.endswith("shard") else ""}'
                     + (f' ({where})' if where else ''))
    return '\n'.join(lines)
