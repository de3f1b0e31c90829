"""A CLIP run's record, `RUN_DIR/diffzoo-run.json`, and what a resumed run may change of its settings.

A new run records its open_clip_train settings (and its world size). A run directory that already
holds checkpoints is compared with the record before anything is built:

- other data, model, optimiser, seed or loss settings: another run; refused (`--name NEW`);
- settings that change the learning-rate schedule — the global batch (per-process batch × processes ×
  accumulation), the steps per epoch (which the data workers round), the warm-up, fewer epochs — are
  refused unless `--accept-changed-settings` is passed: the message gives the schedule before and after
  and the learning rate at the step the run resumes from under each;
- more epochs lengthen the run: accepted, saying how the schedule stretches (the rate at the resumed
  step jumps from the old schedule's value to the new one's);
- settings that keep the schedule but not the bit-for-bit replay of the uninterrupted run (data workers,
  processes, precision, torch.compile, the same global batch split otherwise, the recipe's `data_backend`) are
  accepted with a warning; hardware, logging and checkpointing settings silently.

A recipe's `lambda_lr` (diffzoo's, not open_clip_train's) is recorded beside them: a new value is accepted,
λ and the sub-norm training at it from the resumed epoch on; leaving it out of a run that had it is refused
(the checkpoint's optimizer holds their groups of their own), and so is adding it to a run whose checkpoint
has no such groups (one from a record older than `lambda_lr`'s, whose checkpoint has them, is recorded).

Every accepted change is recorded: the record is rewritten with the settings the run now trains with
and `changes_on_resume` lists each resume's changes (old → new), the epoch it resumed from and how it
was accepted.
"""
import glob
import json
import os
import sys
from typing import Any, Callable, Dict, List, Optional

from diffzoo.checkpoint import RUN_CONFIG
from diffzoo.files import atomic_write_text

from .recipe import RecipeError
from .train_data import steps_per_epoch
from .resume import latest_checkpoint

CHANGES = 'changes_on_resume'
ACCEPT_FLAG = '--accept-changed-settings'
# hardware, logging and checkpointing: what the run trains does not depend on them
FREE = {'report_to', 'log_every_n_steps', 'device', 'dist_url', 'dist_backend', 'resume', 'save_frequency',
        'val_frequency', 'zeroshot_frequency', 'log_local', 'debug', 'horovod', 'no_set_device_rank',
        'delete_previous_checkpoint', 'wandb_notes', 'remote_sync', 'remote_sync_frequency',
        'remote_sync_protocol', 'save_most_recent', 'grad_checkpointing', 'use_bn_sync', 'ddp_static_graph',
        'local_loss', 'gather_with_grad', 'logs'}  # logs: the run directory was found, however it is spelled
# the same schedule, another sample order or other numerics: not the uninterrupted run bit for bit
REPLAY = {'workers', 'precision', 'torchcompile', 'batch_size', 'accum_freq', 'world_size', 'data_backend'}
# the schedule's own settings, compared through what they give (`_schedule`)
SCHEDULE = {'warmup', 'epochs'}
LAMBDA_LR = 'lambda_lr'  # the recipe's: another value is accepted and noted; dropped or added, checked (docstring)
DATA_PATHS = {'train_data', 'val_data'}  # the same data spelled otherwise from the same folder is the same data


def _same_setting(key: str, old: Any, new: Any) -> bool:
    if key in DATA_PATHS and isinstance(old, str) and isinstance(new, str):
        return os.path.abspath(old) == os.path.abspath(new)  # './shards' and 'shards', relative and absolute
    return old == new


def _jsonable(args) -> Dict:
    return json.loads(json.dumps(vars(args), default=str))


def _write(path: str, record: Dict) -> None:
    # other ranks read it now or not at all, never half written
    atomic_write_text(path, json.dumps(record, indent=1, sort_keys=True))


def _schedule(s: Dict, num_samples: Optional[int]) -> Dict:
    """The learning-rate schedule a settings record gives: global batch, steps per epoch, warm-up, total."""
    world = int(s.get('world_size') or 1)
    batch, accum = int(s['batch_size']), int(s.get('accum_freq') or 1)
    samples = s.get('train_num_samples') or num_samples
    steps = steps_per_epoch(int(samples), batch, world, int(s['workers']), accum) if samples else None
    return {'global_batch': batch * world * accum, 'steps_per_epoch': steps, 'warmup': int(s.get('warmup') or 0),
            'epochs': int(s['epochs']), 'total': steps * int(s['epochs']) if steps else None}


