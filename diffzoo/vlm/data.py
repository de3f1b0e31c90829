"""VQAv2 from a local copy, and the batches a VLM trains on.

Two layouts are read (`load_vqav2(root, split)`):

    official   v2_OpenEnded_mscoco_<split>2014_questions.json, v2_mscoco_<split>2014_annotations.json
               and COCO images <split>2014/COCO_<split>2014_<image_id:012d>.jpg under `root`
    parquet    Hugging Face's layout: *.parquet files whose path names the split, with columns
               question, answers (list of {"answer": …} or of strings), multiple_choice_answer,
               question_id, image ({"bytes": …} or {"path": …}); question_type / answer_type if present

`fraction` keeps a seeded random subset (the paper selected models on 40 % of VQAv2).

PaliGemma's task prompt is "answer en {question}\\n" and the target the consensus answer
(`multiple_choice_answer`). `VLMCollator` turns samples into `VisionLanguageModel` batches: prefix =
BOS + prompt (bidirectional), suffix = answer + EOS (causal, the only scored tokens), right padding.
`PaliGemmaCollator` uses a PaliGemma processor, whose `suffix=` does the same for real checkpoints.

An image that does not decode (truncated or corrupt file, a path that is a directory, or over PIL's pixel limit
`Image.MAX_IMAGE_PIXELS`, which stays as PIL sets it: a JPEG is decoded at a scale under it, any other image
refused, `diffzoo.vlm.images`) drops its sample from the batch; the batch then carries `skipped_images` (the
dropped samples' `source`s, why each did not open, and the positions of the kept ones), which `SkippedImages`
counts (one entry per distinct file, named with why the first time) and the trainer pops before the forward
pass. A batch with no readable image becomes one placeholder row (a blank image, nothing scored), so
every process still takes its step. At evaluation (`train=False`) the same holds:
`diffzoo.eval.vqa.answer_questions` answers the kept questions only and reports the others as left out.
"""
import io
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
from PIL import Image

from .images import open_rgb

PROMPT = 'answer en {question}\n'


@dataclass
class VQASample:
    question_id: int
    question: str
    answer: str  # the consensus answer, the training target
    answers: List[str]  # the human answers, for VQA accuracy
    image: Union[str, bytes]  # a path or encoded bytes
    question_type: str = ''
    answer_type: str = ''
    extra: Dict = field(default_factory=dict)

    @property
    def source(self) -> str:
        """Where the image comes from: its path, or for encoded bytes the file and row they were read from."""
        if isinstance(self.image, str):
            return self.image
        return self.extra.get('source', f'question {self.question_id}')

    def load_image(self) -> Image.Image:
        return open_rgb(io.BytesIO(self.image) if isinstance(self.image, bytes) else self.image)


# PIL: UnidentifiedImageError (an OSError), truncated data, broken chunks, more pixels than its bomb limit
UNREADABLE = (OSError, SyntaxError, Image.DecompressionBombError)


def unreadable_why(exc: BaseException) -> str:
    """Why an image did not open, in words: the error's kind and message."""
    return f'{type(exc).__name__}: {str(exc)[:200]}'


def load_images(samples: Sequence[VQASample], why: Optional[Dict[str, str]] = None
                 ) -> Tuple[List[int], List[Image.Image], List[str]]:
    """(positions of the samples kept, their RGB images, sources of the dropped ones): an unreadable image
    drops its sample, in training and at evaluation alike (the collators here, `diffzoo.eval.lmm`'s runner: any
    sample with `load_image()` and `source`); `why` (when given) receives source → why."""
    kept, images, skipped = [], [], []
    for i, s in enumerate(samples):
        try:
            image = s.load_image()
        except UNREADABLE as exc:
            skipped.append(s.source)
            if why is not None:
                why[s.source] = unreadable_why(exc)
            continue
        kept.append(i)
        images.append(image)
    return kept, images, skipped


def _skipped_record(skipped: List[str], kept: List[int], placeholder: bool, why: Optional[Dict[str, str]] = None
                    ) -> Dict:
    """The batch's `skipped_images` entry: dropped sources (and why each did not open), positions of the kept
    samples in the samples given (what `diffzoo.eval.vqa.answer_questions` pairs answers with), whether the row is
    a placeholder."""
    return {'sources': skipped, 'why': dict(why or {}), 'kept': kept, 'placeholder': bool(placeholder)}


def _placeholder() -> Tuple[List[VQASample], List[Image.Image]]:
    """One row for a batch without a readable image: an empty question on a blank image (nothing is scored)."""
    return [VQASample(question_id=0, question='', answer='', answers=[], image=b'')], [Image.new('RGB', (32, 32))]


