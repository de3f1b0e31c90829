"""What diffzoo's data accounting costs the real training loader, at CC12M-like bookkeeping.

open_clip_train's own `get_wds_dataset` (shard shuffle, split by worker, sample shuffle, decode, the model's
training preprocess, tokenizer, batches of --data-batch, `with_epoch` from sizes.json) is read twice per
repetition, in alternating order: plain, and inside `diffzoo.train.seams.installed()` (seeded shuffles and the
per-sample journal of `diffzoo.train.data_events`) with the epoch's journal written as in training. The corpus has
CC12M's bookkeeping: sizes.json declares `shards` shards of `per_shard` samples (default 2,176 × 5,000), and each
shard name holds that many tiny images, so every worker's journal names as many shards and positions as a CC12M
epoch's would. The names are links to a few real tars (the bytes of 10.9 M samples are not the point; their
accounting is). Each read times `batches` batches once every worker has delivered its first; samples/s is the
median over the repetitions, the ratio plain / accounted (≤ 1.01 is the target); beside it the workers' CPU
seconds per batch, accounted / plain, and the slowdown the accounting's own CPU time implies (its stages alone
on the same samples against plain ones, over a worker core's time per sample): steadier where workers
outnumber cores. The journal's bytes per sample
trained give the bytes it writes per epoch (linear in samples: one appended line per batch).
"""
import argparse
import io
import json
import os
import resource
import statistics
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Dict, List

from .data import time_batches
from .measure import BenchError

REAL_TARS = 4  # distinct tar files behind the shard names


def _tiny_png(seed: int) -> bytes:
    from PIL import Image
    buf = io.BytesIO()
    Image.new('RGB', (8, 8), ((seed * 37) % 256, (seed * 11) % 256, 128)).save(buf, format='PNG')
    return buf.getvalue()


def write_corpus(root: Path, shards: int, per_shard: int) -> str:
    """`shards` shard names (links to REAL_TARS tars of `per_shard` samples) and sizes.json; the brace url."""
    pngs = [_tiny_png(i) for i in range(16)]
    for t in range(min(REAL_TARS, shards)):
        with tarfile.open(root / f'real-{t}.tar', 'w') as tar:
            for i in range(per_shard):
                for ext, data in (('png', pngs[i % len(pngs)]), ('txt', f'a tiny scene {i}'.encode())):
                    info = tarfile.TarInfo(f'{t:03d}{i:06d}.{ext}')
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    width = len(str(shards - 1))
    names = [f'{i:0{width}d}.tar' for i in range(shards)]
    for i, name in enumerate(names):
        os.symlink(root / f'real-{i % REAL_TARS}.tar', root / name)
    (root / 'sizes.json').write_text(json.dumps({name: per_shard for name in names}))
    return str(root / f'{{{0:0{width}d}..{shards - 1:0{width}d}}}.tar')


def _read(url: str, model: str, batch: int, workers: int, batches: int, accounted: bool) -> Dict:
    import open_clip
    import open_clip_train.data

    from diffzoo.train import data_events, data_report, seams

    if accounted:
        with seams.installed():
            events = os.environ[data_events.ENV]
            data_report.start_epoch(events, 0)
            row = _read(url, model, batch, workers, batches, accounted=False)
            row['journal_bytes'] = sum(p.stat().st_size for p in Path(events).glob('*.jsonl'))
            row['journal_samples'] = data_report.collect(events, 0)['trained']  # prefetched batches too
            return row
    cfg = open_clip.get_model_config(model)
    preprocess = open_clip.image_transform(cfg['vision_cfg'].get('image_size', 224), is_train=True)
    args = argparse.Namespace(train_data=url, train_num_samples=None, dataset_resampled=False, seed=0, rank=0,
                              world_size=1, workers=workers, batch_size=batch, train_data_upsampling_factors=None)
    info = open_clip_train.data.get_wds_dataset(args, preprocess, True, epoch=0, tokenizer=open_clip.get_tokenizer(model))
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    seen, counted, elapsed = time_batches(info.dataloader, workers, batches)
    epoch_samples = info.dataloader.num_samples
    del info  # stops the workers; their CPU time is the children's once they have been joined
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    worker_cpu = (after.ru_utime + after.ru_stime) - (cpu.ru_utime + cpu.ru_stime)
    return {'samples_timed': counted, 'seconds': elapsed, 'samples_per_s': counted / elapsed,
            'worker_cpu_s': worker_cpu, 'batches_seen': seen, 'epoch_samples': epoch_samples}


