"""`python -m diffzoo.analysis`: per-layer token similarity and attention of one or two models.

    python -m diffzoo.analysis --model RECIPE [--adapter DIR] --images DIR --prompts "…" "…"
        [--model RECIPE [--compare-adapter DIR]] [--out analysis/]
    python -m diffzoo.analysis --model NAME[,PRETRAINED] --images DIR [--model NAME[,PRETRAINED]]

A model is a VLM recipe (a YAML file or a shipped name, `python -m diffzoo.train.vlm recipes`) or
an open_clip model; the second --model, of the same kind, is overlaid on every plot.

writes `analysis.json` (every number, per sample and averaged) and PNGs with the models overlaid,
and prints a table; the definitions are `diffzoo.analysis`'s docstring.
"""
import argparse
import json
import sys
import time
from pathlib import Path
from typing import List, Optional

from diffzoo.flags import at_least, output_folder, torch_device
from diffzoo.recipes import recipe_names

TOP_K = 25  # diffzoo.analysis.metrics.TOP_K, spelled here so that --help imports no torch (tested equal)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog='python -m diffzoo.analysis', fromfile_prefix_chars='@',
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description='Per-layer token similarity and attention (entropy, mass by token category, top-k overlap\n'
                    'across prompts) of a VLM or a CLIP vision tower; two models overlaid. Definitions:\n'
                    '  python -c "import diffzoo.analysis as a; print(a.__doc__)"',
        epilog='Example (vanilla vs differential decoder, each with its trained adapter):\n'
               '  python -m diffzoo.analysis --model paligemma-3b-vqav2-diff --adapter runs/vlm/diff/adapter \\\n'
               '      --model paligemma-3b-vqav2-baseline --compare-adapter runs/vlm/base/adapter \\\n'
               '      --images coco/ --prompts "answer en what is on the table?" "answer en how many people?"\n'
               'Arguments can be read from a file, one per line: --prompts @prompts.txt')
    p.add_argument('--model', dest='models', action='append', default=[], metavar='RECIPE|NAME[,PRETRAINED]',
                   help='a VLM recipe (diffzoo.train.vlm; file or shipped name) or an open_clip model '
                        '(diffclip-*, clip-*-baseline); give it twice to overlay a second model of the same kind')
    p.add_argument('--adapter', metavar='DIR', help='a LoRA adapter saved by diffzoo.train.vlm (of the first VLM --model)')
    p.add_argument('--compare-adapter', metavar='DIR', help='the adapter of the second VLM --model')
    p.add_argument('--label', help='name of the first model in plots and tables (default: recipe / model name)')
    p.add_argument('--compare-label', help='name of the second model')
    p.add_argument('--images', nargs='+', required=True, metavar='PATH', help='image files or directories')
    p.add_argument('--prompts', nargs='+', default=[], metavar='TEXT',
                   help='prompts for a VLM, each asked about every image (two or more for the top-k overlap); '
                        'given verbatim: VQA-tuned models expect "answer en QUESTION"')
    p.add_argument('--top-k', type=at_least(1), default=TOP_K,
                   help=f'visual tokens compared across prompts (default {TOP_K})')
    p.add_argument('--out', type=output_folder, default='analysis', metavar='DIR',
                   help='output directory (default analysis/)')
    p.add_argument('--device', type=torch_device, default=None, help='default: cuda when available, else cpu')
    p.add_argument('--seed', type=at_least(0), default=0,
                   help='seed for randomly initialised parts (same for both models)')
    return p


def _label(text: str, adapter: Optional[str]) -> str:
    name = Path(text).stem if text.endswith(('.yaml', '.yml')) else text
    return f'{name} + {Path(adapter).name}' if adapter else name


def _is_vlm_recipe(source: str) -> bool:
    return source.endswith(('.yaml', '.yml')) or source in recipe_names('vlm')


