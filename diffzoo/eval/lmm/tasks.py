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
"""
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Sequence

from PIL import Image

from diffzoo.data import llava_qa
from diffzoo.data.shards import DataError

from . import metrics

SHORT = llava_qa.SHORT_ANSWER  # LLaVA-1.5's short-answer prompt
OKVQA_PROMPT = "When the provided information is insufficient, respond with 'Unanswerable'.\n" + SHORT
LETTER_PROMPT = "Answer with the option's letter from the given choices directly."
MME_SUFFIX = ' Please answer yes or no.'
POPE_SPLITS = ('random', 'popular', 'adversarial')


@dataclass
class Sample:
    id: str
    image: Path
    prompt: str
    meta: Dict = field(default_factory=dict)  # what scoring needs: label, split, answers, …

    @property
    def source(self) -> str:
        return str(self.image)

    def load_image(self) -> Image.Image:
        with Image.open(self.image) as im:
            return im.convert('RGB')


@dataclass
class Task:
    name: str
    read: Callable[[Path], List[Sample]]
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


def _required(path: Path) -> Path:
    if not path.exists():
        raise DataError(f'{path}: not found; the benchmark\'s local copy is expected there (python -m diffzoo.eval.lmm '
                        f'-h lists each task\'s files)')
    return path


def read_pope(root: Path) -> List[Sample]:
    samples = []
    for split in POPE_SPLITS:
        name = f'coco_pope_{split}.json'
        path = _required(llava_qa.first_file(root / 'coco' / name, root / name))
        for line in path.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                samples.append(Sample(f'{split}-{r["question_id"]}', root / 'val2014' / r['image'],
                                      f'{r["text"].strip()}\n{SHORT}', {'split': split, 'label': r['label']}))
    return samples


# where MME's subtask folders may lie under the task's folder: in it, or in the release folder as its zip unpacks
# (the Hugging Face copy, darkyarding/MME, nests them once more in MME_Benchmark/)
MME_RELEASE = ('.', 'MME_Benchmark_release_version', 'MME_Benchmark_release_version/MME_Benchmark', 'MME_Benchmark')


def read_mme(root: Path) -> List[Sample]:
    samples = []
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
            for j, line in enumerate(l for l in txt.read_text().splitlines() if l.strip()):
                if '\t' not in line:
                    raise DataError(f'{txt}: line {line!r} is not "question<TAB>Yes|No" as MME\'s files are')
                question, label = line.rsplit('\t', 1)
                question = question.strip().replace(MME_SUFFIX, '')
                samples.append(Sample(f'{task}/{txt.stem}/{j}', image if image else image_dir / f'{txt.stem}.jpg',
                                      f'{question}\n{SHORT}', {'subtask': task, 'image': txt.stem, 'label': label}))
    return samples


SCIENCEQA_LLAVA_QUESTIONS = 'llava_test_CQM-A.json'  # LLaVA-1.5's ScienceQA test questions (scripts/v1_5/eval/sqa.sh)


def _scienceqa_images(root: Path, image: str) -> Path:
    return llava_qa.first_file(root / 'images' / 'test' / image, root / 'test' / image)


def _option_count(prompt: str) -> int:
    """How many options "A. …", "B. …", … the prompt's last option list holds."""
    lines = prompt.splitlines()
    first = max((i for i, line in enumerate(lines) if line.startswith('A. ')), default=len(lines))
    count = 0
    while first + count < len(lines) and lines[first + count].startswith(f'{chr(65 + count)}. '):
        count += 1
    return count


def read_scienceqa_llava(root: Path) -> List[Sample]:
    """LLaVA-1.5's question file, a list of {id, image: "<pid>/image.png" under images/test/, conversations:
    [human, gpt]}: the human turn asked as its model_vqa_science.py --single-pred-prompt asks it ("<image>" removed,
    the text stripped, then "\\n" and the letter prompt; a text that already ends with it is asked as written); the
    answer and option count from ScienceQA's problems.json when it lies beside it (as LLaVA's eval_science_qa.py
    scores), else the gpt turn's letter and the options in the prompt. The questions with an image (ScienceQA-IMG,
    LLaVA's IMG-Accuracy)."""
    path = root / SCIENCEQA_LLAVA_QUESTIONS
    problems = json.loads((root / 'problems.json').read_text()) if (root / 'problems.json').is_file() else None
    samples = []
    for n, q in enumerate(json.loads(path.read_text())):
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
        samples.append(Sample(pid, _scienceqa_images(root, q['image']), prompt, {'answer': answer, 'options': options}))
    return samples


