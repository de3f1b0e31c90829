"""LLaVA-style conversation data from a local copy, its prompt formats, and the batches a VLM trains on.

The data is LLaVA's JSON (its 558K captions, its 665K instruction mix, TinyLLaVA's sets): a list of

    {"id": …, "image": "coco/train2017/000000033471.jpg" (optional: a text-only sample has none),
     "conversations": [{"from": "human", "value": "<image>\\nWhat is …?"}, {"from": "gpt", "value": "…"}, …]}

with image paths relative to an image folder. `load_conversations(json_path, image_folder)` reads it and
checks every record once, before any model is built; a missing JSON file or image folder raises
FileNotFoundError naming the path. A record that cannot train is left out and counted under its
reason (`Problems`): its image file missing, `<image>` missing from an image sample or repeated, `<image>`
in a text-only sample, turns not alternating human → gpt, no gpt turn, or not a conversation at all. A
conversation that ends on a human turn loses that turn (counted as a truncation, the sample kept). As
LLaVA's preprocessing does, the `<image>` placeholder moves to the start of the first human turn
(`<image>\\n` + the rest of it).

Prompt formats (`FORMATS`, the recipe's choice):

    plain           LLaVA's pre-training (`conv_llava_plain`): the image, then the first answer and a
                    newline, scored; the human text is dropped (it only holds the image)
    vicuna_v1       LLaVA-1.5's conversation template (`conv_vicuna_v1`): its system line, then
                    "USER: … ASSISTANT: …</s>" per round; BOS first when the tokenizer has one
    chat_template   the language model's own `tokenizer.apply_chat_template` (Qwen2.5's ChatML for
                    TinyLLaVA-style runs); each assistant turn is what the template adds after its
                    generation prompt (content and end-of-turn tokens)

Only the assistant's tokens are scored: each format renders a conversation as pieces, (text, scored); the
whole text is tokenized as LLaVA tokenizes it, and each piece's tokens are found by tokenizing the text
before it (`encode`): with Vicuna's SentencePiece tokenizer, legacy or not, the ids equal LLaVA-1.5's
`tokenizer_image_token` of the whole prompt and the scored tokens are each answer's and its `</s>` (for a
legacy tokenizer, LLaVA's `preprocess_v1` label mask). Finding the pieces costs a tokenization of the text
before each change between scored and unscored text. `<image>` becomes the position where the model splices the image tokens (`image_at`,
`VisionLanguageModel`); a text-only sample has none (-1) and its row carries a blank image that the
model leaves out. A sample longer than `max_length` text tokens is cut to it (counted); one whose cut
leaves nothing scored is left out of the batch (counted). An image that does not decode drops its
sample as `diffzoo.vlm.data` does; the batch then carries `skipped_images` for the trainer.
"""
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from PIL import Image

from .data import UNREADABLE, _skipped_record
from .options import CONVERSATION_FORMATS as FORMATS
from .options import IMAGE_ASPECTS as ASPECTS

IMAGE = '<image>'
HUMAN, GPT = 'human', 'gpt'
VICUNA_V1_SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. "
                    "The assistant gives helpful, detailed, and polite answers to the user's questions.")


@dataclass(frozen=True)
class Conversation:
    id: str
    turns: Tuple[Tuple[str, str], ...]  # (HUMAN or GPT, text), alternating, starting with HUMAN, ending with GPT
    image: Optional[str] = None  # the image file's path; None for a text-only sample

    @property
    def source(self) -> str:
        return self.image if self.image is not None else f'conversation {self.id}'

    def load_image(self) -> Image.Image:
        with Image.open(self.image) as im:
            return im.convert('RGB')


@dataclass
class Problems:
    """Records left out (reason → count) and conversations cut short, with the first few ids of each."""
    left_out: Counter = field(default_factory=Counter)
    truncated: Counter = field(default_factory=Counter)
    examples: Dict[str, List[str]] = field(default_factory=dict)

    def add(self, kind: str, reason: str, record_id: str) -> None:
        getattr(self, kind)[reason] += 1
        ids = self.examples.setdefault(reason, [])
        if len(ids) < 3:
            ids.append(str(record_id))

    def summary(self) -> str:
        parts = [f'{n} left out: {r} (e.g. {", ".join(self.examples[r])})' for r, n in sorted(self.left_out.items())]
        parts += [f'{n} cut short: {r} (e.g. {", ".join(self.examples[r])})' for r, n in sorted(self.truncated.items())]
        return '; '.join(parts) or 'every record kept whole'

    def record(self) -> Dict:
        return {'left_out': dict(self.left_out), 'truncated': dict(self.truncated), 'examples': self.examples}


