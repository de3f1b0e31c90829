"""Checkpoint conversion and publishing, with the preprocessing each checkpoint was trained with.

    python -m diffzoo.convert official-diffclip IN.pt OUT.safetensors   open_clip weights, preprocessing
                                                                        in the file's metadata
    python -m diffzoo.convert official-diffclip IN.pt OUT_DIR           open_clip's local-dir / hub layout
    python -m diffzoo.convert publish OUT_DIR --repo USER/NAME          upload that folder to the hub

reads an official DiffCLIP checkpoint (safely, see `diffzoo.checkpoint`) and writes diffzoo's
open_clip state dict with the preprocessing DiffCLIP trained with (ImageNet mean/std, bilinear
resize of the shorter side). A `.safetensors` file loads with
`open_clip.create_model_and_transforms('diffclip-b16', pretrained='OUT.safetensors')`; a directory
holds open_clip_config.json (model_cfg, preprocess_cfg) and open_clip_model.safetensors, and loads
with `open_clip.create_model_and_transforms('local-dir:OUT_DIR')` or, once published,
`'hf-hub:USER/NAME'` (after `import diffzoo`, which registers the model classes it names).
"""
import argparse
import json
import sys
from pathlib import Path
from typing import Dict

import open_clip
from huggingface_hub import HfApi
from safetensors.torch import save_file

from diffzoo.checkpoint import (PREPROCESS_METADATA, CheckpointError, StateDict, is_official_diffclip,
                                official_diffclip_to_open_clip, read_state_dict)
from diffzoo.clip.pretrained import PRETRAINED

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


def official_diffclip(src: Path, dst: Path) -> StateDict:
    """The official checkpoint as diffzoo's open_clip state dict at `dst`: a .safetensors file, or a
    hub-layout directory."""
    state_dict = read_state_dict(src)
    if not is_official_diffclip(state_dict):
        raise CheckpointError(f'{src}: not in the official DiffCLIP layout (no image_projection / visual.blocks.*)')
    converted = official_diffclip_to_open_clip(state_dict)
    if dst.suffix == '.safetensors':
        write_weights(converted, dst, DIFFCLIP_PREPROCESS, 'official-diffclip')
    else:
        write_hub_layout('diffclip-b16', converted, DIFFCLIP_PREPROCESS, dst, 'official-diffclip')
    return converted


def publish(folder: Path, repo: str, private: bool = False) -> str:
    """Upload a hub-layout folder to the Hugging Face hub (creating the repo); returns its URL."""
    missing = [name for name in (CONFIG_FILE, WEIGHTS_FILE) if not (folder / name).is_file()]
    if missing:
        raise CheckpointError(f'{folder}: no {", ".join(missing)}; write the folder with '
                              f'python -m diffzoo.convert official-diffclip IN.pt {folder}')
    api = HfApi()
    api.create_repo(repo, private=private, exist_ok=True)
    return str(api.upload_folder(repo_id=repo, folder_path=str(folder), commit_message='Add diffzoo open_clip model'))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog='python -m diffzoo.convert', description=__doc__.split('\n\n')[0])
    sub = p.add_subparsers(dest='command', required=True)
    off = sub.add_parser('official-diffclip', help='official DiffCLIP checkpoint_best.pt → open_clip weights')
    off.add_argument('src', type=Path, help='official checkpoint (checkpoint_best.pt)')
    off.add_argument('dst', type=Path, help='output: a .safetensors file, or a directory (hub layout)')
    pub = sub.add_parser('publish', help='upload a hub-layout directory to the Hugging Face hub')
    pub.add_argument('folder', type=Path, help='a directory official-diffclip wrote')
    pub.add_argument('--repo', required=True, metavar='USER/NAME', help='the hub repo to create or update')
    pub.add_argument('--private', action='store_true')
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.command == 'publish':
            print(f'uploaded {args.folder} to {publish(args.folder, args.repo, args.private)}')
            return 0
        converted = official_diffclip(args.src, args.dst)
    except CheckpointError as e:
        print(f'error: {e}', file=sys.stderr)
        return 2
    n = sum(v.numel() for v in converted.values())
    print(f'{args.src} → {args.dst}: {len(converted)} tensors, {n:,} parameters (open_clip layout), preprocessing '
          f'mean {DIFFCLIP_PREPROCESS["mean"]}, std {DIFFCLIP_PREPROCESS["std"]}, '
          f'{DIFFCLIP_PREPROCESS["interpolation"]} resize of the {DIFFCLIP_PREPROCESS["resize_mode"]} side')
    if args.dst.suffix == '.safetensors':
        print(f"load with: open_clip.create_model_and_transforms('diffclip-b16', pretrained='{args.dst}')")
    else:
        print(f"load with: open_clip.create_model_and_transforms('local-dir:{args.dst}') (after import diffzoo)")
    return 0


if __name__ == '__main__':
    sys.exit(main())
