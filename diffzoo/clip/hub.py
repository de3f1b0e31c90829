"""open_clip weight files and open_clip's hub layout: an official DiffCLIP checkpoint converted into them
(with the preprocessing it was trained with), a folder checked and published (`python -m diffzoo.convert`)."""
import json
import shutil
from pathlib import Path
from typing import Dict, List, Optional

import open_clip
import torch
from huggingface_hub import HfApi
from safetensors.torch import save_file

from diffzoo.checkpoint import (PREPROCESS_METADATA, CheckpointError, StateDict, first_keys, is_official_diffclip,
                                official_diffclip_to_open_clip, read_state_dict)
from .pretrained import PRETRAINED

CONFIG_FILE, WEIGHTS_FILE = 'open_clip_config.json', 'open_clip_model.safetensors'  # open_clip's hub layout
PREPROCESS_KEYS = ('mean', 'std', 'interpolation', 'resize_mode')
DIFFCLIP_PREPROCESS = {k: PRETRAINED['diffclip-b16']['cc3m'][k] for k in PREPROCESS_KEYS}


def write_weights(state_dict: StateDict, path: Path, preprocess_cfg: Dict, source: str) -> None:
    """safetensors weights with the preprocess cfg and the source in the metadata."""
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state_dict.items()}, str(path),
              metadata={'format': 'pt', 'source': source, PREPROCESS_METADATA: json.dumps(preprocess_cfg)})


def write_hub_layout(model_name: str, state_dict: StateDict, preprocess_cfg: Dict, out_dir: Path,
                     source: str) -> Path:
    """open_clip's local-dir / hub layout: the model config and preprocess cfg, and the weights."""
    model_cfg = open_clip.get_model_config(model_name)
    if model_cfg is None:
        raise CheckpointError(f'{model_name}: not an open_clip model config (import diffzoo registers its models)')
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / CONFIG_FILE).write_text(json.dumps({'model_cfg': model_cfg, 'preprocess_cfg': preprocess_cfg},
                                                  indent=2) + '\n')
    write_weights(state_dict, out_dir / WEIGHTS_FILE, preprocess_cfg, source)
    return out_dir


def check_fit(state_dict: StateDict, model_name: str, source: Path) -> None:
    """A CheckpointError naming what of `state_dict` does not fit `model_name` (keys missing or not its own, tensors
    of another shape); compared with the model built on the meta device (keys and shapes only)."""
    with torch.device('meta'):
        expected = {k: v.shape for k, v in open_clip.create_model(model_name, device='meta').state_dict().items()}
    missing, unexpected = expected.keys() - state_dict.keys(), state_dict.keys() - expected.keys()
    reshaped = sorted(k for k in expected.keys() & state_dict.keys() if state_dict[k].shape != expected[k])
    if missing or unexpected or reshaped:
        found = [f'{len(keys)} {what} ({first_keys(keys, 2)})' for keys, what in (
            (missing, 'missing'), (unexpected, f'not {model_name}\'s'), (reshaped, 'of another shape')) if keys]
        shape = (f'; e.g. {reshaped[0]}: {tuple(state_dict[reshaped[0]].shape)} here, {tuple(expected[reshaped[0]])} '
                 f'in {model_name}') if reshaped else ''
        raise CheckpointError(f'{source}: converted, its tensors do not fit {model_name}: {"; ".join(found)}{shape}; '
                              f'convert takes the published DiffCLIP ViT-B/16 checkpoint, whole')


def official_diffclip(src: Path, dst: Path) -> StateDict:
    """The official checkpoint as diffzoo's open_clip state dict at `dst`: a .safetensors file, or a
    hub-layout directory. A file that does not convert into diffclip-b16's tensors exactly is refused, before
    anything is written."""
    state_dict = read_state_dict(src)
    if not is_official_diffclip(state_dict):
        raise CheckpointError(f'{src}: not in the official DiffCLIP layout (no image_projection / visual.blocks.*)')
    try:
        converted = official_diffclip_to_open_clip(state_dict)
    except CheckpointError as exc:
        raise CheckpointError(f'{src}: {exc}') from None
    check_fit(converted, 'diffclip-b16', src)
    if dst.suffix == '.safetensors':
        write_weights(converted, dst, DIFFCLIP_PREPROCESS, 'official-diffclip')
    else:
        write_hub_layout('diffclip-b16', converted, DIFFCLIP_PREPROCESS, dst, 'official-diffclip')
    return converted


def hub_files(folder: Path) -> List[Path]:
    """The files `publish` sends from a hub-layout folder: open_clip's config (with the model and its
    preprocessing) and weights. Raises CheckpointError naming what is missing."""
    missing = [name for name in (CONFIG_FILE, WEIGHTS_FILE) if not (folder / name).is_file()]
    if missing:
        raise CheckpointError(f'{folder}: no {", ".join(missing)}; write the folder with '
                              f'python -m diffzoo.convert official-diffclip IN.pt {folder}')
    config_path = folder / CONFIG_FILE
    try:
        config = json.loads(config_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f'{config_path}: not JSON ({e}); write the folder again with '
                              f'python -m diffzoo.convert official-diffclip IN.pt {folder}') from None
    config = config if isinstance(config, dict) else {}
    preprocess = config.get('preprocess_cfg')
    lacking = ([] if isinstance(config.get('model_cfg'), dict) else ['model_cfg']) + [
        f'preprocess_cfg.{k}' for k in ('mean', 'std')
        if not (isinstance(preprocess, dict) and preprocess.get(k) is not None)]
    if lacking:  # open_clip would load it with OpenAI's mean/std, not what the weights were trained with
        raise CheckpointError(f'{config_path}: no {", ".join(lacking)}; write the folder again with '
                              f'python -m diffzoo.convert official-diffclip IN.pt {folder}')
    return [folder / CONFIG_FILE, folder / WEIGHTS_FILE]


def publish(folder: Path, repo: Optional[str], private: bool = False, local_dir: Optional[Path] = None) -> str:
    """Upload a hub-layout folder's `hub_files` to the Hugging Face hub (creating the repo) and return its
    URL, or, given `local_dir`, write those files there instead and return its `local-dir:` name."""
    files = hub_files(folder)
    if local_dir is not None:
        if local_dir.resolve() == folder.resolve():
            raise CheckpointError(f'--local-dir {local_dir} is the folder published; name another folder')
        local_dir.mkdir(parents=True, exist_ok=True)
        for f in files:
            shutil.copyfile(f, local_dir / f.name)
        return f'local-dir:{local_dir}'
    api = HfApi()
    api.create_repo(repo, private=private, exist_ok=True)
    return str(api.upload_folder(repo_id=repo, folder_path=str(folder), allow_patterns=[f.name for f in files],
                                 commit_message='Add diffzoo open_clip model'))
