"""The benchmarks' official scoring, each named after the script it follows.

    POPE          POPE's evaluate.py (as LLaVA-1.5's eval_pope.py): the answer's first sentence, commas
                  dropped, split on spaces; "no", "not" or "No" among the words → no, else yes. Per split:
                  accuracy, precision, recall, F1 (yes the positive class) and the share of yes predictions.
    MME           MME's calculation.py: "yes"/"no" as is, else the first four characters holding "yes" (→ yes)
                  or "no" (→ no), else other; read after lower-casing, stripping and dropping periods, as
                  lmms-eval does (its lone "y"/"n" rule is not MME's). Per subtask: accuracy over
                  questions and accuracy+ over images (both of an image's two questions right), each in
                  percent; its score is their sum; perception sums the 10 perception subtasks, cognition the 4.
    ScienceQA     LLaVA's eval_science_qa.py: the reply is an option letter, or starts with "X. ", or holds one
                  "The answer is X."; anything else (a letter beyond the options included) fails and counts as
                  wrong, as LLaVA's get_pred_idx and lmms-eval count it; failed='random' draws an option instead,
                  as ScienceQA's own scripts do. Accuracy over the questions.
    GQA           exact match after lower-casing, dropping punctuation and surrounding spaces (lmms-eval's
                  exact_match with ignore_case and ignore_punctuation).
    TextVQA/OKVQA the VQA accuracy with the official answer normalisation (`diffzoo.eval.vqa.vqa_accuracy`).

lmms-eval (HEAD of 2026-08) differs on three: its POPE counts only a reply of exactly "yes" or "no" (after
lower-casing and stripping) and its yes_ratio is the share of yes *labels*; its MME also reads a lone "y"/"n";
its ScienceQA reads the letter in any case ("b") and before a bare period ("B."), and not from "The answer is
B.". `lmms_eval_pope` and `lmms_eval_scienceqa` give its rows, so both can be reported. GQA, TextVQA and OK-VQA
score every reply as its functions do.
"""
import random
import re
import string
from collections import defaultdict
from typing import Callable, Dict, Iterable, List, Mapping, Sequence, Tuple

from diffzoo.eval.vqa import vqa_accuracy

MME_PERCEPTION = ('existence', 'count', 'position', 'color', 'posters', 'celebrity', 'scene', 'landmark', 'artwork',
                  'OCR')
MME_COGNITION = ('commonsense_reasoning', 'numerical_calculation', 'text_translation', 'code_reasoning')


def pope_answer(text: str) -> str:
    """yes or no, as POPE's evaluate.py reads a reply."""
    if '.' in text:
        text = text.split('.')[0]
    words = text.replace(',', '').split(' ')
    return 'no' if 'No' in words or 'not' in words or 'no' in words else 'yes'


def _prf(tp: int, fp: int, fn: int) -> Tuple[float, float, float]:
    """Precision, recall and F1 (0 where undefined)."""
    precision = tp / (tp + fp) if tp + fp else 0.0
    recall = tp / (tp + fn) if tp + fn else 0.0
    return precision, recall, 2 * precision * recall / (precision + recall) if precision + recall else 0.0


def _by_split(rows: Sequence[Mapping], read: Callable[[str], str]) -> Dict[str, List[Tuple[str, str]]]:
    """{split: [(read(prediction), label)]}, splits in the order met, labels lower-cased and stripped."""
    splits: Dict[str, List] = defaultdict(list)
    for r in rows:
        splits[r['split']].append((read(r['prediction']), r['label'].strip().lower()))
    return splits


def _pope_counts(pairs: Iterable[Tuple[str, str]]) -> Dict[str, float]:
    """(predicted yes/no, label yes/no) pairs → accuracy, precision, recall, F1, yes ratio (fractions)."""
    tp = fp = tn = fn = 0
    for pred, label in pairs:
        if pred == 'yes':
            tp, fp = tp + (label == 'yes'), fp + (label == 'no')
        else:
            tn, fn = tn + (label == 'no'), fn + (label == 'yes')
    total = tp + fp + tn + fn
    precision, recall, f1 = _prf(tp, fp, fn)
    return {'accuracy': (tp + tn) / total if total else 0.0, 'precision': precision, 'recall': recall, 'f1': f1,
            'yes_ratio': (tp + fp) / total if total else 0.0, 'questions': total}


def pope(rows: Sequence[Mapping]) -> Dict[str, Dict[str, float]]:
    """Rows {split, prediction, label} → {split: metrics} (module docstring), splits in the order met."""
    return {split: _pope_counts(pairs) for split, pairs in _by_split(rows, pope_answer).items()}


