"""LLaVA-style conversation data from a local copy, its prompt formats, and the batches a VLM trains on.

The data is LLaVA's JSON (its 558K captions, its 665K instruction mix, TinyLLaVA's sets): a list of

    {"id": …, "image": "coco/train2017/000000033471.jpg" (optional: a text-only sample has none),
     "conversations": [{"from": "human", "value": "<image>\\nWhat is …?"}, {"from": "gpt", "value": "…"}, …]}

with image paths relative to an image folder. `load_conversations(json_path, image_folder)` reads it and
checks every record once, before any model is built; a missing JSON file or image folder raises
FileNotFoundError naming the path, and a file that is not a JSON list (empty, not UTF-8, cut short) ValueError
naming it, what is wrong and where. A record that cannot train is left out and counted under its reason
(`Problems`): an `id` that is not a string or a whole number (a missing or null one becomes `#<position>`); an
`image` that is not a string, that leaves the image folder (an absolute path or a `..` component, the rule
`diffzoo.data.shards.hostile_name` applies to shards; symlinks inside the folder are followed), that the system
refuses as a path (e.g. a name over 255 bytes), whose file is missing, or that is not a file (a directory, a symlink
loop or to nothing: `diffzoo.vlm.images.path_problem` says which); `<image>` missing from an image sample
or repeated, `<image>` in a text-only sample, turns not alternating human → gpt, no gpt turn, or not a
conversation at all. As LLaVA's `preprocess_v1` and TinyLLaVA's templates do, a first turn that is not the
human's is dropped (counted as a truncation). A conversation that ends on a human turn is kept whole for vicuna_v1
(`prompt_format`), as LLaVA's `preprocess_v1` takes it: its rounds do not add up, so it is masked whole, counted as
a tokenization mismatch; for the other formats it loses that turn (counted as a truncation, the sample kept:
TinyLLaVA's template stops the run on it, LLaVA's `preprocess_plain` reads the first two turns). As LLaVA's
`preprocess_multimodal` does, `<image>` moves to the start of the
turn that holds it (`<image>\n` + the rest of that turn, stripped: a turn that is only `<image>` stays `<image>`).

How a conversation becomes tokens and labels (the formats: plain, vicuna_v1, qwen2_instruct, chat_template)
is `diffzoo.vlm.templates`. `<image>` becomes the position where the model splices the image tokens
(`image_at`, `VisionLanguageModel`); a text-only sample has none (-1) and its row carries a blank image that
the model leaves out. A sample longer than `max_length` tokens is cut to it as LLaVA's and TinyLLaVA's
collators cut it, the image placeholder counted as one token, and again once the image is spliced in as the model's
positions, with the tokens equal to the pad id dropped first (`ConversationCollator.fit`: what LLaVA's and
TinyLLaVA's models do before their forward pass) (counted); one whose cut leaves nothing scored is
left out of the batch (counted), and so is one whose rounds the format's reference could not count
(`mismatched`, counted; `mismatch='score'` trains on it). An image that does not decode drops its sample as
`diffzoo.vlm.data` does; the batch then carries `skipped_images` for the trainer.
"""
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from PIL import Image

from diffzoo.data.shards import hostile_name
from .data import UNREADABLE, _skipped_record, read_json, unreadable_why
from .images import open_rgb, path_problem
from .options import CONVERSATION_FORMATS as FORMATS
from .options import IMAGE_ASPECTS as ASPECTS
from .options import MISMATCH_RULES
from .templates import GPT, HUMAN, IMAGE, VICUNA_V1_SYSTEM, encode, prompt  # noqa: F401 (the format's API, re-exported)


@dataclass(frozen=True)
class Conversation:
    id: str
    turns: Tuple[Tuple[str, str], ...]  # (HUMAN or GPT, text), alternating, from HUMAN; vicuna_v1's may end on HUMAN
    image: Optional[str] = None  # the image file's path; None for a text-only sample

    @property
    def source(self) -> str:
        return self.image if self.image is not None else f'conversation {self.id}'

    def load_image(self) -> Image.Image:
        return open_rgb(self.image)


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


