"""Training recipes: YAML files that expand to open_clip_train's command line.

A recipe key is either one of open_clip_train's own flags, spelt with underscores (`lr`, `wd`,
`beta1`, `precision`, `train_data`, …), or one of the few keys diffzoo derives flags from:

- `global_batch_size`, `max_batch_per_gpu`: the per-GPU `--batch-size` is the global batch split
  over the world size; where that exceeds `max_batch_per_gpu`, `--accum-freq` makes up the rest
  (open_clip accumulates features, so the contrastive loss still sees the global batch).
- `warmup_epochs`: open_clip counts warm-up in optimizer steps; the steps per epoch follow from
  the dataset size (`sizes.json` or `train_num_samples`), the global batch and the workers,
  exactly as open_clip_train computes them.
- `distributed_loss`: `auto` adds `--local-loss --gather-with-grad` when the world size is > 1.
- `lambda_lr`: λ and the sub-norm in AdamW groups of their own at this learning rate, under the same
  schedule (`diffzoo.train.lambda_lr`); default: `lr`, as open_clip_train trains them.
- `data_backend`: `open_clip` (default: the data-loader workers decode and augment each image) or `device`
  (they hand over the encoded images; the training process decodes and augments each batch on its device,
  `diffzoo.train.device_data`).
- `base`: another recipe this one extends (a shipped name or a path relative to this file).

`train_data` is a shard directory (all its `*.tar`), a brace pattern or a `::` list; `${VAR}`
in any string value is read from the environment.
"""
import contextlib
import functools
import importlib.util
import io
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from open_clip_train.params import parse_args

from diffzoo.flags import output_problem
from diffzoo.recipes import Key, RecipeError, expand_env, unknown_keys_error
from diffzoo.recipes import parse_overrides as _parse_overrides
from diffzoo.recipes import find_recipe as _find
from diffzoo.recipes import load_recipe as _load
from diffzoo.recipes import recipe_names as _names

from .train_data import check_shard_count, dataset_size, expand_shards, steps_per_epoch

DATA_BACKENDS = ('open_clip', 'device')  # the `data_backend` key's values (diffzoo.train.device_data)
DIFFZOO_KEYS = {
    'base': 'recipe this one extends',
    'description': 'one line saying what the run reproduces',
    'global_batch_size': 'samples per optimizer step, all GPUs together',
    'max_batch_per_gpu': 'largest per-GPU batch; above it, gradient accumulation',
    'warmup_epochs': 'warm-up length in epochs (turned into open_clip steps)',
    'distributed_loss': 'auto | true | false: --local-loss --gather-with-grad on > 1 process',
    'lambda_lr': 'learning rate of λ and the sub-norm, their own AdamW groups (default: lr)',
    'data_backend': 'open_clip | device: JPEG decode and augmentation in the loader workers or on the device',
}
# open_clip flags that diffzoo computes; a recipe gives the diffzoo key instead.
DERIVED = {'batch_size': 'global_batch_size', 'accum_freq': 'global_batch_size',
           'warmup': 'warmup_epochs', 'local_loss': 'distributed_loss', 'gather_with_grad': 'distributed_loss'}
__all__ = ['RecipeError', 'expand_env', 'parse_overrides', 'recipe_names', 'find_recipe', 'load_recipe', 'resolve']


@functools.lru_cache(maxsize=1)
def open_clip_defaults() -> Dict:
    """open_clip_train's flags (as argparse dests) and their default values."""
    return dict(vars(parse_args([])))


def valid_keys() -> List[str]:
    return sorted(set(DIFFZOO_KEYS) | set(open_clip_defaults()))


def recipe_names() -> List[str]:
    return _names('clip')


def find_recipe(name_or_path: str, relative_to: Optional[Path] = None) -> Path:
    return _find(name_or_path, relative_to, 'clip')


def load_recipe(name_or_path: str, relative_to: Optional[Path] = None) -> Dict:
    """The recipe's keys with its `base` chain merged underneath (later files win)."""
    return _load(name_or_path, relative_to, 'clip')


def parse_overrides(tokens: List[str]) -> Dict:
    """['--lr', '1e-3', '--epochs=2', '--grad-checkpointing'] -> {'lr': 0.001, 'epochs': 2, …}."""
    try:
        return _parse_overrides(tokens)
    except RecipeError as exc:
        raise RecipeError(f'{exc} (open_clip_train flags go after a lone --)') from None


