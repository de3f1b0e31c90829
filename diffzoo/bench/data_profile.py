"""python -m diffzoo.bench.data_profile: where a training step's wait for data goes, each backend's data path
taken apart on the same shards (a synthetic corpus unless --data) with the model's train transform.

- files: per image, a full PIL decode and RGB conversion (open_clip's), `data_backend: device`'s readability
  check (`device_data.check_decodes`: a JPEG decoded at 1/8 of its size) and its header alone, median ms;
- workers: a data-loader worker's CPU seconds per sample (this process, one torch thread, as a worker has) for
  open_clip's pipeline (read, decode, transform, tokens) and the device backend's worker side (read, header and
  check, tokens, crop boxes, the encoded batch), and the samples/s --workers such workers can deliver at most;
- making: each stage of a batch's making in the training process, one at a time and synchronised, median
  seconds per batch: the encoded files' copy to the device (as the loader hands them over, and from pinned
  memory), the decode (nvJPEG on CUDA, libjpeg-turbo on the CPU; with the calling thread's CPU seconds, where
  nvJPEG decodes Huffman codes of small images), the crop and resize as the loader runs it (on CUDA also in
  float32 under open_clip_train's TF32, with the largest difference from float64 in levels) and the
  normalisation;
- training: open_clip_train's training loader as `python -m diffzoo.train` builds it (its seams, --workers
  workers), each backend, with a training step of the model per batch (forward, ClipLoss, backward, AdamW; bf16
  autocast on CUDA): the loop's wait for each batch and each whole iteration, as open_clip_train logs
  `Data (t)` and `Batch (t)`, and the wait's share of the iterations after the first few; the device backend
  with one and with two batches made ahead.

Results: --out (JSON) and a table; figures measured: docs/performance.md.
"""
import argparse
import io
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Dict, List, Optional

DEFAULTS = {'cuda': dict(model='diffclip-b16', batch=256, workers=8, batches=40, image_size=256, warmup=5),
            'cpu': dict(model='diffclip-tiny', batch=32, workers=2, batches=12, image_size=256, warmup=2),
            'smoke': dict(model='clip-tiny-baseline', batch=8, workers=2, batches=4, image_size=96, warmup=1)}


def file_costs(urls: List[str], limit: int = 100) -> Dict:
    """Median ms per image of open_clip's decode, the device backend's check and the header, on the first
    `limit` JPEGs of the shards."""
    from PIL import Image

    from diffzoo.data.shards import iter_samples
    from diffzoo.train.device_data import check_decodes

    def full(data):
        with Image.open(io.BytesIO(data)) as image:
            image.load()
            image.convert('RGB')

    def check(data):
        with Image.open(io.BytesIO(data)) as image:
            check_decodes(image)

    def header(data):
        with Image.open(io.BytesIO(data)) as image:
            return image.size

    files = [m['jpg'] for url in urls for _, m in iter_samples(Path(url)) if 'jpg' in m][:limit]
    out = {'images': len(files), 'size': list(Image.open(io.BytesIO(files[0])).size) if files else None}
    for name, fn in (('full_decode_ms', full), ('check_ms', check), ('header_ms', header)):
        times = []
        for data in files:
            start = time.perf_counter()
            fn(data)
            times.append(1e3 * (time.perf_counter() - start))
        out[name] = statistics.median(times) if times else None
    out['check_share_of_full'] = out['check_ms'] / out['full_decode_ms'] if files else None
    return out


def worker_cpu(urls: List[str], model: str, batch: int, workers: int, limit: int = 1024) -> Dict:
    """CPU seconds per sample of a worker of each backend (over about `limit` samples after the first batch), and
    the samples/s `workers` of them deliver at most."""
    import torch

    from .data import pipeline
    out, threads = {}, torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for backend in ('open_clip', 'device'):
            batches = iter(pipeline(urls, model, batch, backend))
            next(batches)  # the first batch left out: the shard opened, the first calls' set-up
            start, samples = time.process_time(), 0
            for _, tokens in batches:
                samples += tokens.shape[0]
                if samples >= limit:
                    break
            cpu = (time.process_time() - start) / max(1, samples)
            out[backend] = {'cpu_s_per_sample': cpu, 'samples_per_s_at_most': workers / cpu}
    finally:
        torch.set_num_threads(threads)
    return {'workers': workers, **out}