class SkippedImages:
    """Distinct unreadable image files met in training batches, and how many samples trained or were dropped.

    `update(batch)` pops the batch's `skipped_images` (call it before the forward pass) and prints a line
    naming each file the first time; `merge` joins the records of every process; `record()` is what
    `skipped_images.json` holds.
    """

    def __init__(self, files: Iterable[str] = ()):
        self.files: List[str] = list(dict.fromkeys(files))
        self.samples_skipped = 0
        self.samples_trained = 0

    def update(self, batch: Dict) -> None:
        skipped = batch.pop('skipped_images', None) or {'sources': [], 'placeholder': False}
        rows = 0 if skipped['placeholder'] else len(batch['input_ids'])
        self.samples_trained += rows
        self.samples_skipped += len(skipped['sources'])
        for source in skipped['sources']:
            if source not in self.files:
                self.files.append(source)
                why = skipped.get('why', {}).get(source)
                print(f'skipped an unreadable image (its questions are left out): {source}'
                      + (f' ({why})' if why else ''), flush=True)

    def merge(self, others: Iterable['SkippedImages']) -> 'SkippedImages':
        total = SkippedImages(self.files)
        total.samples_skipped, total.samples_trained = self.samples_skipped, self.samples_trained
        for other in others:
            total.files += [f for f in other.files if f not in total.files]
            total.samples_skipped += other.samples_skipped
            total.samples_trained += other.samples_trained
        return total

    def record(self) -> Dict:
        return {'count': len(self.files), 'files': self.files, 'samples_skipped': self.samples_skipped,
                'samples_trained': self.samples_trained}

    def summary(self) -> str:
        if not self.files:
            return f'{self.samples_trained} samples trained, no unreadable image'
        shown = ', '.join(self.files[:3]) + (f' and {len(self.files) - 3} more' if len(self.files) > 3 else '')
        return (f'{self.samples_trained} samples trained; {len(self.files)} unreadable image file(s) left out '
                f'({self.samples_skipped} samples): {shown}')


def _subset(samples: List[VQASample], fraction: float, seed: int) -> List[VQASample]:
    if not 0 < fraction <= 1:
        raise ValueError(f'fraction={fraction}: expected a number in (0, 1]')
    if fraction == 1:
        return samples
    keep = sorted(random.Random(seed).sample(range(len(samples)), max(1, round(fraction * len(samples)))))
    return [samples[i] for i in keep]


def read_json(path: Path, fix: str):
    """`path`'s JSON (UTF-8); a file that is not JSON raises ValueError naming it, what is wrong and where, its
    size and `fix`."""
    raw = path.read_bytes()
    size = len(raw)
    try:
        text = raw.decode('utf-8-sig')
    except UnicodeDecodeError as exc:
        raise ValueError(f'{path}: not UTF-8 text (byte {exc.start:,} of {size:,} is {raw[exc.start:exc.start + 1]!r}: '
                         f'{exc.reason}); {fix}') from exc
    del raw  # not held beside the records as they are built
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        what = 'an empty file' if not text.strip() else 'not valid JSON'
        raise ValueError(f'{path}: {what} ({exc.msg} at line {exc.lineno:,} column {exc.colno:,}; {size:,} bytes); '
                         f'{fix}') from exc


def _read_json(path: Path, key: str) -> List[Dict]:
    """`path`'s list under `key`; a damaged or truncated file is named, with its size."""
    data = read_json(path, 'most likely a truncated download; download it again (and check that the path is the '
                           'VQAv2 file)')
    if not isinstance(data, dict) or key not in data:
        raise ValueError(f'{path}: no "{key}" list; expected the official VQAv2 file of that name')
    return data[key]


def _official(root: Path, split: str) -> List[VQASample]:
    questions_file = root / f'v2_OpenEnded_mscoco_{split}2014_questions.json'
    annotations_file = root / f'v2_mscoco_{split}2014_annotations.json'
    questions = {q['question_id']: q for q in _read_json(questions_file, 'questions')}
    annotations = _read_json(annotations_file, 'annotations')
    images = root / f'{split}2014'
    samples = []
    for a in annotations:
        q = questions.get(a['question_id'])
        if q is None:
            raise ValueError(f'{annotations_file}: question {a["question_id"]} is not in {questions_file}')
        samples.append(VQASample(
            question_id=a['question_id'], question=q['question'], answer=a['multiple_choice_answer'],
            answers=[x['answer'] for x in a['answers']], question_type=a.get('question_type', ''),
            answer_type=a.get('answer_type', ''),
            image=str(images / f'COCO_{split}2014_{a["image_id"]:012d}.jpg')))
    missing = [s.image for s in samples if not Path(s.image).is_file()]
    if missing:
        raise FileNotFoundError(f'{images}: {len(missing)} of {len(samples)} images are missing (e.g. {missing[0]}); '
                                f'unpack COCO {split}2014 there')
    return samples


