"""`make demo`: CLIP against DiffCLIP, from data to attention maps, in a few minutes on a CPU.

    python -m diffzoo.demo [--out demo] [--fresh] [--epochs 4] [--train 4000] [--val 500]
                           [--model diffclip-tiny] [--baseline clip-tiny-baseline]

1. data      a synthetic corpus (`diffzoo.data.synthetic`): coloured shapes with captions on
             cluttered backgrounds, as train/val webdataset shards with a fixed seed.
2. train     the model and its baseline with one recipe each (the shipped recipes of the same
             names, identical but for the model), through `python -m diffzoo.train`.
3. evaluate  both the same way on the val split (`diffzoo.eval.synthetic`), each with the image
             transforms its run trained with: zero-shot accuracy on the subject's shape and colour,
             image→text and text→image R@1/5/10, each with its Wilson 95 % interval; the table says
             "within chance" where the two models' intervals overlap.
4. figures   attention maps of both vision towers for a few val images (`diffzoo.analysis.maps`;
             each patch's share of its map, one colour scale per figure), attention entropy per
             layer, λ per layer of the differential model, loss curves.

Everything goes under OUT: `data/`, `runs/<model>-<scenes>x<epochs>/` (open_clip_train's run
directories, with `train.log`), `results.json` and the PNGs. A re-run reuses the corpus and every finished training
run (an interrupted one resumes from its last checkpoint); `--fresh` starts over. The numbers are
whatever this seed gives: nothing is tuned for either model. Each training uses every core: with the
cores busy elsewhere it takes many times longer. Fewer steps (`--train 1000 --epochs 3`, 96 per model)
still learn colour; much fewer leave the losses at chance, ln 32 (the tiny recipes' batch of 32).
"""
import argparse
import logging
import signal
import sys
from typing import List

from diffzoo.train.recipe import RecipeError, find_recipe


def main(argv: List[str] = None) -> int:
    parser = argparse.ArgumentParser(prog='python -m diffzoo.demo', description=__doc__.split('\n\n')[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split('\n\n', 2)[2])
    parser.add_argument('--out', default='demo', help='output directory (default ./demo)')
    parser.add_argument('--fresh', action='store_true', help='delete OUT/data and OUT/runs and start over')
    parser.add_argument('--epochs', type=int, default=4, help='epochs per model')
    parser.add_argument('--train', type=int, default=4000, help='training scenes')
    parser.add_argument('--val', type=int, default=500, help='validation scenes (fewer: wider intervals)')
    parser.add_argument('--model', default='diffclip-tiny', help='a model with a shipped recipe of its name')
    parser.add_argument('--baseline', default='clip-tiny-baseline')
    args = parser.parse_args(argv)
    if args.train < 64 or args.val < 32 or args.epochs < 1:
        parser.error(f'--train {args.train} --val {args.val} --epochs {args.epochs}: the demo needs at least '
                     f'64 train and 32 val scenes (a batch of 32, two-object scenes to show) and 1 epoch')

    logging.getLogger().setLevel(logging.ERROR)  # open_clip logs every checkpoint it loads
    for name in (args.model, args.baseline):
        try:
            find_recipe(name)
        except RecipeError as exc:
            parser.error(f'--model/--baseline {name}: {exc}')

    from diffzoo import demo_steps  # matplotlib, open_clip_train: imported after parsing
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill ends the training child too (demo_steps.stop)
    try:
        return demo_steps.run(args)
    except KeyboardInterrupt:  # Ctrl-C: one line saying what a rerun keeps, not a traceback
        print(f'\ninterrupted: run the same command again to go on (it reuses {args.out}/data and every finished '
              f'training, and resumes an unfinished one from its last finished epoch)', file=sys.stderr, flush=True)
        return 130


if __name__ == '__main__':
    sys.exit(main())
