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
hold every set's folder. A sample whose image file is missing or that has no answer is left out and counted per
set; so is, counted per set under its reason, one the JSON could not hold safely: an image path that would leave
`image_root` (an absolute path outside it, or a `..` component: the rule `diffzoo.data.shards.hostile_name`
applies to shards), a question or answer that is not a string, or a record not in its set's layout (a field
missing or of another type), and a VQAv2 or OK-VQA annotation whose question_id names no question. A missing
annotation file stops the command, naming it, and so does a file that is not JSON, naming what is wrong and where,
or not in its set's layout (a list where the set publishes an object, no "questions" list).
"""
import json
from collections import Counter, defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple

from .shards import DataError, hostile_name

SHORT_ANSWER = 'Answer the question using a single word or phrase.'  # LLaVA-1.5's short-answer prompt
POPE_SPLITS = ('random', 'popular', 'adversarial')  # POPE's three ways of choosing absent objects


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
    fix = 'use the set\'s published annotation file, whole (download it again if it was cut short)'
    try:
        return json.loads(path.read_bytes())
    except json.JSONDecodeError as exc:
        raise DataError(f'{path}: not valid JSON ({exc.msg} at line {exc.lineno:,} column {exc.colno:,}; '
                        f'{path.stat().st_size:,} bytes); {fix}') from exc
    except UnicodeDecodeError as exc:
        raise DataError(f'{path}: not UTF-8 text (byte {exc.start:,}: {exc.reason}); {fix}') from exc


def _published(path: Path, kind: type, key: Optional[str] = None):
    """`path`'s JSON (its `key` field) when it is a `kind` (dict or list), as the set publishes it; else the file is
    named (a file of another layout would otherwise stop the command at the first record, unnamed)."""
    data = _json(path)
    if key is not None:
        data = data.get(key) if isinstance(data, dict) else None
    if not isinstance(data, kind):
        what = f'a JSON object with a "{key}" list' if key is not None else 'a JSON ' + ('object' if kind is dict
                                                                                         else 'list')
        raise DataError(f'{path}: not {what}, as the set publishes it; use the set\'s published annotation file')
    return data


class Unmatched(ValueError):
    """A record whose fields are in the layout but that names nothing its set holds; the message is why."""


@contextmanager
def _record(left_out: Optional[Counter], of: str = ''):
    """A record its reader cannot read (a field missing or of another type, `Unmatched`) is left out and counted
    in `left_out` under why (`of`: which file's records, where a set has two); without `left_out` (a reader called
    on its own) the error goes on."""
    try:
        yield
    except Unmatched as exc:
        if left_out is None:
            raise
        left_out[str(exc)] += 1
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        if left_out is None:
            raise
        missing = f'no {exc.args[0]!r} field' if isinstance(exc, KeyError) and exc.args else 'a field of another type'
        left_out[f'not in the set\'s layout ({of}{missing})'] += 1


def first_file(*paths: Path) -> Path:
    """The first of `paths` that is a file (else the first, for the error that names it)."""
    return next((p for p in paths if p.is_file()), paths[0])


def _most_frequent(answers: List[str]) -> str:
    counts = Counter(answers)
    return max(answers, key=lambda a: counts[a]) if answers else ''  # ties: the first given


def _coco(root: Path, split: str, questions: str, annotations: str, consensus: bool,
          left_out: Optional[Counter] = None) -> Iterator[QA]:
    qs = {}
    for q in _published(root / questions, list, 'questions'):
        with _record(left_out, 'a question: '):  # counted apart from the annotations: no id ties it to one
            qs[q['question_id']] = q
    for a in _published(root / annotations, list, 'annotations'):
        with _record(left_out):
            q = qs.get(a['question_id'])
            if q is None:
                raise Unmatched(f'question_id not in {questions}')
            humans = tuple(x['answer'] for x in a['answers'])
            answer = a['multiple_choice_answer'] if consensus else _most_frequent(list(humans))
            image = root / f'{split}2014' / f'COCO_{split}2014_{a["image_id"]:012d}.jpg'
            yield QA(str(a['question_id']), image, q['question'], answer, humans)


def vqav2(root: Path, split: str, left_out: Optional[Counter] = None) -> Iterator[QA]:
    return _coco(root, split, f'v2_OpenEnded_mscoco_{split}2014_questions.json',
                 f'v2_mscoco_{split}2014_annotations.json', consensus=True, left_out=left_out)


def okvqa(root: Path, split: str, left_out: Optional[Counter] = None) -> Iterator[QA]:
    return _coco(root, split, f'OpenEnded_mscoco_{split}2014_questions.json', f'mscoco_{split}2014_annotations.json',
                 consensus=False, left_out=left_out)


def vizwiz(root: Path, split: str, left_out: Optional[Counter] = None) -> Iterator[QA]:
    for i, r in enumerate(_published(first_file(root / 'Annotations' / f'{split}.json', root / f'{split}.json'),
                                     list)):
        with _record(left_out):
            yield QA(r.get('image', str(i)), root / split / r['image'], r['question'],
                     _most_frequent([a['answer'] for a in r.get('answers', [])]))


def gqa(root: Path, split: str, left_out: Optional[Counter] = None) -> Iterator[QA]:
    for qid, r in _published(root / f'{split}_balanced_questions.json', dict).items():
        with _record(left_out):
            yield QA(qid, root / 'images' / f'{r["imageId"]}.jpg', r['question'], r['answer'])


OCRVQA_SPLITS = {'train': 1, 'val': 2, 'test': 3}


def ocrvqa(root: Path, split: str, left_out: Optional[Counter] = None) -> Iterator[QA]:
    if split not in OCRVQA_SPLITS:
        raise DataError(f'ocrvqa split {split!r}: one of {", ".join(OCRVQA_SPLITS)}')
    for book, r in _published(root / 'dataset.json', dict).items():
        with _record(left_out):  # a cover's questions: left out together
            if r.get('split') != OCRVQA_SPLITS[split]:
                continue
            ext = Path(r.get('imageURL', '')).suffix or '.jpg'
            image = first_file(root / 'images' / f'{book}{ext}', root / 'images' / f'{book}.jpg')
            for j, (q, a) in enumerate(zip(r['questions'], r['answers'])):
                yield QA(f'{book}-{j}', image, q, a)


def docvqa(root: Path, split: str, left_out: Optional[Counter] = None) -> Iterator[QA]:
    for r in _published(first_file(root / f'{split}_v1.0_withQT.json', root / f'{split}_v1.0.json'), list, 'data'):
        with _record(left_out):
            yield QA(str(r['questionId']), root / r['image'], r['question'], (r.get('answers') or [''])[0])


def chartqa(root: Path, split: str, left_out: Optional[Counter] = None) -> Iterator[QA]:
    files = [root / split / f'{split}_{kind}.json' for kind in ('human', 'augmented')]
    if not any(f.is_file() for f in files):
        _json(files[0])  # names the file
    for f in files:
        if f.is_file():
            for i, r in enumerate(_published(f, list)):
                with _record(left_out):
                    yield QA(f'{f.stem}-{i}', root / split / 'png' / r['imgname'], r['query'], str(r['label']))


READERS: Dict[str, Callable[..., Iterator[QA]]] = {  # (root, split, left_out=None)
    'vqav2': vqav2, 'okvqa': okvqa, 'vizwiz': vizwiz, 'gqa': gqa, 'ocrvqa': ocrvqa, 'docvqa': docvqa,
    'chartqa': chartqa}


@dataclass
class Report:
    """Per set: samples kept, left out for a missing image or an empty answer (`rows`), and left out for any other
    reason (`left_out`: set → reason → samples, with the first sample's id in `examples`; `notes`)."""
    kept: Counter = field(default_factory=Counter)
    missing_image: Counter = field(default_factory=Counter)
    no_answer: Counter = field(default_factory=Counter)
    left_out: Dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    examples: Dict[Tuple[str, str], str] = field(default_factory=dict)

    def leave_out(self, name: str, reason: str, qa_id: str) -> None:
        self.left_out[name][reason] += 1
        self.examples.setdefault((name, reason), f'{name}-{qa_id}')

    def rows(self) -> List[Tuple[str, int, int, int]]:
        return [(s, self.kept[s], self.missing_image[s], self.no_answer[s]) for s in READERS
                if s in self.kept or s in self.missing_image or s in self.no_answer or s in self.left_out]

    def notes(self) -> List[str]:
        """One line per set and reason of `left_out`, e.g. "docvqa: 2 left out: image path outside --image-root
        (a ../ component) (e.g. docvqa-52212)"."""
        return [f'{name}: {n:,} left out: {reason}' + (f' (e.g. {self.examples[name, reason]})'
                                                        if (name, reason) in self.examples else '')
                for name in READERS for reason, n in sorted(self.left_out.get(name, {}).items()) if n]


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
        for qa in READERS[name](root, split, report.left_out[name]):
            if not isinstance(qa.question, str) or not isinstance(qa.answer, str):
                report.leave_out(name, 'question or answer not a string', qa.id)
                continue
            if not qa.answer.strip():
                report.no_answer[name] += 1
                continue
            image = qa.image.relative_to(image_root).as_posix() if qa.image.is_relative_to(image_root) else None
            outside = hostile_name(image) if image is not None else 'an absolute path'
            if outside:
                report.leave_out(name, f'image path outside --image-root ({outside})', qa.id)
                continue
            try:
                found = qa.image.is_file()
            except OSError as exc:  # a name over 255 bytes
                report.leave_out(name, f'image path refused by the system ({exc.strerror})', qa.id)
                continue
            if not found:
                report.missing_image[name] += 1
                continue
            question = qa.question.strip() + (f'\n{prompt}' if prompt else '')
            records.append({'id': f'{name}-{qa.id}', 'image': image,
                            'conversations': exchange(question, qa.answer.strip())})
            report.kept[name] += 1
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(records) + '\n')
    return report
