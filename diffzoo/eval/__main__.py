"""python -m diffzoo.eval — evaluate open_clip models (diffzoo's and any other) side by side.

    python -m diffzoo.eval --model diffclip-b16,cc3m --model clip-b16-baseline,base.pt \\
        --dataset cifar10 --dataset wds/flickr30k --dataset-root '/data/{dataset}'
    python -m diffzoo.eval --run-dir runs/diffclip-tiny --every-checkpoint \\
        --dataset synthetic --dataset-root data/synthetic

Models: --model NAME[,PRETRAINED], repeated, one table column each. PRETRAINED is a checkpoint
file (open_clip_train's epoch_K.pt, an official DiffCLIP checkpoint_best.pt) or a pretrained tag
of NAME (cc3m, cc12m); without it the model is randomly initialised (--seed). A training run
adds its newest checkpoints/epoch_K.pt, or every one with --every-checkpoint (a column per epoch,
and a PNG of each metric against epoch): --run-dir RUN when the run names its model
(RUN/diffzoo-run.json or RUN/params.txt), --model NAME,RUN to name it (PRETRAINED a directory;
one named like a tag of NAME is refused as ambiguous: write ./cc3m for the directory).

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
--output, rewritten after each dataset — by default RUN/eval/results.json for one training run, else
./eval-results.json in the current directory — and the command ends with a table: a row per
dataset/metric, a column per model. Metrics are in percent.
"""
import argparse
import sys
from typing import List, Optional

from diffzoo.flags import at_least, output_file, torch_device

from .options import CLASSIFIERS, TASKS, FewShotConfig


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog='python -m diffzoo.eval', description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    m = p.add_argument_group('models')
    m.add_argument('--model', action='append', default=[], metavar='NAME[,PRETRAINED]',
                   help='an open_clip model and its weights (file, tag or training run directory); repeat to compare')
    m.add_argument('--run-dir', metavar='RUN', help='a training run directory (runs/NAME) that names its model')
    m.add_argument('--every-checkpoint', action='store_true',
                   help='every epoch_K.pt of a training run (--run-dir, --model NAME,RUN), not the newest')
    m.add_argument('--force-image-size', type=at_least(1), metavar='PX', help="open_clip's force_image_size")
    d = p.add_argument_group('datasets')
    d.add_argument('--dataset', action='append', default=[], metavar='NAME', help='repeat for several')
    d.add_argument('--dataset-root', metavar='DIR', help="the dataset's folder, or a template with {dataset}")
    d.add_argument('--task', action='append', default=[], choices=('auto',) + TASKS,
                   help='repeatable; default: auto')
    r = p.add_argument_group('running')
    r.add_argument('--device', type=torch_device, default=None, help='default: cuda when available, else cpu')
    r.add_argument('--no-amp', action='store_true', help='no mixed precision on CUDA (never used on CPU)')
    r.add_argument('--batch-size', type=at_least(1), default=64)
    r.add_argument('--workers', type=at_least(0), default=4, help='data-loading processes')
    r.add_argument('--seed', type=at_least(0), default=0, help='random-init weights, few-shot episodes, linear probe')
    f = p.add_argument_group('few-shot (see diffzoo/eval/fewshot.py) and linear probe')
    defaults = FewShotConfig()
    f.add_argument('--fewshot-way', type=int, default=defaults.way)
    f.add_argument('--fewshot-shot', type=int, default=defaults.shot)
    f.add_argument('--fewshot-query', type=int, default=defaults.query, help='query images per class')
    f.add_argument('--fewshot-episodes', type=int, default=defaults.episodes)
    f.add_argument('--fewshot-classifier', default=defaults.classifier, choices=CLASSIFIERS)
    f.add_argument('--lp-epochs', type=at_least(1), default=10, help="CLIP_benchmark's linear-probe epochs")
    f.add_argument('--lp-lr', type=float, default=0.1, help="CLIP_benchmark's linear-probe learning rate")
    o = p.add_argument_group('output')
    o.add_argument('--output', type=output_file, metavar='JSON',
                   help='default: RUN/eval/results.json, else ./eval-results.json')
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    from . import runner  # torch, open_clip and CLIP_benchmark: imported after parsing, so --help answers at once
    try:
        return runner.run(args)
    except runner.ERRORS as exc:
        print(f'error: {exc}', file=sys.stderr)
        return 2


if __name__ == '__main__':
    sys.exit(main())
