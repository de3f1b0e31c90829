"""Scoring MMNeedle: ask a model (or read saved answers) for every sample, then existence, index and
exact accuracy, overall and per needle cell."""
import json
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from PIL import Image

from diffzoo.files import atomic_write_text

from .haystack import UNREADABLE, NeedleError, Progress, Sample
from .protocols import PROTOCOLS, RUN, Ask, Query, parse_answer, parse_step


def _unreadable(protocol: str, query: Query, answer: str, n: int) -> bool:
    if protocol == 'mmneedle':
        return parse_answer(answer) == UNREADABLE
    return parse_step(answer, n, query.name.split('/')[0]) is None


def _fraction(correct: int, total: int) -> Optional[float]:
    return correct / total if total else None


def score(samples: Sequence[Sample], ask_for: Callable[[Sample], Ask], protocol: str = 'mmneedle',
          log: Optional[Callable[[str], None]] = None) -> Dict:
    """Run `protocol` over the samples, asking `ask_for(sample)(query)` for each answer (None: no answer,
    the sample is left out), and score it; see `evaluate` for the result."""
    if protocol not in RUN:
        raise NeedleError(f'protocol {protocol!r}: choose one of {", ".join(PROTOCOLS)}')
    if not samples:
        raise NeedleError('no samples to score')
    n, m = samples[0].n, samples[0].m
    if any(s.n != n or s.m != m for s in samples):
        raise NeedleError('the samples mix haystack shapes (M images of N×N); score each set on its own')
    records, progress = [], Progress(log, protocol, len(samples), 'samples')
    for done, sample in enumerate(samples, 1):
        prediction, asked = RUN[protocol](sample, ask_for(sample))
        record = {'id': sample.id, 'truth': list(sample.truth),
                  'prediction': None if prediction is None else list(prediction),
                  'queries': [{'query': q.name, 'stitches': list(q.stitches), 'prompt': q.prompt, 'answer': a}
                              for q, a in asked],
                  'unreadable': sum(a is not None and _unreadable(protocol, q, a, n) for q, a in asked)}
        if prediction is not None:
            record['existence'] = (prediction.index != -1) == sample.positive
            record['index'] = prediction.index == sample.truth.index if sample.positive else None
            record['exact'] = prediction == sample.truth
        records.append(record)
        progress(done)
    return summarize(records, protocol, m, n, samples[0].size)


def summarize(records: List[Dict], protocol: str, m: int, n: int, size: int) -> Dict:
    answered = [r for r in records if r['prediction'] is not None]
    positives = [r for r in answered if r['truth'][0] != -1]
    negatives = [r for r in answered if r['truth'][0] == -1]
    count = {
        'samples': len(records), 'answered': len(answered), 'empty': len(records) - len(answered),
        'positives': len(positives), 'negatives': len(negatives),
        'queries': sum(len(r['queries']) for r in records),
        'unreadable_answers': sum(r['unreadable'] for r in records),
        'existence_correct': sum(r['existence'] for r in answered),
        'existence_correct_positives': sum(r['existence'] for r in positives),
        'existence_correct_negatives': sum(r['existence'] for r in negatives),
        'index_correct': sum(r['index'] for r in positives),
        'exact_correct': sum(r['exact'] for r in positives),
        'overall_correct': sum(r['exact'] for r in answered),
    }
    metrics = {
        'existence_accuracy': _fraction(count['existence_correct'], len(answered)),
        'existence_accuracy_positives': _fraction(count['existence_correct_positives'], len(positives)),
        'existence_accuracy_negatives': _fraction(count['existence_correct_negatives'], len(negatives)),
        'index_accuracy': _fraction(count['index_correct'], len(positives)),
        'exact_accuracy': _fraction(count['exact_correct'], len(positives)),
        'overall_accuracy': _fraction(count['overall_correct'], len(answered)),  # exact, or -1 when absent
    }
    cell_count = [[0] * n for _ in range(n)]
    cell_exact = [[0] * n for _ in range(n)]
    cell_index = [[0] * n for _ in range(n)]
    for r in positives:
        row, column = r['truth'][1] - 1, r['truth'][2] - 1
        cell_count[row][column] += 1
        cell_exact[row][column] += r['exact']
        cell_index[row][column] += r['index']
    per_cell = {
        'count': cell_count,
        'exact_accuracy': [[_fraction(e, c) for e, c in zip(es, cs)] for es, cs in zip(cell_exact, cell_count)],
        'index_accuracy': [[_fraction(i, c) for i, c in zip(is_, cs)] for is_, cs in zip(cell_index, cell_count)],
    }
    return {'benchmark': 'mmneedle', 'protocol': protocol, 'm': m, 'n': n, 'size': size, 'metrics': metrics,
            'counts': count, 'per_cell': per_cell,
            'empty_ids': [r['id'] for r in records if r['prediction'] is None], 'records': records}