def read_scienceqa(root: Path) -> List[Sample]:
    """ScienceQA-IMG from LLaVA-1.5's llava_test_CQM-A.json when it is there, else from ScienceQA's own files."""
    if (root / SCIENCEQA_LLAVA_QUESTIONS).is_file():
        return read_scienceqa_llava(root)
    if not (root / 'problems.json').is_file():
        raise DataError(f'{root}: neither ScienceQA\'s problems.json (with pid_splits.json and images/test/<pid>/) nor '
                        f'LLaVA-1.5\'s {SCIENCEQA_LLAVA_QUESTIONS} (with images/test/<pid>/image.png); put either '
                        f'there')
    problems = json.loads((root / 'problems.json').read_text())
    test = json.loads(_required(root / 'pid_splits.json').read_text())['test']
    samples = []
    for pid in test:
        p = problems[pid]
        if not p.get('image'):
            continue  # ScienceQA-IMG: the questions with an image
        options = '\n'.join(f'{chr(65 + i)}. {c}' for i, c in enumerate(p['choices']))
        context = f'Context: {p["hint"]}\n' if p.get('hint') else ''
        image = _scienceqa_images(root, f'{pid}/{p["image"]}')
        samples.append(Sample(pid, image, f'{context}{p["question"]}\n{options}\n{LETTER_PROMPT}',
                              {'answer': chr(65 + p['answer']), 'options': len(p['choices'])}))
    return samples


def read_textvqa(root: Path) -> List[Sample]:
    data = json.loads(_required(root / 'TextVQA_0.5.1_val.json').read_text())['data']
    # lmms-eval capitalizes the question (str.capitalize: the rest lower-cased), as its textvqa_doc_to_text does
    return [Sample(str(r['question_id']), root / 'train_images' / f'{r["image_id"]}.jpg',
                   f'{r["question"].capitalize()}\n{SHORT}',
                   {'answers': r['answers']}) for r in data]


TEXTVQA_OCR_QUESTIONS = 'llava_textvqa_val_v051_ocr.jsonl'


def read_textvqa_ocr(root: Path) -> List[Sample]:
    """LLaVA-1.5's TextVQA questions (with OCR tokens in their text), scored on TextVQA's own answers."""
    answers = {s.id: s.meta['answers'] for s in read_textvqa(root)}
    path = _required(root / TEXTVQA_OCR_QUESTIONS)
    samples = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        r = json.loads(line)
        missing = [k for k in ('question_id', 'image', 'text') if k not in r]
        if missing:
            raise DataError(f'{path}: line {n} has no {", ".join(missing)}; LLaVA-1.5\'s TextVQA question file has '
                            f'{{question_id, image, text}} on each line')
        qid = str(r['question_id'])
        if qid not in answers:
            raise DataError(f'{path}: question {qid} (line {n}) is not in {root / "TextVQA_0.5.1_val.json"}; both '
                            f'files must be TextVQA 0.5.1 val')
        samples.append(Sample(qid, root / 'train_images' / r['image'], r['text'], {'answers': answers[qid]}))
    return samples


def read_gqa(root: Path) -> List[Sample]:
    _required(root / 'testdev_balanced_questions.json')
    return [Sample(qa.id, qa.image, f'{qa.question}\n{SHORT}', {'answer': qa.answer})
            for qa in llava_qa.gqa(root, 'testdev')]


def read_okvqa(root: Path) -> List[Sample]:
    _required(root / 'mscoco_val2014_annotations.json')
    return [Sample(qa.id, qa.image, f'{qa.question}\n{OKVQA_PROMPT}', {'answers': list(qa.answers)})
            for qa in llava_qa.okvqa(root, 'val')]


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