def _analyse(kind: str, source: str, adapter: Optional[str], pil, names, args, t0: float):
    # heavy (torch, open_clip, transformers): imported after parsing so that --help answers at once
    import torch

    from diffzoo.eval.models import EvalError, load, parse_model
    from diffzoo.vlm.factory import vlm_from_recipe

    from .layers import analyse_clip, analyse_vlm
    if kind == 'vlm':
        vlm = vlm_from_recipe(source, adapter, args.device)
        print(f'      analysing ({time.time() - t0:.0f} s so far)', flush=True)
        return analyse_vlm(vlm, pil, args.prompts, args.top_k, names, log=lambda s: print(s, flush=True))
    try:
        loaded = load(parse_model(source), args.device, seed=args.seed)
    except EvalError as exc:
        raise ValueError(str(exc)) from None
    print(f'      analysing ({time.time() - t0:.0f} s so far)', flush=True)
    return analyse_clip(loaded.model, torch.stack([loaded.preprocess(im) for im in pil]), image_names=names)


def main(argv: Optional[List[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    sources = args.models
    if not 1 <= len(sources) <= 2:
        parser.error(f'{len(sources)} models given ({" ".join(sources) or "none"}): pass --model once, '
                     'or twice to compare two models')
    kinds = ['vlm' if _is_vlm_recipe(source) else 'clip' for source in sources]
    if len(set(kinds)) > 1:
        parser.error(f'--model {sources[0]} and --model {sources[1]}: one is a VLM recipe, the other an open_clip '
                     'model; compare two of the same kind')
    kind = kinds[0]
    if kind == 'vlm' and not args.prompts:
        parser.error(f'--model {sources[0]} is a VLM recipe: pass --prompts (one or more; two or more for the '
                     'top-k overlap)')
    if kind == 'clip' and (args.prompts or args.adapter or args.compare_adapter):
        parser.error(f'--model {sources[0]} is an open_clip model: --prompts, --adapter and --compare-adapter '
                     'apply to VLM recipes')
    if args.compare_adapter and len(sources) < 2:
        parser.error('--compare-adapter is the adapter of a second --model RECIPE; pass one')
    # heavy (torch, open_clip, transformers): imported after parsing so that --help answers at once
    import torch

    from .images import image_files, load_images
    from .layers import DEFINITIONS
    from .plots import plot_analysis
    from .report import summary_table
    args.device = args.device or ('cuda' if torch.cuda.is_available() else 'cpu')
    try:
        files = image_files(args.images)
        pil = load_images(files)
    except ValueError as exc:
        print(f'error: {exc}', file=sys.stderr)
        return 2
    names = [f.name for f in files]
    models = [(args.label or _label(sources[0], args.adapter), sources[0], args.adapter)]
    if len(sources) == 2:
        label = args.compare_label or _label(sources[1], args.compare_adapter)
        models.append((label if label != models[0][0] else f'{label} (compare)', sources[1], args.compare_adapter))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {'images': [str(f) for f in files], 'prompts': args.prompts, 'top_k': args.top_k,
              'definitions': DEFINITIONS, 'models': {}}
    steps = len(models) + 1
    t0 = time.time()
    print(f'[0/{steps}] {len(pil)} image(s)' + (f' × {len(args.prompts)} prompt(s)' if kind == 'vlm' else ''),
          flush=True)
    for step, (label, source, adapter) in enumerate(models, start=1):
        print(f'[{step}/{steps}] {label}: building {source}' + (f' with adapter {adapter}' if adapter else ''),
              flush=True)
        torch.manual_seed(args.seed)
        try:
            report = _analyse(kind, source, adapter, pil, names, args, t0)
        except (ValueError, FileNotFoundError) as exc:
            done = f'; {out / "analysis.json"} holds the models analysed before it' if result['models'] else ''
            print(f'error: {label} ({source}): {exc}{done}', file=sys.stderr)
            return 2
        result['models'][label] = {'source': source, 'adapter': adapter, **report}
        (out / 'analysis.json').write_text(json.dumps(result, indent=1) + '\n')  # kept if a later model fails
    print(f'[{steps}/{steps}] writing figures ({time.time() - t0:.0f} s so far)', flush=True)
    reports = {label: r for label, r in result['models'].items()}
    written = [out / 'analysis.json', *plot_analysis(reports, out)]
    print('\n' + summary_table(reports) + '\n')
    for path in written:
        print(f'wrote {path}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