def evaluate(samples: Sequence[Sample], answer_fn: Callable[[List[Image.Image], str], str],
             protocol: str = 'mmneedle', log: Optional[Callable[[str], None]] = None,
             answered: Optional[Dict[Tuple[int, str], Optional[str]]] = None,
             sink: Optional[Callable[[Dict], None]] = None) -> Dict:
    """Ask a model, `answer_fn(images, prompt) -> answer`, every query of `protocol` and score it.

    Returns a JSON-ready dict: `metrics` (fractions, None where there is nothing to count) —
    existence_accuracy over all answered samples, and on positives / negatives alone; index_accuracy
    and exact_accuracy over positives (MMNeedle's headline numbers); overall_accuracy, exact or a
    correct -1, over all — `counts` behind each, `per_cell` (N×N lists, [row][column] of the needle's
    cell: count, exact_accuracy and index_accuracy over positives), `empty_ids` (answer_fn returned
    None: left out, as MMNeedle), and `records`, one per sample with every prompt and answer.

    `answered`: answers given before, by (sample id, query), reused instead of asked again (a stopped run's);
    `sink` gets each new answer as it comes, a `read_answers` line ({"id", "query", "prompt", "answer"})."""
    answered = answered or {}

    def ask_for(sample: Sample) -> Ask:
        images = []  # read on the first query the model is asked, not for answers reused

        def ask(query: Query) -> Optional[str]:
            key = (sample.id, query.name)
            if key in answered:
                return answered[key]
            if not images:
                images.extend(sample.images())
            answer = answer_fn([images[k - 1] for k in query.stitches], query.prompt)
            answer = None if answer is None else str(answer)
            if sink is not None:
                sink({'id': sample.id, 'query': query.name, 'prompt': query.prompt, 'answer': answer})
            return answer
        return ask
    return score(samples, ask_for, protocol, log)


def read_answers(path) -> Dict[Tuple[int, str], Optional[str]]:
    """(sample id, query) → answer from JSONL lines {"id": 3, "query": "row/1", "answer": "top"};
    "query" defaults to "mmneedle", and "answer": null marks a sample left unanswered."""
    path = Path(path)
    if not path.is_file():
        raise NeedleError(f'--answers {path}: no such file; write one JSONL line per query: '
                          f'{{"id": 0, "query": "mmneedle", "answer": "1, 2, 1"}}')
    try:
        text = path.read_text(encoding='utf-8')
    except UnicodeDecodeError as exc:
        raise NeedleError(f'{path}: not UTF-8 text ({exc}); write the answers as UTF-8 JSON lines') from None
    answers = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise NeedleError(f'{path} line {number}: not JSON ({exc.msg})') from None
        if (not isinstance(obj, dict) or not isinstance(obj.get('id'), int) or isinstance(obj['id'], bool)
                or 'answer' not in obj or not isinstance(obj.get('query', 'mmneedle'), str)):
            raise NeedleError(f'{path} line {number}: expected {{"id": <sample id>, "query": ..., "answer": ...}}, '
                              f'got {line.strip()[:80]}')
        if obj['answer'] is not None and not isinstance(obj['answer'], str):
            obj['answer'] = str(obj['answer'])  # a bare -1 is an answer too
        key = (obj['id'], obj.get('query', 'mmneedle'))
        if key in answers:
            raise NeedleError(f'{path} line {number}: a second answer for sample {key[0]}, query {key[1]!r}')
        answers[key] = obj['answer']
    return answers


def score_answers(samples: Sequence[Sample], answers: Dict[Tuple[int, str], Optional[str]],
                  protocol: Optional[str] = None, where: str = 'answers', log=None) -> Dict:
    """Score answers a model gave to a built set; `protocol` None reads it from the query names."""
    if protocol is None:
        protocol = 'two_step' if any(q.startswith(('row/', 'column/')) for _, q in answers) else 'mmneedle'
    missing: List[Tuple[int, str]] = []

    def ask_for(sample: Sample) -> Ask:
        def ask(query: Query) -> Optional[str]:
            key = (sample.id, query.name)
            if key not in answers:
                missing.append(key)
                return None
            return answers[key]
        return ask
    result = score(samples, ask_for, protocol, log)
    if missing:
        shown = ', '.join(f'sample {i} query {q!r}' for i, q in missing[:5])
        raise NeedleError(f'{where}: {len(missing)} queries of the {protocol} protocol have no answer ({shown}'
                          f'{", …" if len(missing) > 5 else ""}); answer them, or write "answer": null to leave '
                          f'a sample out')
    unknown = set(answers) - {(r['id'], q['query']) for r in result['records'] for q in r['queries']}
    if unknown:
        i, q = sorted(unknown)[0]
        raise NeedleError(f'{where}: {len(unknown)} answers match no query the {protocol} protocol asks (e.g. sample '
                          f'{i} query {q!r}); check --protocol and the haystack set')
    return result


def write_answers(result: Dict, path) -> Path:
    """Every query and answer of a result as JSONL, the input of `score_answers`; written whole or not at all."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write_text(path, ''.join(
        json.dumps({'id': record['id'], 'query': q['query'], 'prompt': q['prompt'], 'answer': q['answer']}) + '\n'
        for record in result['records'] for q in record['queries']))
