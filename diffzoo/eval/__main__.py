"""python -m diffzoo.eval — evaluate open_clip models (diffzoo's and any other) side by side.

    python -m diffzoo.eval --model diffclip-b16,cc3m --model clip-b16-baseline,base.pt \\
        --dataset cifar10 --dataset wds/flickr30k --dataset-root '/data/{dataset}'
    python -m diffzoo.eval --run-dir runs/diffclip-tiny --every-checkpoint \\
        --dataset synthetic --dataset-root data/synthetic

Models: --model NAME[,PRETRAINED], repeated, one table column each. PRETRAINED is a checkpoint
file (open_clip_train's epoch_K.pt, an official DiffCLIP checkpoint_best.pt) or a pretrained tag
of NAME (cc3m, cc12m); without it the model is randomly initialised (--seed). --run-dir RUN adds
the run's newest checkpoints/epoch_K.pt, or every one with --every-checkpoint (a column per
epoch, and a PNG of each metric against epoch); its model name comes from RUN/diffzoo-run.json
or RUN/params.txt.

Datasets and tasks (--task, repeatable; `auto` is each dataset's default):
    CLIP_benchmark classification sets   zeroshot_classification (auto), linear_probe (CUDA), fewshot
      imagenet1k imagenetv2 imagenet-a imagenet-r imagenet_sketch cifar10 cifar100 caltech101 dtd pets
      flowers sun397 fgvc_aircraft food101, any wds/NAME, and dummy (CLIP_benchmark's smoke test)
    wds/mscoco_captions wds/flickr8k wds/flickr30k   zeroshot_retrieval (auto)
    synthetic  (the diffzoo corpus directory)       zeroshot_classification + zeroshot_retrieval (auto), fewshot
    mmvp       (the MMVP-VLM folder)                 mmvp (auto)
--dataset-root is read as CLIP_benchmark reads --dataset_root: the dataset's folder, or a template
such as '/data/{dataset}' when several are given. Nothing is downloaded: a missing copy is an
error naming the path expected and where to get it.

Results: every row (model, pretrained, checkpoint sha256, dataset, task, metric, value) goes to
--output, rewritten after each dataset — by default RUN/eval/results.json with --run-dir, else
./eval-results.json in the current directory — and the command ends with a table: a row per
dataset/metric, a column per model. Metrics are in percent.
"""
import argparse
import sys
import time
from pathlib import Path
from typing import List, Optional

from diffzoo.checkpoint import CheckpointError
from diffzoo.data.shards import DataError

from . import benchmark, fewshot, suite
from .models import EvalError, load, parse_model, run_checkpoints
from .results import Row, plot_vs_epoch, table, write_json


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog='python -m diffzoo.eval', description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    m = p.add_argument_group('models')
    m.add_argument('--model', action='append', default=[], metavar='NAME[,PRETRAINED]',
                   help='an open_clip model and its weights (file or tag); repeat to compare')
    m.add_argument('--run-dir', metavar='RUN', help='a training run directory (runs/NAME)')
    m.add_argument('--every-checkpoint', action='store_true', help="every epoch_K.pt of --run-dir, not the newest")
    m.add_argument('--run-model', metavar='NAME', help="the run's model when its directory does not name it")
    m.add_argument('--force-image-size', type=int, metavar='PX', help="open_clip's force_image_size")
    d = p.add_argument_group('datasets')
    d.add_argument('--dataset', action='append', default=[], metavar='NAME', help='repeat for several')
    d.add_argument('--dataset-root', metavar='DIR', help="the dataset's folder, or a template with {dataset}")
    d.add_argument('--task', action='append', default=[], choices=('auto',) + suite.TASKS,
                   help='repeatable; default: auto')
    r = p.add_argument_group('running')
    r.add_argument('--device', default=None, help='default: cuda when available, else cpu')
    r.add_argument('--no-amp', action='store_true', help='no mixed precision on CUDA (never used on CPU)')
    r.add_argument('--batch-size', type=int, default=64)
    r.add_argument('--workers', type=int, default=4, help='data-loading processes')
    r.add_argument('--seed', type=int, default=0, help='random-init weights, few-shot episodes, linear probe')
    f = p.add_argument_group('few-shot (see diffzoo/eval/fewshot.py) and linear probe')
    defaults = fewshot.FewShotConfig()
    f.add_argument('--fewshot-way', type=int, default=defaults.way)
    f.add_argument('--fewshot-shot', type=int, default=defaults.shot)
    f.add_argument('--fewshot-query', type=int, default=defaults.query, help='query images per class')
    f.add_argument('--fewshot-episodes', type=int, default=defaults.episodes)
    f.add_argument('--fewshot-classifier', default=defaults.classifier, choices=fewshot.CLASSIFIERS)
    f.add_argument('--lp-epochs', type=int, default=10, help="CLIP_benchmark's linear-probe epochs")
    f.add_argument('--lp-lr', type=float, default=0.1, help="CLIP_benchmark's linear-probe learning rate")
    o = p.add_argument_group('output')
    o.add_argument('--output', metavar='JSON', help='default: RUN/eval/results.json, else ./eval-results.json')
    return p


