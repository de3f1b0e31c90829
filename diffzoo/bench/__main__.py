"""python -m diffzoo.bench: speed and memory of differential attention against the same run's baseline.

Sections (each module's docstring says how it measures):
  model    training step (forward, ClipLoss, backward, AdamW) samples/s and peak memory, and
           encode_image images/s, per open_clip model, each step timed in blocks of consecutive steps
           interleaved between models; ratios with the spread of their per-block ratios; with --compile,
           both towers compiled: speed-up and graph breaks (diffzoo.bench.whole_model)
  layer    each attention variant alone vs timm's SDPA Attention at 77/197/577/4096 tokens:
           fwd+bwd and fwd time, peak memory against the N×N bytes, SDPA backend (diffzoo.bench.attention)
  profile  one training step per model under torch.profiler: attention, GEMM and other kernel time,
           against the baseline's, with each model's profiler table beside the JSON (diffzoo.bench.profile)
  steps    --steps consecutive training steps per model, timed, then under torch.profiler: the slowest
           against the fastest, kernel by kernel, with the GPU's idle gaps, garbage collections, Triton
           compilations and allocator calls of each (diffzoo.bench.step_profile)
  data     webdataset decode + preprocess images/s for 1 and --workers workers (diffzoo.bench.data), and
           open_clip_train's training loader with and without diffzoo's data accounting at CC12M-like
           bookkeeping: samples/s ratio and journal bytes per epoch (diffzoo.bench.accounting)
  train    scripts/train.sh for one epoch of a differential recipe and its baseline on a synthetic
           corpus: images/s per GPU, their ratio, and the share of each step spent waiting for data
           (diffzoo.bench.end_to_end; by default on CUDA and in --smoke, not on CPU)
Peak memory: CUDA allocator counters; on CPU the torch.profiler memory events (diffzoo.bench.measure).

Results go to bench/results/<device>-<YYYY-MM-DD>.json (environment included, rewritten after each
section) and a table with the ratios and PASS/MISS lines for the project's targets is printed.

On a CUDA machine, `python -m diffzoo.bench.gpu OUT` runs the GPU check: the Triton kernel's launches and
tests, these sections, torch.compile, train.sh and the VLM commands, the LLaVA-style stages, each step
time-boxed, into OUT/gpu_check.json (`--device cpu`: a dry run at tiny sizes; its --help says more).
"""
import argparse
import datetime
import gc
import os
import sys
from pathlib import Path
from typing import Dict, List, Optional

from diffzoo.files import atomic_write_json

