"""`python -m diffzoo.eval.needle build | score | run`: MMNeedle."""
import argparse
import json
import sys
from pathlib import Path
from typing import Dict, List, Optional

from PIL import Image

import diffzoo.eval.needle as needle_package
from diffzoo.files import atomic_write_json, repair_json_lines
from diffzoo.flags import output_folder
from diffzoo.recipes import RecipeError

from .haystack import (HaystackConfig, NeedleError, build, find_captions, read_captions, read_haystacks,
                       usable_captions, write)
from .protocols import PROTOCOLS
from .report import table, write_report
from .scoring import evaluate, read_answers, score_answers, write_answers

ANSWERS, RUN_SETTINGS = 'answers.jsonl', 'run.json'  # `run`'s answers so far, and the settings that asked them


def model_answer_fn(recipe: str, adapter=None, max_new_tokens: int = 20, device: str = 'cpu'):
    """`answer_fn` for the model a VLM recipe names (`diffzoo.vlm.vlm_from_recipe`: with its LoRA
    adapter, or made differential as the recipe says): greedy decoding of one image per prompt
    (build haystacks with --m 1 for single-image models)."""
    # heavy (torch, transformers): imported on use so that the command's --help answers at once
    from diffzoo.vlm.factory import vlm_from_recipe
    vlm = vlm_from_recipe(recipe, adapter, device)

    def answer(images: List[Image.Image], prompt: str) -> str:
        if len(images) != 1:
            raise NeedleError(f'the model reads one image per prompt, the query has {len(images)}; '
                              f'build the haystacks with --m 1')
        return vlm.answer(images, [prompt], max_new_tokens)[0]
    return answer


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog='python -m diffzoo.eval.needle', description=needle_package.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest='command', required=True)
    b = sub.add_parser('build', help='stitch a haystack set from an image folder and its captions')
    b.add_argument('--source', required=True, metavar='DIR', help='the images (for COCO: val2014/)')
    b.add_argument('--captions', metavar='FILE', help='COCO captions_val2014.json, or JSON/JSONL file name → '
                   'caption; default: captions_val2014.json in DIR, DIR/annotations or DIR/../annotations')
    b.add_argument('--out', type=output_folder, required=True, metavar='DIR')
    defaults = HaystackConfig()
    b.add_argument('--m', type=int, default=defaults.m, help='images per sample')
    b.add_argument('--n', type=int, default=defaults.n, help='each image an N×N stitch')
    b.add_argument('--size', type=int, default=defaults.size, help='px per sub-image (MMNeedle: 256)')
    b.add_argument('--samples', type=int, default=defaults.samples)
    b.add_argument('--positive-fraction', type=float, default=defaults.positive_fraction,
                   help='of samples holding the needle (the first ones)')
    b.add_argument('--positives', type=int, help='a number of positives instead of --positive-fraction')
    b.add_argument('--seed', type=int, default=defaults.seed)
    b.add_argument('--overwrite', action='store_true', help='replace a set already in --out')
    s = sub.add_parser('score', help="score a model's answers to a built set")
    s.add_argument('--haystacks', required=True, metavar='DIR', help='a directory `build` wrote')
    s.add_argument('--answers', required=True, metavar='FILE', help='JSONL: {"id", "query", "answer"} per query')
    s.add_argument('--out', type=output_folder, required=True, metavar='DIR')
    s.add_argument('--protocol', choices=PROTOCOLS, help='default: two_step if the queries are row/K, column/K')
    s.add_argument('--title', help='of the heatmap')
    r = sub.add_parser('run', help='ask a model every query of a built set, then score it')
    r.add_argument('--haystacks', required=True, metavar='DIR', help='a directory `build` wrote')
    r.add_argument('--recipe', required=True, help='a VLM recipe naming the model (diffzoo.train.vlm; file or shipped name)')
    r.add_argument('--adapter', metavar='DIR', help='a LoRA adapter written by diffzoo.train.vlm (its adapter/ dir)')
    r.add_argument('--protocol', choices=PROTOCOLS, default='two_step')
    r.add_argument('--max-new-tokens', type=int, default=20)
    r.add_argument('--device', default='cpu')
    r.add_argument('--out', type=output_folder, required=True, metavar='DIR')
    r.add_argument('--title', help='of the heatmap')
    return p