def _default_output(args) -> Path:
    if args.output:
        return Path(args.output)
    return Path(args.run_dir) / 'eval' / 'results.json' if args.run_dir else Path('eval-results.json')


def run(args) -> int:
    import torch
    if args.every_checkpoint and not args.run_dir:
        raise EvalError('--every-checkpoint needs --run-dir RUN (a training run directory)')
    if not args.dataset:
        raise EvalError('pass at least one --dataset (see python -m diffzoo.eval -h)')
    specs = [parse_model(text) for text in args.model]
    if args.run_dir:
        specs += run_checkpoints(args.run_dir, args.run_model, every=args.every_checkpoint)
    if not specs:
        raise EvalError('nothing to evaluate: pass --model NAME[,PRETRAINED] or --run-dir RUN')
    config = fewshot.FewShotConfig(args.fewshot_way, args.fewshot_shot, args.fewshot_query, args.fewshot_episodes,
                                   args.seed, args.fewshot_classifier)
    plan = []
    for dataset in dict.fromkeys(args.dataset):
        if dataset not in (suite.SYNTHETIC, suite.MMVP):
            benchmark.check_known(dataset)
    suite.check_tasks(list(dict.fromkeys(args.dataset)), args.task)
    for dataset in dict.fromkeys(args.dataset):
        root = benchmark.dataset_root(args.dataset_root, dataset)
        tasks = suite.tasks_for(dataset, args.task)
        suite.check_dataset(dataset, root, tasks)
        plan.append((dataset, root, tasks))
    device = args.device or ('cuda' if torch.cuda.is_available() else 'cpu')
    amp = device.startswith('cuda') and not args.no_amp
    output = _default_output(args)
    settings = dict(vars(args), device=device, amp=amp, output=str(output), clip_benchmark=_version('clip-benchmark'),
                    open_clip=_version('open_clip_torch'))

    rows: List[Row] = []
    for i, spec in enumerate(specs, 1):
        print(f'[{i}/{len(specs)}] {spec.label}: loading {spec.name}'
              + (f' from {spec.pretrained}' if spec.pretrained else ' (random init)'), flush=True)
        loaded = load(spec, device, args.force_image_size, args.seed)
        for dataset, root, tasks in plan:
            for task in tasks:
                start = time.time()
                print(f'  {dataset}: {task} …', flush=True)
                results = suite.run(loaded, dataset, root, task, device, amp, args.batch_size, args.workers, config,
                                    args.lp_epochs, args.lp_lr, progress=print)
                for task_name, metrics in results.items():
                    rows += [Row(spec.name, spec.pretrained, loaded.checkpoint_sha256, dataset, task_name, metric,
                                 value, spec.label, spec.epoch) for metric, value in metrics.items()]
                shown = ', '.join(f'{k} {v:.2f}' for m in results.values() for k, v in list(m.items())[:3])
                print(f'  {dataset}: {task} done in {time.time() - start:.0f}s ({shown})', flush=True)
                write_json(output, rows, settings)
        del loaded
    print()
    print(table(rows))
    print(f'\nresults: {output}')
    if args.every_checkpoint:
        plot = plot_vs_epoch(rows, output.with_name(output.stem + '_vs_epoch.png'))
        if plot:
            print(f'plot: {plot}')
    return 0


def _version(package: str) -> Optional[str]:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def main(argv: Optional[List[str]] = None) -> int:
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return run(args)
    except (EvalError, CheckpointError, DataError) as exc:
        print(f'error: {exc}', file=sys.stderr)
        return 2


if __name__ == '__main__':
    sys.exit(main())
