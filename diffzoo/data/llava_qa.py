"""Single-round QA sets in their published layouts → one LLaVA-format JSON (`python -m diffzoo.data llava-qa`).

eRAM-V's continued pre-training (its Table 6) mixes VQAv2, OK-VQA, VizWiz, GQA, OCR-VQA, DocVQA and ChartQA,
each "reformatted to fit the instruction fine-tuning paradigm", one question and answer per sample. The
reformatting is LLaVA-1.5's for short answers: the human turn is `<image>`, the question and "Answer the
question using a single word or phrase."; the gpt turn the answer. What each reader takes (paths under the
folder given for that set):

    vqav2    v2_OpenEnded_mscoco_<split>2014_questions.json, v2_mscoco_<split>2014_annotations.json,
             <split>2014/COCO_<split>2014_<image id:012d>.jpg; the consensus answer (multiple_choice_answer)
    okvqa    OpenEnded_mscoco_<split>2014_questions.json, mscoco_<split>2014_annotations.json, COCO images as
             VQAv2's; the most frequent of the ten answers
    vizwiz   Annotations/<split>.json (or <split>.json), <split>/<image>; the most frequent answer
    gqa      <split>_balanced_questions.json, images/<imageId>.jpg; its short answer
    ocrvqa   dataset.json (split 1 train, 2 val, 3 test), images/<id>.<ext of imageURL, or jpg>; every
             question of a cover, each its own sample
    docvqa   <split>_v1.0_withQT.json or <split>_v1.0.json, the image path each record names; its first answer
    chartqa  <split>/<split>_human.json and <split>_augmented.json, <split>/png/<imgname>; its label

Image paths in the JSON are relative to `image_root` (the training recipe's `data.image_folder`), which must
hold every set's folder. A sample whose image file is missing is left out and counted per set; a missing
annotation file stops the command, naming it.
"""
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple

from .shards import DataError

SHORT_ANSWER = 'Answer the question using a single word or phrase.'  # LLaVA-1.5's short-answer prompt


def exchange(question: str, answer: str, image: bool = True) -> List[Dict]:
    """One LLaVA-format exchange: the human's question (after `<image>` when `image`) and the gpt's answer."""
    return [{'from': 'human', 'value': f'<image>\n{question}' if image else question}, {'from': 'gpt', 'value': answer}]


@dataclass(frozen=True)
class QA:
    id: str
    image: Path
    question: str
    answer: str  # the one trained on
    answers: Tuple[str, ...] = ()  # every human answer, where the set has several (VQA accuracy)


def _json(path: Path):
    if not path.is_file():
        raise DataError(f'{path}: no such file (the set\'s published annotation file; see python -m diffzoo.data '
                        f'llava-qa -h for each set\'s layout)')
    return json.loads(path.read_text())


def first_file(*paths: Path) -> Path:
    """The first of `paths` that is a file (else the first, for the error that names it)."""
    return next((p for p in paths if p.is_file()), paths[0])


def _most_frequent(answers: List[str]) -> str:
    counts = Counter(answers)
    return max(answers, key=lambda a: counts[a]) if answers else ''  # ties: the first given


def _coco(root: Path, split: str, questions: str, annotations: str, consensus: bool) -> Iterator[QA]:
    qs = {q['question_id']: q for q in _json(root / questions)['questions']}
    for a in _json(root / annotations)['annotations']:
        q = qs.get(a['question_id'])
        if q is None:
            continue
        humans = tuple(x['answer'] for x in a['answers'])
        answer = a['multiple_choice_answer'] if consensus else _most_frequent(list(humans))
        image = root / f'{split}2014' / f'COCO_{split}2014_{a["image_id"]:012d}.jpg'
        yield QA(str(a['question_id']), image, q['question'], answer, humans)


def vqav2(root: Path, split: str) -> Iterator[QA]:
    return _coco(root, split, f'v2_OpenEnded_mscoco_{split}2014_questions.json',
                 f'v2_mscoco_{split}2014_annotations.json', consensus=True)


def okvqa(root: Path, split: str) -> Iterator[QA]:
    return _coco(root, split, f'OpenEnded_mscoco_{split}2014_questions.json', f'mscoco_{split}2014_annotations.json',
                 consensus=False)


