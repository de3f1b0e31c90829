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
"""
import io
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Sequence, Union

import torch

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

    def load_image(self):
        from PIL import Image
        source = io.BytesIO(self.image) if isinstance(self.image, bytes) else self.image
        with Image.open(source) as im:
            return im.convert('RGB')


def _subset(samples: List[VQASample], fraction: float, seed: int) -> List[VQASample]:
    if not 0 < fraction <= 1:
        raise ValueError(f'fraction={fraction}: expected a number in (0, 1]')
    if fraction == 1:
        return samples
    keep = sorted(random.Random(seed).sample(range(len(samples)), max(1, round(fraction * len(samples)))))
    return [samples[i] for i in keep]


def _official(root: Path, split: str) -> List[VQASample]:
    questions_file = root / f'v2_OpenEnded_mscoco_{split}2014_questions.json'
    annotations_file = root / f'v2_mscoco_{split}2014_annotations.json'
    with open(questions_file) as f:
        questions = {q['question_id']: q for q in json.load(f)['questions']}
    with open(annotations_file) as f:
        annotations = json.load(f)['annotations']
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
        for row in table:
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
                answer_type=row.get('answer_type', '')))
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
        tok = self.tokenizer
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
            labels[i, n:len(ids)] = input_ids[i, n:len(ids)]
        batch = {'pixel_values': torch.stack([self.transform(s.load_image()) for s in samples]),
                 'input_ids': input_ids, 'attention_mask': attention_mask, 'prefix_mask': prefix_mask}
        if self.train:
            batch['labels'] = labels
        return batch


class PaliGemmaCollator:
    """VQA samples → a PaliGemma batch through its processor (`suffix=` marks the scored answer)."""

    def __init__(self, processor, train: bool = True):
        self.processor, self.train = processor, train

    def __call__(self, samples: Sequence[VQASample]) -> Dict[str, torch.Tensor]:
        image = getattr(self.processor, 'image_token', '<image>')  # PaliGemma's prompts start with the image tokens
        prompts = [image + PROMPT.format(question=s.question) for s in samples]
        kwargs = {'suffix': [s.answer for s in samples]} if self.train else {}
        return dict(self.processor(text=prompts, images=[s.load_image() for s in samples], return_tensors='pt',
                                   padding='longest', **kwargs))
