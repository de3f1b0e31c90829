"""The benchmarks as local copies hold them: each task's reader, prompt, scoring and table lines.

Each task reads the files its authors (or LLaVA-1.5's evaluation, which DiffCLIP and eRAM-V follow) publish,
under the folder given for it:

    pope       coco/coco_pope_{random,popular,adversarial}.json (or without coco/): one JSON per line
               {question_id, image, text, label}; COCO images in val2014/
    mme        MME_Benchmark_release_version's subtask folders, in the folder itself or in its
               MME_Benchmark_release_version/ (or …/MME_Benchmark/) as the zip unpacks:
               <subtask>/questions_answers_YN/*.txt with <subtask>/images/*, or <subtask>/*.txt beside the images;
               each line "question<TAB>Yes|No"
    scienceqa  problems.json, pid_splits.json and images/test/<pid>/<image> (or test/<pid>/<image>), or LLaVA-1.5's
               llava_test_CQM-A.json with images/test/<pid>/image.png (its prompts; answers from problems.json
               when it is there): the test questions that have an image (ScienceQA-IMG)
    textvqa    TextVQA_0.5.1_val.json and train_images/<image_id>.jpg
    textvqa_ocr  textvqa's folder (textvqa/) with LLaVA-1.5's question file llava_textvqa_val_v051_ocr.jsonl
                 ({question_id, image, text} per line): its text asked as written, the question with
                 "Reference OCR token: …" (LLaVA-1.5's own TextVQA setting; eRAM-V's Table 2 is textvqa's)
    gqa        testdev_balanced_questions.json and images/<imageId>.jpg
    okvqa      OpenEnded_mscoco_val2014_questions.json, mscoco_val2014_annotations.json and COCO val2014/

Prompts are lmms-eval's defaults (LLaVA-1.5's): the question, then "Answer the question using a single word
or phrase." (POPE, MME — its " Please answer yes or no." replaced —, TextVQA — the question capitalized, without
OCR tokens, as eRAM-V's Table 2 evaluates it (image only) —, GQA; OK-VQA
first asks for 'Unanswerable' when the image does not tell); ScienceQA: "Context: <hint>" when there is one,
the question, the options "A. …", then "Answer with the option's letter from the given choices directly."
Scoring: `diffzoo.eval.lmm.metrics`.

A question its files give badly is left out, counted by reason and named (`LeftOut`), and the others are asked: a
line or record that is not a JSON object, a missing field or one of another type (a question or answer that is not
a string, answers that are not a list of strings), a POPE or MME label that is not yes/no, a ScienceQA answer that
is not among its options, a question id one of two paired files lacks (ScienceQA's, TextVQA's, OK-VQA's), an MME
image without its answer file (named and counted as one: its questions are not known), an image name that would
leave the benchmark's folder (an absolute path or a `..` component: the
shards' rule, `hostile_name`; symlinks are followed as any file), and a question id met before (the first
question with that id is kept, every later one is a repeat and left out). A reader called without a `LeftOut`
refuses the first such question instead (DataError).
"""
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from PIL import Image

from diffzoo.data import llava_qa
from diffzoo.data.shards import DataError

from . import metrics
from .records import (IMAGE_OUTSIDE, REPEATED, LeftOut, Sample, image_in, json_lines, read_json, required,
                      strict_unless, strings, with_fields)
from .scienceqa import LETTER_PROMPT, SCIENCEQA_LLAVA_QUESTIONS, read_scienceqa

__all__ = ['TASKS', 'Task', 'Sample', 'LeftOut', 'IMAGE_OUTSIDE', 'REPEATED', 'LETTER_PROMPT', 'DataError',
           'read_scienceqa', 'rows_for_scoring']

SHORT = llava_qa.SHORT_ANSWER  # LLaVA-1.5's short-answer prompt
OKVQA_PROMPT = "When the provided information is insufficient, respond with 'Unanswerable'.\n" + SHORT
MME_SUFFIX = ' Please answer yes or no.'
POPE_SPLITS = llava_qa.POPE_SPLITS


def accuracy_lines(scores: Dict) -> List[str]:
    """The table line of an accuracy (percent), with the replies that gave no letter where the scorer counts them."""
    extra = f', {scores["failed"]} without a letter' if 'failed' in scores else ''
    return [f'  accuracy {100 * scores["accuracy"]:6.2f}  ({scores["questions"]} q{extra})']


def pope_lines(scores: Dict) -> List[str]:
    """POPE's table lines: per split, accuracy, precision, recall, F1 and the share of yes (percent)."""
    return [f'  {split:<12} acc {100 * r["accuracy"]:6.2f}  prec {100 * r["precision"]:6.2f}  '
            f'rec {100 * r["recall"]:6.2f}  F1 {100 * r["f1"]:6.2f}  yes {100 * r["yes_ratio"]:5.1f}%  '
            f'({r["questions"]} q)' for split, r in scores.items()]