# diffzoo's keys as recipe schema keys (types, allowed values); open_clip's flags are checked by its own parser
DIFFZOO_SCHEMA = {
    'base': Key((str,), None, DIFFZOO_KEYS['base']),
    'description': Key((str,), None, DIFFZOO_KEYS['description']),
    'global_batch_size': Key((int,), None, DIFFZOO_KEYS['global_batch_size']),
    'max_batch_per_gpu': Key((int,), None, DIFFZOO_KEYS['max_batch_per_gpu']),
    'warmup_epochs': Key((int, float), None, DIFFZOO_KEYS['warmup_epochs']),
    'distributed_loss': Key((str, bool), 'auto', DIFFZOO_KEYS['distributed_loss'], ('auto', True, False)),
    'lambda_lr': Key((int, float), None, DIFFZOO_KEYS['lambda_lr']),
    'data_backend': Key((str,), 'open_clip', DIFFZOO_KEYS['data_backend'], DATA_BACKENDS),
}
POSITIVE = ('global_batch_size', 'max_batch_per_gpu', 'lr', 'epochs', 'batch_size', 'lambda_lr', 'train_num_samples',
            'log_every_n_steps')  # > 0
NON_NEGATIVE = ('warmup_epochs', 'workers', 'wd')  # ≥ 0


def check_values(recipe: Dict) -> None:
    """Each value's type and range: diffzoo's keys by DIFFZOO_SCHEMA, open_clip's flags by open_clip_train's
    own argument parser (its types and choices), then the ranges every run needs."""
    for key, value in recipe.items():
        if not _finite(value):
            raise RecipeError(f'recipe key {key}: {value!r} is not a finite number; give a number')
        if key in DIFFZOO_SCHEMA:
            DIFFZOO_SCHEMA[key].check(value, key)
        elif value is not None and isinstance(value, (str, int, float)) and not isinstance(value, bool):
            stderr = io.StringIO()
            try:
                with contextlib.redirect_stderr(stderr):
                    parse_args(to_argv({key: value}))
            except SystemExit:
                reason = stderr.getvalue().strip().splitlines()[-1].split('error: ', 1)[-1]
                raise RecipeError(f'recipe key {key}: {value!r} is refused by open_clip_train ({reason})') from None
    for key in POSITIVE + NON_NEGATIVE:
        value = recipe.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and (
                value <= 0 if key in POSITIVE else value < 0):
            raise RecipeError(f'recipe key {key}: {value!r} must be {"positive" if key in POSITIVE else "0 or more"}')
    for key in ('image_mean', 'image_std'):
        value = recipe.get(key)
        if value is not None and (not isinstance(value, (list, tuple)) or len(value) != 3):
            raise RecipeError(f'recipe key {key}: {value!r}; give one number per RGB channel, e.g. [0.5, 0.5, 0.5]')
    if any(s <= 0 for s in recipe.get('image_std') or ()):
        raise RecipeError(f'recipe key image_std: {recipe["image_std"]!r}; each channel\'s std must be positive')
    name = recipe.get('name')
    if name is not None and (not str(name).strip() or os.sep in str(name) or str(name) in ('.', '..')):
        raise RecipeError(f'recipe key name: {name!r}; the run\'s folder under logs is named by it: give a name '
                          f'without {os.sep}, or leave it out for the recipe\'s')
    logs = recipe.get('logs')
    problem = output_problem(str(logs), folder=True) if isinstance(logs, str) and '://' not in logs else None
    if problem:
        raise RecipeError(f'recipe key logs: {logs!r}: {problem}')
    if recipe.get('train_data') is not None and not str(recipe['train_data']).strip():
        raise RecipeError("recipe key train_data: '' names no shards; give the shard folder or a brace pattern")


