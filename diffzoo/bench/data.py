"""The webdataset input pipeline: decoded, preprocessed images per second, per DataLoader worker.

The pipeline is open_clip_train's `get_wds_dataset` for training, stage for stage, without the
shuffle buffers: shard list → split_by_worker → tar samples → drop samples without image or caption
→ decode jpg to PIL RGB → the model's training preprocess (open_clip `image_transform(is_train=True)`)
and tokenizer → (image, text) tuples → batches, read through `wds.WebLoader`. Without `--data`, a
synthetic corpus (`diffzoo.data.synthetic`) is written to a temporary directory first.

Each worker count runs one pass over the shards; the clock starts when every worker has delivered
its first batch (worker start-up and the first decode excluded) and the images counted are those
after it. Per-worker throughput is the total divided by the worker count.

`worker_cpu`: a worker's CPU seconds per sample (`time.process_time` over one pass in this process, with one
torch thread as a DataLoader worker has) for open_clip's pipeline and for `data_backend: device`'s worker side
(headers, crop boxes, tokens, encoded batches: `diffzoo.train.device_data`), their ratio, and the device side's
wall and CPU time per batch (decode, crop, resize, normalise on the device: `diffzoo.train.device_loader`; on the
CPU with the bench's torch threads), medians with the first batch left out.
"""
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Dict, List, Optional, Sequence

from diffzoo.data.synthetic import CorpusConfig, write_corpus
from diffzoo.train.device_data import EncodedCollation, TrainTransform, encoded_image, kept_encoded
from diffzoo.train.device_loader import DeviceLoader

from .measure import BenchError

SHARDS = 32  # synthetic shards: enough for 32 workers to each get one


def shard_urls(directory) -> List[str]:
    path = Path(directory)
    for candidate in (path, path / 'train'):
        shards = sorted(str(p) for p in candidate.glob('*.tar')) if candidate.is_dir() else []
        if shards:
            return shards
    raise BenchError(f'--data {directory}: no *.tar shards in it or in its train/ directory; pass a directory '
                     f'of webdataset shards, or leave --data out to benchmark on a generated synthetic corpus')


def train_transform(model: str):
    import open_clip
    cfg = open_clip.get_model_config(model)
    if cfg is None:
        raise BenchError(f'--data-model {model}: not an open_clip model config')
    return open_clip.image_transform(cfg['vision_cfg'].get('image_size', 224), is_train=True)


def pipeline(urls: Sequence[str], model: str, batch: int, backend: str = 'open_clip'):
    """open_clip_train's training stages; `backend` 'device': with data_backend device's worker side."""
    import open_clip
    import webdataset as wds
    from open_clip_train.data import filter_no_caption_or_no_image, log_and_continue, tarfile_to_samples_nothrow

    preprocess = train_transform(model)
    tokenizer = open_clip.get_tokenizer(model)
    if backend == 'device':
        decode = wds.decode(encoded_image, handler=log_and_continue)
        batched = wds.batched(batch, collation_fn=EncodedCollation(TrainTransform.of(preprocess)), partial=True)
        preprocess = kept_encoded
    else:
        decode, batched = wds.decode('pilrgb', handler=log_and_continue), wds.batched(batch, partial=True)
    return wds.DataPipeline(
        wds.SimpleShardList(list(urls)),
        wds.split_by_worker,
        tarfile_to_samples_nothrow,
        wds.select(filter_no_caption_or_no_image),
        decode,
        wds.rename(image='jpg;png;jpeg;webp', text='txt'),
        wds.map_dict(image=preprocess, text=lambda text: tokenizer(text)[0]),
        wds.to_tuple('image', 'text'),
        batched,
    )


def time_batches(loader, workers: int, limit: Optional[int] = None):
    """(batches read, images timed, seconds): the clock starts once every worker has delivered its first batch
    and counts the images after it, up to `limit` timed batches (None: the whole loader)."""
    started, counted, batches = None, 0, 0
    for images, _ in loader:  # images: (b, 3, S, S)
        batches += 1
        if started is None:
            if batches >= workers:  # every worker has delivered its first batch
                started = time.perf_counter()
            continue
        counted += images.shape[0]
        if limit is not None and batches >= workers + limit:
            break
    return batches, counted, time.perf_counter() - started if started is not None else 0.0