def mme_lines(scores: Dict) -> List[str]:
    """MME's table line: the perception and cognition totals."""
    return [f'  perception {scores["perception"]:7.2f}   cognition {scores["cognition"]:7.2f}   '
            f'({len(scores["subtasks"])} subtasks)']


@dataclass
class Task:
    name: str
    read: Callable[[Path, Optional[LeftOut]], List[Sample]]
    max_new_tokens: int
    expects: str  # the files the reader looks for, for the error that names a missing copy
    folder: str = ''  # the local copy's folder under --data: the task's name unless it shares another's
    benchmark: str = ''  # whose scorers score it (metrics.SCORERS): the task's name unless it asks another's questions
    summary: Callable[[Dict], List[str]] = accuracy_lines  # its scores as the runner's table lines

    def __post_init__(self):
        self.folder = self.folder or self.name
        self.benchmark = self.benchmark or self.name

    @property
    def scorers(self) -> Dict[str, metrics.Scorer]:
        """The named scorers of its benchmark (`metrics` docstring)."""
        return metrics.SCORERS[self.benchmark]

    @property
    def default_scorer(self) -> str:
        """The scorer behind the papers' tables."""
        return metrics.DEFAULT_SCORER[self.benchmark]

    def score(self, rows: Sequence[Mapping], scorer: str = '') -> Dict:
        """Rows (`rows_for_scoring`) scored by the named scorer, or the default."""
        return self.scorers[scorer or self.default_scorer](rows)

    def questions(self, root: Path) -> Tuple[List[Sample], LeftOut]:
        """The task's questions under `root`, each id once, and those left out (module docstring): a repeated id
        keeps the first question that has it."""
        left_out, seen, kept = LeftOut(), set(), []
        for s in self.read(root, left_out):
            if s.id in seen:
                left_out.add(REPEATED, f'{s.where or s.source} (question {s.id})')
            else:
                seen.add(s.id)
                kept.append(s)
        return kept, left_out

def _yes_no(label) -> bool:
    return isinstance(label, str) and label.strip().lower() in ('yes', 'no')


def read_pope(root: Path, left_out: Optional[LeftOut] = None) -> List[Sample]:
    left_out, samples = strict_unless(left_out), []
    for split in POPE_SPLITS:
        name = f'coco_pope_{split}.json'
        path = required(llava_qa.first_file(root / 'coco' / name, root / name))
        for where, r in json_lines(path, ('question_id', 'image', 'text', 'label'), left_out):
            if not isinstance(r['text'], str):
                left_out.add('question text not a string', where)
            elif not _yes_no(r['label']):
                left_out.add('label not yes or no', f'{where} (label {r["label"]!r})')
            elif (image := image_in(root / 'val2014', r['image'], left_out, where)) is not None:
                samples.append(Sample(f'{split}-{r["question_id"]}', image, f'{r["text"].strip()}\n{SHORT}',
                                      {'split': split, 'label': r['label']}, where))
    return samples


# where MME's subtask folders may lie under the task's folder: in it, or in the release folder as its zip unpacks
# (the Hugging Face copy, darkyarding/MME, nests them once more in MME_Benchmark/)
MME_RELEASE = ('.', 'MME_Benchmark_release_version', 'MME_Benchmark_release_version/MME_Benchmark', 'MME_Benchmark')


IMAGE_SUFFIXES = frozenset(Image.registered_extensions())  # '.jpg', '.png', …: what PIL opens
NO_ANSWER_FILE = 'image without its answer file (<name>.txt: its questions are not asked)'


