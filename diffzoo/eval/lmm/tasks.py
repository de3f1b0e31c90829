"""The benchmarks as local copies hold them: each task's reader, prompt and scoring.

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
line that is not a JSON object, a missing field, a POPE or MME label that is not yes/no, an image name that would
leave the benchmark's folder (an absolute path or a `..` component: the shards' rule, `hostile_name`; symlinks are
followed as any file), and a question id met before (the first question with that id is kept, every later one is a
repeat and left out). A reader called without a `LeftOut` refuses the first such question instead (DataError).
"""
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from PIL import Image

from diffzoo.data import llava_qa
from diffzoo.data.shards import DataError, hostile_name

from . import metrics

SHORT = llava_qa.SHORT_ANSWER  # LLaVA-1.5's short-answer prompt
OKVQA_PROMPT = "When the provided information is insufficient, respond with 'Unanswerable'.\n" + SHORT
LETTER_PROMPT = "Answer with the option's letter from the given choices directly."
MME_SUFFIX = ' Please answer yes or no.'
POPE_SPLITS = llava_qa.POPE_SPLITS


@dataclass
class Sample:
    id: str
    image: Path
    prompt: str
    meta: Dict = field(default_factory=dict)  # what scoring needs: label, split, answers, …
    where: str = ''  # where its file gives it ("<file>:<line>"), to name it

    @property
    def source(self) -> str:
        return str(self.image)

    def load_image(self) -> Image.Image:
        with Image.open(self.image) as im:
            return im.convert('RGB')


IMAGE_OUTSIDE = 'image name leaves the benchmark folder'
REPEATED = 'repeated question id (the first is kept)'


@dataclass
class LeftOut:
    """The questions a task leaves out: reason → where each lies, in the order met. `strict`: refuse the first
    (DataError) instead, for a reader called on its own."""
    named: Dict[str, List[str]] = field(default_factory=dict)
    strict: bool = False

    def add(self, reason: str, where: str) -> None:
        if self.strict:
            raise DataError(f'{where}: {reason}; fix that question, or read the task through Task.questions, which '
                            f'leaves such questions out and counts them')
        self.named.setdefault(reason, []).append(where)

    def counts(self) -> Dict[str, int]:
        return {reason: len(places) for reason, places in self.named.items()}

    def examples(self, n: int = 3) -> Dict[str, List[str]]:
        return {reason: places[:n] for reason, places in self.named.items()}


def _left_out(left_out: Optional[LeftOut]) -> LeftOut:
    return LeftOut(strict=True) if left_out is None else left_out


def _image_in(folder: Path, name, left_out: LeftOut, where: str) -> Optional[Path]:
    """folder / name for an image name a benchmark file gives; None (left out) for a name that is not a string or
    would leave the folder (`hostile_name`)."""
    why = hostile_name(name) if isinstance(name, str) else 'not a file name'
    if why:
        left_out.add(IMAGE_OUTSIDE, f'{where} ({name!r}: {why})')
        return None
    return folder / name


def _built_in(folder: Path, image: Path, left_out: LeftOut, where: str) -> bool:
    """Whether an image path another module built under `folder` from a file's name stays in it (else left out)."""
    try:
        why = hostile_name(image.relative_to(folder).as_posix())
    except ValueError:  # the name was absolute: the join gave it unchanged
        why = 'an absolute path'
    if why:
        left_out.add(IMAGE_OUTSIDE, f'{where} ({str(image)!r}: {why})')
    return not why


def _jsonl(path: Path, needs: Sequence[str], left_out: LeftOut) -> Iterator[Tuple[str, Dict]]:
    """("<file>:<line>", record) for each line of a JSON-lines file that is a JSON object holding every field in
    `needs`; any other line is left out."""
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        missing = [k for k in needs if k not in record] if isinstance(record, dict) else None
        if missing is None:
            left_out.add('malformed line (not a JSON object)', f'{path}:{n}')
        elif missing:
            left_out.add(f'no {", ".join(missing)}', f'{path}:{n}')
        else:
            yield f'{path}:{n}', record


def _json(path: Path):
    """A benchmark's JSON file; DataError naming it when it does not parse."""
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise DataError(f'{path}: not JSON ({exc}); put the benchmark\'s published file there') from exc


@dataclass
class Task:
    name: str
    read: Callable[[Path, Optional[LeftOut]], List[Sample]]
    max_new_tokens: int
    expects: str  # the files the reader looks for, for the error that names a missing copy
    folder: str = ''  # the local copy's folder under --data: the task's name unless it shares another's
    benchmark: str = ''  # whose scorers score it (metrics.SCORERS): the task's name unless it asks another's questions

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


def _required(path: Path) -> Path:
    if not path.exists():
        raise DataError(f'{path}: not found; the benchmark\'s local copy is expected there (python -m diffzoo.eval.lmm '
                        f'-h lists each task\'s files)')
    return path


def _yes_no(label) -> bool:
    return isinstance(label, str) and label.strip().lower() in ('yes', 'no')


