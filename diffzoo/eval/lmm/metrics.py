"""The benchmarks' scoring: named scorers per benchmark, each following one reference script reply by reply.

`SCORERS[benchmark][name]` scores a task's rows; `DEFAULT_SCORER[benchmark]` is the one behind the papers' tables
(LLaVA-1.5's evaluation scripts, which DiffCLIP and eRAM-V follow). `python -m diffzoo.eval.lmm --scoring
TASK=NAME` (or `--scoring NAME` for every task) picks another; results.json records which scored each task.
Replies are scored as diffzoo's VLMs return them: stripped, as LLaVA's model_vqa*.py store them. lmms-eval's
functions are those of lmms-eval 0.7.3 (the `lmms` extra), the same in its 2026-08 HEAD.

    pope       pope *     POPE's evaluate.py as LLaVA-1.5's eval_pope.py: the reply up to its first period, commas
                          dropped, split on spaces; "no", "not" or "No" among the words → no, else yes. Per split:
                          accuracy, precision, recall, F1 (yes the positive class), share of yes predictions.
               lmms_eval  lmms-eval's pope_process_results: only a reply that is "yes" or "no" after lower-casing and
                          stripping counts, and its yes_ratio is the share of yes labels.
    mme        mme *      MME's eval_tool/calculation.py (parse_pred_ans) on the lines LLaVA's
                          convert_answer_to_mme.py writes (the reply as stored, nothing dropped): lower-cased only,
                          then "yes"/"no", else the first four characters holding "yes" (→ yes) or "no" (→ no), else
                          other ("n.o." and "...No" are other). Per subtask: accuracy over questions and accuracy+
                          over images (both of an image's two questions right), in percent; its score is their sum;
                          perception sums the 10 perception subtasks, cognition the 4.
               lmms_eval  lmms-eval's parse_pred_ans: lower-cased, stripped and every period dropped first, and a
                          lone "y"/"n" read as yes/no; then MME's rule and sums.
    scienceqa  llava *    LLaVA-1.5's eval_science_qa.py: the reply is one of the letters A–E (its --options,
                          whatever the number of choices), or starts with one and ". ", or holds exactly one
                          "The answer is X." (X any capital); get_pred_idx keeps a letter among the question's options
                          and gives -1 (wrong) otherwise ("The answer is E." of four options, "I think B"). `failed`
                          counts those replies (the script does not count them). Accuracy over the questions.
               lmms_eval  lmms-eval's sqa_process_results: the reply, stripped, is the letter in any case ("b"), or
                          starts with a capital and a period ("B."); not read from "The answer is B.".
    gqa        llava *    LLaVA's scripts/convert_gqa_for_eval.py (trailing periods dropped, lower-cased) and GQA's
                          eval.py (the prediction string equal to the answer): "t-shirt" is not "tshirt".
               lmms_eval  lmms-eval's exact_match with gqa.yaml's ignore_case and ignore_punctuation: the reply
                          stripped, both lower-cased and every string.punctuation mark deleted, then equal.
    textvqa    llava *    LLaVA's eval_textvqa.py (m4c_evaluator's TextVQAAccuracyEvaluator): the reply and every
                          human answer through EvalAI's answer processor ("Nokia" → "nokia", "Two." → "2"), then
                          VQA accuracy (`diffzoo.eval.vqa_answers.evalai_accuracy`).
               lmms_eval  lmms-eval's textvqa_process_results: the same, reply by reply (tested).
               vqaeval    VQAv2's vqaEval.py on the reply as given: normalised only when the humans differ.
    okvqa      lmms_eval *  lmms-eval's ok_vqa_process_results, as textvqa's (LLaVA-1.5 has no OK-VQA script);
                          llava and vqaeval as for textvqa.

(* the default.) TextVQA's llava and lmms_eval scorers are one function: LLaVA's evaluator and lmms-eval's give the
same score on every reply (TextVQAAccuracyEvaluator also asserts ten human answers, as TextVQA has).
"""
import random
import re
import string
from collections import defaultdict
from typing import Callable, Dict, Iterable, List, Mapping, Sequence, Tuple

