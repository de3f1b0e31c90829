"""`python -m diffzoo.train`: a recipe (+ overrides) -> open_clip_train's own training loop.

    python -m diffzoo.train --recipe RECIPE [--key value …] [--accept-changed-settings] [-- open_clip_train flags]
    python -m diffzoo.train --model NAME --train-data … [open_clip_train flags]
                            (a complete run without a recipe, as python -m open_clip_train.main takes it;
                             so does torchrun … -m diffzoo.train --model NAME …)
    python -m diffzoo.train recipes                          (the shipped recipes)
    python -m diffzoo.train plot-lambda RUN_DIR [--out PNG]   (λ against step, every layer)

Before open_clip builds anything, the data is checked (shards exist, sizes known, enough shards
for the workers, every worker's shards fill a batch, an epoch makes a step), the disk's room for a
checkpoint, and the run directory (diffzoo.train.run_record): a directory that holds a run started with
other settings is refused, a resume that changes the schedule is refused unless --accept-changed-settings
is passed, one with the same settings is resumed from its latest checkpoint
(recipes set `--resume latest --save-most-recent`), read with weights_only=True; a missing or unreadable
latest checkpoint gives way to the newest intact epoch_K.pt (diffzoo.train.resume). Flags after `--`
are appended last, so they win over the recipe. Under torchrun every process runs this; only rank 0
prints and writes.
"""
import argparse
import sys
from typing import List, Optional

import yaml

from diffzoo.data.shards import DataError

from .recipe import DIFFZOO_KEYS, RecipeError, find_recipe, recipe_names


USAGE = 'usage: python -m diffzoo.train --recipe RECIPE [--key value …] [--accept-changed-settings] [-- open_clip_train flags]'


def _plot_lambda(argv: List[str]) -> int:
    p = argparse.ArgumentParser(prog='python -m diffzoo.train plot-lambda')
    p.add_argument('run_dir')
    p.add_argument('--out', default=None, help='PNG path (default RUN_DIR/lambda.png)')
    a = p.parse_args(argv)
    from .metrics import plot_lambda  # torch: imported after parsing, so --help answers at once
    print(plot_lambda(a.run_dir, a.out))
    return 0


def _list_recipes() -> int:
    for name in recipe_names():
        with open(find_recipe(name)) as f:
            description = (yaml.safe_load(f) or {}).get('description', '')
        print(f'  {name:<28} {description}')
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (['-h'], ['--help']):
        print(USAGE)
        print(__doc__)
        print('recipe keys of diffzoo (plus every open_clip_train flag, with underscores):')
        for key, text in DIFFZOO_KEYS.items():
            print(f'  {key:<18} {text}')
        return 0
    try:
        if argv[:1] == ['plot-lambda']:
            return _plot_lambda(argv[1:])
        if argv[:1] == ['recipes']:
            return _list_recipes()
    except (RecipeError, DataError, FileNotFoundError) as exc:
        print(f'error: {exc}', file=sys.stderr)
        return 2
    from . import runner  # open_clip, open_clip_train and torch: imported once the command is known (--help at once)
    try:
        return runner.run(argv, __doc__)
    except runner.ERRORS as exc:
        print(f'error: {exc}', file=sys.stderr)
        return 2
    except runner.LostContact as exc:
        print(f'error: {exc}', file=sys.stderr, flush=True)
        return 1


if __name__ == '__main__':
    sys.exit(main())
