"""`python -m diffzoo.train`: a recipe (+ overrides) -> open_clip_train's own training loop.

    python -m diffzoo.train --recipe RECIPE [--key value …] [--accept-changed-settings] [-- open_clip_train flags]
    python -m diffzoo.train --model NAME --train-data … [open_clip_train flags]
                            (a complete run without a recipe, as python -m open_clip_train.main takes it;
                             so does torchrun … -m diffzoo.train --model NAME …)
    python -m diffzoo.train recipes                          (the shipped recipes)
    python -m diffzoo.train plot-lambda RUN_DIR [--out PNG]   (λ against step, every layer)
    python -m diffzoo.train torchrun [torchrun flags] -- ARGS
                            (torchrun running `python -m diffzoo.train ARGS` in each process, as scripts/train.sh
                             starts it: a failed run ends on its own error and exit status, without torchrun's
                             report of the failure)

Before open_clip builds anything, the data is checked (shards exist, sizes known, enough shards
for the workers, every worker's shards fill a batch, an epoch makes a step), the disk's room for a
checkpoint, and the run directory (diffzoo.train.run_record): a directory that holds a run started with
other settings is refused, a resume that changes the schedule is refused unless --accept-changed-settings
is passed, one with the same settings is resumed from its latest checkpoint
(recipes set `--resume latest --save-most-recent`), read with weights_only=True; a missing or unreadable
latest checkpoint gives way to the newest intact epoch_K.pt (diffzoo.train.resume). Flags after `--`
are appended last, so they win over the recipe. Under torchrun every process runs this; only rank 0
prints and writes. A rerun that resumes says so first ("resuming RUN from epoch N (checkpoint …)"); Ctrl-C
ends with one line naming the checkpoint the same command resumes from.
"""
import argparse
import logging
import os
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
    args = p.parse_args(argv)
    from .lambda_log import plot_lambda  # matplotlib: imported after parsing, so --help answers at once
    print(plot_lambda(args.run_dir, args.out))
    return 0


def _list_recipes() -> int:
    for name in recipe_names():
        with open(find_recipe(name)) as f:
            description = (yaml.safe_load(f) or {}).get('description', '')
        print(f'  {name:<28} {description}')
    return 0


# torchrun's own log lines about a failure its process reports itself (the exit code, the signal it passed on)
TORCHRUN_NOISE = ('failed (exitcode', 'Received %s death signal', 'Sending process %s closing signal')


def _quiet(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(TORCHRUN_NOISE)


def _torchrun(argv: List[str]) -> int:
    """`torchrun [torchrun flags] -m -- diffzoo.train ARGS`, exiting with the status of the first process that
    failed (128 + N for signal N). torchrun's ChildFailedError traceback and failure summary are left out: each
    process prints its own error, which is then the last thing on the screen."""
    if '--' not in argv:
        print('usage: python -m diffzoo.train torchrun [torchrun flags] -- [python -m diffzoo.train arguments]',
              file=sys.stderr)
        return 2
    flags, args = argv[:argv.index('--')], argv[argv.index('--') + 1:]
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    for name in ('torch.distributed.elastic.multiprocessing.api', 'torch.distributed.elastic.agent.server.api'):
        logging.getLogger(name).addFilter(_quiet)
    try:
        torchrun.run(torchrun.parse_args(flags + ['-m', '--', 'diffzoo.train'] + args))
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        if failure.exitcode >= 0:
            return failure.exitcode  # the process said why (an `error:` line, a traceback)
        print(f'error: rank {rank} (pid {failure.pid}) was stopped by {failure.signal_name()}; run the same '
              f'command again to resume from the run\'s last checkpoint', file=sys.stderr)
        return 128 - failure.exitcode
    except SignalException as exc:  # torchrun stopped by a signal (Ctrl-C, scancel, kill) and passed it on
        if exc.sigval.name != 'SIGINT':  # on Ctrl-C each process says where it stopped
            print(f'stopped by {exc.sigval.name}; run the same command again to resume from the run\'s last '
                  f'checkpoint', file=sys.stderr)
        return 128 + int(exc.sigval)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    try:
        return _main(list(sys.argv[1:] if argv is None else argv))
    except KeyboardInterrupt as exc:  # Ctrl-C: one line, not a traceback; every process of a torchrun job gets it
        if os.environ.get('RANK', '0') == '0':
            print(f'\ninterrupted{f": {exc}" if str(exc) else ""}', file=sys.stderr, flush=True)
        return 130


def _main(argv: List[str]) -> int:
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
        if argv[:1] == ['torchrun']:
            return _torchrun(argv[1:])
    except (RecipeError, DataError, FileNotFoundError) as exc:
        print(f'error: {exc}', file=sys.stderr)
        return 2
    from . import runner  # open_clip_train: imported once the command is known
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