def _turns(record: Dict, has_image: bool, problems: Problems, record_id: str) -> Optional[Tuple[Tuple[str, str], ...]]:
    """The record's turns as (role, text) with `<image>` leading the first human turn; None (counted) when
    the record cannot train."""
    turns = record.get('conversations')
    if not isinstance(turns, list) or not all(isinstance(t, dict) and isinstance(t.get('value'), str)
                                              and t.get('from') in (HUMAN, GPT) for t in turns):
        problems.add('left_out', 'not a conversation (a list of {from: human|gpt, value})', record_id)
        return None
    roles = [t['from'] for t in turns]
    if any(role != (HUMAN, GPT)[i % 2] for i, role in enumerate(roles)):
        problems.add('left_out', 'turns not alternating human, gpt', record_id)
        return None
    if roles and roles[-1] == HUMAN:
        problems.add('truncated', 'ended on a human turn (that turn dropped)', record_id)
        turns = turns[:-1]
    if not turns:
        problems.add('left_out', 'no gpt turn', record_id)
        return None
    placeholders = sum(t['value'].count(IMAGE) for t in turns)
    if has_image and placeholders == 0:
        problems.add('left_out', f'{IMAGE} missing from an image sample', record_id)
        return None
    if has_image and placeholders > 1:
        problems.add('left_out', f'{IMAGE} repeated', record_id)
        return None
    if not has_image and placeholders:
        problems.add('left_out', f'{IMAGE} in a sample without an image', record_id)
        return None
    out = [(t['from'], t['value']) for t in turns]
    if has_image:  # LLaVA's preprocess_multimodal: the placeholder leads the first human turn
        found = next(i for i, (_, text) in enumerate(out) if IMAGE in text)
        role, text = out[found]
        out[found] = (role, text.replace(IMAGE, '').strip())
        out[0] = (HUMAN, f'{IMAGE}\n{out[0][1]}')
    return tuple(out)


def load_conversations(json_path: Union[str, Path], image_folder: Union[str, Path, None] = None
                       ) -> Tuple[List[Conversation], Problems]:
    """The trainable conversations of a LLaVA-format JSON file, and what was left out or cut (module docstring)."""
    json_path = Path(json_path)
    if not json_path.is_file():
        raise FileNotFoundError(f'{json_path}: no such file; point data.json at a LLaVA-format JSON '
                                f'(a list of {{id, image?, conversations}})')
    records = json.loads(json_path.read_text())
    if not isinstance(records, list):
        raise ValueError(f'{json_path}: a {type(records).__name__}, expected a list of {{id, image?, conversations}}')
    folder = None if image_folder is None else Path(image_folder)
    if folder is not None and not folder.is_dir():
        raise FileNotFoundError(f'{folder}: no such folder; point data.image_folder at the images the JSON names')
    problems, kept = Problems(), []
    for n, record in enumerate(records):
        record_id = str(record.get('id', f'#{n}')) if isinstance(record, dict) else f'#{n}'
        if not isinstance(record, dict):
            problems.add('left_out', 'not a conversation (a list of {from: human|gpt, value})', record_id)
            continue
        image = record.get('image')
        if image is not None:
            if folder is None:
                raise ValueError(f'{json_path}: record {record_id} names image {image!r} but no image folder was '
                                 f'given; set data.image_folder')
            path = folder / image
            if not path.is_file():
                problems.add('left_out', 'image file missing', record_id)
                continue
            image = str(path)
        turns = _turns(record, image is not None, problems, record_id)
        if turns is not None:
            kept.append(Conversation(record_id, turns, image))
    return kept, problems


def plain_pieces(turns: Sequence[Tuple[str, str]], tokenizer=None) -> List[Tuple[str, bool]]:
    """LLaVA's `conv_llava_plain` (its `preprocess_plain`): '<image>' then the first answer and '\\n', scored."""
    return [(IMAGE if IMAGE in turns[0][1] else '', False), (turns[1][1] + '\n', True)]


def vicuna_v1_pieces(turns: Sequence[Tuple[str, str]], tokenizer=None) -> List[Tuple[str, bool]]:
    """LLaVA-1.5's `conv_vicuna_v1` (sep ' ', sep2 '</s>'): 'SYSTEM USER: q ASSISTANT: a</s>USER: …', the
    answers and their '</s>' scored."""
    eos = getattr(tokenizer, 'eos_token', None) or '</s>'
    pieces = [(VICUNA_V1_SYSTEM + ' ', False)]
    for i in range(0, len(turns), 2):
        pieces.append((f'USER: {turns[i][1]} ASSISTANT:', False))
        pieces.append((f' {turns[i + 1][1]}{eos}', True))
    return pieces


