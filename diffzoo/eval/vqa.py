"""VQA accuracy as the official VQAv2 evaluation computes it, and a VLM's answers to VQA questions.

    python -m diffzoo.eval.vqa --predictions RESULTS.json --annotations ANNOTATIONS.json [--scoring llava]

The reference is `PythonEvaluationTools/vqaEvaluation/vqaEval.py` of github.com/GT-Vision-Lab/VQA
(master, a013f00) with `loadRes` of `PythonHelperTools/vqaTools/vqa.py`. The script expects answers already
processed by the submitter; how each reply is prepared is the scoring (`diffzoo.eval.vqa_answers`):

- 'llava' (the default): every reply through EvalAI's answer processor first, as LLaVA-1.5's
  convert_vqav2_for_submission.py does before submitting to the evaluation server (and lmms-eval on each
  reply): "Yes" against ten "yes" scores 1.
- 'lmms_eval': lmms-eval's vqav2_process_results (reply and human answers always normalised).
- 'vqaeval': the official script on the reply as given: only if the human answers of a question differ
  among themselves are they and the reply normalised; when all humans agree the comparison is exact, case
  included ("Yes" against ten "yes" scores 0).

What the script does besides, and where this module follows it:

- Accuracy of one question with human answers a_1..a_n (n = 10 in VQAv2), leaving each out in turn:

      acc = 1/n · Σ_i min(1, #{j ≠ i : a_j = prediction} / 3)

  so of 10 humans, 4 or more matching give 1, 3 give 0.9, 2 give 0.6 and 1 gives 0.3. The official script
  leaves out an answer dict, and the dicts differ by `answer_id`; here answer i is left out by position.
- `overall` is the mean over questions, and `perQuestionType` / `perAnswerType` the mean over the
  questions of each `question_type` / `answer_type`, all as round(100 · mean, 2), summed in annotation
  order. The script is Python 2, whose round() takes halves away from zero (12.125 → 12.13 where
  Python 3 gives 12.12); `_py2_rounded_percent` does the same on the float's exact value.
- The results must be a list of {"question_id", "answer"} covering exactly the annotated questions
  (`loadRes` asserts the two id sets are equal). `evaluate` requires the same by default;
  `allow_missing=True` scores only the predicted questions. Ids in the results but not in the
  annotations are always an error, as are duplicate ids (the script silently keeps the last).
"""
import argparse
import json
import sys
from collections import Counter
from collections.abc import Mapping
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from diffzoo.eval.vqa_answers import VQA_SCORING, vqa_accuracy
from diffzoo.flags import output_file


class VQAInputError(ValueError):
    """Predictions or annotations not in the official format, or not of the same questions."""


def _py2_rounded_percent(fraction_sum: float, count: int) -> float:
    """round(100 · sum / count, 2) as the script's Python 2 rounds: halves away from zero."""
    value = 100 * fraction_sum / count
    return float(Decimal(value).quantize(Decimal('0.01'), rounding=ROUND_HALF_UP))


def _example(ids) -> str:
    return repr(next(iter(ids)))