from diffzoo.eval.vqa_answers import evalai_accuracy, vqa_accuracy

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
    """{split: [(read(prediction), label)]}, splits in the order met, labels lower-cased and stripped. A label
    that is not yes or no is refused (ValueError naming the row): counted nowhere but in the total, it would
    change every score silently (the benchmark runner leaves such questions out before asking them)."""
    splits: Dict[str, List] = defaultdict(list)
    for n, r in enumerate(rows):
        label = r['label'].strip().lower() if isinstance(r['label'], str) else r['label']
        if label not in ('yes', 'no'):
            raise ValueError(f'POPE row {n} ({r["split"]}): label {r["label"]!r} is not yes or no; leave the '
                             f'question out, or give it its label')
        splits[r['split']].append((read(r['prediction']), label))
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


def _yes_no_prefix(text: str) -> str:
    """calculation.py's parse_pred_ans on a lower-cased reply: yes, no, or other."""
    if text in ('yes', 'no'):
        return text
    prefix = text[:4]
    return 'yes' if 'yes' in prefix else 'no' if 'no' in prefix else 'other'


def mme_answer(text: str) -> str:
    """yes, no or other, as MME's calculation.py reads a reply LLaVA stored (module docstring). calculation.py
    reads its line's reply with the newline (the last of its four tab-separated fields); no newline forms "yes"
    or "no" within the first four characters, so the reply alone gives the same."""
    return _yes_no_prefix(text.strip().lower())


def lmms_eval_mme_answer(text: str) -> str:
    """yes, no or other, as lmms-eval's mme parse_pred_ans reads a reply: "n.o." → no, "y" → yes."""
    text = text.lower().strip().replace('.', '')
    if len(text) == 1:
        return {'y': 'yes', 'n': 'no'}.get(text, 'other')
    return _yes_no_prefix(text)