def chat_template_pieces(turns: Sequence[Tuple[str, str]], tokenizer) -> List[Tuple[str, bool]]:
    """The tokenizer's chat template: each assistant turn is what the template renders after the
    generation prompt of the turns before it; everything else is context."""
    if not getattr(tokenizer, 'chat_template', None):
        raise ValueError(f'{type(tokenizer).__name__} has no chat template; choose data.format vicuna_v1 or a '
                         f'tokenizer with one (Qwen2.5-Instruct has)')
    messages = [{'role': 'user' if role == HUMAN else 'assistant', 'content': text} for role, text in turns]
    pieces, done = [], ''
    for i, message in enumerate(messages):
        if message['role'] != 'assistant':
            continue
        before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        upto = tokenizer.apply_chat_template(messages[:i + 1], tokenize=False)
        if not before.startswith(done) or not upto.startswith(before):
            raise ValueError('the chat template renders a conversation differently from its first turns '
                             '(a later turn changes the text before it), so the assistant tokens cannot be told '
                             'apart; use data.format vicuna_v1')
        pieces += [(before[len(done):], False), (upto[len(before):], True)]
        done = upto
    return pieces


PIECES: Dict[str, Callable] = {'plain': plain_pieces, 'vicuna_v1': vicuna_v1_pieces,
                               'chat_template': chat_template_pieces}


def encode(turns: Sequence[Tuple[str, str]], tokenizer, prompt_format: str) -> Tuple[List[int], List[bool], int]:
    """(token ids, scored flag per token, image_at): image_at is the index the image tokens go before (the
    `<image>` placeholder's place), -1 without one. BOS leads plain and vicuna_v1 when the tokenizer has one
    (LLaVA's Llama tokenizer adds it); a chat template writes its own.

    The ids are the whole conversation's text tokenized as LLaVA's `tokenizer_image_token` does it (each side
    of `<image>` at once), so a model trains on the tokens it is prompted with: a SentencePiece tokenizer
    (Vicuna's, legacy or not) tokenizes a piece alone otherwise than in its context (a space at a piece's
    end, the prefix space after `</s>`). A piece's first token is the first one the tokenization of the text
    before it does not hold; a token that spans two pieces belongs to the later one."""
    if prompt_format not in PIECES:
        raise ValueError(f'prompt format {prompt_format!r}: expected one of {FORMATS}')
    ids, scored, image_at = [], [], -1
    if prompt_format != 'chat_template' and tokenizer.bos_token_id is not None:
        ids, scored = [tokenizer.bos_token_id], [False]
    pieces = PIECES[prompt_format](turns, tokenizer)
    text = ''.join(piece for piece, _ in pieces)
    starts, at = [], 0  # (where each piece starts in `text`, whether it is scored)
    for piece, is_scored in pieces:
        starts.append((at, is_scored))
        at += len(piece)
    begin = 0
    for j, chunk in enumerate(text.split(IMAGE)):
        if j:
            image_at = len(ids)
        end = begin + len(chunk)
        if chunk:
            chunk_ids = _tokens(tokenizer, chunk)
            flag = [f for p, f in starts if p <= begin][-1]
            done = 0
            for p, is_scored in starts:
                if begin < p < end and is_scored != flag:
                    before = _tokens(tokenizer, chunk[:p - begin])
                    held = next((i for i, (a, b) in enumerate(zip(chunk_ids, before)) if a != b),
                                min(len(chunk_ids), len(before)))
                    scored += [flag] * max(0, held - done)
                    done, flag = max(done, held), is_scored
            scored += [flag] * (len(chunk_ids) - done)
            ids += chunk_ids
        begin = end + len(IMAGE)
    return ids, scored, image_at


def _tokens(tokenizer, text: str) -> List[int]:
    return tokenizer(text, add_special_tokens=False)['input_ids']


def prompt(question: str, tokenizer, prompt_format: str, image: bool = True) -> Tuple[List[int], int]:
    """(token ids, image_at) of one question as the format asks it, up to where the answer starts (vicuna_v1:
    after 'ASSISTANT:'; a chat template: after its generation prompt): what a model trained on that format
    is given to answer."""
    turns = ((HUMAN, f'{IMAGE}\n{question}' if image else question), (GPT, ''))
    ids, scored, image_at = encode(turns, tokenizer, prompt_format)
    end = scored.index(True) if True in scored else len(ids)
    return ids[:end], image_at if image_at <= end else -1



