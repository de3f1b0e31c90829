"""Starting open_clip_train's loop for `python -m diffzoo.train` (`diffzoo.train.launch` parses the command):
the recipe resolved into open_clip_train's argv, the model, data and run-directory checks, the plan printed,
then `open_clip_train.main.main` with diffzoo's seams installed."""
import difflib
import glob
import json
import os
import sys
from typing import Dict, List, Optional

import open_clip
import open_clip_train.main
import torch.distributed
from open_clip_train.params import parse_args

from diffzoo.checkpoint import RUN_CONFIG, CheckpointError
from diffzoo.data.shards import DataError

from . import seams
from .resume import epoch_checkpoints, restore_latest
from .recipe import (
    DERIVED, Plan, RecipeError, check_shard_count, dataset_size, expand_shards, find_recipe, load_recipe,
    open_clip_defaults, parse_overrides, resolve,
)

ERRORS = (RecipeError, DataError, CheckpointError, FileNotFoundError)  # bad inputs: `main` prints them, exits 2


# open_clip_train settings that may differ when a run is resumed (hardware, logging, world size).
MAY_CHANGE_ON_RESUME = {
    'workers', 'batch_size', 'accum_freq', 'warmup', 'local_loss', 'gather_with_grad', 'log_every_n_steps',
    'report_to', 'device', 'dist_url', 'dist_backend', 'grad_checkpointing', 'torchcompile', 'precision',
    'resume', 'save_frequency', 'val_frequency', 'zeroshot_frequency', 'log_local', 'debug', 'horovod',
    'no_set_device_rank', 'use_bn_sync', 'ddp_static_graph', 'delete_previous_checkpoint', 'wandb_notes',
    'remote_sync', 'remote_sync_frequency', 'remote_sync_protocol', 'save_most_recent',
}


def _world() -> tuple:
    from open_clip_train.distributed import world_info_from_env
    return world_info_from_env()  # (local_rank, rank, world_size), from torchrun / SLURM variables


def _jsonable(args) -> Dict:
    return json.loads(json.dumps(vars(args), default=str))


def check_run_dir(args, rank: int) -> Optional[str]:
    """Refuse a run directory whose checkpoints come from other settings; record the settings of a new run
    (or of one that stopped before its first checkpoint, e.g. on a typo: nothing of it is lost)."""
    if args.name is None:
        return None  # open_clip names a new directory by date
    run_dir = os.path.join(args.logs, args.name)
    path = os.path.join(run_dir, RUN_CONFIG)
    config = _jsonable(args)
    if os.path.exists(path) and glob.glob(os.path.join(run_dir, 'checkpoints', '*.pt')):
        with open(path) as f:
            stored = json.load(f)
        changed = sorted(k for k in set(stored) | set(config)
                         if k not in MAY_CHANGE_ON_RESUME and stored.get(k) != config.get(k))
        if changed:
            diffs = '; '.join(f'{k}: {stored.get(k)!r} -> {config.get(k)!r}' for k in changed[:6])
            raise RecipeError(f'{run_dir} holds a run started with other settings ({diffs}). Re-run its original '
                              f'command to resume it, or pass --name NEW for a new run.')
    elif rank == 0:
        os.makedirs(run_dir, exist_ok=True)
        tmp = f'{path}.tmp'
        with open(tmp, 'w') as f:
            json.dump(config, f, indent=1, sort_keys=True)
        os.replace(tmp, path)  # other ranks read it now or not at all, never half written
    return run_dir


def preflight(argv: List[str], world_size: int):
    """open_clip_train's parsed args for `argv`, after the model and data checks open_clip would do later."""
    args = parse_args(list(argv))
    known = open_clip.list_models()
    if args.model not in known and not args.model.startswith(('hf-hub:', 'local-dir:')):
        close = difflib.get_close_matches(args.model, known, n=3)
        raise RecipeError(f'model {args.model!r} is not an open_clip model'
                          + (f'; did you mean {", ".join(close)}?' if close else '')
                          + ' (all of them: python -c "import diffzoo, open_clip; print(open_clip.list_models())")')
    if args.train_data and args.dataset_type in ('webdataset', 'auto') and '.tar' in args.train_data:
        _, shards = expand_shards(args.train_data)
        if args.train_num_samples is None:
            dataset_size(shards)
        if not args.dataset_resampled:
            check_shard_count(len(shards), args.workers, world_size)
    return args