def _cmd_build(a) -> int:
    config = HaystackConfig(a.m, a.n, a.size, a.samples, a.positive_fraction, a.positives, a.seed)
    if not Path(a.source).is_dir():
        raise NeedleError(f'--source {a.source}: no such folder; pass the folder of images (for COCO: val2014/)')
    captions_path = Path(a.captions) if a.captions else find_captions(a.source)
    captions = read_captions(captions_path)
    print(f'build: {len(captions)} captions from {captions_path}', flush=True)
    usable = usable_captions(a.source, captions)
    if usable.missing:
        print(f'build: {len(usable.missing)} of {len(captions)} images missing (first: {usable.missing[0]}); '
              f'left out', flush=True)
    if usable.blank:
        print(f'build: {len(usable.blank)} of {len(captions)} captions blank (first: {usable.blank[0]}); left out',
              flush=True)
    samples = build(a.source, usable.captions, config)
    settings = dict(vars(a), source=str(Path(a.source).resolve()), captions=str(captions_path.resolve()),
                    positives=config.num_positives, captioned_images=len(usable.captions),
                    images_missing=len(usable.missing), blank_captions=len(usable.blank),
                    first_missing=usable.missing[0] if usable.missing else None)
    settings.pop('command')
    settings.pop('overwrite')
    manifest = write(samples, a.out, settings, log=lambda line: print(line, flush=True), overwrite=a.overwrite)
    positives = config.num_positives
    width, height = a.n * a.size, a.n * a.size
    print()
    print(f'{"samples":<22}{len(samples)} ({positives} with the needle, {len(samples) - positives} without)')
    print(f'{"images per sample":<22}{a.m}, each {a.n}x{a.n} sub-images of {a.size} px ({width}x{height} px)')
    print(f'{"images used":<22}{len(usable.captions)} of {len(captions)} captioned'
          + (f' ({len(usable.missing)} missing)' if usable.missing else '')
          + (f' ({len(usable.blank)} blank captions)' if usable.blank else ''))
    print(f'{"seed":<22}{a.seed}')
    print(f'{"manifest":<22}{manifest}')
    print(f'{"stitches":<22}{Path(a.out) / "stitches"}')
    return 0


def _cmd_score(a) -> int:
    samples = read_haystacks(a.haystacks)
    answers = read_answers(a.answers)
    result = score_answers(samples, answers, a.protocol, where=f'--answers {a.answers}',
                           log=lambda line: print(line, flush=True))
    results, heatmap = write_report(result, a.out, a.title)
    print()
    print(table(result))
    print(f'\nresults: {results}\nheatmap: {heatmap}')
    return 0


def answers_so_far(out: Path, settings: Dict) -> Dict:
    """The answers a stopped `run` of the same settings left in `out` (a last line the stop cut short dropped);
    {} for a new run. Answers of other settings (another model, protocol or set) are refused, not mixed in."""
    path, record = out / ANSWERS, out / RUN_SETTINGS
    if not path.exists():
        return {}
    try:
        before = json.loads(record.read_text())
    except (OSError, ValueError):
        before = None
    if before != settings:
        differs = ('no record of the run that wrote it' if not isinstance(before, dict) else '; '.join(
            f'{k}: {before.get(k)!r} -> {v!r}' for k, v in settings.items() if before.get(k) != v))
        raise NeedleError(f'--out {out} holds the answers of another run ({differs}); give another --out, or delete '
                          f'{path} to ask again')
    try:
        repair_json_lines(path)  # the last answer a stop cut short is asked again
    except ValueError as exc:
        raise NeedleError(str(exc)) from None
    return read_answers(path)


def _cmd_run(a) -> int:
    samples = read_haystacks(a.haystacks)
    out = Path(a.out)
    settings = {'haystacks': str(Path(a.haystacks).resolve()), 'recipe': a.recipe, 'adapter': a.adapter,
                'protocol': a.protocol, 'max_new_tokens': a.max_new_tokens}
    answered = answers_so_far(out, settings)
    answer_fn = model_answer_fn(a.recipe, a.adapter, a.max_new_tokens, a.device)
    if answered:
        print(f'run: {len(answered)} answers of a stopped run in {out / ANSWERS} reused', flush=True)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / RUN_SETTINGS, settings)
    with open(out / ANSWERS, 'a', encoding='utf-8') as f:
        def sink(line: Dict) -> None:  # each answer kept as it comes: a stopped run loses none
            f.write(json.dumps(line) + '\n')
            f.flush()
        result = evaluate(samples, answer_fn, a.protocol, log=lambda line: print(line, flush=True),
                          answered=answered, sink=sink)
    answers = write_answers(result, out / ANSWERS)  # in sample order
    results, heatmap = write_report(result, a.out, a.title)
    print()
    print(table(result))
    print(f'\nresults: {results}\nheatmap: {heatmap}\nanswers: {answers}')
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return {'build': _cmd_build, 'score': _cmd_score, 'run': _cmd_run}[args.command](args)
    except (NeedleError, RecipeError) as exc:
        print(f'error: {exc}', file=sys.stderr)
        return 2


if __name__ == '__main__':
    sys.exit(main())