def _turns(record: Dict, has_image: bool, problems: Problems, record_id: str, keep_last_question: bool
           ) -> Optional[Tuple[Tuple[str, str], ...]]:
    """The record's turns as (role, text) with `<image>` leading the turn that holds it; None (counted) when
    the record cannot train. A last human turn is kept with `keep_last_question`, else dropped (counted)."""
    turns = record.get('conversations')
    if not isinstance(turns, list) or not all(isinstance(t, dict) and isinstance(t.get('value'), str)
                                              and t.get('from') in (HUMAN, GPT) for t in turns):
        problems.add('left_out', 'not a conversation (a list of {from: human|gpt, value})', record_id)
        return None
    if turns and turns[0].get('from') != HUMAN:  # LLaVA and TinyLLaVA skip a first turn not from the human
        problems.add('truncated', 'started on a gpt turn (that turn dropped)', record_id)
        turns = turns[1:]
    roles = [t['from'] for t in turns]
    if any(role != (HUMAN, GPT)[i % 2] for i, role in enumerate(roles)):
        problems.add('left_out', 'turns not alternating human, gpt', record_id)
        return None
    if GPT not in roles:
        problems.add('left_out', 'no gpt turn', record_id)
        return None
    if roles[-1] == HUMAN and not keep_last_question:
        problems.add('truncated', 'ended on a human turn (that turn dropped)', record_id)
        turns = turns[:-1]
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
    if has_image:  # LLaVA's preprocess_multimodal: the placeholder leads the turn that holds it
        found = next(i for i, (_, text) in enumerate(out) if IMAGE in text)
        role, text = out[found]
        out[found] = (role, f'{IMAGE}\n{text.replace(IMAGE, "").strip()}'.strip())
    return tuple(out)


def _image_file(image, folder: Path) -> Tuple[Optional[str], Optional[str]]:
    """(the path of a record's image file, None) or (None, why the record cannot use it)."""
    if not isinstance(image, str):
        return None, 'image not a string (a path relative to the image folder)'
    could_leave = '..' in image or image.startswith(('/', '\\')) or image[1:2] == ':'  # where hostile_name may object
    outside = could_leave and hostile_name(image)
    if outside:
        return None, f'image path outside the image folder ({outside})'
    path = folder / image
    problem = path_problem(path)  # missing, a directory, a symlink loop, a name the system refuses
    return (None, problem) if problem else (str(path), None)


KEEPS_LAST_QUESTION = ('vicuna_v1',)  # formats whose reference takes a conversation ending on a human turn whole


def load_conversations(json_path: Union[str, Path], image_folder: Union[str, Path, None] = None,
                       prompt_format: Optional[str] = None) -> Tuple[List[Conversation], Problems]:
    """The trainable conversations of a LLaVA-format JSON file, and what was left out or cut (module docstring);
    `prompt_format` the format they train in (a last human turn is kept for vicuna_v1)."""
    json_path = Path(json_path)
    if not json_path.is_file():
        raise FileNotFoundError(f'{json_path}: no such file; point data.json at a LLaVA-format JSON '
                                f'(a list of {{id, image?, conversations}})')
    records = read_json(json_path, 'data.json must be a LLaVA-format JSON (a list of {id, image?, conversations}) '
                                   'in UTF-8; if it was cut short, download or write it again')
    if not isinstance(records, list):
        raise ValueError(f'{json_path}: a {type(records).__name__}, expected a list of {{id, image?, conversations}}')
    folder = None if image_folder is None else Path(image_folder)
    if folder is not None and not folder.is_dir():
        raise FileNotFoundError(f'{folder}: no such folder; point data.image_folder at the images the JSON names')
    problems, kept = Problems(), []
    for n, record in enumerate(records):
        if not isinstance(record, dict):
            problems.add('left_out', 'not a conversation (a list of {from: human|gpt, value})', f'#{n}')
            continue
        record_id = record.get('id')
        if isinstance(record_id, bool) or not isinstance(record_id, (str, int, type(None))):
            problems.add('left_out', 'id not a string or a whole number', f'#{n}')
            continue
        record_id = f'#{n}' if record_id is None else str(record_id)
        image = record.get('image')
        if image is not None:
            if folder is None and isinstance(image, str):
                raise ValueError(f'{json_path}: record {record_id} names image {image!r} but no image folder was '
                                 f'given; set data.image_folder')
            image, unusable = _image_file(image, folder)
            if unusable:
                problems.add('left_out', unusable, record_id)
                continue
        turns = _turns(record, image is not None, problems, record_id, prompt_format in KEEPS_LAST_QUESTION)
        if turns is not None:
            kept.append(Conversation(record_id, turns, image))
    return kept, problems


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


CONVERSATION_ID_LISTS = ('cut_short', 'left_out_long', 'mismatched')  # a batch's lists of conversation ids (below)


