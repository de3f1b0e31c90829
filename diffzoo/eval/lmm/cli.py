"""`python -m diffzoo.eval.lmm --model RECIPE [--stage RUN | --adapter DIR] --task pope --task mme … --data DIR`:
the papers' VLM benchmarks on any model `vlm_from_recipe` builds.

Each task reads its local copy from `--data DIR/<task>` (textvqa_ocr: DIR/textvqa; or `--data-for TASK=DIR`); nothing is downloaded, and a
missing copy is an error naming the file expected. Questions are answered greedily in batches (a progress
bar), an image that does not decode leaves its question out (named once, counted), and the official scoring
follows (`diffzoo.eval.lmm.metrics`): each task's default scorer is the one behind the papers' tables (LLaVA-1.5's
scripts), and `--scoring TASK=NAME` (or `--scoring NAME`, for every task asked) names another. A question its files
give badly (`tasks` docstring: a malformed line, a missing field, a label not yes/no, an image name outside the
folder, a repeated question id — the first kept) is left out before any model is built, counted by reason and named.

A question longer than the model takes (`max_length` positions, its image's and text's: the recipe's
`data.max_length` for a model trained on conversations, LLaVA's `tokenizer_model_max_length`, else the language
model's `max_position_embeddings`) is cut to it as LLaVA's model cuts a prompt at evaluation, answered and scored,
and counted and named (`cut_to_max_length`), so one such question neither takes the run's memory nor ends it.

OUT receives `<task>_predictions.jsonl` (every question's prompt, reply and what it is scored against), appended
batch by batch as the replies are made; `results.json` (every row, the scorer of each task, the questions answered,
reused, cut and left out per reason, and what answered it), after each task, beside the tasks of earlier runs into
the same OUT; and the table printed at the end. Run again with the same OUT, a
cut run goes on where it stopped: each reply already in the predictions file is reused for the question of the same
id and prompt (a half-written last line is cut off and its question asked again; rows that answer no question
asked now stay in the file, unscored), when the model, its stage or adapter files and the reply length are those
that wrote it (OUT/answered_by.json); otherwise that file is moved aside (`<task>_predictions.N.jsonl`) and the
task answered anew.
"""
import argparse
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from diffzoo.data.shards import DataError
from diffzoo.files import atomic_write_json
from diffzoo.flags import at_least, output_folder
from diffzoo.recipes import RecipeError

from .tasks import TASKS, LeftOut, Sample, rows_for_scoring

ANSWERED_BY = 'answered_by.json'  # what answered each task's predictions file: the model, its files, the reply length
UNREADABLE = 'image does not open'


def _scorer_list() -> str:
    return '; '.join(f'{name}: ' + ', '.join(f'{s} (default)' if s == t.default_scorer else s for s in t.scorers)
                     for name, t in TASKS.items())