def read_pope(root: Path, left_out: Optional[LeftOut] = None) -> List[Sample]:
    left_out, samples = _left_out(left_out), []
    for split in POPE_SPLITS:
        name = f'coco_pope_{split}.json'
        path = _required(llava_qa.first_file(root / 'coco' / name, root / name))
        for where, r in _jsonl(path, ('question_id', 'image', 'text', 'label'), left_out):
            if not isinstance(r['text'], str):
                left_out.add('question text not a string', where)
            elif not _yes_no(r['label']):
                left_out.add('label not yes or no', f'{where} (label {r["label"]!r})')
            elif (image := _image_in(root / 'val2014', r['image'], left_out, where)) is not None:
                samples.append(Sample(f'{split}-{r["question_id"]}', image, f'{r["text"].strip()}\n{SHORT}',
                                      {'split': split, 'label': r['label']}, where))
    return samples


# where MME's subtask folders may lie under the task's folder: in it, or in the release folder as its zip unpacks
# (the Hugging Face copy, darkyarding/MME, nests them once more in MME_Benchmark/)
MME_RELEASE = ('.', 'MME_Benchmark_release_version', 'MME_Benchmark_release_version/MME_Benchmark', 'MME_Benchmark')


def read_mme(root: Path, left_out: Optional[LeftOut] = None) -> List[Sample]:
    left_out, samples = _left_out(left_out), []
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
        for txt in sorted(qa_dir.glob('*.txt')):
            image = next((p for p in sorted(image_dir.glob(txt.stem + '.*')) if p.suffix != '.txt'), None)
            lines = [(n, line) for n, line in enumerate(txt.read_text().splitlines(), 1) if line.strip()]
            for j, (n, line) in enumerate(lines):
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


SCIENCEQA_LLAVA_QUESTIONS = 'llava_test_CQM-A.json'  # LLaVA-1.5's ScienceQA test questions (scripts/v1_5/eval/sqa.sh)


def _scienceqa_images(root: Path, image, left_out: LeftOut, where: str) -> Optional[Path]:
    """images/test/<image> (or test/<image>); None (left out) for a name that would leave those folders."""
    if _image_in(root, image, left_out, where) is None:
        return None
    return llava_qa.first_file(root / 'images' / 'test' / image, root / 'test' / image)


def _option_count(prompt: str) -> int:
    """How many options "A. …", "B. …", … the prompt's last option list holds."""
    lines = prompt.splitlines()
    first = max((i for i, line in enumerate(lines) if line.startswith('A. ')), default=len(lines))
    count = 0
    while first + count < len(lines) and lines[first + count].startswith(f'{chr(65 + count)}. '):
        count += 1
    return count


def read_scienceqa_llava(root: Path, left_out: Optional[LeftOut] = None) -> List[Sample]:
    """LLaVA-1.5's question file, a list of {id, image: "<pid>/image.png" under images/test/, conversations:
    [human, gpt]}: the human turn asked as its model_vqa_science.py --single-pred-prompt asks it ("<image>" removed,
    the text stripped, then "\\n" and the letter prompt; a text that already ends with it is asked as written); the
    answer and option count from ScienceQA's problems.json when it lies beside it (as LLaVA's eval_science_qa.py
    scores), else the gpt turn's letter and the options in the prompt. The questions with an image (ScienceQA-IMG,
    LLaVA's IMG-Accuracy)."""
    path, left_out = root / SCIENCEQA_LLAVA_QUESTIONS, _left_out(left_out)
    problems = _json(root / 'problems.json') if (root / 'problems.json').is_file() else None
    samples = []
    for n, q in enumerate(_json(path)):
        turns = q.get('conversations') or []
        if 'id' not in q or len(turns) < 2 or any('value' not in t for t in turns[:2]):
            raise DataError(f'{path}: entry {n} is not {{id, image, conversations: [human, gpt]}} as LLaVA-1.5\'s '
                            f'{SCIENCEQA_LLAVA_QUESTIONS} is')
        if not q.get('image'):
            continue  # ScienceQA-IMG: the questions with an image
        pid, question = str(q['id']), turns[0]['value'].replace('<image>', '').strip()
        prompt = question if question.endswith(LETTER_PROMPT) else f'{question}\n{LETTER_PROMPT}'
        if problems is not None:
            if pid not in problems:
                raise DataError(f'{path}: question {pid} is not in {root / "problems.json"}; both must be ScienceQA\'s')
            answer, options = chr(65 + problems[pid]['answer']), len(problems[pid]['choices'])
        else:
            answer, options = turns[1]['value'].strip(), _option_count(prompt)
            if len(answer) != 1 or not 'A' <= answer < chr(65 + options):
                raise DataError(f'{path}: question {pid} answers {answer!r}, not one of its {options} option letters; '
                                f'put ScienceQA\'s problems.json beside it to read the answers from there')
        where = f'{path} entry {n} (id {pid})'
        if (image := _scienceqa_images(root, q['image'], left_out, where)) is not None:
            samples.append(Sample(pid, image, prompt, {'answer': answer, 'options': options}, where))
    return samples