def making(urls: List[str], model: str, batch: int, batches: int, device) -> Dict:
    """Median seconds per batch of each stage of the device backend's making (module docstring)."""
    import torch

    from diffzoo.train.device_data import TrainTransform
    from diffzoo.train.device_loader import DeviceLoader, decode_images
    from diffzoo.train.resample import resized_crops

    from .data import pipeline, train_transform
    from .measure import synchronize
    transform = TrainTransform.of(train_transform(model))
    loader = DeviceLoader(SimpleNamespace(num_batches=0, num_samples=0), transform, batch, device)
    cuda, bicubic = device.type == 'cuda', transform.interpolation.value == 'bicubic'
    times: Dict[str, List[float]] = {}
    largest = 0

    def timed(name, fn, cpu_name=None):
        synchronize(device)
        start, cpu_start = time.perf_counter(), time.process_time()
        result = fn()
        synchronize(device)
        times.setdefault(name, []).append(time.perf_counter() - start)
        if cpu_name:
            times.setdefault(cpu_name, []).append(time.process_time() - cpu_start)
        return result

    for k, (encoded, _) in enumerate(pipeline(urls, model, batch, 'device')):
        if k >= batches:
            break
        if cuda:
            timed('copy_s', lambda: encoded['data'].to(device))
            pinned = encoded['data'].pin_memory()
            timed('copy_pinned_s', lambda: pinned.to(device, non_blocking=True))
        files = list(torch.split(encoded['data'], encoded['lengths'].tolist()))
        images, _ = timed('decode_s', lambda: decode_images(files, encoded['needs_pil'].tolist(), device),
                          'decode_cpu_s')
        read = [i for i, image in enumerate(images) if image is not None]
        images, boxes = [images[i] for i in read], encoded['boxes'][read]
        if loader.batched:
            crops = timed('resize_s', lambda: resized_crops(images, boxes, transform.size, bicubic))
            if cuda:
                single = timed('resize_float32_s', lambda: resized_crops(images, boxes, transform.size, bicubic,
                                                                          torch.float32))
                largest = max(largest, int((single.int() - crops.int()).abs().max()))
        else:
            crops = timed('resize_s', lambda: torch.stack([loader.cropped(image, box)
                                                           for image, box in zip(images, boxes.tolist())]))
        timed('normalize_s', lambda: loader.normalized(crops))
    out = {name: statistics.median(values[1:] or values) for name, values in times.items()}
    out['batched_resize'] = loader.batched
    if cuda and loader.batched:
        out['resize_float32_max_levels_from_float64'] = largest
    return out


def training(urls: List[str], model_name: str, batch: int, workers: int, batches: int, warmup: int, device,
             backend: str, depth: int = 1) -> Dict:
    """The loop's wait and iteration per batch, open_clip_train's loader with `backend`, a training step each."""
    import open_clip
    import open_clip_train.data
    import torch

    from diffzoo.train import data_report, seams

    from .measure import autocast, synchronize
    model, preprocess, _ = open_clip.create_model_and_transforms(model_name, device=device, output_dict=True)
    model.train()
    loss, optimizer = open_clip.ClipLoss(), torch.optim.AdamW(model.parameters(), lr=1e-5)
    args = argparse.Namespace(train_data='::'.join(urls), val_data=None, train_num_samples=batch * batches,
                              dataset_resampled=False, train_data_upsampling_factors=None, seed=0, batch_size=batch,
                              world_size=1, rank=0, workers=workers, device=str(device))
    precision = 'bf16' if device.type == 'cuda' else 'fp32'
    waits, iterations = [], []
    with seams.installed(data_backend=backend):
        data_report.start_epoch(os.environ['DIFFZOO_DATA_EVENTS'], 0)
        info = open_clip_train.data.get_wds_dataset(args, preprocess, True, epoch=0,
                                                    tokenizer=open_clip.get_tokenizer(model_name))
        info.set_epoch(0)
        loader = info.dataloader
        if backend == 'device':
            loader.depth = depth
        batches_iter, start = iter(loader), time.perf_counter()
        for k in range(loader.num_batches):
            if k == warmup:
                synchronize(device)
                start = time.perf_counter()
            begin = time.perf_counter()
            try:
                images, tokens = next(batches_iter)
            except StopIteration:
                break
            got = time.perf_counter()
            images, tokens = images.to(device, non_blocking=True), tokens.to(device, non_blocking=True)
            with autocast(device, precision):
                out = model(images, tokens)
                total = loss(out['image_features'], out['text_features'], out['logit_scale'])
            total.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if k >= warmup:
                waits.append(got - begin)
                iterations.append(time.perf_counter() - begin)
        synchronize(device)
        elapsed = time.perf_counter() - start
        del batches_iter, loader, info
    if not waits:
        raise RuntimeError(f'data profile: {backend} made no batch after the {warmup} left out; pass --batches larger')
    return {'backend': backend, 'ahead': depth if backend == 'device' else None, 'batches_timed': len(waits),
            'wait_s': statistics.median(waits), 'iteration_s': statistics.median(iterations),
            'wait_share': sum(waits) / elapsed, 'images_per_s': batch * len(waits) / elapsed}