def mme(rows: Sequence[Mapping], read: Callable[[str], str] = mme_answer) -> Dict:
    """Rows {subtask, image, prediction, label} → per-subtask accuracy, accuracy+ and score, and the
    perception and cognition totals over the subtasks present (module docstring)."""
    by_task: Dict[str, Dict[str, List[bool]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        by_task[r['subtask']][r['image']].append(read(r['prediction']) == r['label'].strip().lower())
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


def lmms_eval_mme(rows: Sequence[Mapping]) -> Dict:
    """MME with lmms-eval's reading of each reply (its mme_aggregate_results sums as calculation.py does when
    every image has its two questions, as MME's have)."""
    return mme(rows, lmms_eval_mme_answer)


_ANSWER_IS = re.compile(r'The answer is ([A-Z]).')
SCIENCEQA_LETTERS = ('A', 'B', 'C', 'D', 'E')  # eval_science_qa.py's --options, whatever a question's choices


def _accuracy(scores: Sequence[float]) -> Dict[str, float]:
    """The mean of per-question scores (1/0, or VQA's fractions) as a fraction, and how many questions."""
    return {'accuracy': sum(scores) / len(scores) if scores else 0.0, 'questions': len(scores)}


def scienceqa_letter(text: str) -> str:
    """The letter LLaVA-1.5's eval_science_qa.py parses from a reply (its parsed_ans), or 'FAILED'; it may lie
    beyond the question's options ("The answer is E." → 'E')."""
    text = text.strip()
    if text in SCIENCEQA_LETTERS:
        return text
    if len(text) >= 3 and text[0] in SCIENCEQA_LETTERS and text[1:3] == '. ':
        return text[0]
    found = _ANSWER_IS.findall(text)
    return found[0] if len(found) == 1 else 'FAILED'


def scienceqa(rows: Sequence[Mapping], failed: str = 'wrong', seed: int = 0) -> Dict[str, float]:
    """Rows {prediction, answer (a letter), options (the number of choices)} → accuracy (fraction) and `failed`,
    the replies that choose none of the question's options (get_pred_idx's -1: no letter parsed, or one beyond
    the options). Such a reply is wrong, as in LLaVA-1.5's script; with failed='random' it is a random option
    instead, as the first release of LLaVA's script and ScienceQA's own scripts draw (random.choice, seeded here)."""
    if failed not in ('wrong', 'random'):
        raise ValueError(f'failed={failed!r}: wrong (LLaVA-1.5) or random (LLaVA\'s first release, ScienceQA\'s '
                         f'scripts)')
    rng = random.Random(seed)
    right, failures = [], 0
    for r in rows:
        options = SCIENCEQA_LETTERS[:r['options']]
        letter = scienceqa_letter(r['prediction'])
        if letter not in options:  # get_pred_idx gives -1
            failures += 1
            letter = rng.choice(options) if failed == 'random' else 'FAILED'
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


def gqa_prediction(text: str) -> str:
    """A reply as LLaVA's convert_gqa_for_eval.py writes it for GQA's eval.py: trailing periods dropped,
    lower-cased ("Yes." → "yes", "T-shirt" → "t-shirt")."""
    return text.strip().rstrip('.').lower()


def gqa(rows: Sequence[Mapping]) -> Dict[str, float]:
    """Rows {prediction, answer} → accuracy (fraction) as GQA's eval.py: the converted reply equal to the answer."""
    return _accuracy([gqa_prediction(r['prediction']) == r['answer'] for r in rows])


def lmms_eval_gqa(rows: Sequence[Mapping]) -> Dict[str, float]:
    """Rows {prediction, answer} → accuracy (fraction) as lmms-eval's exact_match with ignore_case and
    ignore_punctuation: "T-shirt" matches "tshirt", "yes!" matches "yes"."""
    def fold(text: str) -> str:
        return text.lower().translate(_PUNCTUATION)
    return _accuracy([fold(r['prediction'].strip()) == fold(r['answer']) for r in rows])


def vqa(rows: Sequence[Mapping]) -> Dict[str, float]:
    """Rows {prediction, answers (the human answers)} → VQA accuracy (fraction), every reply and human answer
    through EvalAI's answer processor: LLaVA's TextVQA evaluator and lmms-eval's textvqa and ok_vqa."""
    return _accuracy([evalai_accuracy(r['prediction'], r['answers']) for r in rows])


def vqaeval(rows: Sequence[Mapping]) -> Dict[str, float]:
    """Rows {prediction, answers} → VQA accuracy (fraction) as VQAv2's vqaEval.py scores the replies as given."""
    return _accuracy([vqa_accuracy(r['prediction'], r['answers'], 'vqaeval') for r in rows])


Scorer = Callable[[Sequence[Mapping]], Dict]
SCORERS: Dict[str, Dict[str, Scorer]] = {  # benchmark → {name: scorer} (module docstring)
    'pope': {'pope': pope, 'lmms_eval': lmms_eval_pope},
    'mme': {'mme': mme, 'lmms_eval': lmms_eval_mme},
    'scienceqa': {'llava': scienceqa, 'lmms_eval': lmms_eval_scienceqa},
    'textvqa': {'llava': vqa, 'lmms_eval': vqa, 'vqaeval': vqaeval},
    'gqa': {'llava': gqa, 'lmms_eval': lmms_eval_gqa},
    'okvqa': {'lmms_eval': vqa, 'llava': vqa, 'vqaeval': vqaeval},
}
DEFAULT_SCORER: Dict[str, str] = {  # the scorer behind the papers' tables
    'pope': 'pope', 'mme': 'mme', 'scienceqa': 'llava', 'textvqa': 'llava', 'gqa': 'llava', 'okvqa': 'lmms_eval'}