class ConversationCollator:
    """Conversations → a `VisionLanguageModel` batch: pixel_values, input_ids, attention_mask, image_at
    (B,), labels (the assistant's tokens; -100 elsewhere), right padding. `skipped_images` as
    `diffzoo.vlm.data`; `cut_short` / `left_out_long` list the ids cut to `max_length` and those left out
    because the cut left nothing scored, `mismatched` those whose rounds the format's reference could not count
    (left out under `mismatch='mask'`, trained on under 'score'). `image_aspect`: 'pad' (LLaVA-1.5's
    image_aspect_ratio: padded to a square of the mean colour first) or 'crop' (the transform alone: TinyLLaVA's
    Qwen2 scripts' 'square'). `image_positions`: the sequence positions the model splices an image into
    (`VisionLanguageModel.image_positions`), which `max_length` counts as the references' models do (`fit`)."""

    def __init__(self, tokenizer, image_transform: Callable, prompt_format: str, max_length: int = 2048,
                 image_size: Tuple[int, int] = (224, 224), image_aspect: str = 'pad', mismatch: str = 'mask',
                 image_positions: int = 1):
        if prompt_format not in FORMATS:
            raise ValueError(f'prompt format {prompt_format!r}: expected one of {FORMATS}')
        if image_aspect not in ASPECTS:
            raise ValueError(f'image_aspect {image_aspect!r}: expected one of {ASPECTS}')
        if mismatch not in MISMATCH_RULES:
            raise ValueError(f'mismatch {mismatch!r}: expected one of {MISMATCH_RULES}')
        if tokenizer.pad_token_id is None:
            raise ValueError('tokenizer: needs a pad token (set tokenizer.pad_token, e.g. to its eos or unk token)')
        self.tokenizer, self.transform, self.format = tokenizer, image_transform, prompt_format
        self.max_length, self.image_size, self.mismatch = max_length, tuple(image_size), mismatch
        self.pad_colour = pad_colour(image_transform) if image_aspect == 'pad' else None
        self.image_positions = image_positions

    def fit(self, ids: List[int], scored: List[bool], image_at: int) -> Tuple[List[int], List[bool], int, bool]:
        """(ids, scored, image_at, whether cut) as LLaVA's and TinyLLaVA's collators and models leave a row: cut to
        `max_length` with the image one token (their collators); the tokens equal to the pad id dropped, which their
        collators leave unattended (`attention_mask = ids != pad`, the EOS kept where the pad is the EOS: TinyLLaVA's)
        and `prepare_inputs_labels_for_multimodal` removes; then the image spliced in as `image_positions` tokens and
        the whole cut to `max_length` again (`tokenizer_model_max_length`). Where that cut reaches into the image,
        they keep part of it and nothing after: the row keeps the text before it, without the image, which scores
        the same tokens from the same context."""
        cut = len(ids) + (image_at >= 0) > self.max_length
        if cut:
            keep = self.max_length - 1 if 0 <= image_at < self.max_length else self.max_length
            ids, scored = ids[:keep], scored[:keep]
            image_at = image_at if image_at < self.max_length else -1
        pad = self.tokenizer.pad_token_id
        if pad != self.tokenizer.eos_token_id and pad in ids:
            attended = [j for j, token in enumerate(ids) if token != pad]
            image_at = sum(j < image_at for j in attended) if image_at >= 0 else -1
            ids, scored = [ids[j] for j in attended], [scored[j] for j in attended]
        if image_at >= 0 and len(ids) + self.image_positions > self.max_length:
            cut = True
            if image_at + self.image_positions <= self.max_length:
                keep = self.max_length - self.image_positions
                ids, scored = ids[:keep], scored[:keep]
            else:
                ids, scored, image_at = ids[:image_at], scored[:image_at], -1
        return ids, scored, image_at, cut

    def __call__(self, samples: Sequence[Conversation]) -> Dict:
        rows, images, kept, skipped, cut, long, mismatched, why = [], [], [], [], [], [], [], {}
        for i, sample in enumerate(samples):
            ids, scored, image_at, mismatch = encode(sample.turns, self.tokenizer, self.format, self.max_length,
                                                     self.mismatch)
            if mismatch:
                mismatched.append(sample.id)
                if self.mismatch == 'mask':
                    continue
            ids, scored, image_at, was_cut = self.fit(ids, scored, image_at)
            if was_cut:
                cut.append(sample.id)
                if not any(scored):
                    long.append(sample.id)
                    continue
            image = None
            if sample.image is not None:
                try:
                    image = sample.load_image()
                except UNREADABLE as exc:
                    skipped.append(sample.source)
                    why[sample.source] = unreadable_why(exc)
                    continue
                if self.pad_colour is not None:
                    image = pad_to_square(image, self.pad_colour)
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
            batch['skipped_images'] = _skipped_record(skipped, kept, placeholder, why)
        if cut:
            batch['cut_short'], batch['left_out_long'] = cut, long
        if mismatched:
            batch['mismatched'] = mismatched
        return batch