def run(cfg: Dict) -> Dict:
    import torch

    from diffzoo.data.synthetic import CorpusConfig, write_corpus

    from .data import SHARDS, shard_urls
    device = torch.device(cfg['device'])
    if device.type == 'cuda':
        torch.backends.cuda.matmul.allow_tf32 = True  # as open_clip_train sets it
        torch.backends.cudnn.allow_tf32 = True
    with tempfile.TemporaryDirectory(prefix='diffzoo-data-profile-') as tmp:
        if cfg['data'] is None:
            samples = cfg['batch'] * (cfg['batches'] + cfg['warmup']) + cfg['batch'] * cfg['workers']
            per_shard = -(-samples // max(SHARDS, 2 * cfg['workers']))
            print(f'data profile: writing {samples:,} synthetic {cfg["image_size"]} px scenes', flush=True)
            write_corpus(tmp, CorpusConfig(train=samples, val=1, image_size=cfg['image_size'], per_shard=per_shard),
                         progress=None)
            urls = shard_urls(Path(tmp) / 'train')
        else:
            urls = shard_urls(cfg['data'])
        result = {'config': cfg, 'shards': len(urls)}
        print('data profile: files', flush=True)
        result['files'] = file_costs(urls)
        print('data profile: workers', flush=True)
        result['workers'] = worker_cpu(urls, cfg['model'], cfg['batch'], cfg['workers'])
        print('data profile: making', flush=True)
        result['making'] = making(urls, cfg['model'], cfg['batch'], cfg['batches'], device)
        result['training'] = []
        for backend, depth in (('open_clip', 1), ('device', 1), ('device', 2)):
            print(f'data profile: training, {backend}' + (f', {depth} ahead' if backend == 'device' else ''),
                  flush=True)
            result['training'].append(training(urls, cfg['model'], cfg['batch'], cfg['workers'], cfg['batches'],
                                               cfg['warmup'], device, backend, depth))
    return result


def table(result: Dict) -> str:
    files, workers, made = result['files'], result['workers'], result['making']
    lines = [f'per image ({files["size"]} px JPEGs): full decode {files["full_decode_ms"]:.2f} ms, the device '
             f'backend\'s check {files["check_ms"]:.2f} ms ({files["check_share_of_full"]:.0%}), header '
             f'{files["header_ms"]:.3f} ms']
    for backend in ('open_clip', 'device'):
        w = workers[backend]
        lines.append(f'{backend:>9} worker: {1e3 * w["cpu_s_per_sample"]:.2f} ms CPU a sample, '
                     f'{workers["workers"]} workers deliver at most {w["samples_per_s_at_most"]:,.0f} samples/s')
    stages = ', '.join(f'{name[:-2]} {1e3 * value:.1f}' for name, value in made.items()
                       if name.endswith('_s'))
    lines.append(f'making a batch of {result["config"]["batch"]}, ms: {stages}')
    if 'resize_float32_max_levels_from_float64' in made:
        lines.append(f'  float32 resize: at most {made["resize_float32_max_levels_from_float64"]} level(s) from '
                     f'float64')
    for row in result['training']:
        name = row['backend'] + (f' ({row["ahead"]} ahead)' if row['ahead'] else '')
        lines.append(f'{name:>18}: wait {1e3 * row["wait_s"]:.1f} ms of {1e3 * row["iteration_s"]:.1f} ms a step, '
                     f'{row["wait_share"]:.0%} of the time waiting, {row["images_per_s"]:,.0f} images/s')
    return '\n'.join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog='python -m diffzoo.bench.data_profile', description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--device', default=None, help='cpu or cuda (default: cuda if available)')
    p.add_argument('--model', default=None, help='open_clip model (default cuda diffclip-b16, cpu diffclip-tiny)')
    p.add_argument('--batch', type=int, default=None, help='per-step batch (default cuda 256, cpu 32)')
    p.add_argument('--workers', type=int, default=None, help='data-loader workers (default cuda 8, cpu 2)')
    p.add_argument('--batches', type=int, default=None, help='batches timed (default cuda 40, cpu 12)')
    p.add_argument('--warmup', type=int, default=None, help='training batches left out first (default cuda 5)')
    p.add_argument('--image-size', type=int, default=None, help='synthetic scenes\' size in px (default 256)')
    p.add_argument('--data', default=None, help='webdataset shard directory (default: a synthetic corpus)')
    p.add_argument('--smoke', action='store_true', help='tiny sizes: seconds, to check the plumbing')
    p.add_argument('--out', default=None, help='JSON to write')
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = parser().parse_args(argv)
    import torch  # heavy: after parsing, so that --help answers at once

    from .measure import BenchError
    device = args.device or ('cuda' if torch.cuda.is_available() else 'cpu')
    cfg = dict(DEFAULTS['smoke' if args.smoke else ('cuda' if device.startswith('cuda') else 'cpu')])
    cfg.update({k: v for k, v in vars(args).items() if v is not None and k in cfg}, device=device, data=args.data)
    if min(cfg['batch'], cfg['workers'], cfg['batches']) < 1 or cfg['warmup'] < 0:
        print('error: --batch, --workers and --batches must be at least 1, --warmup at least 0', file=sys.stderr)
        return 2
    try:
        result = run(cfg)
    except BenchError as exc:
        print(f'error: {exc}', file=sys.stderr)
        return 2
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + '\n')
    print(table(result))
    if args.out:
        print(f'results: {args.out}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
