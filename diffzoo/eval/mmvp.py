"""MMVP-VLM (Tong et al., 2024, "Eyes Wide Shut?"): CLIP-blind image pairs, scored as the official script.

The benchmark's folder, as published (huggingface.co/datasets/MMVP/MMVP_VLM):

    Questions.csv                     header, then rows: question id, type, statement
    MLLM_VLM Images/<type>/<id>.jpg    one image per row

Rows come in pairs (ids 2n-1, 2n) of one type: two images that look alike to CLIP and two
statements, each true of the image with its own id. There are 9 types (visual patterns) of 15
pairs each. Scoring follows `scripts/evaluate_vlm.py` of github.com/tsb0601/MMVP: each statement,
prompted as "a photo of <statement>", picks the image of the pair it is more similar to (softmax
over the two images > 0.5 for the first, so a tie picks the second); a pair is correct only if
both statements pick their own image. The score of a type is the percentage of its pairs that are
correct, and `average` is the mean over types (what DiffCLIP's Figure 4 reports).
"""
import csv
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Tuple

import torch

from .models import EvalError

QUESTIONS = 'Questions.csv'
IMAGES = 'MLLM_VLM Images'
PROMPT = 'a photo of {}'
HOW = 'the MMVP-VLM folder from huggingface.co/datasets/MMVP/MMVP_VLM (Questions.csv and "MLLM_VLM Images/")'


@dataclass(frozen=True)
class Pair:
    pattern: str
    statements: Tuple[str, str]
    images: Tuple[Path, Path]  # images[k] is the one statement k is true of


def read_pairs(root) -> List[Pair]:
    """The pairs of an MMVP-VLM folder, in file order; errors name the missing file."""
    root = Path(root)
    questions = root / QUESTIONS
    if not questions.is_file():
        raise EvalError(f'--dataset mmvp: no {questions}; pass --dataset-root pointing to {HOW}')
    with open(questions, newline='') as f:
        rows = [r for r in csv.reader(f)][1:]  # skip the header
    rows = [r for r in rows if any(cell.strip() for cell in r)]
    if len(rows) % 2:
        raise EvalError(f'{questions}: {len(rows)} questions, an odd number; rows must come in pairs')
    pairs = []
    for first, second in zip(rows[::2], rows[1::2]):
        if len(first) < 3 or len(second) < 3:
            raise EvalError(f'{questions}: row {first!r} or {second!r} is not "id,type,statement"')
        (id1, pattern, statement1), (id2, _, statement2) = first[:3], second[:3]
        images = tuple(root / IMAGES / pattern / f'{int(i)}.jpg' for i in (id1, id2))
        for image in images:
            if not image.is_file():
                raise EvalError(f'--dataset mmvp: no image {image} for question {image.stem}; {HOW}')
        pairs.append(Pair(pattern, (statement1, statement2), images))
    return pairs


def pair_correct(similarity: torch.Tensor) -> bool:
    """`similarity` (2 statements, 2 images); statement k must pick image k, a tie picks image 1 (the second)."""
    picks = [0 if row[0] > row[1] else 1 for row in similarity.tolist()]
    return picks == [0, 1]


def score(patterns: List[str], correct: List[bool]) -> Dict[str, float]:
    """Percent of correct pairs per pattern, in first-seen order, and their mean as `average`."""
    per_pattern: Dict[str, List[bool]] = {}
    for pattern, ok in zip(patterns, correct):
        per_pattern.setdefault(pattern, []).append(ok)
    scores = {p: 100.0 * sum(oks) / len(oks) for p, oks in per_pattern.items()}
    scores['average'] = sum(scores.values()) / len(per_pattern)
    return scores


@torch.no_grad()
def evaluate(loaded, root, device: str = 'cpu') -> Dict[str, float]:
    from PIL import Image
    pairs = read_pairs(root)
    correct = []
    for pair in pairs:
        images = torch.stack([loaded.preprocess(Image.open(p).convert('RGB')) for p in pair.images]).to(device)
        texts = loaded.tokenizer([PROMPT.format(s) for s in pair.statements]).to(device)
        similarity = loaded.model.encode_text(texts, normalize=True) @ loaded.model.encode_image(
            images, normalize=True).T  # (2 statements, 2 images)
        correct.append(pair_correct(similarity.float().cpu()))
    return score([p.pattern for p in pairs], correct)