def parser() -> argparse.ArgumentParser:
    from . import tasks
    p = argparse.ArgumentParser(prog='python -m diffzoo.eval.lmm', description=__doc__ + '\n' + tasks.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--model', required=True, help='a VLM recipe (file or shipped name) naming the model')
    p.add_argument('--stage', metavar='RUN', help="a LLaVA-style stage's run directory (its stage/ is loaded)")
    p.add_argument('--adapter', metavar='DIR', help='a LoRA adapter written by diffzoo.train.vlm (its adapter/ dir)')
    p.add_argument('--task', action='append', required=True, choices=sorted(TASKS), help='repeatable')
    p.add_argument('--data', metavar='DIR', help='holds one folder per task (pope/, mme/, …)')
    p.add_argument('--data-for', action='append', default=[], metavar='TASK=DIR', help="one task's folder")
    p.add_argument('--out', type=output_folder, required=True, metavar='DIR')
    p.add_argument('--batch-size', type=at_least(1), default=8)
    p.add_argument('--max-new-tokens', type=at_least(1), help="default: each task's (lmms-eval's)")
    p.add_argument('--scoring', action='append', default=[], metavar='TASK=NAME',
                   help=f'the reference scorer of a task, or NAME alone for every task asked (repeatable); '
                        f'{_scorer_list()}')
    p.add_argument('--limit', type=at_least(1), metavar='N',
                   help='the first N questions of each task (a smoke run; N ≥ 1, leave it out for every question)')
    p.add_argument('--device', default='cpu')
    return p


def _folders(args) -> Dict[str, Path]:
    given = {}
    for item in args.data_for:
        task, sep, folder = item.partition('=')
        if not sep or task not in TASKS:
            raise DataError(f'--data-for {item!r}: expected TASK=DIR with TASK one of {", ".join(sorted(TASKS))}')
        given[task] = Path(folder)
    folders, missing = {}, []
    for task in args.task:
        if task in given:
            folders[task] = given[task]
        elif args.data:
            folders[task] = Path(args.data) / TASKS[task].folder
        else:
            raise DataError(f'--task {task}: no folder; give --data DIR (holding {TASKS[task].folder}/) or --data-for '
                            f'{task}=DIR')
        if not folders[task].is_dir():
            missing.append(f'{folders[task]}: no such folder, expected the local copy of {task} '
                           f'({TASKS[task].expects})')
    if missing:  # every one at once, so a second run does not stop at the next
        raise DataError('\n  '.join([f'{len(missing)} of the tasks\' folders missing:', *missing]))
    return folders


def chosen_scorers(tasks: List[str], scoring: List[str]) -> Dict[str, str]:
    """{task: scorer name} for the tasks asked: each task's default unless `--scoring` names another; a later
    --scoring wins. ValueError names a task or scorer that does not exist."""
    chosen = {task: TASKS[task].default_scorer for task in tasks}
    for item in scoring:
        task, sep, name = item.rpartition('=')
        named = [task] if sep else tasks
        if sep and task not in TASKS:
            raise ValueError(f'--scoring {item}: no task {task!r}; one of {", ".join(sorted(TASKS))}')
        if sep and task not in chosen:
            raise ValueError(f'--scoring {item}: {task} is not among the tasks asked (--task {task} adds it)')
        lacking = [t for t in named if name not in TASKS[t].scorers]
        if lacking:
            raise ValueError(f'--scoring {item}: ' + '; '.join(
                f'{t} has no scorer {name!r} (its scorers: {", ".join(TASKS[t].scorers)})' for t in lacking))
        chosen.update({t: name for t in named})
    return chosen


def _weight_files(args) -> List[Path]:
    """The files of --stage (the run directory's stage/, or the folder itself) and --adapter; DataError naming what
    is missing, before any model is built."""
    from diffzoo.vlm.stages import STAGE_CONFIG, STAGE_DIR, STAGE_WEIGHTS, stage_problem  # torch: once data is found
    files = []
    if args.stage:
        folder = Path(args.stage) if (Path(args.stage) / STAGE_CONFIG).is_file() else Path(args.stage) / STAGE_DIR
        files = [folder / STAGE_CONFIG, folder / STAGE_WEIGHTS]
        missing = [p.name for p in files if not p.is_file()]
        if missing:
            lacks = f'no {" and no ".join(missing)} in {folder}' if Path(args.stage).is_dir() else 'no such folder'
            raise DataError(f'--stage {args.stage}: {lacks} (a finished stage writes {STAGE_DIR}/{STAGE_CONFIG} and '
                            f'{STAGE_WEIGHTS}); name the run directory of a finished stage')
        problem = stage_problem(folder)  # a stage that trained no step, weights cut short: what a chain refuses
        if problem:
            raise DataError(f'--stage {args.stage}: {problem}')
    if args.adapter:
        if not Path(args.adapter).is_dir():
            raise DataError(f'--adapter {args.adapter}: no such folder; name the adapter/ folder diffzoo.train.vlm '
                            f'wrote')
        files += sorted(p for p in Path(args.adapter).iterdir() if p.is_file())
    return files


def _answered_by(args, weights: List[Path], max_new_tokens: int) -> Dict:
    """What a task's replies depend on: the model as named (and its recipe file's sha256), the size and time of
    the stage's and adapter's files, and the reply length."""
    recipe = hashlib.sha256(Path(args.model).read_bytes()).hexdigest() if Path(args.model).is_file() else None
    return {'model': args.model, 'recipe_sha256': recipe, 'stage': args.stage, 'adapter': args.adapter,
            'max_new_tokens': max_new_tokens,
            'files': {str(p.resolve()): [p.stat().st_size, p.stat().st_mtime_ns] for p in weights}}


def _set_aside(path: Path) -> Path:
    """Move a predictions file to the first free <task>_predictions.N.jsonl beside it."""
    n = 1
    while (aside := path.with_name(f'{path.stem}.{n}.jsonl')).exists():
        n += 1
    os.replace(path, aside)
    return aside


def previous_replies(path: Path, label: str) -> Dict[Tuple[str, str], str]:
    """{(id, prompt): reply} of the rows a predictions file holds. A half-written last line (a run killed while
    writing) is cut off the file; any other line that is not a row is named and skipped; its question is asked
    again."""
    if not path.is_file():
        return {}
    data = path.read_bytes()
    whole = data.rfind(b'\n') + 1
    if whole < len(data):
        with open(path, 'r+b') as f:
            f.truncate(whole)
        print(f'{label}: the last line of {path} was half-written (a run cut while writing); cut off, its question '
              f'is asked again', flush=True)
    replies, bad = {}, []
    for n, line in enumerate(data[:whole].decode('utf-8', errors='replace').splitlines(), 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if isinstance(row, dict) and all(isinstance(row.get(k), str) for k in ('id', 'prompt', 'prediction')):
            replies[(row['id'], row['prompt'])] = row['prediction']
        elif line.strip():
            bad.append(n)
    if bad:
        print(f'{label}: {len(bad)} line(s) of {path} are not prediction rows (line {", ".join(map(str, bad[:5]))}); '
              f'skipped, their questions are asked again', flush=True)
    return replies


def answer(vlm, samples: List[Sample], batch_size: int, max_new_tokens: int, label: str, predictions=None):
    """Replies to every sample whose image decodes, in order, each batch's rows appended to the open file
    `predictions` (and flushed) as they are made; the samples left out (unreadable images)."""
    from tqdm import tqdm

    from diffzoo.vlm.data import load_images  # torch: once the data is found
    replies, left_out = {}, []
    with tqdm(total=len(samples), desc=label, unit='q', file=sys.stdout, dynamic_ncols=True) as bar:
        for i in range(0, len(samples), batch_size):
            batch, why = samples[i:i + batch_size], {}
            kept, images, _ = load_images(batch, why)
            chunk = [batch[k] for k in kept]
            for s in [s for k, s in enumerate(batch) if k not in kept]:  # their images do not open
                left_out.append(s)
                print(f'{label}: image {s.image} does not open ({why[s.source]}); its question is left out',
                      flush=True)
            if chunk:
                texts = vlm.answer(images, [s.prompt for s in chunk], max_new_tokens)
                replies.update((s.id, text) for s, text in zip(chunk, texts))
                if predictions is not None:
                    predictions.write(''.join(json.dumps(_row(s, text)) + '\n' for s, text in zip(chunk, texts)))
                    predictions.flush()
            bar.update(len(batch))
    return replies, left_out


def _row(s: Sample, reply: str) -> Dict:
    return {'id': s.id, 'image': str(s.image), 'prompt': s.prompt, 'prediction': reply, **s.meta}


def _left_out_lines(task: str, left_out: LeftOut) -> List[str]:
    return [f'{task}: {n} left out: {reason} (e.g. {"; ".join(left_out.named[reason][:3])})'
            for reason, n in left_out.counts().items()]


def _run_task(vlm, args, task: str, questions: List[Sample], left_out: LeftOut, scorer: str, answerers: Dict,
              answered_by: Dict) -> Dict:
    """Answer one task's questions not answered before in OUT (module docstring), score them by `scorer`, and
    return its results.json entry; `answerers` is OUT's record of what answered each task."""
    out, spec = Path(args.out), TASKS[task]
    path = out / f'{task}_predictions.jsonl'
    if path.exists() and answerers.get(task) != answered_by:
        print(f'{task}: {path} was written by another model, stage, adapter or reply length (or holds no record of '
              f'it in {out / ANSWERED_BY}); moved to {_set_aside(path)}, every question is asked anew', flush=True)
    answerers[task] = answered_by
    atomic_write_json(out / ANSWERED_BY, answerers)  # before the first row it stands for
    before = previous_replies(path, task)
    replies = {s.id: before[(s.id, s.prompt)] for s in questions if (s.id, s.prompt) in before}
    if before:
        print(f'{task}: {len(replies)} replies reused from {path}; {len(questions) - len(replies)} questions to ask'
              + (f' ({len(before) - len(replies)} replies there answer no question asked now: kept, not scored)'
                 if len(before) > len(replies) else ''), flush=True)
    cut = _over_length(vlm, questions, task)
    with open(path, 'a') as predictions:
        new, unreadable = answer(vlm, [s for s in questions if s.id not in replies], args.batch_size,
                                 answered_by['max_new_tokens'], task, predictions)
    for s in unreadable:
        left_out.add(UNREADABLE, str(s.image))
    reused, replies = len(replies), {**replies, **new}
    answered = [s for s in questions if s.id in replies]
    scores = spec.score(rows_for_scoring(answered, [replies[s.id] for s in answered]), scorer)
    return {'scores': scores, 'scoring': scorer, 'questions': len(questions), 'answered': len(answered),
            'reused': reused, 'left_out': left_out.counts(), 'left_out_examples': left_out.examples(),
            'cut_to_max_length': {'count': len(cut), 'max_length': vlm.max_length, 'examples': cut[:3]}}


def _over_length(vlm, questions: List[Sample], label: str) -> List[str]:
    """The questions longer than the model's `max_length` positions (their image's and text's), each "<id> (<n>
    positions)", printed: the model cuts them to it, as LLaVA's model cuts a prompt (`BuiltVLM`), and they are
    answered and scored as cut."""
    limit = vlm.max_length
    over = [] if limit is None else [(s.id, n) for s in questions if (n := vlm.prompt_positions(s.prompt)) > limit]
    if over:
        print(f'{label}: {len(over)} question(s) longer than the model\'s {limit:,} positions, cut to them as LLaVA\'s '
              f'model cuts a prompt, then answered (e.g. {"; ".join(f"{q} ({n:,} positions)" for q, n in over[:3])})',
              flush=True)
    return [f'{q} ({n:,} positions)' for q, n in over]


def main(argv: Optional[List[str]] = None) -> int:
    p = parser()
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        scoring = chosen_scorers(args.task, args.scoring)
    except ValueError as exc:
        p.error(str(exc))
    try:
        folders = _folders(args)
        samples, left = {}, {}
        for task, folder in folders.items():
            questions, left[task] = TASKS[task].questions(folder)
            samples[task] = questions[:args.limit]
            print(f'{task}: {len(samples[task])} questions from {folder}'
                  + (f' (the first {args.limit} of {len(questions)})' if len(questions) > len(samples[task]) else ''),
                  flush=True)
            print(''.join(line + '\n' for line in _left_out_lines(task, left[task])), end='', flush=True)
        weights = _weight_files(args)
        from diffzoo.vlm.factory import vlm_from_recipe  # torch, transformers: once the data is found
        vlm = vlm_from_recipe(args.model, args.adapter, args.device, stage=args.stage)
    except (DataError, RecipeError) as exc:
        print(f'error: {exc}', file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        answerers = json.loads((out / ANSWERED_BY).read_text())
    except (OSError, ValueError):  # none yet, or unreadable: every predictions file there is set aside
        answerers = {}
    try:  # the tasks of earlier runs into this --out are kept beside this run's, each with what answered it
        results = {task: r for task, r in json.loads((out / 'results.json').read_text())['results'].items()
                   if task not in samples}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # none yet, or not a results file
        results = {}
    table = []
    for task, questions in samples.items():
        answered_by = _answered_by(args, weights, args.max_new_tokens or TASKS[task].max_new_tokens)
        r = _run_task(vlm, args, task, questions, left[task], scoring[task], answerers, answered_by)
        results[task] = r = {**r, 'data': str(folders[task]), 'answered_by': answered_by}
        atomic_write_json(out / 'results.json', {'settings': dict(vars(args)), 'results': results})
        counts = [f'{r["reused"]} of them reused'] if r['reused'] else []
        counts += [f'{n} left out: {reason}' for reason, n in r['left_out'].items()]
        if r['cut_to_max_length']['count']:
            counts.append(f'{r["cut_to_max_length"]["count"]} cut to {r["cut_to_max_length"]["max_length"]:,} '
                          f'positions')
        table += [f'{task} ({r["answered"]} answered' + ''.join(f', {c}' for c in counts)
                  + f'; scored as {r["scoring"]})', *TASKS[task].summary(r['scores'])]
    files = ', '.join(str(out / f'{task}_predictions.jsonl') for task in samples)
    print('\n' + '\n'.join(table) + f'\n\nresults: {out / "results.json"}\npredictions: {files}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
