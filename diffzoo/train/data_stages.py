"""The stages of open_clip_train's webdataset pipeline that count what an epoch trains (`diffzoo.train.data_events`
keeps the journal they write to): `to_tuple` (`NumberedTuples`: a sample's shard and position go on with it),
`batched` (`Batched`: a batch's samples counted as trained before it leaves), and, for training, `WholePasses`:
a data-loader worker's passes over its shards batched as one stream, so that no sample is dropped at a pass's end.
`CountingWebdataset` is the webdataset module as open_clip_train.data sees it with these in place
(`diffzoo.train.seams`).
"""
import os
from typing import List, Optional

import torch
import webdataset
from webdataset.filters import _to_tuple, default_collation_fn

from diffzoo.data.shards import DataError

from .data_events import INDEX, _log, _ProcessLog


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
                    log.readable.setdefault(sample.get('__url__'), []).append(position)
                    result = _Numbered(result)
                    result.sample_id = (sample.get('__url__'), position)
                yield result


class Batched(webdataset.PipelineStage):
    """webdataset's `batched` (same batches), counting the samples of each batch as trained and writing
    the process's counts before the batch leaves, and counting the pass when its source is exhausted (a
    training pipeline's source, `WholePasses`, counts its own passes and never ends)."""

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
        if log is not None:
            log.passes += counted
            log.flush()

    @staticmethod
    def _count(batch: List, log: Optional[_ProcessLog]) -> bool:
        ids = [s.sample_id for s in batch if getattr(s, 'sample_id', None) is not None]
        if log is None or not ids:
            return False
        for url, position in ids:  # readable as trained, not written twice
            log.trained.setdefault(url, []).append(position)
            waiting = log.readable.get(url)
            if waiting and position in waiting:
                waiting.remove(position)
                if not waiting:
                    del log.readable[url]
        log.flush()
        return True


class WholePasses(webdataset.PipelineStage):
    """A data-loader worker's passes over its shards as one stream: the stages before `batched` run again each
    time a pass ends, so the last batch of a pass is completed by the first samples of the next, and no sample
    is dropped at a pass's end (webdataset's `with_epoch` alone restarts the pipeline and `batched` drops the
    partial batch, so a worker whose readable samples are not a multiple of the batch never trains the rest and
    trains its first samples again). An epoch is the first `with_epoch` batches of the stream; each epoch starts
    a new stream, so a resumed epoch replays the uninterrupted run's.

    It reads a sample ahead, so a pass's end is journalled (`passes`, its last samples readable) before its last
    sample leaves. A pass of fewer samples than a batch ends the run with a `DataError` naming the shards:
    every pass would make no batch of its own (open_clip_train alone repeats it forever), and a batch would hold
    a sample twice. A resampled source never ends a pass."""

    def __init__(self, pipeline, batchsize: int):
        self.pipeline, self.batchsize = pipeline, batchsize

    def run(self):
        log = _log()
        while True:
            samples, read, urls = iter(self.pipeline), 0, {}
            sample = next(samples, None)
            while True:
                following = None if sample is None else next(samples, None)
                if sample is not None:
                    read += 1
                    urls[(getattr(sample, 'sample_id', None) or (None,))[0]] = None
                if following is None:  # the pass ends with `sample` (None: an empty pass)
                    if log is not None:
                        log.passes += any(url is not None for url in urls)
                        log.flush()
                    if read < self.batchsize:
                        raise DataError(_no_full_batch(read, self.batchsize, [u for u in urls if u is not None]))
                    if sample is not None:
                        yield sample
                    break
                yield sample
                sample = following


def _no_full_batch(read: int, batch_size: int, urls: List[str]) -> str:
    info = torch.utils.data.get_worker_info()
    worker = f'data worker {info.id}' if info is not None else 'the data loader'
    rank = os.environ.get('RANK', '0')
    names = ', '.join(os.path.basename(u) for u in urls[:4]) + (f' and {len(urls) - 4} more' if len(urls) > 4 else '')
    folder = os.path.dirname(urls[0]) if urls else None
    where = f' ({names} in {folder})' if urls else ''
    check = f'python -m diffzoo.data check {folder}' if folder else 'python -m diffzoo.data check DIR'
    return (f'{worker} of rank {rank} read {read} sample(s) in a pass over its shards{where} and made no full batch '
            f'of {batch_size}; every pass would make none (open_clip_train alone repeats it forever), and a batch '
            f'would hold a sample twice, its own negative. The shards hold fewer '
            f'samples than the run counted on (a shard cut short, or sizes.json or --train-num-samples counting '
            f'more): run {check}, then python -m diffzoo.data sizes DIR --recount; or pass a smaller per-GPU '
            f'batch (--max_batch_per_gpu) or fewer --workers')


class CountingWebdataset:
    """The webdataset module as open_clip_train.data sees it: the same, but `to_tuple` and `batched`
    count the samples trained, and a training pipeline batches each worker's passes as one stream."""

    to_tuple = NumberedTuples
    batched = Batched

    def __init__(self, module):
        self._module = module

    def DataPipeline(self, *stages):  # webdataset's name
        """open_clip's pipeline; one that ends with `batched` without partial batches (training) batches
        `WholePasses` of the stages before it."""
        last = stages[-1]
        if not isinstance(last, Batched) or last.partial:
            return self._module.DataPipeline(*stages)
        return self._module.DataPipeline(WholePasses(self._module.DataPipeline(*stages[:-1]), last.batchsize), last)

    def __getattr__(self, name):
        return getattr(self._module, name)