def vizwiz(root: Path, split: str) -> Iterator[QA]:
    for i, r in enumerate(_json(first_file(root / 'Annotations' / f'{split}.json', root / f'{split}.json'))):
        yield QA(r.get('image', str(i)), root / split / r['image'], r['question'],
                 _most_frequent([a['answer'] for a in r.get('answers', [])]))


def gqa(root: Path, split: str) -> Iterator[QA]:
    for qid, r in _json(root / f'{split}_balanced_questions.json').items():
        yield QA(qid, root / 'images' / f'{r["imageId"]}.jpg', r['question'], r['answer'])


OCRVQA_SPLITS = {'train': 1, 'val': 2, 'test': 3}


def ocrvqa(root: Path, split: str) -> Iterator[QA]:
    if split not in OCRVQA_SPLITS:
        raise DataError(f'ocrvqa split {split!r}: one of {", ".join(OCRVQA_SPLITS)}')
    for book, r in _json(root / 'dataset.json').items():
        if r.get('split') != OCRVQA_SPLITS[split]:
            continue
        ext = Path(r.get('imageURL', '')).suffix or '.jpg'
        image = first_file(root / 'images' / f'{book}{ext}', root / 'images' / f'{book}.jpg')
        for j, (q, a) in enumerate(zip(r['questions'], r['answers'])):
            yield QA(f'{book}-{j}', image, q, a)


def docvqa(root: Path, split: str) -> Iterator[QA]:
    for r in _json(first_file(root / f'{split}_v1.0_withQT.json', root / f'{split}_v1.0.json'))['data']:
        yield QA(str(r['questionId']), root / r['image'], r['question'], (r.get('answers') or [''])[0])


def chartqa(root: Path, split: str) -> Iterator[QA]:
    files = [root / split / f'{split}_{kind}.json' for kind in ('human', 'augmented')]
    if not any(f.is_file() for f in files):
        _json(files[0])  # names the file
    for f in files:
        if f.is_file():
            for i, r in enumerate(_json(f)):
                yield QA(f'{f.stem}-{i}', root / split / 'png' / r['imgname'], r['query'], str(r['label']))


READERS: Dict[str, Callable[[Path, str], Iterator[QA]]] = {
    'vqav2': vqav2, 'okvqa': okvqa, 'vizwiz': vizwiz, 'gqa': gqa, 'ocrvqa': ocrvqa, 'docvqa': docvqa,
    'chartqa': chartqa}


@dataclass
class Report:
    kept: Counter = field(default_factory=Counter)
    missing_image: Counter = field(default_factory=Counter)
    no_answer: Counter = field(default_factory=Counter)

    def rows(self) -> List[Tuple[str, int, int, int]]:
        return [(s, self.kept[s], self.missing_image[s], self.no_answer[s]) for s in READERS
                if s in self.kept or s in self.missing_image or s in self.no_answer]


def convert(sets: Dict[str, Path], image_root: Path, out: Path, split: str = 'train',
            prompt: Optional[str] = SHORT_ANSWER) -> Report:
    """Write one LLaVA-format JSON of every set's single-round questions (module docstring)."""
    image_root = Path(image_root).resolve()
    if not image_root.is_dir():
        raise DataError(f'--image-root {image_root}: no such folder')
    records, report = [], Report()
    for name, root in sets.items():
        root = Path(root).resolve()
        if not root.is_dir():
            raise DataError(f'--{name} {root}: no such folder')
        if image_root not in (root, *root.parents):
            raise DataError(f'--{name} {root} is not inside --image-root {image_root}; the JSON\'s image paths are '
                            f'relative to it, so choose a folder that holds every set')
        for qa in READERS[name](root, split):
            if not qa.answer.strip():
                report.no_answer[name] += 1
                continue
            if not qa.image.is_file():
                report.missing_image[name] += 1
                continue
            question = qa.question.strip() + (f'\n{prompt}' if prompt else '')
            records.append({'id': f'{name}-{qa.id}', 'image': qa.image.relative_to(image_root).as_posix(),
                            'conversations': exchange(question, qa.answer.strip())})
            report.kept[name] += 1
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(records) + '\n')
    return report