def read_mme(root: Path, left_out: Optional[LeftOut] = None) -> List[Sample]:
    left_out, samples = strict_unless(left_out), []
    subtasks = metrics.MME_PERCEPTION + metrics.MME_COGNITION
    release = next((root / r for r in MME_RELEASE if any((root / r / t).is_dir() for t in subtasks)), None)
    if release is None:
        raise DataError(f'{root}: none of MME\'s subtask folders ({", ".join(metrics.MME_PERCEPTION[:3])}, …) in '
                        f'{", ".join(str(root / r) for r in MME_RELEASE)}; unzip MME_Benchmark_release_version.zip '
                        f'into {root}')
    present = [t for t in subtasks if (release / t).is_dir()]
    for task in present:
        folder = release / task
        qa_dir, image_dir = ((folder / 'questions_answers_YN', folder / 'images')
                             if (folder / 'questions_answers_YN').is_dir() else (folder, folder))
        answered = {txt.stem for txt in qa_dir.glob('*.txt')}
        for image in sorted(p for p in (image_dir.iterdir() if image_dir.is_dir() else ())
                            if p.suffix.lower() in IMAGE_SUFFIXES):
            if image.stem not in answered:
                left_out.add(NO_ANSWER_FILE, str(image))
        for txt in sorted(qa_dir.glob('*.txt')):
            if not txt.is_file():
                left_out.add('answer file not a file', str(txt))
                continue
            image = next((p for p in sorted(image_dir.glob(txt.stem + '.*')) if p.suffix != '.txt'), None)
            lines = [(n, line) for n, line in enumerate(txt.read_bytes().splitlines(), 1) if line.strip()]
            for j, (n, raw) in enumerate(lines):
                try:
                    line = raw.decode('utf-8')
                except UnicodeDecodeError:
                    left_out.add('line not UTF-8', f'{txt}:{n}')
                    continue
                question, tab, label = line.rpartition('\t')
                if not tab:
                    left_out.add('line not "question<TAB>Yes|No" as MME\'s are', f'{txt}:{n}')
                elif not _yes_no(label):
                    left_out.add('label not Yes or No', f'{txt}:{n} (label {label!r})')
                else:
                    samples.append(Sample(f'{task}/{txt.stem}/{j}', image if image else image_dir / f'{txt.stem}.jpg',
                                          f'{question.strip().replace(MME_SUFFIX, "")}\n{SHORT}',
                                          {'subtask': task, 'image': txt.stem, 'label': label}, f'{txt}:{n}'))
    return samples

def _answer_list(answers) -> bool:
    return isinstance(answers, list) and bool(answers) and all(isinstance(a, str) for a in answers)


NOT_ANSWERS = 'answers not a list of strings'


def _textvqa_records(root: Path, left_out: LeftOut) -> Iterator[Tuple[str, Dict]]:
    """(where, record) of each TextVQA val question that has every field and a list of answers; the others left
    out."""
    path = required(root / 'TextVQA_0.5.1_val.json')
    for where, r in with_fields(((f'{path} entry {n}', r) for n, r in enumerate(read_json(path)['data'])),
                                ('question_id', 'question', 'image_id', 'answers'), left_out):
        if _answer_list(r['answers']):
            yield where, r
        else:
            left_out.add(NOT_ANSWERS, where)


def read_textvqa(root: Path, left_out: Optional[LeftOut] = None) -> List[Sample]:
    left_out, samples = strict_unless(left_out), []
    for where, r in _textvqa_records(root, left_out):
        if not strings(r, ('question',), left_out, where):
            continue
        if (image := image_in(root / 'train_images', f'{r["image_id"]}.jpg', left_out, where)) is not None:
            # lmms-eval capitalizes the question (str.capitalize: the rest lower-cased), as its textvqa_doc_to_text
            samples.append(Sample(str(r['question_id']), image, f'{r["question"].capitalize()}\n{SHORT}',
                                  {'answers': r['answers']}, where))
    return samples


TEXTVQA_OCR_QUESTIONS = 'llava_textvqa_val_v051_ocr.jsonl'


def read_textvqa_ocr(root: Path, left_out: Optional[LeftOut] = None) -> List[Sample]:
    """LLaVA-1.5's TextVQA questions (with OCR tokens in their text), scored on TextVQA's own answers."""
    answers = {str(r['question_id']): r['answers'] for _, r in _textvqa_records(root, LeftOut())}
    path, left_out, samples = required(root / TEXTVQA_OCR_QUESTIONS), strict_unless(left_out), []
    for where, r in json_lines(path, ('question_id', 'image', 'text'), left_out):
        qid = str(r['question_id'])
        if not strings(r, ('text',), left_out, where):
            continue
        if qid not in answers:
            left_out.add('question id not in TextVQA_0.5.1_val.json (both files must be TextVQA 0.5.1 val)',
                         f'{where} (question {qid})')
        elif (image := image_in(root / 'train_images', r['image'], left_out, where)) is not None:
            samples.append(Sample(qid, image, r['text'], {'answers': answers[qid]}, where))
    return samples


def read_gqa(root: Path, left_out: Optional[LeftOut] = None) -> List[Sample]:
    """GQA's testdev-balanced questions ({question id: {imageId, question, answer, …}}), each named by its id."""
    path, left_out, samples = required(root / 'testdev_balanced_questions.json'), strict_unless(left_out), []
    questions = read_json(path)
    if not isinstance(questions, dict):
        raise DataError(f'{path}: a JSON {type(questions).__name__}, not GQA\'s object of questions by id; put GQA\'s '
                        f'published testdev_balanced_questions.json there')
    records = ((f'{path} question {qid}', r) for qid, r in questions.items())
    for where, r in with_fields(records, ('imageId', 'question', 'answer'), left_out):
        if strings(r, ('imageId', 'question', 'answer'), left_out, where) and (
                image := image_in(root / 'images', f'{r["imageId"]}.jpg', left_out, where)) is not None:
            samples.append(Sample(where.rpartition(' question ')[2], image, f'{r["question"]}\n{SHORT}',
                                  {'answer': r['answer']}, where))
    return samples


