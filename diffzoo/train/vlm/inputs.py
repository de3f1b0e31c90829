"""What a VLM run needs before its first step, checked: its settings (`check_settings`), its data files
(`check_data_files`: that they are there, not what they hold, which the run's loader reads once), and for
`python -m diffzoo.train.vlm chain STAGE …` every stage's recipe, data and `init_from` (`check_chain`) before
the first stage trains, so a stage that cannot run is named before hours of the ones before it, not after."""
import codecs
import json
from pathlib import Path
from typing import Dict, List, Sequence

import torch

from diffzoo.recipes import RecipeError
from diffzoo.vlm.recipe import checked_recipe
from diffzoo.vlm.stages import STAGE_CONFIG, check_spec, model_spec, spec_differences, stage_output

LLAVA_JSON = 'a LLaVA-format JSON (a list of {id, image?, conversations})'


def check_settings(recipe: Dict) -> None:
    """Refuse what no run of this recipe could do: a stage of a model whose tower and projector are inside its
    checkpoint, a stage on VQAv2 or LoRA fine-tuning on conversations, FSDP without GPUs (accelerate would train
    unsharded), FSDP over LoRA."""
    data, stage = recipe['data'], recipe['train'] is not None
    if stage and recipe['model']['type'] != 'build_vlm':
        raise RecipeError('train: stages apply to build_vlm models (model.type: build_vlm); a PaliGemma checkpoint '
                          'trains with LoRA (train: null)')
    if stage and data['type'] != 'conversations':
        raise RecipeError('train: a stage trains on conversations (data.type: conversations); VQAv2 fine-tuning is '
                          'train: null')
    if not stage and data['type'] != 'vqav2':
        raise RecipeError(f'data.type {data["type"]}: LoRA fine-tuning (train: null) reads VQAv2; conversations train '
                          f'in a stage (train: {{projector, vision, language_model, …}})')
    cuda = torch.cuda.is_available() and recipe['device'] != 'cpu'
    if recipe['fsdp'] is not None and not cuda:
        raise RecipeError('fsdp: accelerate shards with FSDP on GPUs only (on CPUs it trains with DDP, every process '
                          'holding the whole model); run on GPUs, or set fsdp: null')
    if recipe['fsdp'] is not None and stage and recipe['train']['language_model'] == 'lora':
        raise RecipeError('fsdp with train.language_model: lora: LoRA trains a few adapters, which DDP holds; FSDP is '
                          'for training a large language model in full (set fsdp: null)')


def check_data_files(data: Dict) -> None:
    """The data files are there and readable: a conversation set's JSON (its first bytes open a list) and image
    folder, a VQAv2 copy's folder. Reads a few bytes, not the file."""
    if data['type'] == 'vqav2':
        if not Path(data['root']).is_dir():
            raise FileNotFoundError(f'data.root {data["root"]}: no such folder; point it at a VQAv2 copy (official '
                                    f'JSON + COCO images, or Hugging Face parquet)')
        return
    path = Path(data['json'])
    if not path.is_file():
        raise FileNotFoundError(f'{path}: no such file; point data.json at {LLAVA_JSON}')
    with open(path, 'rb') as f:
        head = f.read(4096).removeprefix(codecs.BOM_UTF8).lstrip()
    if not head.startswith(b'['):
        found = 'empty' if not head else f'starts with {head[:24]!r}'
        raise ValueError(f'{path}: {found}, not a JSON list; point data.json at {LLAVA_JSON}')
    folder = data['image_folder']
    if folder is not None and not Path(folder).is_dir():
        raise FileNotFoundError(f'{folder}: no such folder; point data.image_folder at the images the JSON names')


def _check_init_from(recipe: Dict, chain: List[Path], specs: List[Dict], at: int) -> None:
    """`init_from` names an earlier stage of the chain (its model this recipe's), or a finished stage on disk of
    this recipe's model (`stage_output`); a later stage of the chain is named as such."""
    init_from, spec = recipe['init_from'], model_spec(recipe)
    named = {Path(init_from).resolve(), (Path(recipe['output']) / init_from).resolve()}
    for i, run_dir in enumerate(chain):
        if run_dir.resolve() not in named or i == at:
            continue
        if i > at:
            raise RecipeError(f'init_from={init_from!r} is stage {i + 1} of the chain, which runs after this one; '
                              f'list the stages in the order they train')
        differs = spec_differences(specs[i], spec)
        if differs:
            raise RecipeError(f'init_from={init_from!r}: stage {i + 1} of the chain trains another model '
                              f'({"; ".join(differs)}); start from a stage of the same model, or give this recipe '
                              f'its model')
        return
    directory = stage_output(init_from, recipe['output'])  # finished, trained, whole: else refused, named
    check_spec(directory, json.loads((directory / STAGE_CONFIG).read_text())['spec'], spec)


def check_chain(names: Sequence[str], overrides: Sequence[str]) -> None:
    """Every stage of a chain checked before the first trains: its recipe (with the overrides), settings, data
    files and `init_from`. The error names the stage."""
    recipes, chain = [], []
    for name in names:
        try:
            recipes.append(checked_recipe(name, overrides))
        except (RecipeError, ValueError, OSError) as exc:
            raise RecipeError(f'stage {len(recipes) + 1} of {len(names)} ({name}), checked before any stage '
                              f'runs: {exc}') from exc
        chain.append(Path(recipes[-1]['output']) / Path(name).stem)  # its run directory (diffzoo.train.vlm.cli.main)
    specs = [model_spec(r) for r in recipes]
    for i, (name, recipe) in enumerate(zip(names, recipes)):
        try:
            check_settings(recipe)
            check_data_files(recipe['data'])
            if recipe['init_from']:
                _check_init_from(recipe, chain, specs, i)
        except (RecipeError, ValueError, OSError) as exc:
            raise RecipeError(f'stage {i + 1} of {len(names)} ({name}), checked before any stage runs: '
                              f'{exc}') from exc