def measure(urls: Sequence[str], model: str, batch: int, workers: int) -> Dict:
    import webdataset as wds
    workers = min(workers, len(urls))
    loader = wds.WebLoader(pipeline(urls, model, batch), batch_size=None, shuffle=False, num_workers=workers)
    batches, counted, elapsed = time_batches(loader, workers)
    if counted == 0 or elapsed <= 0:
        raise BenchError(f'data: {workers} workers read only {batches} batches of {batch}; the corpus is too small '
                         f'to time, pass --data-samples larger or --data-batch smaller')
    total = counted / elapsed
    return {'workers': workers, 'batches': batches, 'images_timed': counted, 'seconds': elapsed,
            'images_per_s': total, 'images_per_s_per_worker': total / workers}


def worker_cpu(urls: Sequence[str], model: str, batch: int, device) -> Dict:
    """CPU seconds per sample of a worker, open_clip's pipeline and data_backend device's, and the device side's
    seconds per batch (module docstring)."""
    import torch

    out, encoded, threads = {}, [], torch.get_num_threads()
    torch.set_num_threads(1)  # as in a DataLoader worker
    try:
        for backend in ('open_clip', 'device'):
            stages = pipeline(urls, model, batch, backend)
            start, samples = time.process_time(), 0  # (building the stages left out: imports, the tokenizer)
            for images, tokens in stages:
                samples += tokens.shape[0]
                if backend == 'device':
                    encoded.append((images, tokens))
            out[f'{backend}_cpu_s_per_sample'] = (time.process_time() - start) / max(1, samples)
    finally:
        torch.set_num_threads(threads)
    transform, source = TrainTransform.of(train_transform(model)), SimpleNamespace(num_batches=0, num_samples=0)
    default = DeviceLoader(source, transform, batch, device)
    timed = {}  # batched: (seconds, CPU seconds) per batch; one resized_crop per image (the CPU's), the batch at once
    for loader in (default, DeviceLoader(source, transform, batch, device, batched=not default.batched)):
        seconds, cpu_seconds = [], []
        for images, tokens in encoded:
            start, cpu_start = time.perf_counter(), time.process_time()
            loader.batch(list(loader.decoded(images, tokens, None)), None)
            if device.type == 'cuda':
                torch.cuda.synchronize(device)
            seconds.append(time.perf_counter() - start)
            cpu_seconds.append(time.process_time() - cpu_start)
        timed[loader.batched] = tuple(statistics.median(t[1:] or t) for t in (seconds, cpu_seconds))
    per_batch, cpu_per_batch = timed[default.batched]
    return {**out, 'ratio': out['device_cpu_s_per_sample'] / out['open_clip_cpu_s_per_sample'],
            'samples': samples, 'batch': batch, 'device': str(device), 'device_s_per_batch': per_batch,
            'device_s_per_sample': per_batch / batch, 'device_cpu_s_per_batch': cpu_per_batch,
            'device_batched': default.batched, 'device_s_per_batch_per_image': timed[False][0],
            'device_s_per_batch_batched': timed[True][0],
            'device_threads': threads if device.type == 'cpu' else None}


def run(data_dir: Optional[str], model: str, batch: int, workers: int, samples: int, image_size: int,
        device=None) -> Dict:
    with tempfile.TemporaryDirectory(prefix='diffzoo-bench-') as tmp:
        if data_dir is None:
            config = CorpusConfig(train=samples, val=1, image_size=image_size,
                                  per_shard=max(1, -(-samples // SHARDS)))
            print(f'  data: writing {samples:,} synthetic {image_size} px scenes to {tmp}', flush=True)
            write_corpus(tmp, config, progress=None)
            source = f'synthetic corpus, {samples} scenes, {image_size} px, {config.per_shard} per shard'
            urls = shard_urls(Path(tmp) / 'train')
        else:
            source = str(data_dir)
            urls = shard_urls(data_dir)
        rows = []
        for n in sorted({1, workers}):
            print(f'  data: {n} worker{"s" if n > 1 else ""} over {len(urls)} shards', flush=True)
            rows.append(measure(urls, model, batch, n))
        import torch
        device = torch.device(device or ('cuda' if torch.cuda.is_available() else 'cpu'))
        print(f'  data: worker CPU per sample, open_clip\'s pipeline and data_backend device\'s; {device} per batch',
              flush=True)
        cpu = worker_cpu(urls, model, batch, device)
    return {'source': source, 'shards': len(urls), 'model': model, 'batch': batch, 'rows': rows, 'worker_cpu': cpu}
