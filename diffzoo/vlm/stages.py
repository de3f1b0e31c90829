"""A LLaVA-style stage's output (`diffzoo.train.vlm_stage` writes it): `<run dir>/stage/stage_model.safetensors`
(the parameters the stage trained and started from, under the model's own names) and `stage.json` (the model
part of its recipe, which whatever loads it must match). `load_stage` puts them into a freshly built model."""
import json
from pathlib import Path
from typing import Dict, Set

import torch
import torch.nn as nn
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor, distribute_tensor

from diffzoo.recipes import RecipeError

STAGE_WEIGHTS = 'stage_model.safetensors'
STAGE_CONFIG = 'stage.json'
STAGE_DIR = 'stage'


def model_spec(recipe: Dict) -> Dict:
    """What a stage's output must match to be loaded: the model and its differential settings."""
    return {'model': recipe['model'], 'differential': recipe['differential']}


def stage_output(init_from: str, output: str) -> Path:
    """The `stage/` folder `init_from` names: a run directory, or a recipe name under `output`."""
    for run_dir in (Path(init_from), Path(output) / init_from):
        if (run_dir / STAGE_DIR / STAGE_CONFIG).is_file():
            return run_dir / STAGE_DIR
    raise RecipeError(f'init_from={init_from!r}: no finished stage at {init_from} or {Path(output) / init_from} (a '
                      f'stage writes {STAGE_DIR}/{STAGE_CONFIG} when it ends); run that stage first, or name its '
                      f'run directory')


def parameters_by_name(model: nn.Module) -> Dict[str, nn.Parameter]:
    return dict(model.named_parameters())


def load_stage(model: nn.Module, directory: Path, spec: Dict) -> Set[int]:
    """Copy a finished stage's tensors into `model` after checking that it was trained on the same model;
    returns the ids of the parameters it filled (held from then on)."""
    saved = json.loads((directory / STAGE_CONFIG).read_text())['spec']
    there, here = saved['model'], spec['model']
    differs = [f'model.{k}: {there.get(k)!r} there, {here.get(k)!r} here' for k in sorted(set(there) | set(here))
               if there.get(k) != here.get(k)]
    if saved['differential'] != spec['differential']:
        differs.append(f'attention: {saved["differential"]!r} there, {spec["differential"]!r} here')
    if differs:
        raise RecipeError(f'{directory}: that stage trained another model ({"; ".join(differs)}); start from a stage '
                          f'of the same model, or give this recipe its model')
    return copy_tensors(model, load_file(str(directory / STAGE_WEIGHTS)), directory, ' the recipe builds')


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
