"""`python -m diffzoo.eval.lmm --model RECIPE [--stage RUN | --adapter DIR] --task pope --task mme … --data DIR`:
the papers' VLM benchmarks on any model `vlm_from_recipe` builds.

Each task reads its local copy from `--data DIR/<task>` (textvqa_ocr: DIR/textvqa; or `--data-for TASK=DIR`); nothing is downloaded, and a
missing copy is an error naming the file expected. Questions are answered greedily in batches (a progress
bar), an image that does not decode leaves its question out (named once, counted), and the official scoring
follows (`diffzoo.eval.lmm.metrics`): each task's default scorer is the one behind the papers' tables (LLaVA-1.5's
scripts), and `--scoring TASK=NAME` (or `--scoring NAME`, for every task asked) names another. OUT receives
`<task>_predictions.jsonl` (every question's prompt, reply and what it is scored against), `results.json` (every
row, and the scorer of each task) and the table printed at the end.
"""
import argparse
import json
import sys
from pathlib import Path
from typing import Dict, List, Optional

from diffzoo.data.shards import DataError

from .tasks import TASKS, rows_for_scoring


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
    p.add_argument('--out', required=True, metavar='DIR')
    p.add_argument('--batch-size', type=int, default=8)
    p.add_argument('--max-new-tokens', type=int, help="default: each task's (lmms-eval's)")
    p.add_argument('--scoring', action='append', default=[], metavar='TASK=NAME',
                   help=f'the reference scorer of a task, or NAME alone for every task asked (repeatable); '
                        f'{_scorer_list()}')
    p.add_argument('--limit', type=int, help='the first N questions of each task (a smoke run)')
    p.add_argument('--device', default='cpu')
    return p


def _folders(a) -> Dict[str, Path]:
    given = {}
    for item in a.data_for:
        task, sep, folder = item.partition('=')
        if not sep or task not in TASKS:
            raise DataError(f'--data-for {item!r}: expected TASK=DIR with TASK one of {", ".join(sorted(TASKS))}')
        given[task] = Path(folder)
    folders = {}
    for task in a.task:
        if task in given:
            folders[task] = given[task]
        elif a.data:
            folders[task] = Path(a.data) / TASKS[task].folder
        else:
            raise DataError(f'--task {task}: no folder; give --data DIR (holding {TASKS[task].folder}/) or --data-for '
                            f'{task}=DIR')
        if not folders[task].is_dir():
            raise DataError(f'{folders[task]}: no such folder, expected the local copy of {task} '
                            f'({TASKS[task].expects})')
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


def answer(vlm, samples, batch_size: int, max_new_tokens: int, label: str):
    """Replies to every sample whose image decodes, in order; the samples left out (unreadable images)."""
    from tqdm import tqdm

    from diffzoo.vlm.data import _load_images
    replies, left_out = {}, []
    with tqdm(total=len(samples), desc=label, unit='q', file=sys.stdout, dynamic_ncols=True) as bar:
        for i in range(0, len(samples), batch_size):
            batch = samples[i:i + batch_size]
            kept, images, _ = _load_images(batch)
            chunk = [batch[k] for k in kept]
            for s in [s for k, s in enumerate(batch) if k not in kept]:  # their images do not open
                left_out.append(s)
                print(f'{label}: image {s.image} does not open; its question is left out', flush=True)
            if chunk:
                for s, text in zip(chunk, vlm.answer(images, [s.prompt for s in chunk], max_new_tokens)):
                    replies[s.id] = text
            bar.update(len(batch))
    return replies, left_out


def _summary(task: str, scores: Dict) -> List[str]:
    """Table lines of one task's scores (percent)."""
    if task == 'pope':
        lines = [f'  {split:<12} acc {100 * r["accuracy"]:6.2f}  prec {100 * r["precision"]:6.2f}  '
                 f'rec {100 * r["recall"]:6.2f}  F1 {100 * r["f1"]:6.2f}  yes {100 * r["yes_ratio"]:5.1f}%  '
                 f'({r["questions"]} q)' for split, r in scores.items()]
        return lines
    if task == 'mme':
        return [f'  perception {scores["perception"]:7.2f}   cognition {scores["cognition"]:7.2f}   '
                f'({len(scores["subtasks"])} subtasks)']
    extra = f', {scores["failed"]} without a letter' if 'failed' in scores else ''
    return [f'  accuracy {100 * scores["accuracy"]:6.2f}  ({scores["questions"]} q{extra})']


def main(argv: Optional[List[str]] = None) -> int:
    p = parser()
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        scoring = chosen_scorers(a.task, a.scoring)
    except ValueError as exc:
        p.error(str(exc))
    try:
        folders = _folders(a)
        samples = {}
        for task, folder in folders.items():
            samples[task] = TASKS[task].read(folder)[:a.limit] if a.limit else TASKS[task].read(folder)
            print(f'{task}: {len(samples[task])} questions from {folder}', flush=True)
    except DataError as exc:
        print(f'error: {exc}', file=sys.stderr)
        return 2
    from diffzoo.vlm.factory import vlm_from_recipe  # torch, transformers: once the data is found
    vlm = vlm_from_recipe(a.model, a.adapter, a.device, stage=a.stage)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results, table = {}, []
    for task, task_samples in samples.items():
        spec = TASKS[task]
        replies, left = answer(vlm, task_samples, a.batch_size, a.max_new_tokens or spec.max_new_tokens, task)
        answered = [s for s in task_samples if s.id in replies]
        with open(out / f'{task}_predictions.jsonl', 'w') as f:
            for s in answered:
                f.write(json.dumps({'id': s.id, 'image': str(s.image), 'prompt': s.prompt, 'prediction': replies[s.id],
                                    **s.meta}) + '\n')
        scores = spec.score(rows_for_scoring(answered, [replies[s.id] for s in answered]), scoring[task])
        results[task] = {'scores': scores, 'scoring': scoring[task], 'questions': len(task_samples),
                         'left_out': len(left), 'data': str(folders[task])}
        table += [f'{task} ({len(answered)} answered' + (f', {len(left)} left out: unreadable images' if left else '')
                  + f'; scored as {scoring[task]})', *_summary(task, scores)]
    settings = dict(vars(a))
    (out / 'results.json').write_text(json.dumps({'settings': settings, 'results': results}, indent=1) + '\n')
    print('\n' + '\n'.join(table) + f'\n\nresults: {out / "results.json"}\npredictions: {out}/<task>_predictions.jsonl')
    return 0


if __name__ == '__main__':
    sys.exit(main())
