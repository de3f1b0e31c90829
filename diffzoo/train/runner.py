"""Starting open_clip_train's loop for `python -m diffzoo.train` (`diffzoo.train.launch` parses the command):
the recipe resolved into open_clip_train's argv, the model, data and run-directory checks, the plan printed,
then `open_clip_train.main.main` with diffzoo's seams installed."""
import difflib
import os
import sys
from typing import Dict, List, Optional, Tuple

import open_clip
import open_clip_train.main
import torch.distributed
from open_clip_train.params import parse_args

from diffzoo.checkpoint import CheckpointError
from diffzoo.data.shards import DataError

from . import loss_report, seams
from .lambda_log import read_lambda_log
from .recipe import Plan, RecipeError, find_recipe, load_recipe, open_clip_defaults, parse_overrides, resolve
from .resume import epoch_checkpoints, latest_checkpoint, restore_latest
from .run_record import check_run_dir, pop_accept, resumed_epoch
from .saving import NoSpaceError, checkpoint_bytes, free_bytes, no_space_message
from .train_data import check_batches_fill, check_shard_count, expand_shards, gone_shards, shard_sizes

ERRORS = (RecipeError, DataError, CheckpointError, FileNotFoundError)  # bad inputs: `main` prints them, exits 2
# the data backend of a recipe that names none, by the type of the run's device (docs/training.md)
DEFAULT_DATA_BACKEND = {'cuda': 'open_clip', 'cpu': 'open_clip'}


def _world() -> tuple:
    from open_clip_train.distributed import world_info_from_env
    return world_info_from_env()  # (local_rank, rank, world_size), from torchrun / SLURM variables


def preflight(argv: List[str], world_size: int) -> Tuple[object, Optional[int]]:
    """open_clip_train's parsed args for `argv` and the training samples sizes.json counts (None when not
    read), after the model and data checks open_clip would do later, or never (a corpus no batch fills)."""
    args = parse_args(list(argv))
    known = open_clip.list_models()
    if args.model not in known and not args.model.startswith(('hf-hub:', 'local-dir:')):
        close = difflib.get_close_matches(args.model, known, n=3)
        raise RecipeError(f'model {args.model!r} is not an open_clip model'
                          + (f'; did you mean {", ".join(close)}?' if close else '')
                          + ' (all of them: python -c "import diffzoo, open_clip; print(open_clip.list_models())")')
    samples = None
    if args.train_data and args.dataset_type in ('webdataset', 'auto') and '.tar' in args.train_data:
        _, shards = expand_shards(args.train_data)
        sizes = shard_sizes(shards) if args.train_num_samples is None else None
        samples = None if sizes is None else sum(sizes)
        if not args.dataset_resampled:
            check_shard_count(len(shards), args.workers, world_size)
            if sizes is not None:
                check_batches_fill(sizes, args.batch_size, args.accum_freq, args.workers, world_size,
                                   os.path.dirname(shards[0]))
    return args, samples


def check_space(args, run_dir: Optional[str]) -> None:
    """Refuse to start when the run directory's disk cannot hold one checkpoint of the model (estimated on
    the meta device): on a full disk open_clip_train would fail at its first save, or its log at once."""
    if not run_dir or not os.path.isdir(run_dir) or args.model.startswith(('hf-hub:', 'local-dir:')):
        return
    needed = checkpoint_bytes(args.model)
    free = free_bytes(run_dir)
    if free < needed:
        raise NoSpaceError(no_space_message(os.path.abspath(run_dir), needed, free, f'one checkpoint of {args.model}'))


def print_plan(plan: Optional[Plan], source: Optional[str], argv: List[str], run_dir: Optional[str],
               data_backend: str = 'open_clip', device_type: str = 'cpu') -> None:
    """The recipe's settings (and the data backend it trains on where it names none), what they derive for this
    world, open_clip_train's command line and the run directory."""
    if plan is not None:
        recipe = os.path.basename(source)[:-len('.yaml')]
        print(f'diffzoo.train: recipe {recipe} ({source})' + (f', run {plan.name}' if plan.name != recipe else ''))
        width = max(len(k) for k in (*plan.recipe, 'data_backend'))
        for key, value in plan.recipe.items():
            print(f'  {key:<{width}}  {value}')
        if 'data_backend' not in plan.recipe:
            print(f'  {"data_backend":<{width}}  {data_backend} (the default on {device_type})')
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
    return {k: v for k, v in parsed.items() if v != open_clip_defaults().get(k)}  # a DERIVED one is refused


