"""The benchmarks as local copies hold them: each task's reader, prompt and scoring.

Each task reads the files its authors (or LLaVA-1.5's evaluation, which DiffCLIP and eRAM-V follow) publish,
under the folder given for it:

    pope       coco/coco_pope_{random,popular,adversarial}.json (or without coco/): one JSON per line
               {question_id, image, text, label}; COCO images in val2014/
    mme        MME_Benchmark_release_version's subtask folders: <subtask>/questions_answers_YN/*.txt with
               <subtask>/images/*, or <subtask>/*.txt beside the images; each line "question<TAB>Yes|No"
    scienceqa  problems.json, pid_splits.json and images/test/<pid>/<image> (or test/<pid>/<image>): the test
               questions that have an image (ScienceQA-IMG)
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
    score: Callable[[Sequence[Mapping]], Dict]
    max_new_tokens: int
    expects: str  # the files the reader looks for, for the error that names a missing copy
    folder: str = ''  # the local copy's folder under --data: the task's name unless it shares another's

    def __post_init__(self):
        self.folder = self.folder or self.name


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


def read_mme(root: Path) -> List[Sample]:
    samples = []
    present = [t for t in metrics.MME_PERCEPTION + metrics.MME_COGNITION if (root / t).is_dir()]
    if not present:
        raise DataError(f'{root}: none of MME\'s subtask folders ({", ".join(metrics.MME_PERCEPTION[:3])}, …); point '
                        f'it at MME_Benchmark_release_version')
    for task in present:
        folder = root / task
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


def read_scienceqa(root: Path) -> List[Sample]:
    problems = json.loads(_required(root / 'problems.json').read_text())
    test = json.loads(_required(root / 'pid_splits.json').read_text())['test']
    samples = []
    for pid in test:
        p = problems[pid]
        if not p.get('image'):
            continue  # ScienceQA-IMG: the questions with an image
        options = '\n'.join(f'{chr(65 + i)}. {c}' for i, c in enumerate(p['choices']))
        context = f'Context: {p["hint"]}\n' if p.get('hint') else ''
        image = llava_qa.first_file(root / 'images' / 'test' / pid / p['image'], root / 'test' / pid / p['image'])
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
    Task('pope', read_pope, metrics.pope, 128, 'coco/coco_pope_{random,popular,adversarial}.json, val2014/'),
    Task('mme', read_mme, metrics.mme, 16, 'MME_Benchmark_release_version/<subtask>/…'),
    Task('scienceqa', read_scienceqa, metrics.scienceqa, 16, 'problems.json, pid_splits.json, images/test/'),
    Task('textvqa', read_textvqa, metrics.vqa, 16, 'TextVQA_0.5.1_val.json, train_images/'),
    Task('textvqa_ocr', read_textvqa_ocr, metrics.vqa, 16, f'{TEXTVQA_OCR_QUESTIONS}, TextVQA_0.5.1_val.json, '
                                                             f'train_images/', folder='textvqa'),
    Task('gqa', read_gqa, metrics.gqa, 16, 'testdev_balanced_questions.json, images/'),
    Task('okvqa', read_okvqa, metrics.vqa, 16, 'OpenEnded_mscoco_val2014_questions.json, '
                                                'mscoco_val2014_annotations.json, val2014/'),
)}


def rows_for_scoring(samples: Sequence[Sample], predictions: Sequence[str]) -> List[Dict]:
    """What each task's score function reads: the sample's meta with its prediction."""
    return [{**s.meta, 'prediction': p} for s, p in zip(samples, predictions)]
