"""What the webdataset pipeline trained and skipped in one epoch, counted by sample, reported per epoch.

open_clip_train's pipeline already skips a bad sample (no caption, no image, a member that does
not decode) or shard (missing, truncated, empty) and goes on; it only logs a warning. The functions
here replace its pipeline functions (see `diffzoo.train.seams`; its `to_tuple` and `batched` stages:
`diffzoo.train.data_stages`) and count as well, per process and
epoch, into the journal `$DIFFZOO_DATA_EVENTS/<pid>-<epoch>.jsonl`: before a batch leaves the process,
one line is appended with what changed since the last line (the batch's samples by shard and position,
shards opened, samples skipped), so the journal is complete once the epoch's last batch has been
trained and costs a few bytes per sample (`python -m diffzoo.bench --sections data` measures it). Each shard
read to its end adds a line to `<pid>-<epoch>.shards.jsonl` (its counts and its keys, a few bits per key for
img2dataset's numbered keys), written before the shard's last sample leaves the reader.

A sample is named by its shard url and its position in the shard (0-based, as the tar holds it);
its key names it in examples. Every count is of distinct samples or shards within one epoch, the
union over data-loader workers and ranks (not their sum):

- samples trained: samples in the batches handed to open_clip's training loop.
- repeats: samples trained that were already trained earlier in the same epoch, by any worker or
  rank (a worker goes on from its first shard again once its shards are read: its last batch of a pass is
  completed by the next pass's first samples, as an epoch of whole batches needs, and an epoch that sizes.json
  or --train-num-samples makes longer than the data takes more; `--dataset-resampled` draws shards with
  replacement); distinct = trained - repeats.
- skipped samples: distinct bad samples (shard url + position), each under one reason; a bad
  sample met again on a re-read is one sample, its extra meetings are counted as repeats.
- skipped shards: distinct shard urls.
- readable samples: distinct samples that reached a batch (caption, image, decoded); the exact
  number the shards hold once every process has read all its shards at least once this epoch.
- shards read to their end: distinct shard urls whose every sample a process handed on, without an error
  in the shard; for each, its samples, those with an image (what sizes.json counts; `data_report` compares
  them with it) and its keys.
- key repeats: samples of the shards read to their end whose `__key__` another sample of them has (the same key
  twice in a tar, a shard copied under a second name): a key held by n samples is n - 1 repeats, each sample
  counted once however often it is read. They are trained, as open_clip trains them.

Under `data_backend: device` the workers batch images undecoded (`diffzoo.train.device_data`) and the training
process decodes them; what it cannot decode, it journals itself (`device_log`, `device-<pid>-<epoch>.jsonl`): the
skip, under the same reason as a worker's, and the sample as `untrained` (the worker counted it trained when its
batch left), with the samples trained again to fill the holes and the images PIL decoded. The counts above are
then the same as open_clip's pipeline gives.

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
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Optional

from open_clip_train.data import group_by_keys_nothrow
from open_clip_train.data import log_and_continue as _open_clip_log_and_continue
from webdataset.tariterators import tar_file_expander as _webdataset_tar_file_expander
from webdataset.tariterators import url_opener

from diffzoo.data.keys import shard_keys
from diffzoo.data.shards import IMAGE_EXTS  # IMAGE_EXTS: what open_clip_train renames to `image`

ENV = 'DIFFZOO_DATA_EVENTS'
REPORT_FILE = 'data.jsonl'  # in the run directory, a record per epoch (diffzoo.train.data_report)
EPOCH_FILE = 'epoch'
SHARDS_SUFFIX = '.shards.jsonl'  # `<pid>-<epoch>.shards.jsonl`: a line per shard read to its end
DEVICE_PREFIX = 'device-'  # `device-<pid>-<epoch>.jsonl`: the training process's lines under data_backend device
DEVICE_COUNTS = ('pil_decodes', 'fill_repeats')  # what that journal counts besides skips (diffzoo.train.device_loader)
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


def mark(bits: Dict[str, int], url: str, position: int) -> None:
    """Set bit `position` of shard `url`'s set of positions (a Python int used as a bit set)."""
    bits[url] = bits.get(url, 0) | (1 << position)


def union(into: Dict[str, int], other: Dict[str, int]) -> None:
    for url, bits in other.items():
        into[url] = into.get(url, 0) | bits


def size(bits: Dict[str, int]) -> int:
    return sum(b.bit_count() for b in bits.values())