def transform_mean(transform: Callable) -> Tuple[float, ...]:
    """The mean a torchvision transform normalises by (its Normalize step); CLIP's when it has none."""
    for step in getattr(transform, 'transforms', ()):
        if hasattr(step, 'mean') and hasattr(step, 'std'):
            return tuple(float(m) for m in step.mean)
    return (0.48145466, 0.4578275, 0.40821073)


def pad_colour(transform: Callable) -> Tuple[int, ...]:
    """The 0–255 colour `pad_to_square` fills with for images that `transform` normalises: its mean."""
    return tuple(int(m * 255) for m in transform_mean(transform))


def pad_to_square(image: Image.Image, colour: Tuple[int, ...]) -> Image.Image:
    """LLaVA-1.5's `expand2square`: the image centred on a square of `colour` (the normaliser's mean), so the
    tower's resize and centre crop keep all of it."""
    width, height = image.size
    if width == height:
        return image
    side = max(width, height)
    square = Image.new(image.mode, (side, side), colour)
    square.paste(image, ((side - width) // 2, (side - height) // 2))
    return square


class ConversationCollator:
    """Conversations → a `VisionLanguageModel` batch: pixel_values, input_ids, attention_mask, image_at
    (B,), labels (the assistant's tokens; -100 elsewhere), right padding. `skipped_images` as
    `diffzoo.vlm.data`; `cut_short` / `left_out_long` list the ids cut to `max_length` and those left out
    because the cut left nothing scored. `image_aspect`: 'pad' (LLaVA-1.5's and TinyLLaVA's
    image_aspect_ratio: padded to a square of the mean colour first) or 'crop' (the transform alone)."""

    def __init__(self, tokenizer, image_transform: Callable, prompt_format: str, max_length: int = 2048,
                 image_size: Tuple[int, int] = (224, 224), image_aspect: str = 'pad'):
        if prompt_format not in FORMATS:
            raise ValueError(f'prompt format {prompt_format!r}: expected one of {FORMATS}')
        if image_aspect not in ASPECTS:
            raise ValueError(f'image_aspect {image_aspect!r}: expected one of {ASPECTS}')
        if tokenizer.pad_token_id is None:
            raise ValueError('tokenizer: needs a pad token (set tokenizer.pad_token, e.g. to its eos or unk token)')
        self.tokenizer, self.transform, self.format = tokenizer, image_transform, prompt_format
        self.max_length, self.image_size = max_length, tuple(image_size)
        self.pad_colour = pad_colour(image_transform) if image_aspect == 'pad' else None

    def __call__(self, samples: Sequence[Conversation]) -> Dict:
        rows, images, kept, skipped, cut, long = [], [], [], [], [], []
        for i, sample in enumerate(samples):
            image = None
            if sample.image is not None:
                try:
                    image = sample.load_image()
                except UNREADABLE:
                    skipped.append(sample.source)
                    continue
                if self.pad_colour is not None:
                    image = pad_to_square(image, self.pad_colour)
            ids, scored, image_at = encode(sample.turns, self.tokenizer, self.format)
            if len(ids) > self.max_length:
                cut.append(sample.id)
                ids, scored = ids[:self.max_length], scored[:self.max_length]
                image_at = image_at if image_at <= len(ids) else -1
                if not any(scored):
                    long.append(sample.id)
                    continue
            rows.append((ids, scored, image_at))
            images.append(image)
            kept.append(i)
        placeholder = not rows
        if placeholder:  # nothing to train on: one row that scores nothing, so every process takes its step
            rows, images = [([self.tokenizer.pad_token_id], [False], -1)], [None]
        T = max(len(ids) for ids, _, _ in rows)
        input_ids = torch.full((len(rows), T), self.tokenizer.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros(len(rows), T, dtype=torch.long)
        labels = torch.full((len(rows), T), -100, dtype=torch.long)
        for r, (ids, scored, _) in enumerate(rows):
            input_ids[r, :len(ids)] = torch.tensor(ids)
            attention_mask[r, :len(ids)] = 1
            labels[r, :len(ids)] = torch.where(torch.tensor(scored), torch.tensor(ids), -100)
        blank = Image.new('RGB', self.image_size)
        batch = {'pixel_values': torch.stack([self.transform(im if im is not None else blank) for im in images]),
                 'input_ids': input_ids, 'attention_mask': attention_mask, 'labels': labels,
                 'image_at': torch.tensor([at for _, _, at in rows], dtype=torch.long)}
        if skipped:
            batch['skipped_images'] = _skipped_record(skipped, kept, placeholder)
        if cut:
            batch['cut_short'], batch['left_out_long'] = cut, long
        return batch