def _parquet(files: Sequence[Path]) -> List[VQASample]:
    import pyarrow.parquet as pq
    samples = []
    for path in files:
        table = pq.read_table(path).to_pylist()
        for index, row in enumerate(table):
            for key in ('question', 'answers', 'image'):
                if key not in row:
                    raise ValueError(f'{path}: no "{key}" column; expected the Hugging Face VQAv2 columns '
                                     f'question, answers, multiple_choice_answer, question_id, image')
            answers = [a['answer'] if isinstance(a, dict) else a for a in row['answers']]
            image = row['image']
            image = image.get('bytes') or image.get('path') if isinstance(image, dict) else image
            samples.append(VQASample(
                question_id=row.get('question_id', len(samples)), question=row['question'],
                answer=row.get('multiple_choice_answer') or max(set(answers), key=answers.count),
                answers=answers, image=image, question_type=row.get('question_type', ''),
                answer_type=row.get('answer_type', ''), extra={'source': f'{path} row {index}'}))
    return samples


def load_vqav2(root: Union[str, Path], split: str = 'train', fraction: float = 1.0, seed: int = 0) -> List[VQASample]:
    """VQAv2 samples of `split` (train / val / …) from `root`, in either layout (module docstring)."""
    root = Path(root)
    if (root / f'v2_mscoco_{split}2014_annotations.json').is_file():
        samples = _official(root, split)
    else:
        files = sorted(p for p in root.rglob('*.parquet') if split in p.relative_to(root).as_posix())
        if not files:
            raise FileNotFoundError(
                f'{root}: neither v2_mscoco_{split}2014_annotations.json (official layout) nor *.parquet files '
                f'with "{split}" in their path (Hugging Face layout); point --data-root at a VQAv2 copy')
        samples = _parquet(files)
    return _subset(samples, fraction, seed)


class VLMCollator:
    """VQA samples → a `VisionLanguageModel` batch: pixel_values, input_ids, attention_mask,
    prefix_mask, labels (answer + EOS scored, -100 elsewhere), question_id."""

    def __init__(self, tokenizer, image_transform: Callable, max_length: int = 64, train: bool = True):
        if tokenizer.bos_token_id is None or tokenizer.eos_token_id is None or tokenizer.pad_token_id is None:
            raise ValueError('tokenizer: needs bos, eos and pad tokens (PaliGemma/Gemma tokenizers have them)')
        self.tokenizer, self.transform = tokenizer, image_transform
        self.max_length, self.train = max_length, train

    def __call__(self, samples: Sequence[VQASample]) -> Dict[str, torch.Tensor]:
        tok, why = self.tokenizer, {}
        kept, images, skipped = load_images(samples, why)
        samples = [samples[i] for i in kept]
        placeholder = skipped and not samples
        if placeholder:
            samples, images = _placeholder()
        rows, prefixes = [], []
        for s in samples:
            prompt = [tok.bos_token_id] + tok(PROMPT.format(question=s.question), add_special_tokens=False)['input_ids']
            answer = tok(s.answer, add_special_tokens=False)['input_ids'] + [tok.eos_token_id] if self.train else []
            ids = (prompt + answer)[:self.max_length]
            rows.append(ids)
            prefixes.append(min(len(prompt), len(ids)))
        T = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), T), tok.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros(len(rows), T, dtype=torch.long)
        prefix_mask = torch.zeros(len(rows), T, dtype=torch.long)
        labels = torch.full((len(rows), T), -100, dtype=torch.long)
        for i, (ids, n) in enumerate(zip(rows, prefixes)):
            input_ids[i, :len(ids)] = torch.tensor(ids)
            attention_mask[i, :len(ids)] = 1
            prefix_mask[i, :n] = 1
            if not placeholder:
                labels[i, n:len(ids)] = input_ids[i, n:len(ids)]
        batch = {'pixel_values': torch.stack([self.transform(im) for im in images]),
                 'input_ids': input_ids, 'attention_mask': attention_mask, 'prefix_mask': prefix_mask}
        if self.train:
            batch['labels'] = labels
        if skipped:
            batch['skipped_images'] = _skipped_record(skipped, kept, placeholder, why)
        return batch


class PaliGemmaCollator:
    """VQA samples → a PaliGemma batch through its processor (`suffix=` marks the scored answer)."""

    def __init__(self, processor, train: bool = True):
        self.processor, self.train = processor, train

    def __call__(self, samples: Sequence[VQASample]) -> Dict[str, torch.Tensor]:
        image, why = getattr(self.processor, 'image_token', '<image>'), {}  # PaliGemma's prompts start with it
        kept, images, skipped = load_images(samples, why)
        samples = [samples[i] for i in kept]
        placeholder = skipped and not samples
        if placeholder:
            samples, images = _placeholder()
        prompts = [image + PROMPT.format(question=s.question) for s in samples]
        kwargs = {'suffix': [s.answer for s in samples]} if self.train else {}
        batch = dict(self.processor(text=prompts, images=images, return_tensors='pt', padding='longest', **kwargs))
        if placeholder:
            batch['labels'] = torch.full_like(batch['input_ids'], -100)
        if skipped:
            batch['skipped_images'] = _skipped_record(skipped, kept, placeholder, why)
        return batch