def _lr_at(s: Dict, sched: Dict, step: int) -> Optional[float]:
    """open_clip_train's learning rate at `step` (its scheduler functions, on no parameters)."""
    import torch
    from open_clip_train.scheduler import const_lr, const_lr_cooldown, cosine_lr
    if sched['total'] is None:
        return None
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.)
    base, warmup, total = float(s['lr']), sched['warmup'], sched['total']
    kind = s.get('lr_scheduler', 'cosine')
    if kind == 'const':
        return const_lr(optimizer, base, warmup, total)(step)
    if kind == 'const-cooldown':
        cooldown = sched['steps_per_epoch'] * int(s.get('epochs_cooldown') or 0)
        return const_lr_cooldown(optimizer, base, warmup, total, cooldown, float(s.get('lr_cooldown_power', 1.)),
                                 float(s.get('lr_cooldown_end', 0.)))(step)
    return cosine_lr(optimizer, base, warmup, total)(step)


def _from_latest(checkpoints: str, read: Callable[[Dict], Any]) -> Any:
    """`read` applied to the latest checkpoint, memory-mapped (the weights are not read); None when there is
    none or it cannot be read (the resume itself names it: diffzoo.train.resume)."""
    path = latest_checkpoint(checkpoints)
    if path is None:
        return None
    import torch
    try:
        return read(torch.load(path, map_location='cpu', weights_only=True, mmap=True))
    except Exception:
        return None


def resumed_epoch(checkpoints: str) -> Optional[int]:
    """The epoch the run resumes from (its latest checkpoint's)."""
    return _from_latest(checkpoints, lambda c: int(c['epoch']))


def _has_lambda_groups(checkpoints: str) -> Optional[bool]:
    """Whether the latest checkpoint's optimizer holds λ's own groups (`diffzoo.train.lambda_lr` marks them with
    `lr_scale`)."""
    return _from_latest(checkpoints, lambda c: any('lr_scale' in g for g in c['optimizer']['param_groups']))


def _describe(sched: Dict) -> str:
    steps = f'{sched["steps_per_epoch"]} steps per epoch, ' if sched['steps_per_epoch'] else ''
    return f'global batch {sched["global_batch"]}, {steps}warm-up {sched["warmup"]} steps, {sched["epochs"]} epoch{"s" * (sched["epochs"] != 1)}'


def _lr_words(lr: Optional[float]) -> str:
    return '-' if lr is None else f'{lr:.3g}'