def _finite(value) -> bool:
    """False for NaN or ±inf (YAML's .nan, .inf), also inside a list or mapping."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, (list, tuple)):
        return all(map(_finite, value))
    if isinstance(value, dict):
        return all(map(_finite, value.values()))
    return True


def check_keys(recipe: Dict) -> None:
    known = set(valid_keys())
    unknown = [k for k in recipe if k not in known]
    if unknown:
        error = unknown_keys_error(unknown, DIFFZOO_KEYS, also=list(open_clip_defaults()))
        raise RecipeError(f'{error}\nand every open_clip_train flag with underscores for dashes '
                          f'(python -m open_clip_train.main --help)')
    derived = [k for k in recipe if k in DERIVED]
    if derived:
        raise RecipeError(f'{", ".join(derived)}: diffzoo computes these; set '
                          f'{", ".join(sorted({DERIVED[k] for k in derived}))} instead')


def split_batch(global_batch: int, world_size: int, max_per_gpu: Optional[int]) -> Tuple[int, int]:
    """(per-GPU batch, accumulation steps) with per_gpu * world_size * accum == global_batch."""
    if global_batch % world_size:
        raise RecipeError(f'global_batch_size {global_batch} does not divide over {world_size} processes; '
                          f'choose a multiple of {world_size}')
    per_process = global_batch // world_size
    accum = max(1, math.ceil(per_process / max_per_gpu)) if max_per_gpu else 1
    while per_process % accum:
        accum += 1
    return per_process // accum, accum


@dataclass
class Plan:
    """A recipe resolved for one world size: open_clip_train argv and what was derived."""
    name: str
    recipe: Dict
    argv: List[str]
    derived: Dict = field(default_factory=dict)


def _flag(key: str) -> str:
    return '--' + key.replace('_', '-')


def to_argv(options: Dict) -> List[str]:
    defaults = open_clip_defaults()
    argv = []
    for key, value in options.items():
        if value is None:
            continue
        if isinstance(value, bool):
            if value and defaults.get(key) is not True:
                argv.append(_flag(key))
            elif not value and defaults.get(key) is True:
                raise RecipeError(f'{key}: false is open_clip\'s default already; remove the key')
            continue
        if isinstance(value, dict):
            argv += [_flag(key)] + [f'{k}={v!r}' if isinstance(v, str) else f'{k}={v}' for k, v in value.items()]
        elif isinstance(value, (list, tuple)):
            argv += [_flag(key)] + [str(v) for v in value]
        else:
            argv += [_flag(key), str(value)]
    return argv


def resolve(recipe: Dict, name: str, world_size: int) -> Plan:
    """Turn a merged recipe (+ overrides) into open_clip_train argv for `world_size` processes."""
    check_keys(recipe)
    recipe = expand_env(recipe)
    check_values(recipe)
    options = {k: v for k, v in recipe.items() if k not in DIFFZOO_KEYS}
    derived = {'world_size': world_size}

    if not options.get('model'):
        raise RecipeError('the recipe names no model; add `model: diffclip-b16` (or pass --model …)')
    options = {'model': options.pop('model'), **options}
    options.setdefault('name', name)
    options.setdefault('logs', 'runs')
    options.setdefault('resume', 'latest')
    options.setdefault('save_most_recent', True)

    if options.get('train_data'):
        options['train_data'], shards = expand_shards(str(options['train_data']))
        num_samples = options.get('train_num_samples') or dataset_size(shards)
        derived.update(shards=len(shards), samples=num_samples)
        workers = int(options.get('workers', open_clip_defaults()['workers']))
        if not options.get('dataset_resampled'):
            check_shard_count(len(shards), workers, world_size)
        global_batch = recipe.get('global_batch_size')
        if global_batch is not None:
            per_gpu, accum = split_batch(int(global_batch), world_size, recipe.get('max_batch_per_gpu'))
            options.update(batch_size=per_gpu, accum_freq=accum)
            derived.update(global_batch_size=int(global_batch), batch_per_gpu=per_gpu, accum_freq=accum)
        per_gpu = int(options.get('batch_size', open_clip_defaults()['batch_size']))
        accum = int(options.get('accum_freq', 1))
        steps = steps_per_epoch(num_samples, per_gpu, world_size, workers, accum)
        derived['steps_per_epoch'] = steps
        if recipe.get('warmup_epochs') is not None:
            options['warmup'] = int(round(float(recipe['warmup_epochs']) * steps))
            derived['warmup_steps'] = options['warmup']

    report_to = str(options.get('report_to') or '')
    if 'tensorboard' in report_to and importlib.util.find_spec('tensorboard') is None:
        options['report_to'] = ','.join(x for x in report_to.split(',') if x != 'tensorboard') or None
        derived['tensorboard'] = 'not installed, not reported to (pip install tensorboard)'

    loss_mode = recipe.get('distributed_loss', 'auto')
    if loss_mode not in ('auto', True, False):
        raise RecipeError(f'distributed_loss must be auto, true or false; got {loss_mode!r}')
    if loss_mode is True or (loss_mode == 'auto' and world_size > 1):
        options.update(local_loss=True, gather_with_grad=True)
    return Plan(name=str(options['name']), recipe=recipe, argv=to_argv(options), derived=derived)
