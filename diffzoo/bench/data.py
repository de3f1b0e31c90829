"""The webdataset input pipeline: decoded, preprocessed images per second, per DataLoader worker.

The pipeline is open_clip_train's `get_wds_dataset` for training, stage for stage, without the
shuffle buffers: shard list → split_by_worker → tar samples → drop samples without image or caption
→ decode jpg to PIL RGB → the model's training preprocess (open_clip `image_transform(is_train=True)`)
and tokenizer → (image, text) tuples → batches, read through `wds.WebLoader`. Without `--data`, a
synthetic corpus (`diffzoo.data.synthetic`) is written to a temporary directory first.

Each worker count runs one pass over the shards; the clock starts when every worker has delivered
its first batch (worker start-up and the first decode excluded) and the images counted are those
after it. Per-worker throughput is the total divided by the worker count.
"""
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from diffzoo.data.synthetic import CorpusConfig, write_corpus

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


def pipeline(urls: Sequence[str], model: str, batch: int):
    import open_clip
    import webdataset as wds
    from open_clip_train.data import filter_no_caption_or_no_image, log_and_continue, tarfile_to_samples_nothrow

    cfg = open_clip.get_model_config(model)
    if cfg is None:
        raise BenchError(f'--data-model {model}: not an open_clip model config')
    preprocess = open_clip.image_transform(cfg['vision_cfg'].get('image_size', 224), is_train=True)
    tokenizer = open_clip.get_tokenizer(model)
    return wds.DataPipeline(
        wds.SimpleShardList(list(urls)),
        wds.split_by_worker,
        tarfile_to_samples_nothrow,
        wds.select(filter_no_caption_or_no_image),
        wds.decode('pilrgb', handler=log_and_continue),
        wds.rename(image='jpg;png;jpeg;webp', text='txt'),
        wds.map_dict(image=preprocess, text=lambda text: tokenizer(text)[0]),
        wds.to_tuple('image', 'text'),
        wds.batched(batch, partial=True),
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


def run(data_dir: Optional[str], model: str, batch: int, workers: int, samples: int, image_size: int) -> Dict:
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
    return {'source': source, 'shards': len(urls), 'model': model, 'batch': batch, 'rows': rows}