SECTIONS = ('model', 'layer', 'profile', 'steps', 'data', 'train')
FULL_MODELS = ['diffclip-b16', 'clip-b16-baseline', 'ViT-B-16', 'diffclip-b16-vision', 'diffclip-b16-dynamic']
# per setting: models, baseline, target model, batch, precision, layer repeats, model blocks and steps per block,
# profiled steps, warm-up, tokens, tokens per layer batch, data samples, data batch, workers, synthetic image
# size, seconds per timed layer repeat, layer width
DEFAULTS = {
    'cuda': dict(models=FULL_MODELS, baseline='clip-b16-baseline', target_model='diffclip-b16', batch=256,
                 precision='bf16', reps=10, blocks=6, block_steps=12, steps=16, warmup=3, tokens=[77, 197, 577, 4096],
                 causal_tokens=[77], tokens_per_batch=256 * 197,
                 data_samples=4096, data_batch=32, workers=min(8, os.cpu_count() or 1), image_size=256,
                 layer_target_s=0.05, layer_dim=768, sections=list(SECTIONS), accounting=[2176, 5000, 100, 7],
                 train_recipes=['diffclip-b16-cc3m', 'clip-b16-baseline-cc3m'], train_samples=16384, nproc=1),
    # 3 models: five B/16 models with AdamW state would hold ~12 GB of RAM at once
    'cpu': dict(models=FULL_MODELS[:3], baseline='clip-b16-baseline', target_model='diffclip-b16', batch=16,
                precision='fp32', reps=3, blocks=3, block_steps=3, steps=6, warmup=1, tokens=[77, 197, 577, 4096],
                causal_tokens=[77], tokens_per_batch=16 * 197,
                data_samples=1024, data_batch=32, workers=min(4, os.cpu_count() or 1), image_size=256,
                layer_target_s=0.2, layer_dim=768, sections=[s for s in SECTIONS if s != 'train'],
                accounting=[2176, 5000, 100, 7], train_recipes=['diffclip-b16-cc3m', 'clip-b16-baseline-cc3m'], train_samples=256, nproc=1),
    'smoke': dict(models=['diffclip-tiny', 'clip-tiny-baseline'], baseline='clip-tiny-baseline',
                  target_model='diffclip-tiny', batch=4, precision=None, reps=2, blocks=2, block_steps=2, steps=4,
                  warmup=1, tokens=[32, 1024], causal_tokens=[32],
                  tokens_per_batch=1024, data_samples=64, data_batch=4, workers=2, image_size=64,
                  layer_target_s=0.002, layer_dim=128, sections=None, accounting=[16, 20, 4, 1],
                  train_recipes=['diffclip-tiny', 'clip-tiny-baseline'], train_samples=48),
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog='python -m diffzoo.bench', description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--device', default=None, help='cpu, cuda or cuda:N (default: cuda if available)')
    p.add_argument('--model', dest='models', action='extend', nargs='+', default=None, metavar='NAME',
                   help='open_clip model names, repeatable; NAME@KERNEL runs NAME with that --split-kernel '
                        '(default cuda: all five B/16; cpu: diffclip-b16 clip-b16-baseline ViT-B-16; smoke: '
                        'diffclip-tiny clip-tiny-baseline)')
    p.add_argument('--baseline', default=None, help='the model every ratio divides by (default clip-b16-baseline)')
    p.add_argument('--batch', type=int, default=None, help='model batch (default cuda 256, cpu 16)')
    p.add_argument('--precision', choices=('fp32', 'bf16', 'fp16'), default=None,
                   help='fp32; bf16 autocast as open_clip_train --precision amp_bf16; fp16 autocast with a gradient '
                        'scaler as its --precision amp (default cuda bf16, cpu fp32)')
    p.add_argument('--reps', type=int, default=None, help='layer section: timed repeats (default cuda 10, cpu 3)')
    p.add_argument('--blocks', type=int, default=None,
                   help='model section: blocks of consecutive steps per model, interleaved (default cuda 6, cpu 3)')
    p.add_argument('--block-steps', type=int, default=None,
                   help='model section: consecutive steps per block, each timed (default cuda 12, cpu 3)')
    p.add_argument('--steps', type=int, default=None,
                   help='steps section: consecutive training steps per model, timed, then profiled (default cuda '
                        '16, cpu 6)')
    p.add_argument('--warmup', type=int, default=None, help='untimed calls before timing (default cuda 3, cpu 1)')
    p.add_argument('--sections', nargs='+', choices=SECTIONS, default=None,
                   help='default: all; on CPU all but train')
    p.add_argument('--compile', action='store_true', help='also time torch.compile of both towers, count graph breaks')
    p.add_argument('--explain', action=argparse.BooleanOptionalAction, default=True,
                   help='--compile: each model\'s graph breaks and their reasons from torch._dynamo.explain first '
                        '(default on; --no-explain leaves the breaks counted while the compiled models run)')
    p.add_argument('--split-kernel', default='auto',
                   help='split_kernel of the differential models and the split-fused layer row: auto (the '
                        "device's default), two_calls, one_call, padded, four_calls or triton (default auto)")
    p.add_argument('--tokens', type=int, nargs='+', default=None, help='layer token counts (default 77 197 577 4096)')
    p.add_argument('--variants', nargs='+', default=None, metavar='VARIANT',
                   help='layer rows to measure (default: every variant the device runs; sdpa, the baseline, '
                        'is always measured)')
    p.add_argument('--causal-tokens', type=int, nargs='*', default=None,
                   help='layer token counts measured again with is_causal=True, as the text tower attends (default 77)')
    p.add_argument('--tokens-per-batch', type=int, default=None,
                   help='layer batch = max(1, this // tokens) (default cuda 256*197, cpu 16*197)')
    p.add_argument('--data', default=None, help='webdataset shard directory (default: a generated synthetic corpus)')
    p.add_argument('--data-samples', type=int, default=None, help='synthetic corpus size (default cuda 4096, cpu 1024)')
    p.add_argument('--data-batch', type=int, default=None, help='data loader batch (default 32)')
    p.add_argument('--workers', type=int, default=None, help='data loader workers besides 1 (default min(8|4, CPUs))')
    p.add_argument('--accounting', type=int, nargs=4, default=None, metavar=('SHARDS', 'PER_SHARD', 'BATCHES', 'REPS'),
                   help='data section, accounting cost: shards and samples per shard in sizes.json, batches of '
                        '--data-batch timed per read, repetitions of each read (default 2176 5000 100 7; smoke 16 20 4 1)')
    p.add_argument('--threads', type=int, default=None, help='torch.set_num_threads (default: torch default)')
    p.add_argument('--tf32', action=argparse.BooleanOptionalAction, default=True,
                   help='allow TF32 matmul/cuDNN on CUDA, as open_clip_train does (default on)')
    p.add_argument('--train-recipes', nargs=2, default=None, metavar=('RECIPE', 'BASELINE'),
                   help='train section: a differential recipe and its baseline '
                        '(default diffclip-b16-cc3m clip-b16-baseline-cc3m; smoke: the tiny ones)')
    p.add_argument('--train-samples', type=int, default=None,
                   help='train section: synthetic corpus size, one epoch (default cuda 16384)')
    p.add_argument('--nproc', type=int, default=None, help='train section: processes (GPUs) per run (default 1)')
    p.add_argument('--smoke', action='store_true', help='tiny models, small token counts, 2 repeats: seconds')
    p.add_argument('--out', default=None, help='JSON path (default bench/results/<device>-<date>[-smoke].json)')
    return p


def resolve(args: argparse.Namespace) -> Dict:
    """Fill unset options from the per-device defaults (smoke overrides them) and check them."""
    # heavy (torch, open_clip): imported after parsing so that --help answers at once
    import open_clip
    import torch

    from diffzoo.layers.kernels import SPLIT_KERNELS

    from .measure import BenchError, resolve_device
    device = resolve_device(args.device or ('cuda' if torch.cuda.is_available() else 'cpu'))
    defaults = dict(DEFAULTS[device.type])
    if args.smoke:
        defaults.update({k: v for k, v in DEFAULTS['smoke'].items() if v is not None})
    cfg = {k: getattr(args, k) if getattr(args, k, None) is not None else v for k, v in defaults.items()}
    cfg['target_model'] = defaults['target_model']
    cfg.update(device=device.type, device_index=device.index, compile=args.compile, explain=args.explain,
               data=args.data, smoke=args.smoke, tf32=args.tf32, threads=args.threads, split_kernel=args.split_kernel)
    if args.split_kernel != 'auto' and args.split_kernel not in SPLIT_KERNELS:
        raise BenchError(f'--split-kernel {args.split_kernel}: expected auto or one of {", ".join(SPLIT_KERNELS)}')
    for name in ('batch', 'reps', 'blocks', 'block_steps', 'steps', 'data_samples', 'data_batch', 'workers',
                 'tokens_per_batch', 'train_samples', 'nproc'):
        if cfg[name] < 1:
            raise BenchError(f'--{name.replace("_", "-")} {cfg[name]}: must be at least 1')
    if min(cfg['accounting']) < 1:
        raise BenchError(f'--accounting {" ".join(map(str, cfg["accounting"]))}: each must be at least 1')
    if cfg['warmup'] < 0:
        raise BenchError(f'--warmup {cfg["warmup"]}: must be 0 or more')
    for name in ('tokens', 'causal_tokens'):
        bad = [n for n in cfg[name] if n < 1]
        if bad:
            raise BenchError(f'--{name.replace("_", "-")} {" ".join(map(str, bad))}: token counts must be at least 1')
    from .attention import VARIANTS
    from .whole_model import model_and_kernel
    cfg['variants'] = args.variants
    if args.variants:
        bad = [v for v in args.variants if v not in VARIANTS]
        if bad:
            raise BenchError(f'--variants {" ".join(bad)}: expected some of {", ".join(VARIANTS)}')
    if {'model', 'profile', 'steps'} & set(cfg['sections']):
        known = set(open_clip.list_models())
        names = cfg['models'] + [cfg['baseline']]
        unknown = [m for m in names if model_and_kernel(m)[0] not in known]
        if unknown:
            raise BenchError(f'--model/--baseline {" ".join(unknown)}: not open_clip models; diffzoo registers '
                             f'{", ".join(sorted(m for m in known if "diff" in m or "baseline" in m))}')
        kernels = [m for m in names if model_and_kernel(m)[1] not in ('auto', *SPLIT_KERNELS)]
        if kernels:
            raise BenchError(f'--model {" ".join(kernels)}: the kernel after @ must be auto or one of '
                             f'{", ".join(SPLIT_KERNELS)}')
        if cfg['baseline'] not in cfg['models']:
            cfg['models'] = [cfg['baseline']] + list(cfg['models'])
            print(f'baseline {cfg["baseline"]} added to --model: ratios need it measured in the same run')
    if args.compile and 'model' not in cfg['sections']:
        raise BenchError('--compile times whole models: keep "model" in --sections')
    return cfg


def default_out(device_slug: str, smoke: bool) -> Path:
    stem = f'{device_slug}-{datetime.date.today().isoformat()}' + ('-smoke' if smoke else '')
    path = Path('bench/results') / f'{stem}.json'
    n = 2
    while path.exists():  # never overwrite an earlier run of the same day
        path = Path('bench/results') / f'{stem}-{n}.json'
        n += 1
    return path


def write(results: Dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, results)


def main(argv: Optional[List[str]] = None) -> int:
    os.environ.setdefault('NO_ALBUMENTATIONS_UPDATE', '1')
    args = parser().parse_args(argv)
    import open_clip  # noqa: F401
    import torch

    from . import accounting, attention, data, end_to_end, profile, report, step_profile, whole_model
    from .measure import BenchError, device_slug, environment
    if argv is None:  # the command's own process: what the imports made stays out of the collector's full passes,
        gc.freeze()   # which would otherwise walk it all inside timed steps (763 ms a pass on the 2-core CPU)
    try:
        cfg = resolve(args)
        device = torch.device(cfg['device'], cfg['device_index']) if cfg['device_index'] is not None \
            else torch.device(cfg['device'])
        if cfg['threads']:
            torch.set_num_threads(cfg['threads'])
        if device.type == 'cuda':
            torch.backends.cuda.matmul.allow_tf32 = cfg['tf32']
            torch.backends.cudnn.allow_tf32 = cfg['tf32']
            torch.backends.cudnn.benchmark = True  # as open_clip_train
        out = Path(args.out) if args.out else default_out(device_slug(device), cfg['smoke'])
        results = {'environment': environment(device), 'config': cfg}
        print(f'diffzoo.bench: {results["environment"]["device"]}, {cfg["precision"]}, batch {cfg["batch"]}, '
              f'split_kernel {cfg["split_kernel"]}, sections {" ".join(cfg["sections"])}'
              f'{" + compile" if cfg["compile"] else ""} -> {out}', flush=True)
        torch.manual_seed(0)
        steps = [s for s in SECTIONS if s in cfg['sections']]
        for i, section in enumerate(steps, 1):
            print(f'[{i}/{len(steps)}] {section}', flush=True)
            if section == 'model':
                results['models'] = whole_model.run(cfg['models'], cfg['batch'], cfg['precision'], cfg['blocks'],
                                                    cfg['block_steps'], cfg['warmup'], device,
                                                    compile_models=cfg['compile'], split_kernel=cfg['split_kernel'],
                                                    explain=cfg['explain'])
                report.add_model_ratios(results['models'], cfg['baseline'])
            elif section == 'layer':
                results['layers'] = attention.run(cfg['tokens'], cfg['tokens_per_batch'], cfg['precision'],
                                                  cfg['reps'], cfg['warmup'], device, cfg['layer_target_s'],
                                                  cfg['layer_dim'], cfg['split_kernel'], cfg['causal_tokens'],
                                                  cfg['variants'])
            elif section == 'profile':
                results['profile'] = profile.run(cfg['models'], cfg['baseline'], cfg['batch'], cfg['precision'],
                                                 cfg['warmup'], device, cfg['split_kernel'], out)
            elif section == 'steps':
                results['steps'] = step_profile.run(cfg['models'], cfg['batch'], cfg['precision'], cfg['steps'],
                                                    cfg['warmup'], device, cfg['split_kernel'], out)
            elif section == 'train':
                results['train'] = end_to_end.run(cfg['train_recipes'], cfg['batch'], cfg['nproc'], cfg['workers'],
                                                  cfg['train_samples'], cfg['image_size'], cfg['warmup'],
                                                  'fp32' if cfg['precision'] == 'fp32' else None)
            else:
                results['data'] = data.run(cfg['data'], cfg['models'][0], cfg['data_batch'], cfg['workers'],
                                           cfg['data_samples'], cfg['image_size'])
                results['data']['accounting'] = accounting.run(cfg['models'][0], cfg['data_batch'], cfg['workers'],
                                                               *cfg['accounting'])
            results['steps_agreement'] = report.steps_agreement(results)
            results['targets'] = report.evaluate_targets(results, cfg['target_model'])
            write(results, out)
    except BenchError as exc:
        print(f'error: {exc}', file=sys.stderr)
        return 2
    print('\n' + report.render(results))
    print(f'\nresults: {out}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