def _okvqa_questions(path: Path, left_out: LeftOut) -> Dict:
    """OK-VQA's questions by id; a record without an id of its own (an int or a string) left out, named."""
    data = read_json(required(path))
    records = data.get('questions') if isinstance(data, dict) else None
    if not isinstance(records, list):
        raise DataError(f'{path}: no "questions" list; put OK-VQA\'s published {path.name} there')
    questions = {}
    for where, q in with_fields(((f'{path} entry {n}', q) for n, q in enumerate(records)), ('question_id',), left_out):
        if isinstance(q['question_id'], (int, str)) and not isinstance(q['question_id'], bool):
            questions[q['question_id']] = (where, q)
        else:
            left_out.add('question_id not a number or a string', f'{where} (question_id {q["question_id"]!r:.60})')
    return questions


def read_okvqa(root: Path, left_out: Optional[LeftOut] = None) -> List[Sample]:
    """OK-VQA val: each annotation {question_id, image_id, answers: [{answer}, …]} with its question's text."""
    path, left_out, samples = required(root / 'mscoco_val2014_annotations.json'), strict_unless(left_out), []
    questions = _okvqa_questions(root / 'OpenEnded_mscoco_val2014_questions.json', left_out)
    annotations = read_json(path)
    records = annotations.get('annotations') if isinstance(annotations, dict) else None
    if not isinstance(records, list):
        raise DataError(f'{path}: no "annotations" list; put OK-VQA\'s published mscoco_val2014_annotations.json there')
    for where, a in with_fields(((f'{path} entry {n}', a) for n, a in enumerate(records)),
                                ('question_id', 'image_id', 'answers'), left_out):
        where = f'{where} (question {a["question_id"]!r:.60})'
        asked = questions.get(a['question_id']) if isinstance(a['question_id'], (int, str)) else None
        humans = [x.get('answer') if isinstance(x, dict) else None for x in a['answers']] \
            if isinstance(a['answers'], list) else None
        if asked is None:
            left_out.add('question id not in OpenEnded_mscoco_val2014_questions.json', where)
        elif not isinstance(a['image_id'], int) or isinstance(a['image_id'], bool):
            left_out.add('image_id not a number', where)
        elif not _answer_list(humans):
            left_out.add('answers not a list of {answer: string}', where)
        elif 'question' not in asked[1]:
            left_out.add('no question', asked[0])
        elif strings(asked[1], ('question',), left_out, asked[0]):  # its image names are numbers: inside val2014/
            image = root / 'val2014' / f'COCO_val2014_{a["image_id"]:012d}.jpg'
            samples.append(Sample(str(a['question_id']), image, f'{asked[1]["question"]}\n{OKVQA_PROMPT}',
                                  {'answers': humans}, where))
    return samples


TASKS: Dict[str, Task] = {t.name: t for t in (
    Task('pope', read_pope, 128, 'coco/coco_pope_{random,popular,adversarial}.json, val2014/', summary=pope_lines),
    Task('mme', read_mme, 16, '<subtask>/… in the folder or in its MME_Benchmark_release_version/',
         summary=mme_lines),
    Task('scienceqa', read_scienceqa, 16, f'problems.json, pid_splits.json, images/test/; or '
                                          f'{SCIENCEQA_LLAVA_QUESTIONS}, images/test/'),
    Task('textvqa', read_textvqa, 16, 'TextVQA_0.5.1_val.json, train_images/'),
    Task('textvqa_ocr', read_textvqa_ocr, 16, f'{TEXTVQA_OCR_QUESTIONS}, TextVQA_0.5.1_val.json, train_images/',
         folder='textvqa', benchmark='textvqa'),
    Task('gqa', read_gqa, 16, 'testdev_balanced_questions.json, images/'),
    Task('okvqa', read_okvqa, 16, 'OpenEnded_mscoco_val2014_questions.json, mscoco_val2014_annotations.json, val2014/'),
)}


def rows_for_scoring(samples: Sequence[Sample], predictions: Sequence[str]) -> List[Dict]:
    """What each task's score function reads: the sample's meta with its prediction."""
    return [{**s.meta, 'prediction': p} for s, p in zip(samples, predictions)]
