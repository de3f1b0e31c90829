"""`python -m diffzoo.analysis.overlays`: where each model's vision tower attends, overlaid on images, and its attention entropy per block (`diffzoo.analysis.maps`).

    python -m diffzoo.analysis.overlays IMAGE [IMAGE ...] --model NAME[,PRETRAINED] [--model …]
        [--query mug --query lamp] [--layer -1] [--out attention.png] [--entropy]
"""
import argparse
import sys
import time
from pathlib import Path
from typing import List, Optional

from diffzoo.eval.options import EvalError
from diffzoo.flags import torch_device

from .images import load_images


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog='python -m diffzoo.analysis.overlays', formatter_class=argparse.RawDescriptionHelpFormatter,
        description='Attention maps of each model\'s vision tower overlaid on images (one column per model),\n'
                    'and attention entropy per block and head (--entropy). The method is in the module docstring:\n'
                    '  python -c "import diffzoo.analysis.maps as m; print(m.__doc__)"',
        epilog='Models are spelled as in python -m diffzoo.eval and CLIP_benchmark: NAME,PRETRAINED with\n'
               'PRETRAINED a tag (cc3m) or a checkpoint file; NAME alone is randomly initialised. Example:\n'
               '  python -m diffzoo.analysis.overlays office.jpg --model diffclip-b16,cc3m \\\n'
               '      --model clip-b16-baseline,cc3m --query mug --query lamp --entropy')
    parser.add_argument('images', nargs='+', metavar='IMAGE', help='image files (anything PIL opens)')
    parser.add_argument('--model', dest='models', action='append', default=[], metavar='NAME[,PRETRAINED]',
                        help='an open_clip model and its weights (tag or file); repeat for more columns')
    parser.add_argument('--query', action='append', default=[], metavar='TEXT',
                        help='text query (repeatable); without one, CLS attention is shown')
    parser.add_argument('--layer', type=int, default=-1, help='vision block of the CLS map (default -1, the last)')
    parser.add_argument('--out', default='attention.png', help='overlay PNG (default attention.png); with '
                        '--entropy the entropy plot goes next to it as <stem>_entropy.png')
    parser.add_argument('--entropy', action='store_true', help='also measure attention entropy per block and head')
    parser.add_argument('--device', type=torch_device, help='torch device (default cuda if available, else cpu)')
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not args.models:
        parser.error('give at least one --model NAME (e.g. --model diffclip-tiny --model clip-tiny-baseline)')
    # open_clip, torch and the analysis modules using them: imported after parsing, so --help answers at once
    import open_clip
    import torch

    from diffzoo.eval.models import parse_model

    from .maps import cls_attention, image_entropy, query_attention, vision_trunk
    from .plots import plot_entropy, plot_overlays
    from .report import entropy_table
    args.device = args.device or ('cuda' if torch.cuda.is_available() else 'cpu')
    t0 = time.time()
    try:
        pil = load_images(args.images)
        specs = [parse_model(text) for text in args.models]
    except (ValueError, EvalError) as exc:
        print(f'error: {exc}', file=sys.stderr)
        return 2
    steps = 2 + len(args.models)
    print(f'[1/{steps}] {len(pil)} image(s): {", ".join(args.images)}', flush=True)

    maps, per_image, n_tokens = {}, {}, {}
    for step, (name, pretrained) in enumerate(((s.name, s.pretrained) for s in specs), start=2):
        column = f'{name} ({Path(pretrained).name})' if pretrained else name
        print(f'[{step}/{steps}] {column}: building' + ('' if pretrained else ' (random init: no --pretrained)'),
              flush=True)
        model, _, preprocess = open_clip.create_model_and_transforms(name, pretrained=pretrained, device=args.device)
        model.eval()
        try:
            trunk = vision_trunk(model)
        except ValueError as exc:
            print(f'error: --model {name}: {exc}', file=sys.stderr)
            return 2
        images = torch.stack([preprocess(p) for p in pil]).to(args.device)
        if args.query:
            print(f'      query maps for {", ".join(repr(q) for q in args.query)}', flush=True)
            maps[column] = query_attention(model, open_clip.get_tokenizer(name), images, args.query)
        else:
            print(f'      CLS attention of block {args.layer % len(trunk.blocks)}', flush=True)
            try:
                maps[column] = cls_attention(model, images, args.layer)
            except ValueError as exc:
                print(f'error: {exc}', file=sys.stderr)
                return 2
        if args.entropy:
            print('      attention entropy per block and head', flush=True)
            per_image[column] = image_entropy(model, images)  # (images, blocks, heads)
            n_tokens[column] = trunk.patch_embed.num_patches + trunk.num_prefix_tokens
        del model

    print(f'[{steps}/{steps}] writing figures ({time.time() - t0:.0f} s so far)', flush=True)
    written = [plot_overlays(pil, maps, args.out, queries=args.query or None)]
    if args.entropy:
        out = Path(args.out)
        entropies = {column: e.mean(0) for column, e in per_image.items()}  # (blocks, heads)
        written.append(plot_entropy(entropies, out.with_name(f'{out.stem}_entropy.png'), n_tokens))
        print('\n' + entropy_table(entropies, n_tokens, per_image) + '\n')
    for path in written:
        print(f'wrote {path}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