def read_scienceqa(root: Path, left_out: Optional[LeftOut] = None) -> List[Sample]:
    """ScienceQA-IMG from LLaVA-1.5's llava_test_CQM-A.json when it is there, else from ScienceQA's own files."""
    if (root / SCIENCEQA_LLAVA_QUESTIONS).is_file():
        return read_scienceqa_llava(root, left_out)
    if not (root / 'problems.json').is_file():
        raise DataError(f'{root}: neither ScienceQA\'s problems.json (with pid_splits.json and images/test/<pid>/) nor '
                        f'LLaVA-1.5\'s {SCIENCEQA_LLAVA_QUESTIONS} (with images/test/<pid>/image.png); put either '
                        f'there')
    problems, left_out = _json(root / 'problems.json'), _left_out(left_out)
    test = _json(_required(root / 'pid_splits.json'))['test']
    samples = []
    for pid in test:
        p = problems[pid]
        if not p.get('image'):
            continue  # ScienceQA-IMG: the questions with an image
        options = '\n'.join(f'{chr(65 + i)}. {c}' for i, c in enumerate(p['choices']))
        context = f'Context: {p["hint"]}\n' if p.get('hint') else ''
        where = f'{root / "problems.json"} (pid {pid})'
        image = _scienceqa_images(root, f'{pid}/{p["image"]}', left_out, where)
        if image is not None:
            samples.append(Sample(pid, image, f'{context}{p["question"]}\n{options}\n{LETTER_PROMPT}',
                                  {'answer': chr(65 + p['answer']), 'options': len(p['choices'])}, where))
    return samples


def _textvqa_records(root: Path, left_out: LeftOut) -> Iterator[Tuple[str, Dict]]:
    """(where, record) of each TextVQA val question that has every field; the others left out."""
    path = _required(root / 'TextVQA_0.5.1_val.json')
    for n, r in enumerate(_json(path)['data']):
        missing = [k for k in ('question_id', 'question', 'image_id', 'answers') if k not in r]
        if missing:
            left_out.add(f'no {", ".join(missing)}', f'{path} entry {n}')
        else:
            yield f'{path} entry {n}', r


def read_textvqa(root: Path, left_out: Optional[LeftOut] = None) -> List[Sample]:
    left_out, samples = _left_out(left_out), []
    for where, r in _textvqa_records(root, left_out):
        if (image := _image_in(root / 'train_images', f'{r["image_id"]}.jpg', left_out, where)) is not None:
            # lmms-eval capitalizes the question (str.capitalize: the rest lower-cased), as its textvqa_doc_to_text
            samples.append(Sample(str(r['question_id']), image, f'{r["question"].capitalize()}\n{SHORT}',
                                  {'answers': r['answers']}, where))
    return samples


TEXTVQA_OCR_QUESTIONS = 'llava_textvqa_val_v051_ocr.jsonl'


def read_textvqa_ocr(root: Path, left_out: Optional[LeftOut] = None) -> List[Sample]:
    """LLaVA-1.5's TextVQA questions (with OCR tokens in their text), scored on TextVQA's own answers."""
    answers = {str(r['question_id']): r['answers'] for _, r in _textvqa_records(root, LeftOut())}
    path, left_out, samples = _required(root / TEXTVQA_OCR_QUESTIONS), _left_out(left_out), []
    for where, r in _jsonl(path, ('question_id', 'image', 'text'), left_out):
        qid = str(r['question_id'])
        if qid not in answers:
            raise DataError(f'{where}: question {qid} is not in {root / "TextVQA_0.5.1_val.json"}; both files must be '
                            f'TextVQA 0.5.1 val')
        if (image := _image_in(root / 'train_images', r['image'], left_out, where)) is not None:
            samples.append(Sample(qid, image, r['text'], {'answers': answers[qid]}, where))
    return samples


def read_gqa(root: Path, left_out: Optional[LeftOut] = None) -> List[Sample]:
    path, left_out = _required(root / 'testdev_balanced_questions.json'), _left_out(left_out)
    return [Sample(qa.id, qa.image, f'{qa.question}\n{SHORT}', {'answer': qa.answer}, f'{path} question {qa.id}')
            for qa in llava_qa.gqa(root, 'testdev')
            if _built_in(root / 'images', qa.image, left_out, f'{path} question {qa.id}')]


def read_okvqa(root: Path, left_out: Optional[LeftOut] = None) -> List[Sample]:
    path = _required(root / 'mscoco_val2014_annotations.json')
    return [Sample(qa.id, qa.image, f'{qa.question}\n{OKVQA_PROMPT}', {'answers': list(qa.answers)},
                   f'{path} question {qa.id}') for qa in llava_qa.okvqa(root, 'val')]  # its image names are numbers


TASKS: Dict[str, Task] = {t.name: t for t in (
    Task('pope', read_pope, 128, 'coco/coco_pope_{random,popular,adversarial}.json, val2014/'),
    Task('mme', read_mme, 16, '<subtask>/… in the folder or in its MME_Benchmark_release_version/'),
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