def stage_cost(samples: int = 20000, batch: int = 32, reps: int = 5) -> Dict:
    """CPU seconds per sample of the accounting alone: open_clip's caption filter, `to_tuple` and `batched`
    against diffzoo's counting ones (journal written) on the same decoded-free samples, medians of `reps`."""
    import webdataset as wds
    from open_clip_train.data import filter_no_caption_or_no_image

    from diffzoo.train import data_events, data_report, data_stages
    items = [{'__url__': f'shard-{i // 5000:05d}.tar', '__key__': f'{i:09d}', data_events.INDEX: i % 5000,
              'png': b'', 'txt': 'a caption'} for i in range(samples)]

    def plain():
        stages = wds.select(filter_no_caption_or_no_image)(iter(items))
        return wds.batched(batch, partial=False)(wds.to_tuple('png', 'txt')(stages))

    def counted():
        log = data_events._log()
        log.start_pass()
        stages = wds.select(data_events.filter_no_caption_or_no_image)(iter(items))
        return data_stages.Batched(batch, partial=False).run(data_stages.NumberedTuples('png', 'txt').run(stages))

    times = {'plain': [], 'accounted': []}
    with tempfile.TemporaryDirectory(prefix='diffzoo-bench-stages-') as events:
        previous = os.environ.get(data_events.ENV)
        os.environ[data_events.ENV] = events
        try:
            data_report.start_epoch(events, 0)
            for _ in range(reps):
                for name, make in (('plain', plain), ('accounted', counted)):
                    start = time.process_time()
                    for _ in make():
                        pass
                    times[name].append(time.process_time() - start)
        finally:
            os.environ.pop(data_events.ENV) if previous is None else os.environ.__setitem__(data_events.ENV, previous)
    plain_s, accounted_s = (statistics.median(times[n]) / samples for n in ('plain', 'accounted'))
    return {'samples': samples, 'plain_cpu_s_per_sample': plain_s, 'accounted_cpu_s_per_sample': accounted_s,
            'accounting_cpu_s_per_sample': accounted_s - plain_s}


def run(model: str, batch: int, workers: int, shards: int, per_shard: int, batches: int, reps: int) -> Dict:
    if shards < workers:
        raise BenchError(f'--data-shards {shards}: fewer shards than --workers {workers}')
    with tempfile.TemporaryDirectory(prefix='diffzoo-bench-accounting-') as tmp:
        print(f'  accounting: {shards:,} shard names of {per_shard:,} tiny samples, {workers} workers, '
              f'{batches} batches of {batch} per read, {reps} repetitions', flush=True)
        url = write_corpus(Path(tmp), shards, per_shard)
        reads: Dict[str, List[Dict]] = {'plain': [], 'accounted': []}
        for rep in range(reps):
            for accounted in ([False, True] if rep % 2 == 0 else [True, False]):
                row = _read(url, model, batch, workers, batches, accounted)
                reads['accounted' if accounted else 'plain'].append(row)
    speed = {name: {'median': statistics.median(r['samples_per_s'] for r in rows),
                    'min': min(r['samples_per_s'] for r in rows), 'max': max(r['samples_per_s'] for r in rows)}
             for name, rows in reads.items()}
    stages = stage_cost(batch=batch)
    # the accounting's own CPU time per sample against a worker core's time per sample: the slowdown it implies
    per_core = speed['plain']['median'] / min(workers, os.cpu_count() or 1)
    per_sample = statistics.median(r['journal_bytes'] / r['journal_samples'] for r in reads['accounted'])
    # the workers' CPU seconds per batch delivered (start-up and shuffle-buffer fill included, alike in both):
    # steadier than wall time where the workers outnumber the cores
    cpu = {name: statistics.median(r['worker_cpu_s'] / r['batches_seen'] for r in rows) for name, rows in reads.items()}
    epoch_samples = reads['accounted'][0]['epoch_samples']
    return {'model': model, 'batch': batch, 'workers': workers, 'shards': shards, 'per_shard': per_shard,
            'batches_timed': batches, 'reps': reps, 'epoch_samples': epoch_samples,
            'plain_samples_per_s': speed['plain'], 'accounted_samples_per_s': speed['accounted'],
            'slowdown': speed['plain']['median'] / speed['accounted']['median'],
            'worker_cpu_s_per_batch': cpu, 'cpu_ratio': cpu['accounted'] / cpu['plain'] if cpu['plain'] else None,
            'journal_bytes_per_sample': per_sample, 'journal_bytes_per_epoch': per_sample * epoch_samples,
            'stages': stages, 'stage_slowdown': 1 + stages['accounting_cpu_s_per_sample'] * per_core,
            'reads': reads}