def _check_id(where: str, value) -> None:
    """A question id is an int or a string, as the official files write it: a bool, a float or a list is refused
    (true and 1.0 would otherwise be scored as question 1)."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise VQAInputError(f'{where}: question_id {value!r} is not an id; the official files give each question '
                            f'an int id')


def _index_predictions(predictions) -> Dict:
    if not isinstance(predictions, list):
        keys = f' with keys {sorted(predictions)[:5]}' if isinstance(predictions, Mapping) else ''
        raise VQAInputError(f'predictions: expected the results format, a list of {{"question_id", "answer"}}, '
                            f'got a {type(predictions).__name__}{keys}')
    answers, duplicates = {}, []
    for i, row in enumerate(predictions):
        if not isinstance(row, Mapping) or 'question_id' not in row or 'answer' not in row:
            raise VQAInputError(f'predictions[{i}] = {row!r}: each result needs "question_id" and "answer"')
        _check_id(f'predictions[{i}]', row['question_id'])
        if row['question_id'] in answers:
            duplicates.append(row['question_id'])
        answers[row['question_id']] = row['answer']
    if duplicates:
        raise VQAInputError(f'predictions: {len(duplicates)} question ids appear more than once '
                            f'(e.g. {duplicates[0]!r}); keep one answer per question')
    return answers


def _annotation_list(annotations) -> List[Mapping]:
    rows = annotations.get('annotations') if isinstance(annotations, Mapping) else annotations
    if not isinstance(rows, list):
        raise VQAInputError('annotations: expected the official annotation file (a dict with an "annotations" list, '
                            'e.g. v2_mscoco_val2014_annotations.json) or that list')
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise VQAInputError(f'annotations[{i}] = {row!r}: expected an annotation dict; pass the official file')
        missing = [k for k in ('question_id', 'question_type', 'answer_type', 'answers') if k not in row]
        if missing:
            raise VQAInputError(f'annotations[{i}] (question_id {row.get("question_id")!r}) has no {missing}; '
                                f'pass the official annotation file, whose entries carry all four')
        _check_id(f'annotations[{i}]', row['question_id'])
        for key in ('question_type', 'answer_type'):
            if not isinstance(row[key], str):
                raise VQAInputError(f'annotations[{i}] (question_id {row["question_id"]!r}): {key} {row[key]!r} is '
                                    f'not a string; pass the official annotation file')
    return rows


def _question_ids(questions) -> set:
    rows = questions.get('questions') if isinstance(questions, Mapping) else questions
    if not isinstance(rows, list):
        raise VQAInputError('questions: expected the official questions file (a dict with a "questions" list, '
                            'e.g. v2_OpenEnded_mscoco_val2014_questions.json) or that list')
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping) or 'question_id' not in row:
            raise VQAInputError(f'questions[{i}] = {row!r}: expected a question dict with "question_id"; pass the '
                                f'official questions file')
        _check_id(f'questions[{i}]', row['question_id'])
    return {row['question_id'] for row in rows}


def evaluate(predictions, annotations, questions=None, *, allow_missing: bool = False, scoring: str = 'llava') -> dict:
    """Score predictions as the official script does; percentages rounded to 2 decimals as it rounds.

    predictions: the results format, a list of {"question_id", "answer"}.
    annotations: the official annotation file's dict (or its "annotations" list): entries with
        "question_id", "question_type", "answer_type" and "answers" (a list of {"answer": ...}).
    questions: optional official questions file's dict (or its "questions" list); when given, only the
        annotated questions listed in it are scored (a split's questions against a full annotation file).
    allow_missing: score only the predicted questions instead of requiring one prediction per question.
    scoring: how each reply is prepared (module docstring): 'llava' (EvalAI's processor first), 'lmms_eval' or
        'vqaeval' (the replies as given).

    Returns {"overall": %, "perQuestionType": {type: %}, "perAnswerType": {type: %},
    "perQuestion": {question_id: %}, "num_questions": scored, "num_missing": annotated but unpredicted,
    "scoring": scoring}.
    """
    if scoring not in VQA_SCORING:
        raise VQAInputError(f'scoring {scoring!r}: one of {", ".join(VQA_SCORING)}')
    answers = _index_predictions(predictions)
    rows = _annotation_list(annotations)
    annotated_ids = Counter(row['question_id'] for row in rows)
    repeated = [qid for qid, n in annotated_ids.items() if n > 1]
    if repeated:
        raise VQAInputError(f'annotations: {len(repeated)} question ids appear more than once (e.g. {repeated[0]!r})')
    if questions is not None:
        listed = _question_ids(questions)
        unannotated = listed - annotated_ids.keys()
        if unannotated:
            raise VQAInputError(f'questions: {len(unannotated)} question ids have no annotation (e.g. '
                                f'{_example(unannotated)}); pass the annotation file of the same split')
        rows = [row for row in rows if row['question_id'] in listed]
    scored_ids = {row['question_id'] for row in rows}
    unknown = answers.keys() - scored_ids
    if unknown:
        raise VQAInputError(f'predictions: {len(unknown)} of {len(answers)} question ids are not among the '
                            f'{len(scored_ids)} annotated questions (e.g. {_example(unknown)}; ids are compared as '
                            'given, so 1 and "1" differ); pass the annotations (and questions) of the split predicted')
    missing = [row['question_id'] for row in rows if row['question_id'] not in answers]
    if missing and not allow_missing:
        raise VQAInputError(f'predictions: no answer for {len(missing)} of {len(rows)} annotated questions '
                            f'(e.g. question_id {missing[0]!r}); predict every question, or pass '
                            'allow_missing=True (--allow-missing) to score only the predicted ones')
    rows = [row for row in rows if row['question_id'] in answers]
    if not rows:
        raise VQAInputError('predictions: none of the annotated questions is predicted; nothing to score')

    per_question: Dict = {}
    by_question_type: Dict[str, List[float]] = {}
    by_answer_type: Dict[str, List[float]] = {}
    for row in rows:
        qid = row['question_id']
        if not isinstance(answers[qid], str):
            raise VQAInputError(f'predictions: the answer of question_id {qid!r} is {answers[qid]!r}, not a string')
        humans = row['answers']
        if (not isinstance(humans, list) or len(humans) < 2
                or not all(isinstance(a, Mapping) and isinstance(a.get('answer'), str) for a in humans)):
            raise VQAInputError(f'annotations: question_id {qid!r} has "answers" {humans!r}; expected a list of at '
                                'least 2 {"answer": str} (10 in VQAv2) to leave one out')
        accuracy = vqa_accuracy(answers[qid], [a['answer'] for a in humans], scoring)
        per_question[qid] = accuracy
        by_question_type.setdefault(row['question_type'], []).append(accuracy)
        by_answer_type.setdefault(row['answer_type'], []).append(accuracy)
    return {
        'overall': _py2_rounded_percent(sum(per_question.values()), len(per_question)),
        'perQuestionType': {t: _py2_rounded_percent(sum(accs), len(accs)) for t, accs in by_question_type.items()},
        'perAnswerType': {t: _py2_rounded_percent(sum(accs), len(accs)) for t, accs in by_answer_type.items()},
        'perQuestion': {qid: _py2_rounded_percent(acc, 1) for qid, acc in per_question.items()},
        'num_questions': len(per_question),
        'num_missing': len(missing),
        'scoring': scoring,
        'counts': {'perQuestionType': {t: len(a) for t, a in by_question_type.items()},
                   'perAnswerType': {t: len(a) for t, a in by_answer_type.items()}},
    }


def answer_questions(vlm, samples: Sequence, batch_size: int = 8, max_new_tokens: int = 8, rank: int = 0,
                     world: int = 1) -> List[Dict]:
    """Greedy answers of a `diffzoo.vlm.VLM` to VQA samples (`diffzoo.vlm.data.VQASample`), in the
    results format [{"question_id", "answer"}]. Under `world` processes each answers every
    `world`-th sample from `rank`; `gather_answers` joins them. A question whose image does not decode
    gets no answer (each such file is named once); `left_out` counts them."""
    collate = vlm.collator(train=False)
    mine = list(samples)[rank::world]
    answers, named = [], set()
    for i in range(0, len(mine), batch_size):
        chunk = mine[i:i + batch_size]
        batch = collate(chunk)
        dropped = batch.pop('skipped_images', None)
        if dropped:
            chunk = [] if dropped['placeholder'] else [chunk[k] for k in dropped['kept']]
            for source in dropped['sources']:
                if source not in named:
                    named.add(source)
                    print(f'skipped an unreadable image (its questions are not answered): {source}', flush=True)
        if not chunk:
            continue
        batch = {k: v.to(vlm.device) if hasattr(v, 'to') else v for k, v in batch.items()}
        for s, text in zip(chunk, vlm.generate(batch, max_new_tokens)):
            answers.append({'question_id': s.question_id, 'answer': text})
    return answers


def left_out(answers: List[Dict], samples: Sequence) -> int:
    """Questions of `samples` without an answer (their image does not decode)."""
    return len({s.question_id for s in samples} - {a['question_id'] for a in answers})


def gather_answers(answers: List[Dict], world: int) -> List[Dict]:
    """Every process's answers (`answer_questions`), on every process, ordered by question id."""
    if world > 1:
        import torch.distributed as dist  # only under torchrun
        parts = [None] * world
        dist.all_gather_object(parts, answers)
        answers = [a for part in parts for a in part]
    return sorted(answers, key=lambda a: a['question_id'])


def accuracy(answers: List[Dict], samples: Sequence, scoring: str = 'llava') -> float:
    """Mean VQA accuracy (%) of results-format answers on VQA samples (their human answers)."""
    humans = {s.question_id: s.answers for s in samples}
    return 100 * sum(vqa_accuracy(a['answer'], humans[a['question_id']], scoring)
                     for a in answers) / max(1, len(answers))


def table(result: dict, top_question_types: int = 10) -> str:
    """Overall, every answer type and the most frequent question types, one per line."""
    counts = result['counts']
    lines = [f'VQA accuracy over {result["num_questions"]} questions, scored as {result["scoring"]}'
             + (f' ({result["num_missing"]} unpredicted, not scored)' if result['num_missing'] else ''),
             f'  {"overall":<28} {result["num_questions"]:>7} {result["overall"]:>7.2f}', 'answer type']
    for name, n in sorted(counts['perAnswerType'].items(), key=lambda kv: -kv[1]):
        lines.append(f'  {name:<28} {n:>7} {result["perAnswerType"][name]:>7.2f}')
    frequent = sorted(counts['perQuestionType'].items(), key=lambda kv: -kv[1])[:top_question_types]
    lines.append(f'question type (the {len(frequent)} most frequent of {len(counts["perQuestionType"])})')
    for name, n in frequent:
        lines.append(f'  {name:<28} {n:>7} {result["perQuestionType"][name]:>7.2f}')
    return '\n'.join(lines)


def _read_json(path: Path, flag: str, expected: str):
    if not path.is_file():
        raise VQAInputError(f'{flag} {path}: no such file; pass {expected}')
    try:
        with open(path, encoding='utf-8') as f:
            return json.load(f)
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise VQAInputError(f'{flag} {path}: not valid UTF-8 JSON ({exc}); pass {expected}') from None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog='python -m diffzoo.eval.vqa', description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--predictions', required=True, metavar='JSON', help='results: [{"question_id", "answer"}, ...]')
    p.add_argument('--annotations', required=True, metavar='JSON', help='e.g. v2_mscoco_val2014_annotations.json')
    p.add_argument('--questions', metavar='JSON', help='optional questions file: score only the questions it lists')
    p.add_argument('--allow-missing', action='store_true',
                   help='score only the predicted questions (default: every annotated question must be predicted)')
    p.add_argument('--scoring', choices=sorted(VQA_SCORING), default='llava',
                   help="how each reply is prepared: llava (default: EvalAI's answer processor, as LLaVA-1.5 submits), "
                        "lmms_eval (its vqav2_process_results), vqaeval (the official script on the reply as given)")
    p.add_argument('--top', type=int, default=10, metavar='N', help='question types shown in the table')
    p.add_argument('--output', type=output_file, metavar='JSON',
                   help='default: PREDICTIONS_accuracy.json beside the predictions')
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    results_format = 'the results JSON, a list of {"question_id", "answer"}'
    annotations_format = 'the official annotation JSON (e.g. v2_mscoco_val2014_annotations.json)'
    predictions_path = Path(args.predictions)
    output = Path(args.output) if args.output else predictions_path.with_name(predictions_path.stem + '_accuracy.json')
    inputs = [Path(p).resolve() for p in (args.predictions, args.annotations, args.questions) if p]
    if output.resolve() in inputs:
        print(f'error: --output {output} is one of the input files, which it would overwrite; give another '
              f'--output', file=sys.stderr)
        return 2
    try:
        predictions = _read_json(predictions_path, '--predictions', results_format)
        annotations = _read_json(Path(args.annotations), '--annotations', annotations_format)
        questions = (_read_json(Path(args.questions), '--questions', 'the official questions JSON')
                     if args.questions else None)
        print(f'scoring {args.predictions} against {args.annotations}', flush=True)
        result = evaluate(predictions, annotations, questions, allow_missing=args.allow_missing, scoring=args.scoring)
    except VQAInputError as exc:
        print(f'error: {exc}\n  (--predictions {args.predictions}, --annotations {args.annotations})', file=sys.stderr)
        return 2
    output.parent.mkdir(parents=True, exist_ok=True)
    with open(output, 'w', encoding='utf-8') as f:
        json.dump(dict(result, predictions=str(predictions_path), annotations=args.annotations,
                       questions=args.questions), f, indent=1)
    print(table(result, args.top))
    print(f'\nresults: {output}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
