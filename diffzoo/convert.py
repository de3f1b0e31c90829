"""Checkpoint conversion and publishing, with the preprocessing each checkpoint was trained with.

    python -m diffzoo.convert official-diffclip IN.pt OUT.safetensors   open_clip weights, preprocessing
                                                                        in the file's metadata
    python -m diffzoo.convert official-diffclip IN.pt OUT_DIR           open_clip's local-dir / hub layout
    python -m diffzoo.convert publish OUT_DIR --repo USER/NAME          upload that folder to the hub
    python -m diffzoo.convert publish OUT_DIR --local-dir COPY          write what the upload would send

reads an official DiffCLIP checkpoint (safely, see `diffzoo.checkpoint`) and writes diffzoo's
open_clip state dict with the preprocessing DiffCLIP trained with (ImageNet mean/std, bilinear
resize of the shorter side). A `.safetensors` file loads with
`open_clip.create_model_and_transforms('diffclip-b16', pretrained='OUT.safetensors')`; a directory
holds open_clip_config.json (model_cfg, preprocess_cfg) and open_clip_model.safetensors, and loads
with `open_clip.create_model_and_transforms('local-dir:OUT_DIR')` or, once published,
`'hf-hub:USER/NAME'` (after `import diffzoo`, which registers the model classes it names). `publish`
sends exactly open_clip's two files (nothing else the folder holds) and refuses a folder whose config
lacks the model or its preprocessing; `--local-dir` writes those same files to a folder instead of the
hub (offline, e.g. to check the upload with `local-dir:COPY`). The functions behind it: `diffzoo.clip.hub`.
"""
import argparse
import sys
from pathlib import Path

from diffzoo.flags import output_file, output_folder


def weights_output(text: str) -> Path:
    """official-diffclip's DST: a .safetensors file, else a folder for the hub layout."""
    return Path(output_file(text) if text.endswith('.safetensors') else output_folder(text))


def folder(text: str) -> Path:
    return Path(output_folder(text))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog='python -m diffzoo.convert', description=__doc__.split('\n\n')[0])
    sub = p.add_subparsers(dest='command', required=True)
    off = sub.add_parser('official-diffclip', help='official DiffCLIP checkpoint_best.pt → open_clip weights')
    off.add_argument('src', type=Path, help='official checkpoint (checkpoint_best.pt)')
    off.add_argument('dst', type=weights_output, help='output: a .safetensors file, or a directory (hub layout)')
    pub = sub.add_parser('publish', help='upload a hub-layout directory to the Hugging Face hub')
    pub.add_argument('folder', type=Path, help='a directory official-diffclip wrote')
    pub.add_argument('--repo', metavar='USER/NAME', help='the hub repo to create or update')
    pub.add_argument('--private', action='store_true')
    pub.add_argument('--local-dir', type=folder, metavar='DIR',
                     help='write the files the upload would send to DIR instead (offline; nothing is uploaded)')
    return p


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.command == 'publish' and args.repo is None and args.local_dir is None:
        p.error('publish: pass --repo USER/NAME to upload, or --local-dir DIR to write the files instead')
    # open_clip, safetensors and torch: imported after parsing, so --help answers at once
    from diffzoo.checkpoint import CheckpointError
    from diffzoo.clip.hub import DIFFCLIP_PREPROCESS, hub_files, official_diffclip, publish
    try:
        if args.command == 'publish':
            where = publish(args.folder, args.repo, args.private, args.local_dir)
            if args.local_dir is None:
                print(f'uploaded {args.folder} to {where}')
            else:
                print(f'wrote {", ".join(f.name for f in hub_files(args.folder))} to {args.local_dir} '
                      f'(not uploaded{f" to {args.repo}" if args.repo else ""}); '
                      f"load with: open_clip.create_model_and_transforms('{where}') (after import diffzoo)")
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