def check_run_dir(args, rank: int, world_size: int, num_samples: Optional[int], accept: bool,
                  lambda_lr: Optional[float] = None, data_backend: str = 'open_clip') -> Optional[str]:
    """Refuse a run directory whose checkpoints come from another run, or a resume whose settings change the
    schedule (unless `accept`); record the settings of a new run (or of one that stopped before its first
    checkpoint: nothing of it is lost) and every change a resume makes (module docstring)."""
    if args.name is None:
        return None  # open_clip names a new directory by date
    run_dir = os.path.join(args.logs, args.name)
    path = os.path.join(run_dir, RUN_CONFIG)
    config = {**_jsonable(args), 'world_size': world_size}
    if lambda_lr is not None:
        config[LAMBDA_LR] = float(lambda_lr)
    if data_backend != 'open_clip':  # (the default's record stays as it was)
        config['data_backend'] = data_backend
    checkpoints = os.path.join(run_dir, 'checkpoints')
    if not (os.path.exists(path) and glob.glob(os.path.join(checkpoints, '*.pt'))):
        if rank == 0:
            os.makedirs(run_dir, exist_ok=True)
            _write(path, config)
        return run_dir
    with open(path) as f:
        record = json.load(f)
    stored = {k: v for k, v in record.items() if k != CHANGES}
    changed = {k: (stored.get(k), config.get(k)) for k in sorted(set(stored) | set(config))
               if not _same_setting(k, stored.get(k), config.get(k)) and not (k == 'world_size' and k not in stored)}
    if LAMBDA_LR in changed and changed[LAMBDA_LR][1] is None:
        raise RecipeError(f'{run_dir} trained λ and the sub-norm at lambda_lr {changed[LAMBDA_LR][0]:g}, in optimizer '
                          f'groups of their own that its checkpoint holds; resume with lambda_lr (its value may '
                          f'change), or pass --name NEW for a new run without it.')
    if LAMBDA_LR in changed and changed[LAMBDA_LR][0] is None and _has_lambda_groups(checkpoints) is False:
        raise RecipeError(f'{run_dir} trained without lambda_lr: its checkpoint\'s optimizer has no groups of λ\'s own '
                          f'to resume; resume without lambda_lr, or pass --name NEW for a new run with it.')
    other = [k for k in changed if k not in FREE | REPLAY | SCHEDULE | {LAMBDA_LR}]
    if other:
        diffs = '; '.join(f'{k}: {changed[k][0]!r} -> {changed[k][1]!r}' for k in other[:6])
        raise RecipeError(f'{run_dir} holds a run started with other settings ({diffs}). Re-run its original '
                          f'command to resume it, or pass --name NEW for a new run.')
    if not changed:
        return run_dir
    old = {**config, **stored}  # a record from before world_size was kept: the same world size
    before, after = _schedule(old, num_samples), _schedule(config, num_samples)
    epoch = resumed_epoch(checkpoints)
    notes, how = [], 'kept the schedule'
    if before != after:
        where = f'the schedule was {_describe(before)}; now {_describe(after)}'
        if epoch is not None and before['steps_per_epoch'] and after['steps_per_epoch']:
            where += (f': resuming after epoch {epoch}, the learning rate goes from '
                      f'{_lr_words(_lr_at(old, before, epoch * before["steps_per_epoch"]))} (the old schedule '
                      f'there) to {_lr_words(_lr_at(config, after, epoch * after["steps_per_epoch"]))}')
        same_but_longer = ({k: v for k, v in before.items() if k not in ('epochs', 'total')}
                           == {k: v for k, v in after.items() if k not in ('epochs', 'total')}
                           and after['epochs'] > before['epochs'])
        if same_but_longer:
            notes.append(f'epochs {before["epochs"]} -> {after["epochs"]}: the run is lengthened; {where}')
            how = 'lengthened'
        elif accept:
            notes.append(f'the learning-rate schedule changes ({ACCEPT_FLAG}): {where}')
            how = ACCEPT_FLAG
        else:
            diffs = '; '.join(f'{k}: {changed[k][0]!r} -> {changed[k][1]!r}' for k in changed)
            raise RecipeError(
                f'{run_dir} was trained with other settings ({diffs}), which change its learning-rate schedule: '
                f'{where}; and the run would no longer replay the uninterrupted run bit for bit. Re-run with the '
                f'original settings, pass {ACCEPT_FLAG} to train on with these (recorded in {path}), or pass '
                f'--name NEW for a new run.')
    replay = [k for k in changed if k in REPLAY]
    if replay:
        notes.append('; '.join(f'{k}: {changed[k][0]!r} -> {changed[k][1]!r}' for k in replay)
                     + ': the run goes on, but no longer replays the uninterrupted run bit for bit (another '
                       'sample order or other numerics)')
    if LAMBDA_LR in changed:
        was, now = changed[LAMBDA_LR]
        since = f'the resume after epoch {epoch}' if epoch is not None else 'this resume'
        notes.append(f'lambda_lr {was:g} -> {now:g}: λ and the sub-norm train at the new rate from {since}'
                     if was is not None else f'lambda_lr {now:g}: recorded (the run\'s record predates it; its '
                                             f'checkpoint holds λ\'s own optimizer groups)')
    if rank == 0:
        for note in notes:
            print(f'warning: {note}', file=sys.stderr, flush=True)
        entry = {'epoch': epoch, 'changed': {k: list(v) for k, v in changed.items()}, 'accepted': how}
        _write(path, {**config, CHANGES: record.get(CHANGES, []) + [entry]})
    return run_dir


def recorded_data_backend(run_dir: str) -> Optional[str]:
    """The data backend a run's record says it trained on (`check_run_dir` records any but the `open_clip`
    default); None where the run directory holds no record."""
    path = os.path.join(run_dir, RUN_CONFIG)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f).get('data_backend', 'open_clip')


def pop_accept(tokens: List[str]):
    """(whether ACCEPT_FLAG is among `tokens`, the tokens without it)."""
    return ACCEPT_FLAG in tokens, [t for t in tokens if t != ACCEPT_FLAG]