def lmms_eval_pope(rows: Sequence[Mapping]) -> Dict[str, Dict[str, float]]:
    """lmms-eval's POPE rows on the same replies: only an exact 'yes' (after lower-casing and stripping) is yes,
    only an exact 'no' counts against recall, and its yes_ratio is the share of yes labels."""
    out = {}
    for split, pairs in _by_split(rows, lambda text: text.strip().lower()).items():
        tp = sum(p == 'yes' and g == 'yes' for p, g in pairs)
        fp = sum(p == 'yes' and g == 'no' for p, g in pairs)
        fn = sum(p == 'no' and g == 'yes' for p, g in pairs)
        precision, recall, f1 = _prf(tp, fp, fn)
        out[split] = {'accuracy': sum(p == g for p, g in pairs) / len(pairs), 'precision': precision,
                      'recall': recall, 'f1': f1, 'yes_ratio': sum(g == 'yes' for _, g in pairs) / len(pairs),
                      'questions': len(pairs)}
    return out


def mme_answer(text: str) -> str:
    """yes, no or other, as MME's calculation.py reads a reply."""
    text = text.lower().strip().replace('.', '')
    if text in ('yes', 'no'):
        return text
    prefix = text[:4]
    return 'yes' if 'yes' in prefix else 'no' if 'no' in prefix else 'other'


def mme(rows: Sequence[Mapping]) -> Dict:
    """Rows {subtask, image, prediction, label} → per-subtask accuracy, accuracy+ and score, and the
    perception and cognition totals over the subtasks present (module docstring)."""
    by_task: Dict[str, Dict[str, List[bool]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        by_task[r['subtask']][r['image']].append(mme_answer(r['prediction']) == r['label'].strip().lower())
    subtasks = {}
    for task, images in by_task.items():
        answers = [right for rights in images.values() for right in rights]
        acc = 100 * sum(answers) / len(answers)
        acc_plus = 100 * sum(all(rights) for rights in images.values()) / len(images)
        subtasks[task] = {'accuracy': acc, 'accuracy_plus': acc_plus, 'score': acc + acc_plus,
                          'questions': len(answers), 'images': len(images)}
    return {'subtasks': subtasks,
            'perception': sum(subtasks[t]['score'] for t in MME_PERCEPTION if t in subtasks),
            'cognition': sum(subtasks[t]['score'] for t in MME_COGNITION if t in subtasks)}


_ANSWER_IS = re.compile(r'The answer is ([A-Z]).')


def _accuracy(scores: Sequence[float]) -> Dict[str, float]:
    """The mean of per-question scores (1/0, or VQA's fractions) as a fraction, and how many questions."""
    return {'accuracy': sum(scores) / len(scores) if scores else 0.0, 'questions': len(scores)}


def scienceqa_letter(text: str, letters: Sequence[str]) -> str:
    """The option letter LLaVA's eval_science_qa.py reads from a reply, or 'FAILED'."""
    text = text.strip()
    if text in letters:
        return text
    if len(text) >= 3 and text[0] in letters and text[1:3] == '. ':
        return text[0]
    found = _ANSWER_IS.findall(text)
    return found[0] if len(found) == 1 else 'FAILED'


def scienceqa(rows: Sequence[Mapping], failed: str = 'wrong', seed: int = 0) -> Dict[str, float]:
    """Rows {prediction, answer (a letter), options (the number of choices)} → accuracy (fraction) and how
    many replies gave no letter. Such a reply counts as wrong (LLaVA, lmms-eval), or with failed='random' as
    a random choice among the options (ScienceQA's scripts; seeded here)."""
    if failed not in ('wrong', 'random'):
        raise ValueError(f'failed={failed!r}: wrong (LLaVA, lmms-eval) or random (ScienceQA\'s scripts)')
    rng = random.Random(seed)
    right, failures = [], 0
    for r in rows:
        letters = [chr(65 + i) for i in range(r['options'])]
        letter = scienceqa_letter(r['prediction'], letters)
        if letter == 'FAILED':
            failures += 1
            letter = rng.choice(letters) if failed == 'random' else letter
        right.append(letter == r['answer'])
    return {**_accuracy(right), 'failed': failures}


def lmms_eval_scienceqa(rows: Sequence[Mapping]) -> Dict[str, float]:
    """ScienceQA as lmms-eval's sqa_process_results reads a reply (module docstring): the reply, stripped, is the
    letter in any case, or starts with an upper-case letter and a period. Accuracy over the questions."""
    right = []
    for r in rows:
        reply, target = r['prediction'].strip(), r['answer'].lower()
        right.append(reply.lower() == target or (len(reply) >= 2 and reply[0].isupper() and reply[1] == '.'
                                                 and reply[0].lower() == target))
    return _accuracy(right)


_PUNCTUATION = str.maketrans('', '', string.punctuation)


def gqa_match(prediction: str, answer: str) -> bool:
    return prediction.lower().translate(_PUNCTUATION).strip() == answer.lower().translate(_PUNCTUATION).strip()


def gqa(rows: Sequence[Mapping]) -> Dict[str, float]:
    """Rows {prediction, answer} → exact-match accuracy (fraction)."""
    right = [gqa_match(r['prediction'], r['answer']) for r in rows]
    return _accuracy(right)


def vqa(rows: Sequence[Mapping]) -> Dict[str, float]:
    """Rows {prediction, answers (the human answers)} → VQA accuracy (fraction), TextVQA's and OK-VQA's."""
    scores = [vqa_accuracy(r['prediction'], r['answers']) for r in rows]
    return _accuracy(scores)
