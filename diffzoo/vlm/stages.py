"""A LLaVA-style stage's output (`diffzoo.train.vlm.stage` writes it): `<run dir>/stage/stage_model.safetensors`
(the parameters the stage trained and started from, under the model's own names) and `stage.json` (the model
part of its recipe, which whatever loads it must match, and the steps it trained). `stage_output` finds one and
refuses it when `stage_problem` finds it unfit (no step trained, weights cut short); `load_stage` puts it into a
freshly built model."""
import json
import struct
from pathlib import Path
from typing import Dict, List, Optional, Set

import torch
import torch.nn as nn
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor, distribute_tensor

from diffzoo.recipes import RecipeError

STAGE_WEIGHTS = 'stage_model.safetensors'
STAGE_CONFIG = 'stage.json'
STAGE_DIR = 'stage'


def model_spec(recipe: Dict) -> Dict:
    """What a stage's output must match to be loaded: the model and its differential settings."""
    return {'model': recipe['model'], 'differential': recipe['differential']}


def weights_problem(path: Path) -> Optional[str]:
    """Why a safetensors file cannot be whole, or None: its header read (8 bytes of length, then JSON) and its
    size the header's (a file cut short, by a full disk or a stopped copy, is smaller). Reads the header only."""
    try:
        with open(path, 'rb') as f:
            length = struct.unpack('<Q', f.read(8))[0]
            header = json.loads(f.read(length))
        end = max((t['data_offsets'][1] for k, t in header.items() if k != '__metadata__'), default=0)
    except (OSError, struct.error, ValueError, KeyError, TypeError, IndexError) as exc:
        return f'{path.name} does not read as safetensors ({type(exc).__name__}: {str(exc)[:120]})'
    size, expected = path.stat().st_size, 8 + length + end
    return None if size == expected else f'{path.name} holds {size:,} bytes of the {expected:,} its header names'


RERUN = (f'rerun that stage (its recipe, with its output): it resumes from its last complete checkpoint and writes '
         f'{STAGE_DIR}/ again')


def stage_problem(directory: Path) -> Optional[str]:
    """Why a stage's output cannot be started from, and the fix, or None: `stage.json` read, at least one step
    trained, and `stage_model.safetensors` whole (`weights_problem`)."""
    try:
        steps = json.loads((directory / STAGE_CONFIG).read_text())['steps']
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f'{STAGE_CONFIG} does not read ({type(exc).__name__}: {str(exc)[:120]}); {RERUN}'
    if not isinstance(steps, int) or steps < 1:
        return (f'{STAGE_CONFIG} records {steps!r} steps: that stage trained nothing; rerun it with max_steps or '
                f'epochs above 0')
    if not (directory / STAGE_WEIGHTS).is_file():
        return f'no {STAGE_WEIGHTS}; {RERUN}'
    problem = weights_problem(directory / STAGE_WEIGHTS)
    return problem and f'{problem}; {RERUN}'


def stage_output(init_from: str, output: str) -> Path:
    """The `stage/` folder `init_from` names: a run directory, or a recipe name under `output`; refused, named,
    when `stage_problem` finds it unfit to start from."""
    for run_dir in (Path(init_from), Path(output) / init_from):
        if (run_dir / STAGE_DIR / STAGE_CONFIG).is_file():
            problem = stage_problem(run_dir / STAGE_DIR)
            if problem:
                raise RecipeError(f'init_from={init_from!r}: {run_dir / STAGE_DIR}: {problem}')
            return run_dir / STAGE_DIR
    raise RecipeError(f'init_from={init_from!r}: no finished stage at {init_from} or {Path(output) / init_from} (a '
                      f'stage writes {STAGE_DIR}/{STAGE_CONFIG} when it ends); run that stage first, or name its '
                      f'run directory')


def parameters_by_name(model: nn.Module) -> Dict[str, nn.Parameter]:
    return dict(model.named_parameters())


def load_stage(model: nn.Module, directory: Path, spec: Dict) -> Set[int]:
    """Copy a finished stage's tensors into `model` after checking that it was trained on the same model;
    returns the ids of the parameters it filled (held from then on)."""
    check_spec(directory, json.loads((directory / STAGE_CONFIG).read_text())['spec'], spec)
    path = directory / STAGE_WEIGHTS
    try:
        tensors = load_file(str(path))
    except (OSError, SafetensorError) as exc:
        raise RecipeError(f'{path} does not load ({type(exc).__name__}: {exc}); {RERUN}') from None
    return copy_tensors(model, tensors, directory, ' the recipe builds')


def spec_differences(there: Dict, here: Dict) -> List[str]:
    """What differs between two `model_spec`s, key by key, in words."""
    a, b = there['model'], here['model']
    differs = [f'model.{k}: {a.get(k)!r} there, {b.get(k)!r} here' for k in sorted(set(a) | set(b))
               if a.get(k) != b.get(k)]
    if there['differential'] != here['differential']:
        differs.append(f'attention: {there["differential"]!r} there, {here["differential"]!r} here')
    return differs


def check_spec(where, saved: Dict, spec: Dict) -> None:
    """Refuse to start from a stage (`where`) whose model (`saved`, its spec) is not this recipe's (`spec`)."""
    differs = spec_differences(saved, spec)
    if differs:
        raise RecipeError(f'{where}: that stage trained another model ({"; ".join(differs)}); start from a stage '
                          f'of the same model, or give this recipe its model')


def copy_tensors(model: nn.Module, tensors: Dict[str, torch.Tensor], where, fix: str) -> Set[int]:
    """Copy whole tensors into `model`'s parameters of the same names (into an FSDP2 parameter's shard), after
    checking every name and shape; returns the ids of the parameters filled. `where` names the tensors' file and
    `fix` ends the error for a name the model lacks."""
    params = parameters_by_name(model)
    for name, value in sorted(tensors.items()):
        if name not in params:
            raise RecipeError(f'{where}: {name} has no parameter in the model{fix}')
        if params[name].shape != value.shape:
            raise RecipeError(f'{where}: {name} is {tuple(value.shape)}, the model\'s {tuple(params[name].shape)}')
    with torch.no_grad():
        for name, value in tensors.items():
            p = params[name]
            value = value.to(device=p.device, dtype=p.dtype)
            if isinstance(p, DTensor):
                value = distribute_tensor(value, p.device_mesh, p.placements)
            p.copy_(value)
    return {id(params[name]) for name in tensors}