def run(argv: List[str], doc: str = '') -> int:
    """Train as `argv` says (`python -m diffzoo.train`'s arguments); 0 when open_clip_train finished. `doc`, the
    command's usage text, ends the error raised when `argv` names nothing to run."""
    head, raw = (argv[:argv.index('--')], argv[argv.index('--') + 1:]) if '--' in argv else (argv, [])
    accept, head = pop_accept(head)
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
    args, samples = preflight(argv, world_size)
    lambda_lr = plan.recipe.get('lambda_lr') if plan is not None else None
    if lambda_lr is not None and getattr(args, 'opt', 'adamw') != 'adamw':
        raise RecipeError(f'lambda_lr: gives λ its own AdamW groups, and --opt {args.opt} builds another optimizer '
                          f'(timm\'s); leave one of them out')
    device_type = torch.device(args.device).type
    default_backend = DEFAULT_DATA_BACKEND.get(device_type, 'open_clip')
    data_backend = plan.recipe.get('data_backend', default_backend) if plan is not None else 'open_clip'
    run_dir = check_run_dir(args, rank, world_size, samples, accept, lambda_lr, data_backend)
    if rank == 0:
        check_space(args, run_dir)
        print_plan(plan, source, argv, run_dir, data_backend, device_type)
        if samples is not None:  # sizes.json was read: does it list shards that are gone?
            gone = gone_shards(expand_shards(args.train_data)[1])
            if gone:
                print(f'warning: {gone}', flush=True)
        if run_dir and args.resume == 'latest' and args.save_most_recent and args.remote_sync is None:
            restored = restore_latest(os.path.join(run_dir, 'checkpoints'))  # else open_clip_train starts over
            if restored:
                print(f'warning: {restored}', file=sys.stderr, flush=True)
    checkpoints = os.path.join(run_dir, 'checkpoints') if run_dir else None
    done = resumed_epoch(checkpoints) if checkpoints and args.resume == 'latest' else None
    if done is not None and done >= args.epochs:  # open_clip_train would load it, log, and train nothing
        if rank == 0:
            print(f'{run_dir}: finished, epoch {done} of {args.epochs}; nothing to train. To train longer, run the '
                  f'same command with --epochs N (N > {done}): it resumes from epoch {done}.', flush=True)
        return 0
    if done is not None and rank == 0:
        print(f'resuming {args.name} from epoch {done} of {args.epochs} (checkpoint {latest_checkpoint(checkpoints)})',
              flush=True)

    with seams.installed(None if lambda_lr is None else float(lambda_lr) / args.lr, data_backend):
        try:
            result = open_clip_train.main.main(argv)
        except KeyboardInterrupt:
            raise KeyboardInterrupt(_interrupted_message(checkpoints, args.resume) if rank == 0 else '') from None
        except DataError as exc:  # from a data-loader worker, whose traceback torch wraps into the message
            raise DataError(str(exc).rsplit(f'{DataError.__name__}: ', 1)[-1].strip()) from None
        except (torch.distributed.DistError, RuntimeError) as exc:
            if world_size > 1 and _lost_contact(exc):
                raise LostContact(_lost_contact_message(exc, rank, run_dir)) from exc
            raise
    if result == -1:
        return 1
    if rank == 0 and run_dir:
        print(_closing_line(args, run_dir, world_size), flush=True)
    return 0


def _closing_line(args, run_dir: str, world_size: int) -> str:
    """The run's last loss and, for CLIP's contrastive loss alone (not SigLIP's, CoCa's caption or a distillation
    loss), where it stands against chance: ln of the global batch."""
    contrastive = not args.siglip and args.distill_model is None and 'coca' not in args.model.lower()
    try:
        records = read_lambda_log(run_dir)
    except FileNotFoundError:
        records = []
    return loss_report.closing_line(records, args.batch_size * args.accum_freq * world_size, contrastive)


# What gloo and NCCL say when the process at the other end of a collective is gone
LOST = ('connection closed by peer', 'connection reset by peer', 'broken pipe', 'socket timeout', 'timed out',
        'nccl communicator was aborted', 'connection refused')


class LostContact(RuntimeError):
    """A collective failed because another process of the job stopped (a node lost, a process killed)."""


def _interrupted_message(checkpoints: Optional[str], resume: Optional[str]) -> str:
    """What Ctrl-C during training leaves: the checkpoint the same command resumes from, or that it starts over."""
    latest = latest_checkpoint(checkpoints) if checkpoints else None
    done = resumed_epoch(checkpoints) if latest else None
    if done is None:
        return 'no epoch was checkpointed yet; the same command starts the run over'
    if resume != 'latest':
        return f'epoch {done} is checkpointed in {latest}; add --resume latest to the same command to go on from it'
    return f'run the same command again to resume from epoch {done} (checkpoint {latest})'


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