def print_plan(plan: Optional[Plan], source: Optional[str], argv: List[str], run_dir: Optional[str]) -> None:
    if plan is not None:
        print(f'diffzoo.train: recipe {plan.name} ({source})')
        width = max(len(k) for k in plan.recipe)
        for key, value in plan.recipe.items():
            print(f'  {key:<{width}}  {value}')
        print(f'derived for {plan.derived["world_size"]} process(es): '
              + ', '.join(f'{k} {v}' for k, v in plan.derived.items() if k != 'world_size'))
    print('open_clip_train ' + ' '.join(argv))
    if run_dir:
        print(f'run directory: {run_dir}')
    sys.stdout.flush()


def _pop_recipe(tokens: List[str]):
    """(the --recipe value or None, the other tokens); --recipe may stand anywhere before a lone --."""
    for i, token in enumerate(tokens):
        if token == '--recipe' or token.startswith('--recipe='):
            if '=' in token:
                return token.split('=', 1)[1], tokens[:i] + tokens[i + 1:]
            if i + 1 >= len(tokens) or tokens[i + 1].startswith('--'):
                raise RecipeError('--recipe needs a value: a shipped recipe name or a YAML path')
            return tokens[i + 1], tokens[:i] + tokens[i + 2:]
    return None, tokens


def _flag_values(flags: List[str]) -> Dict:
    """What open_clip_train flags set, as recipe keys (the values that differ from its defaults)."""
    parsed = vars(parse_args(list(flags)))
    return {k: v for k, v in parsed.items() if v != open_clip_defaults().get(k) and k not in DERIVED}


def run(argv: List[str], doc: str = '') -> int:
    """Train as `argv` says (`python -m diffzoo.train`'s arguments); 0 when open_clip_train finished. `doc`, the
    command's usage text, ends the error raised when `argv` names nothing to run."""
    head, raw = (argv[:argv.index('--')], argv[argv.index('--') + 1:]) if '--' in argv else (argv, [])
    recipe_arg, head = _pop_recipe(head)
    local_rank, rank, world_size = _world()
    plan, source = None, None
    if recipe_arg is not None:
        source = str(find_recipe(recipe_arg))
        recipe = load_recipe(recipe_arg)
        recipe.update(parse_overrides(head))
        recipe.update(_flag_values(raw))  # flags after -- are seen by the checks below, and win in argv
        plan = resolve(recipe, os.path.basename(source)[:-len('.yaml')], world_size)
        argv = plan.argv + raw
    else:
        argv = head + raw  # open_clip_train's own flags, as `python -m open_clip_train.main` takes them
        if not argv:
            raise RecipeError('nothing to run: pass --recipe RECIPE, or open_clip_train flags\n' + doc)
    args = preflight(argv, world_size)
    run_dir = check_run_dir(args, rank)
    if rank == 0:
        print_plan(plan, source, argv, run_dir)
        if run_dir and args.resume == 'latest' and args.save_most_recent and args.remote_sync is None:
            restored = restore_latest(os.path.join(run_dir, 'checkpoints'))  # else open_clip_train starts over
            if restored:
                print(f'warning: {restored}', file=sys.stderr, flush=True)

    with seams.installed():
        try:
            result = open_clip_train.main.main(argv)
        except (torch.distributed.DistError, RuntimeError) as exc:
            if world_size > 1 and _lost_contact(exc):
                raise LostContact(_lost_contact_message(exc, rank, run_dir)) from exc
            raise
    return 1 if result == -1 else 0


# What gloo and NCCL say when the process at the other end of a collective is gone
LOST = ('connection closed by peer', 'connection reset by peer', 'broken pipe', 'socket timeout', 'timed out',
        'nccl communicator was aborted', 'connection refused')


class LostContact(RuntimeError):
    """A collective failed because another process of the job stopped (a node lost, a process killed)."""


def _lost_contact(exc: BaseException) -> bool:
    return isinstance(exc, torch.distributed.DistError) or any(s in str(exc).lower() for s in LOST)


def _lost_contact_message(exc: BaseException, rank: int, run_dir: Optional[str]) -> str:
    checkpoints = os.path.join(run_dir, 'checkpoints') if run_dir else None
    epochs = epoch_checkpoints(checkpoints) if checkpoints else []
    where = (f'the newest checkpoint is {os.path.join(checkpoints, epochs[0])}' if epochs
             else 'no epoch has been checkpointed yet, so it starts over')
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return (f'rank {rank} lost contact with another process of this job ({first}): a node or process stopped. '
            f'Nothing after the last checkpoint is kept; {where}: run the same command on every node to resume')