class _ProcessLog:
    """One process's journal (a data-loader worker, or the trainer with workers=0): what happened since the
    last line, appended as one JSON line per batch; `data_report.collect` adds the lines up."""

    def __init__(self, directory: str, prefix: str = ''):
        self.where, self.directory, self.pid, self.prefix = directory, Path(directory), os.getpid(), prefix
        self.epoch: Optional[int] = None
        self.file = self.shards_file = None
        self.reset()

    def reset(self) -> None:
        self.opened: List[str] = []  # shard urls opened (each time)
        self.read = 0  # samples read (each time), as the caption filter met them
        self.trained: Dict[str, List[int]] = {}  # shard url -> positions trained
        self.readable: Dict[str, List[int]] = {}  # shard url -> positions that reached to_tuple, not yet trained
        self.skips: List[list] = []  # [reason, url, position, key], as met
        self.passes = 0  # passes over this process's shards completed
        self.last_sample = (None, None, None)  # (url, position, key) of the sample being decoded
        self.untrained: Dict[str, List[int]] = {}  # data_backend device: positions a worker counted, not trained
        self.device: Dict[str, int] = {}  # data_backend device: 'pil_decodes', 'fill_repeats'

    def start_pass(self) -> None:
        """A pass over this process's shards begins: a new epoch (as `start_epoch` wrote it) starts a new journal."""
        try:
            epoch = int((self.directory / EPOCH_FILE).read_text())
        except (OSError, ValueError):
            epoch = None
        if epoch != self.epoch:
            self.flush()
            for file in (self.file, self.shards_file):
                if file is not None:
                    file.close()
            self.epoch, self.file, self.shards_file = epoch, None, None
            self.reset()

    def skip(self, reason: str, url: Optional[str], position: Optional[int], key: Optional[str]) -> None:
        self.skips.append([reason, url, position, key])

    def shard_read(self, url: str, keys: List[str], images: int) -> None:
        """A shard read to its end: its samples (`keys`, in order) and how many have an image, as a line of
        this epoch's shards file, written at once."""
        groups, repeats = shard_keys(keys)
        if self.shards_file is None:
            self.shards_file = open(self.directory / f'{self.pid}-{self.epoch}{SHARDS_SUFFIX}', 'a')
        line = {'url': url, 'samples': len(keys), 'images': images, 'keys': groups, 'key_repeats': repeats}
        self.shards_file.write(json.dumps(line, separators=(',', ':')) + '\n')
        self.shards_file.flush()

    def flush(self) -> None:
        """Append what changed since the last line, if anything did."""
        line = {name: value for name, value in (('open', self.opened), ('read', self.read), ('trained', self.trained),
                                                ('readable', self.readable), ('skip', self.skips),
                                                ('passes', self.passes), ('untrained', self.untrained),
                                                ('device', self.device)) if value}
        if not line:
            return
        if self.file is None:  # this epoch's journal (epoch None: what is read outside the training epochs)
            self.file = open(self.directory / f'{self.prefix}{self.pid}-{self.epoch}.jsonl', 'a')
        self.file.write(json.dumps(line, separators=(',', ':')) + '\n')
        self.file.flush()  # the trainer reads the journal once it holds the batch
        last_sample = self.last_sample
        self.reset()
        self.last_sample = last_sample


_LOG: Optional[_ProcessLog] = None
_DEVICE_LOG: Optional[_ProcessLog] = None


def _log() -> Optional[_ProcessLog]:
    global _LOG
    directory = os.environ.get(ENV)
    if not directory:
        return None
    if _LOG is None or _LOG.where != directory or _LOG.pid != os.getpid():  # (per sample: no Path built)
        _LOG = _ProcessLog(directory)  # new process (a forked worker starts with its parent's object)
    return _LOG


def device_log() -> Optional[_ProcessLog]:
    """The training process's own journal under data_backend device (`diffzoo.train.device_loader`): images
    skipped after a worker counted them as trained (`untrained`), samples trained again to fill the epoch's last
    batch, PIL decodes; `data_report.collect` adds it to the workers' journals but not to the loader processes."""
    global _DEVICE_LOG
    directory = os.environ.get(ENV)
    if not directory:
        return None
    if _DEVICE_LOG is None or _DEVICE_LOG.where != directory or _DEVICE_LOG.pid != os.getpid():
        _DEVICE_LOG = _ProcessLog(directory, DEVICE_PREFIX)
    return _DEVICE_LOG


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
    each numbered by its position in the shard; counts shards opened, empty and broken ones, and notes
    each shard read to its end with its keys and samples with an image."""
    for source in streams:
        url = source.get('url')
        if log is not None:
            log.opened.append(url)
        state = {'failed': False, 'go_on': True}
        files = _webdataset_tar_file_expander([source], handler=_counting_shard_errors(handler, url, log, state))
        samples = group_by_keys_nothrow(files, handler=handler)
        sample, keys, images = next(samples, None), [], 0
        if log is not None and sample is None and not state['failed']:
            log.skip('empty_shard', url, None, None)
        position = 0
        while sample is not None:
            following = next(samples, None)  # read one ahead: the shard's end is known before its last sample leaves
            sample[INDEX] = position
            if log is not None:
                keys.append(sample['__key__'])
                images += not sample.keys().isdisjoint(IMAGE_EXTS)
                if following is None and not state['failed']:
                    log.shard_read(url, keys, images)
            yield sample
            sample, position = following, position + 1
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
