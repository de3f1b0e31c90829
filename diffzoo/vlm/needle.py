"""MMNeedle, the Multimodal Needle-in-a-Haystack benchmark (Wang et al., 2024), and the two-step
querying that Differential PaliGemma (Li et al., 2025) used for a short-context model.

A sample's *haystack* is M images, each an N×N stitch of sub-images resized to `size`×`size` px
(MMNeedle: M ∈ {1, 10}, N ∈ {1, 2, 4, 8}, 256 px; Differential PaliGemma: one 2×2 stitch of 224 px
COCO val2014 images). The *needle* is the caption of one sub-image. A positive sample holds it at
(index, row, column), all 1-based: index counts the M images, row and column the grid. A negative
sample's needle is the caption of an image that is in none of its stitches; its ground truth is -1
(stored as index = row = column = -1).

What follows github.com/Wang-ML-Lab/multimodal-needle-in-a-haystack (read, not copied):
- stitching (`sample_stitched_images.py`): sub-image k = row·N + column is resized to size×size and
  pasted at (column·size, row·size) on a black RGB canvas;
- samples (`sample_single_needle.py`): the first half of the samples are positives, the rest
  negatives; a positive's cell is uniform over the M·N² cells; a negative's needle comes from an
  image that is in none of its stitches;
- captions (`annotations_trainval/file_to_caption.py`): one caption per COCO image — of its five
  annotations the last in file order (a dict keyed by image id keeps the last);
- the prompt (`needle.py`, single needle): `MMNEEDLE_PROMPT`, kept word for word so that answers
  compare with the paper's, followed by a line "Caption: <needle>"; the images come first;
- scoring (`evaluate.py`): an answer other than "-1" claims the needle is there (existence); index
  accuracy compares the first field, exact accuracy the whole "index, row, column"; it prints index
  and exact accuracy for sets of positive samples, existence for both; exact accuracy per grid cell
  of the needle is its heatmap; answers that never came back (None) are left out.

Where diffzoo differs, on purpose:
- the M·N² sub-images of a sample are distinct, and no sub-image other than the needle's (positive)
  or no sub-image at all (negative) has the needle's caption (compared lower-case, without a final
  period); MMNeedle samples each stitch on its own and does not compare captions;
- sample i is drawn from its own generator seeded by (seed, i) over the file names in sorted order,
  so a set is the same on every machine (MMNeedle: one `random.seed(0)` over `os.listdir` order);
- `parse_answer` reads the integers of an answer in order, so "(2,1,2)" and "image 2, row 1,
  column 2." count; MMNeedle strips spaces, newlines and periods and compares with the string
  "2, 1, 2" (its first ", " field for the index). An index or exact match there is one here too;
  existence differs only for answers whose first number is -1 but that say more than "-1" (there:
  present, here: absent);
- stitches are written as PNG (lossless); MMNeedle writes JPEG. Cells of the heatmap with no
  positive sample are blank, not 0.

The two-step protocol (`two_step`), for models that see one image with a short context (PaliGemma-3B
at 224 px). The paper asked of a 2×2 stitch "top or bottom?", then "left or right?"; for M stitches
of N×N this asks each stitch on its own, k = 1..M, with the caption:
    row step:    which row holds the caption's sub-image, or none? N = 2: "top or bottom" (the
                 paper's question); N > 2: a row number, 1 = top … N = bottom; N = 1: "yes or no".
    column step: it is in that row (half) — which column? N = 2: "left or right"; N > 2: a column
                 number, 1 = left … N = right. Not asked for N = 1.
The first stitch whose row answer does not say "none" (or "no", "-1" …) is the predicted index, and
the row and column answers there the predicted row and column; later stitches are not asked. If
every stitch says none, the prediction is -1. As in MMNeedle, an answer that does not say the needle
is absent claims it is present: an unreadable row answer predicts this stitch with row and column
unknown (the index may be right, exact is not). So existence = "some stitch claimed it", index =
"the first stitch to claim it", at most M + 1 queries per sample.

    python -m diffzoo.vlm.needle build --source val2014 --captions annotations/captions_val2014.json \\
        --out needle/2x2 --m 1 --n 2 --size 224 --samples 1000
    python -m diffzoo.vlm.needle score --haystacks needle/2x2 --answers answers.jsonl --out needle/2x2/scores
    python -m diffzoo.vlm.needle run --haystacks needle/2x2 --recipe paligemma-3b-vqav2-diff \\
        --adapter runs/vlm/paligemma-3b-vqav2-diff/adapter --protocol two_step --out needle/2x2/diff

`run` asks the model a `diffzoo.vlm.train` recipe names (with its LoRA adapter, or made differential
as the recipe says) and scores it; models reading one image per prompt need --m 1.
"""
import argparse
import json
import math
import os
import random
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

from PIL import Image

MANIFEST = 'haystacks.json'
FORMAT = 'diffzoo-mmneedle-1'
RESULTS = 'needle_results.json'
HEATMAP = 'needle_heatmap.png'
PROTOCOLS = ('mmneedle', 'two_step')
COCO_CAPTIONS = 'captions_val2014.json'

# needle.py of MMNeedle, single needle, word for word: answers are compared with the paper's.
MMNEEDLE_PROMPT = ("Given {m} {images} indexed from 1 to {m}, each divided into {n}*{n} {subimages}, identify the "
                   "subimage that best matches the provided caption. Respond with 'index, row, column' and nothing "
                   "else. For example, '1, 2, 3' indicates the subimage in the first image, second row, and third "
                   "column. If no match is found, respond only with '-1'.")
# The two-step questions (diffzoo's words); every prompt ends with the caption line, as MMNeedle's.
ROW_PROMPTS = {
    1: "Does this image match the caption? Answer 'yes' or 'no'.",
    2: "This image is a grid of 2 by 2 pictures. Is the picture that matches the caption in the top half or "
       "the bottom half? Answer 'top' or 'bottom', or 'none' if no picture matches the caption.",
    'n': "This image is a grid of {n} by {n} pictures, its rows numbered 1 (top) to {n} (bottom). Which row holds "
         "the picture that matches the caption? Answer with the row number, or 'none' if no picture matches "
         "the caption.",
}
COLUMN_PROMPTS = {
    2: "This image is a grid of 2 by 2 pictures. The picture that matches the caption is in the {half} half. "
       "Is it on the left or on the right? Answer 'left' or 'right'.",
    'n': "This image is a grid of {n} by {n} pictures, its columns numbered 1 (left) to {n} (right). The picture "
         "that matches the caption is in row {row}. Which column holds it? Answer with the column number.",
}
ABSENT_WORDS = {'none', 'no', 'not', 'neither', 'nowhere', 'absent', 'nothing'}
POSITION_WORDS = {'row': {'top': 1, 'upper': 1, 'bottom': -1, 'lower': -1},  # -1: the last, N
                  'column': {'left': 1, 'right': -1}}
_INTEGER = re.compile(r'(?<!\d)-?\d+')
_TOKEN = re.compile(r'(?<!\d)-?\d+|[a-z]+')


class NeedleError(ValueError):
    pass


class Location(NamedTuple):
    """1-based (index, row, column); (-1, -1, -1) is "absent", None a field an answer did not give."""
    index: Optional[int]
    row: Optional[int]
    column: Optional[int]


ABSENT = Location(-1, -1, -1)
UNREADABLE = Location(None, None, None)


def caption_key(caption: str) -> str:
    """Captions compare lower-case, with runs of spaces collapsed and no final period."""
    return ' '.join(caption.lower().split()).rstrip('.').strip()


def find_captions(source) -> Path:
    """The captions file next to a COCO-style image folder, or an error listing where it looked."""
    source = Path(source)
    candidates = [source / COCO_CAPTIONS, source / 'annotations' / COCO_CAPTIONS,
                  source.parent / 'annotations' / COCO_CAPTIONS, source / 'captions.json', source / 'captions.jsonl']
    for path in candidates:
        if path.is_file():
            return path
    raise NeedleError(f'--source {source}: no captions file at {", ".join(map(str, candidates))}; pass --captions '
                      f'FILE (COCO captions_val2014.json, or JSON/JSONL mapping file name to caption)')


_FILE_KEYS = ('file_name', 'file', 'filename', 'image', 'path')
_CAPTION_KEYS = ('caption', 'text', 'txt')


def _entry(obj, where: str) -> Tuple[str, str]:
    if not isinstance(obj, dict):
        raise NeedleError(f'{where}: expected an object {{"file_name": ..., "caption": ...}}, got {obj!r:.80}')
    name = next((obj[k] for k in _FILE_KEYS if k in obj), None)
    caption = next((obj[k] for k in _CAPTION_KEYS if k in obj), None)
    if not isinstance(name, str):
        raise NeedleError(f'{where}: no file name field (one of {", ".join(_FILE_KEYS)}) in {obj!r:.80}')
    if not isinstance(caption, str):
        raise NeedleError(f'{where}: no caption field (one of {", ".join(_CAPTION_KEYS)}) in {obj!r:.80}')
    return name, caption


def read_captions(path) -> Dict[str, str]:
    """File name (relative to the image folder) → caption, from any of:
    COCO annotations ({"images": [...], "annotations": [...]}: the last caption of each image, as
    MMNeedle), a JSON object {file name: caption or [captions] (the first is used)}, a JSON list or
    JSONL lines of {"file_name": ..., "caption": ...} (MMNeedle's captions_val2014_newline.json)."""
    path = Path(path)
    if not path.is_file():
        raise NeedleError(f'--captions {path}: no such file; pass the COCO captions_val2014.json or a JSON/JSONL '
                          f'file mapping file name to caption')
    text = path.read_text(encoding='utf-8')
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = []
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    data.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise NeedleError(f'{path} line {number}: neither JSON nor JSONL ({exc.msg})') from None
    if isinstance(data, dict) and ('annotations' in data or 'images' in data):
        for key in ('images', 'annotations'):
            if not isinstance(data.get(key), list):
                raise NeedleError(f'{path}: COCO annotations without a "{key}" list; pass captions_val2014.json '
                                  f'from annotations_trainval2014.zip')
        last = {}
        for number, a in enumerate(data['annotations']):
            if not isinstance(a, dict) or 'image_id' not in a or not isinstance(a.get('caption'), str):
                raise NeedleError(f'{path}: annotations[{number}] has no "image_id" and "caption"')
            last[a['image_id']] = a['caption']  # the last caption of an image, as MMNeedle's file_to_caption.py
        captions = {}
        for number, image in enumerate(data['images']):
            if not isinstance(image, dict) or 'id' not in image or 'file_name' not in image:
                raise NeedleError(f'{path}: images[{number}] has no "id" and "file_name"')
            if image['id'] in last:
                captions[image['file_name']] = last[image['id']]
    elif isinstance(data, dict):
        captions = {}
        for name, value in data.items():
            if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
                value = value[0]
            if not isinstance(value, str):
                raise NeedleError(f'{path}: the caption of "{name}" is {value!r:.60}, not text')
            captions[name] = value
    elif isinstance(data, list):
        captions = dict(_entry(obj, f'{path} entry {i}') for i, obj in enumerate(data))
    else:
        raise NeedleError(f'{path}: expected COCO annotations, a JSON object or a list of objects')
    if not captions:
        raise NeedleError(f'{path}: no captions in it')
    return captions


def usable_captions(source, captions: Dict[str, str]) -> Dict[str, str]:
    """The captions whose image file exists under `source` (a captions file may cover more images)."""
    source = Path(source)
    if not source.is_dir():
        raise NeedleError(f'--source {source}: no such folder; pass the folder of images (for COCO: val2014/)')
    found = {name: c for name, c in captions.items() if (source / name).is_file() and caption_key(c)}
    if not found:
        first = next(iter(captions))
        raise NeedleError(f'--source {source}: none of the {len(captions)} files the captions name is there (first: '
                          f'{first}); pass the folder that holds them (for COCO: val2014/)')
    return found


@dataclass(frozen=True)
class HaystackConfig:
    m: int = 1  # images per sample
    n: int = 2  # each an n×n stitch
    size: int = 224  # px of a sub-image (Differential PaliGemma 224, MMNeedle 256)
    samples: int = 1000
    positive_fraction: float = 0.5
    positives: Optional[int] = None  # a number of positives; overrides positive_fraction
    seed: int = 0

    def __post_init__(self):
        for name, low in (('m', 1), ('n', 1), ('size', 8), ('samples', 1)):
            if getattr(self, name) < low:
                raise NeedleError(f'--{name} {getattr(self, name)}: must be at least {low}')
        if not 0 <= self.positive_fraction <= 1:
            raise NeedleError(f'--positive-fraction {self.positive_fraction}: must be between 0 and 1')
        if self.positives is not None and not 0 <= self.positives <= self.samples:
            raise NeedleError(f'--positives {self.positives}: must be between 0 and --samples {self.samples}')

    @property
    def num_positives(self) -> int:
        return self.positives if self.positives is not None else round(self.samples * self.positive_fraction)

    @property
    def cells(self) -> int:
        return self.m * self.n * self.n


@dataclass(frozen=True)
class Sample:
    id: int
    cells: Tuple[Tuple[str, ...], ...]  # (M, N²): file name of stitch k, row-major cell r·N + c (0-based)
    needle: str  # the caption asked for
    needle_source: str  # the file it describes
    truth: Location  # 1-based, ABSENT for a negative
    n: int
    size: int
    root: Path  # the folder the file names are in
    stitches: Tuple[Path, ...] = field(default=(), compare=False)  # written PNGs, if any

    @property
    def positive(self) -> bool:
        return self.truth != ABSENT

    @property
    def m(self) -> int:
        return len(self.cells)

    def images(self) -> List[Image.Image]:
        """The M stitched RGB images: read from the written PNGs, else stitched from the source."""
        if self.stitches:
            images = []
            for path in self.stitches:
                if not path.is_file():
                    raise NeedleError(f'sample {self.id}: {path} is missing; rebuild the set with '
                                      f'python -m diffzoo.vlm.needle build')
                with Image.open(path) as image:
                    images.append(image.convert('RGB'))
            return images
        return [stitch([self.root / name for name in names], self.n, self.size) for names in self.cells]


class _Progress:
    """`log('label: done/total what (s)')` at most every `every_s` seconds, and at the end."""

    def __init__(self, log: Optional[Callable[[str], None]], label: str, total: int, what: str, every_s=5.0):
        self.log, self.label, self.total, self.what, self.every_s = log, label, total, what, every_s
        self.start = self.last = time.time()

    def __call__(self, done: int):
        now = time.time()
        if self.log and (done == self.total or now - self.last >= self.every_s):
            self.last = now
            self.log(f'{self.label}: {done}/{self.total} {self.what} ({now - self.start:.1f} s)')


def load_subimage(path, size: int) -> Image.Image:
    """One source image as an RGB size×size sub-image (aspect not kept, as MMNeedle)."""
    try:
        with Image.open(path) as image:
            return image.convert('RGB').resize((size, size), Image.Resampling.BICUBIC)
    except OSError as exc:
        raise NeedleError(f'{path}: cannot read the image ({exc}); replace it or drop it from the captions file') \
            from None


def stitch(paths: Sequence, n: int, size: int) -> Image.Image:
    """n×n sub-images, row-major: paths[r·n + c] at (c·size, r·size) on a black canvas."""
    if len(paths) != n * n:
        raise NeedleError(f'a {n}x{n} stitch needs {n * n} images, got {len(paths)}')
    canvas = Image.new('RGB', (n * size, n * size))
    for k, path in enumerate(paths):
        row, column = divmod(k, n)
        canvas.paste(load_subimage(path, size), (column * size, row * size))
    return canvas


def _draw(rng: random.Random, pool: List[str], k: int, banned: set, key_of: Dict[str, str]) -> List[str]:
    """k distinct names from pool whose caption key is not banned (rejection, then an explicit list)."""
    chosen: List[str] = []
    taken = set()
    for _ in range(20 * k + 50):
        if len(chosen) == k:
            return chosen
        name = pool[rng.randrange(len(pool))]
        if name not in taken and key_of[name] not in banned:
            chosen.append(name)
            taken.add(name)
    if len(chosen) < k:
        rest = [name for name in pool if name not in taken and key_of[name] not in banned]
        chosen += rng.sample(rest, k - len(chosen))
    return chosen


def build(source, captions: Dict[str, str], config: HaystackConfig) -> List[Sample]:
    """The samples of a haystack set (nothing stitched yet); the same (source, captions, config) give the
    same samples. `captions` maps file names under `source` to captions (see `read_captions`)."""
    source = Path(source).resolve()
    captions = usable_captions(source, captions)
    pool = sorted(captions)
    key_of = {name: caption_key(captions[name]) for name in pool}
    distinct = len(set(key_of.values()))
    positives = config.num_positives
    needed = config.cells + (1 if positives < config.samples else 0)
    if distinct < needed:
        raise NeedleError(
            f'--source {source}: {len(pool)} captioned images ({distinct} distinct captions), but a haystack of '
            f'--m {config.m} images of {config.n}x{config.n} needs {config.cells} sub-images with distinct captions'
            + (' plus 1 for the needles of negatives' if needed > config.cells else '')
            + '; use a smaller --m or --n, or more images')
    samples = []
    for i in range(config.samples):
        rng = random.Random(f'mmneedle/{config.seed}/{i}')
        if i < positives:  # the first ones are positives, as MMNeedle
            needle = pool[rng.randrange(len(pool))]
            others = _draw(rng, pool, config.cells - 1, {key_of[needle]}, key_of)
            j = rng.randrange(config.cells)
            names = others[:j] + [needle] + others[j:]
            index, cell = divmod(j, config.n * config.n)
            row, column = divmod(cell, config.n)
            truth = Location(index + 1, row + 1, column + 1)
        else:
            names = _draw(rng, pool, config.cells, set(), key_of)
            needle = _draw(rng, pool, 1, {key_of[name] for name in names}, key_of)[0]
            truth = ABSENT
        per_image = config.n * config.n
        cells = tuple(tuple(names[k * per_image:(k + 1) * per_image]) for k in range(config.m))
        samples.append(Sample(i, cells, captions[needle], needle, truth, config.n, config.size, source))
    return samples


def write(samples: Sequence[Sample], out, settings: Dict, log: Optional[Callable[[str], None]] = print,
          overwrite: bool = False) -> Path:
    """The stitches as out/stitches/SSSSS-K.png and the manifest out/haystacks.json (written last)."""
    out = Path(out)
    manifest = out / MANIFEST
    if manifest.exists() and not overwrite:
        raise NeedleError(f'--out {out}: {manifest} exists; pass another --out, or --overwrite to replace it')
    (out / 'stitches').mkdir(parents=True, exist_ok=True)
    entries, progress = [], _Progress(log, 'build', len(samples), 'samples stitched')
    for done, sample in enumerate(samples, 1):
        files = []
        for k, image in enumerate(sample.images(), 1):
            relative = f'stitches/{sample.id:05d}-{k}.png'
            image.save(out / relative)
            files.append(relative)
        entries.append({'id': sample.id, 'stitches': files, 'cells': [list(c) for c in sample.cells],
                        'needle': sample.needle, 'needle_source': sample.needle_source,
                        'index': sample.truth.index, 'row': sample.truth.row, 'column': sample.truth.column,
                        'prompt': mmneedle_prompt(sample.m, sample.n, sample.needle)})
        progress(done)
    tmp = manifest.with_name(MANIFEST + '.tmp')
    tmp.write_text(json.dumps({'format': FORMAT, 'settings': settings, 'samples': entries}, indent=1) + '\n')
    os.replace(tmp, manifest)
    return manifest


def read_haystacks(directory) -> List[Sample]:
    """The samples of a set `write` left in `directory`, their stitches read from its PNGs."""
    directory = Path(directory)
    manifest = directory / MANIFEST
    if not manifest.is_file():
        raise NeedleError(f'--haystacks {directory}: no {MANIFEST}; build the set first with '
                          f'python -m diffzoo.vlm.needle build --source DIR --out {directory}')
    data = json.loads(manifest.read_text())
    if data.get('format') != FORMAT:
        raise NeedleError(f'{manifest}: format {data.get("format")!r}, expected {FORMAT!r}; rebuild the set')
    settings = data['settings']
    samples = []
    for entry in data['samples']:
        truth = Location(entry['index'], entry['row'], entry['column'])
        samples.append(Sample(entry['id'], tuple(tuple(c) for c in entry['cells']), entry['needle'],
                              entry['needle_source'], truth, settings['n'], settings['size'],
                              Path(settings['source']), tuple(directory / s for s in entry['stitches'])))
    return samples


def mmneedle_prompt(m: int, n: int, caption: str) -> str:
    prompt = MMNEEDLE_PROMPT.format(m=m, n=n, images='images' if m > 1 else 'image',
                                    subimages='subimages' if n > 1 else 'subimage')
    return f'{prompt}\nCaption: {caption}'


def row_prompt(n: int, caption: str) -> str:
    return ROW_PROMPTS.get(n, ROW_PROMPTS['n']).format(n=n) + f'\nCaption: {caption}'


def column_prompt(n: int, row: int, caption: str) -> str:
    half = {1: 'top', 2: 'bottom'}.get(row, str(row))
    return COLUMN_PROMPTS.get(n, COLUMN_PROMPTS['n']).format(n=n, row=row, half=half) + f'\nCaption: {caption}'


def parse_answer(text: Optional[str]) -> Location:
    """(index, row, column) from an answer to the MMNeedle prompt: its first three integers, in order.
    A first integer of -1 is ABSENT; fewer integers leave the rest None ("2" gives index 2, as
    MMNeedle's index accuracy reads the first field); no integer at all is UNREADABLE."""
    numbers = [int(x) for x in _INTEGER.findall(text or '')]
    if not numbers:
        return UNREADABLE
    if numbers[0] == -1:
        return ABSENT
    numbers = (numbers + [None, None])[:3]
    return Location(*numbers)


def parse_step(text: Optional[str], n: int, axis: str) -> Optional[int]:
    """A row or column (1..n) from a two-step answer, -1 for "none"/"no"/"-1", None if unreadable.
    The first word that says something decides: "top"/"upper" = 1, "bottom"/"lower" = n, "left" = 1,
    "right" = n, an integer 1..n; and for a 1×1 row question "yes" = 1."""
    words = POSITION_WORDS[axis]
    for token in _TOKEN.findall((text or '').lower()):
        if token in ABSENT_WORDS or token == '-1':
            return -1
        if token == 'yes' and n == 1 and axis == 'row':
            return 1
        if token in words:
            return words[token] if words[token] > 0 else n
        if token.lstrip('-').isdigit() and 1 <= int(token) <= n:
            return int(token)
    return None


@dataclass(frozen=True)
class Query:
    name: str  # with the sample id, the key of an answer: 'mmneedle', 'row/K', 'column/K'
    stitches: Tuple[int, ...]  # 1-based indices of the images shown
    prompt: str


Ask = Callable[[Query], Optional[str]]


def _mmneedle(sample: Sample, ask: Ask) -> Tuple[Optional[Location], List[Tuple[Query, Optional[str]]]]:
    query = Query('mmneedle', tuple(range(1, sample.m + 1)), mmneedle_prompt(sample.m, sample.n, sample.needle))
    answer = ask(query)
    return (None if answer is None else parse_answer(answer)), [(query, answer)]


def _two_step(sample: Sample, ask: Ask) -> Tuple[Optional[Location], List[Tuple[Query, Optional[str]]]]:
    asked = []
    for k in range(1, sample.m + 1):
        query = Query(f'row/{k}', (k,), row_prompt(sample.n, sample.needle))
        answer = ask(query)
        asked.append((query, answer))
        if answer is None:
            return None, asked
        row = parse_step(answer, sample.n, 'row')
        if row == -1:
            continue
        if row is None:
            return Location(k, None, None), asked
        if sample.n == 1:
            return Location(k, 1, 1), asked
        query = Query(f'column/{k}', (k,), column_prompt(sample.n, row, sample.needle))
        answer = ask(query)
        asked.append((query, answer))
        if answer is None:
            return None, asked
        column = parse_step(answer, sample.n, 'column')
        return Location(k, row, column if column != -1 else None), asked
    return ABSENT, asked


_RUN = {'mmneedle': _mmneedle, 'two_step': _two_step}


def _unreadable(protocol: str, query: Query, answer: str, n: int) -> bool:
    if protocol == 'mmneedle':
        return parse_answer(answer) == UNREADABLE
    return parse_step(answer, n, query.name.split('/')[0]) is None


def _fraction(correct: int, total: int) -> Optional[float]:
    return correct / total if total else None


def score(samples: Sequence[Sample], ask_for: Callable[[Sample], Ask], protocol: str = 'mmneedle',
          log: Optional[Callable[[str], None]] = None) -> Dict:
    """Run `protocol` over the samples, asking `ask_for(sample)(query)` for each answer (None: no answer,
    the sample is left out), and score it; see `evaluate` for the result."""
    if protocol not in _RUN:
        raise NeedleError(f'protocol {protocol!r}: choose one of {", ".join(PROTOCOLS)}')
    if not samples:
        raise NeedleError('no samples to score')
    n, m = samples[0].n, samples[0].m
    if any(s.n != n or s.m != m for s in samples):
        raise NeedleError('the samples mix haystack shapes (M images of N×N); score each set on its own')
    records, progress = [], _Progress(log, protocol, len(samples), 'samples')
    for done, sample in enumerate(samples, 1):
        prediction, asked = _RUN[protocol](sample, ask_for(sample))
        record = {'id': sample.id, 'truth': list(sample.truth),
                  'prediction': None if prediction is None else list(prediction),
                  'queries': [{'query': q.name, 'stitches': list(q.stitches), 'prompt': q.prompt, 'answer': a}
                              for q, a in asked],
                  'unreadable': sum(a is not None and _unreadable(protocol, q, a, n) for q, a in asked)}
        if prediction is not None:
            record['existence'] = (prediction.index != -1) == sample.positive
            record['index'] = prediction.index == sample.truth.index if sample.positive else None
            record['exact'] = prediction == sample.truth
        records.append(record)
        progress(done)
    return summarize(records, protocol, m, n, samples[0].size)


def summarize(records: List[Dict], protocol: str, m: int, n: int, size: int) -> Dict:
    answered = [r for r in records if r['prediction'] is not None]
    positives = [r for r in answered if r['truth'][0] != -1]
    negatives = [r for r in answered if r['truth'][0] == -1]
    count = {
        'samples': len(records), 'answered': len(answered), 'empty': len(records) - len(answered),
        'positives': len(positives), 'negatives': len(negatives),
        'queries': sum(len(r['queries']) for r in records),
        'unreadable_answers': sum(r['unreadable'] for r in records),
        'existence_correct': sum(r['existence'] for r in answered),
        'existence_correct_positives': sum(r['existence'] for r in positives),
        'existence_correct_negatives': sum(r['existence'] for r in negatives),
        'index_correct': sum(r['index'] for r in positives),
        'exact_correct': sum(r['exact'] for r in positives),
        'overall_correct': sum(r['exact'] for r in answered),
    }
    metrics = {
        'existence_accuracy': _fraction(count['existence_correct'], len(answered)),
        'existence_accuracy_positives': _fraction(count['existence_correct_positives'], len(positives)),
        'existence_accuracy_negatives': _fraction(count['existence_correct_negatives'], len(negatives)),
        'index_accuracy': _fraction(count['index_correct'], len(positives)),
        'exact_accuracy': _fraction(count['exact_correct'], len(positives)),
        'overall_accuracy': _fraction(count['overall_correct'], len(answered)),  # exact, or -1 when absent
    }
    cell_count = [[0] * n for _ in range(n)]
    cell_exact = [[0] * n for _ in range(n)]
    cell_index = [[0] * n for _ in range(n)]
    for r in positives:
        row, column = r['truth'][1] - 1, r['truth'][2] - 1
        cell_count[row][column] += 1
        cell_exact[row][column] += r['exact']
        cell_index[row][column] += r['index']
    per_cell = {
        'count': cell_count,
        'exact_accuracy': [[_fraction(e, c) for e, c in zip(es, cs)] for es, cs in zip(cell_exact, cell_count)],
        'index_accuracy': [[_fraction(i, c) for i, c in zip(is_, cs)] for is_, cs in zip(cell_index, cell_count)],
    }
    return {'benchmark': 'mmneedle', 'protocol': protocol, 'm': m, 'n': n, 'size': size, 'metrics': metrics,
            'counts': count, 'per_cell': per_cell,
            'empty_ids': [r['id'] for r in records if r['prediction'] is None], 'records': records}


def evaluate(samples: Sequence[Sample], answer_fn: Callable[[List[Image.Image], str], str],
             protocol: str = 'mmneedle', log: Optional[Callable[[str], None]] = None) -> Dict:
    """Ask a model, `answer_fn(images, prompt) -> answer`, every query of `protocol` and score it.

    Returns a JSON-ready dict: `metrics` (fractions, None where there is nothing to count) —
    existence_accuracy over all answered samples, and on positives / negatives alone; index_accuracy
    and exact_accuracy over positives (MMNeedle's headline numbers); overall_accuracy, exact or a
    correct -1, over all — `counts` behind each, `per_cell` (N×N lists, [row][column] of the needle's
    cell: count, exact_accuracy and index_accuracy over positives), `empty_ids` (answer_fn returned
    None: left out, as MMNeedle), and `records`, one per sample with every prompt and answer."""
    def ask_for(sample: Sample) -> Ask:
        images = sample.images()

        def ask(query: Query) -> Optional[str]:
            answer = answer_fn([images[k - 1] for k in query.stitches], query.prompt)
            return None if answer is None else str(answer)
        return ask
    return score(samples, ask_for, protocol, log)


def read_answers(path) -> Dict[Tuple[int, str], Optional[str]]:
    """(sample id, query) → answer from JSONL lines {"id": 3, "query": "row/1", "answer": "top"};
    "query" defaults to "mmneedle", and "answer": null marks a sample left unanswered."""
    path = Path(path)
    if not path.is_file():
        raise NeedleError(f'--answers {path}: no such file; write one JSONL line per query: '
                          f'{{"id": 0, "query": "mmneedle", "answer": "1, 2, 1"}}')
    answers = {}
    for number, line in enumerate(path.read_text(encoding='utf-8').splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise NeedleError(f'{path} line {number}: not JSON ({exc.msg})') from None
        if not isinstance(obj, dict) or not isinstance(obj.get('id'), int) or 'answer' not in obj:
            raise NeedleError(f'{path} line {number}: expected {{"id": <sample id>, "query": ..., "answer": ...}}, '
                              f'got {line.strip()[:80]}')
        if obj['answer'] is not None and not isinstance(obj['answer'], str):
            obj['answer'] = str(obj['answer'])  # a bare -1 is an answer too
        key = (obj['id'], obj.get('query', 'mmneedle'))
        if key in answers:
            raise NeedleError(f'{path} line {number}: a second answer for sample {key[0]}, query {key[1]!r}')
        answers[key] = obj['answer']
    return answers


def score_answers(samples: Sequence[Sample], answers: Dict[Tuple[int, str], Optional[str]],
                  protocol: Optional[str] = None, where: str = 'answers', log=None) -> Dict:
    """Score answers a model gave to a built set; `protocol` None reads it from the query names."""
    if protocol is None:
        protocol = 'two_step' if any(q.startswith(('row/', 'column/')) for _, q in answers) else 'mmneedle'
    missing: List[Tuple[int, str]] = []

    def ask_for(sample: Sample) -> Ask:
        def ask(query: Query) -> Optional[str]:
            key = (sample.id, query.name)
            if key not in answers:
                missing.append(key)
                return None
            return answers[key]
        return ask
    result = score(samples, ask_for, protocol, log)
    if missing:
        shown = ', '.join(f'sample {i} query {q!r}' for i, q in missing[:5])
        raise NeedleError(f'{where}: {len(missing)} queries of the {protocol} protocol have no answer ({shown}'
                          f'{", …" if len(missing) > 5 else ""}); answer them, or write "answer": null to leave '
                          f'a sample out')
    unknown = set(answers) - {(r['id'], q['query']) for r in result['records'] for q in r['queries']}
    if unknown:
        i, q = sorted(unknown)[0]
        raise NeedleError(f'{where}: {len(unknown)} answers match no query the {protocol} protocol asks (e.g. sample '
                          f'{i} query {q!r}); check --protocol and the haystack set')
    return result


def write_answers(result: Dict, path) -> Path:
    """Every query and answer of a result as JSONL, the input of `score_answers`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, 'w', encoding='utf-8') as f:
        for record in result['records']:
            for q in record['queries']:
                f.write(json.dumps({'id': record['id'], 'query': q['query'], 'prompt': q['prompt'],
                                    'answer': q['answer']}) + '\n')
    return path


def plot_cells(result: Dict, path, title: Optional[str] = None) -> Path:
    """Exact accuracy by the needle's cell in its stitch (MMNeedle's per-sub-image heatmap); each cell
    shows its accuracy and count, blank where no positive sample had its needle there."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    import numpy as np

    n = result['n']
    values = np.array([[math.nan if v is None else v for v in row] for row in result['per_cell']['exact_accuracy']])
    fig, ax = plt.subplots(figsize=(max(3.6, 1.1 * n + 1.6), max(3.0, 1.1 * n + 0.9)))
    cmap = matplotlib.colormaps['RdYlGn'].with_extremes(bad='#dddddd')
    image = ax.imshow(np.ma.masked_invalid(values), cmap=cmap, vmin=0, vmax=1)
    for r in range(n):
        for c in range(n):
            count = result['per_cell']['count'][r][c]
            text = f'{values[r, c]:.0%}\nn={count}' if count else 'n=0'
            ax.text(c, r, text, ha='center', va='center', fontsize=max(6, 11 - n))
    ax.set_xticks(range(n), [str(c + 1) for c in range(n)])
    ax.set_yticks(range(n), [str(r + 1) for r in range(n)])
    ax.set_xlabel('needle column')
    ax.set_ylabel('needle row')
    metrics = result['metrics']
    ax.set_title(title or f'MMNeedle ({result["protocol"]} protocol), M={result["m"]}, {n}x{n}\n'
                          f'exact {_percent(metrics["exact_accuracy"])}, index {_percent(metrics["index_accuracy"])}',
                 fontsize=9)
    fig.colorbar(image, ax=ax, label='exact accuracy', fraction=0.046, pad=0.04)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def _percent(value: Optional[float]) -> str:
    return '-' if value is None else f'{100 * value:.2f}%'


def table(result: Dict) -> str:
    """The metrics with their counts, and exact accuracy by the needle's cell."""
    m, c, n = result['metrics'], result['counts'], result['n']
    rows = [('existence', m['existence_accuracy'], c['existence_correct'], c['answered']),
            ('existence, needle present', m['existence_accuracy_positives'], c['existence_correct_positives'],
             c['positives']),
            ('existence, needle absent', m['existence_accuracy_negatives'], c['existence_correct_negatives'],
             c['negatives']),
            ('index (needle present)', m['index_accuracy'], c['index_correct'], c['positives']),
            ('exact (needle present)', m['exact_accuracy'], c['exact_correct'], c['positives']),
            ('overall (exact, or -1)', m['overall_accuracy'], c['overall_correct'], c['answered'])]
    lines = [f'MMNeedle, {result["protocol"]} protocol: M={result["m"]} image(s) of {n}x{n} sub-images, '
             f'{c["samples"]} samples ({c["positives"]} with the needle, {c["negatives"]} without)',
             f'{"metric":<28}{"accuracy":>10}  correct / total']
    lines += [f'{name:<28}{_percent(value):>10}  {right} / {total}' for name, value, right, total in rows]
    lines.append(f'queries {c["queries"]}, unreadable answers {c["unreadable_answers"]}, '
                 f'samples left out (no answer) {c["empty"]}')
    lines.append('exact accuracy by the needle\'s cell (row \\ column):')
    lines.append('      ' + ''.join(f'{col + 1:>10}' for col in range(n)))
    for r in range(n):
        lines.append(f'{r + 1:>6}' + ''.join(f'{_percent(v):>10}' for v in result['per_cell']['exact_accuracy'][r]))
    return '\n'.join(lines)


def write_report(result: Dict, out, title: Optional[str] = None) -> Tuple[Path, Path]:
    """out/needle_results.json (every number, every answer) and out/needle_heatmap.png."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    results = out / RESULTS
    tmp = results.with_name(RESULTS + '.tmp')
    tmp.write_text(json.dumps(result, indent=1) + '\n')
    os.replace(tmp, results)
    return results, plot_cells(result, out / HEATMAP, title)


def model_answer_fn(recipe: Dict, adapter=None, max_new_tokens: int = 20, device: str = 'cpu'):
    """`answer_fn` for the model a `diffzoo.vlm.train` recipe names (a PaliGemma checkpoint or a
    build_vlm model), made differential as the recipe says or, with `adapter`, as the adapter saved;
    greedy decoding of one image per prompt (build haystacks with --m 1 for single-image models)."""
    import torch
    from .lora import load_adapter
    from .train import build_model
    model, _, _, tokenizer, kind = build_model(recipe, torch.device(device))
    if adapter is not None:
        model = load_adapter(model, adapter)
    elif recipe.get('differential'):
        from .differential import differentialize
        from .model import VisionLanguageModel
        differentialize(model.language_model if isinstance(model, VisionLanguageModel) else model,
                        **recipe['differential'])
    model.eval()
    transform = None
    if kind == 'build_vlm':
        from .train import image_transform
        transform = image_transform(recipe['model']['vision'], model)

    @torch.no_grad()
    def answer(images: List[Image.Image], prompt: str) -> str:
        if len(images) != 1:
            raise NeedleError(f'the model reads one image per prompt, the query has {len(images)}; '
                              f'build the haystacks with --m 1')
        if kind == 'paligemma':
            batch = tokenizer(text=prompt, images=images[0], return_tensors='pt').to(device)
            out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False)
            return tokenizer.decode(out[0, batch['input_ids'].shape[1]:], skip_special_tokens=True).strip()
        ids = [tokenizer.bos_token_id] + tokenizer(prompt, add_special_tokens=False)['input_ids']
        out = model.generate(transform(images[0])[None].to(device), torch.tensor([ids], device=device),
                             max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id)
        return tokenizer.decode(out[0], skip_special_tokens=True).strip()
    return answer


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog='python -m diffzoo.vlm.needle', description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest='command', required=True)
    b = sub.add_parser('build', help='stitch a haystack set from an image folder and its captions')
    b.add_argument('--source', required=True, metavar='DIR', help='the images (for COCO: val2014/)')
    b.add_argument('--captions', metavar='FILE', help='COCO captions_val2014.json, or JSON/JSONL file name → '
                   'caption; default: captions_val2014.json in DIR, DIR/annotations or DIR/../annotations')
    b.add_argument('--out', required=True, metavar='DIR')
    defaults = HaystackConfig()
    b.add_argument('--m', type=int, default=defaults.m, help='images per sample')
    b.add_argument('--n', type=int, default=defaults.n, help='each image an N×N stitch')
    b.add_argument('--size', type=int, default=defaults.size, help='px per sub-image (MMNeedle: 256)')
    b.add_argument('--samples', type=int, default=defaults.samples)
    b.add_argument('--positive-fraction', type=float, default=defaults.positive_fraction,
                   help='of samples holding the needle (the first ones)')
    b.add_argument('--positives', type=int, help='a number of positives instead of --positive-fraction')
    b.add_argument('--seed', type=int, default=defaults.seed)
    b.add_argument('--overwrite', action='store_true', help='replace a set already in --out')
    s = sub.add_parser('score', help="score a model's answers to a built set")
    s.add_argument('--haystacks', required=True, metavar='DIR', help='a directory `build` wrote')
    s.add_argument('--answers', required=True, metavar='FILE', help='JSONL: {"id", "query", "answer"} per query')
    s.add_argument('--out', required=True, metavar='DIR')
    s.add_argument('--protocol', choices=PROTOCOLS, help='default: two_step if the queries are row/K, column/K')
    s.add_argument('--title', help='of the heatmap')
    r = sub.add_parser('run', help='ask a model every query of a built set, then score it')
    r.add_argument('--haystacks', required=True, metavar='DIR', help='a directory `build` wrote')
    r.add_argument('--recipe', required=True, help='a diffzoo.vlm.train recipe naming the model (file or shipped name)')
    r.add_argument('--adapter', metavar='DIR', help='a LoRA adapter written by diffzoo.vlm.train (its adapter/ dir)')
    r.add_argument('--protocol', choices=PROTOCOLS, default='two_step')
    r.add_argument('--max-new-tokens', type=int, default=20)
    r.add_argument('--device', default='cpu')
    r.add_argument('--out', required=True, metavar='DIR')
    r.add_argument('--title', help='of the heatmap')
    return p


def _cmd_build(a) -> int:
    config = HaystackConfig(a.m, a.n, a.size, a.samples, a.positive_fraction, a.positives, a.seed)
    if not Path(a.source).is_dir():
        raise NeedleError(f'--source {a.source}: no such folder; pass the folder of images (for COCO: val2014/)')
    captions_path = Path(a.captions) if a.captions else find_captions(a.source)
    captions = read_captions(captions_path)
    print(f'build: {len(captions)} captions from {captions_path}', flush=True)
    samples = build(a.source, captions, config)
    settings = dict(vars(a), source=str(Path(a.source).resolve()), captions=str(captions_path.resolve()),
                    positives=config.num_positives)
    settings.pop('command')
    settings.pop('overwrite')
    manifest = write(samples, a.out, settings, log=lambda line: print(line, flush=True), overwrite=a.overwrite)
    positives = config.num_positives
    width, height = a.n * a.size, a.n * a.size
    print()
    print(f'{"samples":<22}{len(samples)} ({positives} with the needle, {len(samples) - positives} without)')
    print(f'{"images per sample":<22}{a.m}, each {a.n}x{a.n} sub-images of {a.size} px ({width}x{height} px)')
    print(f'{"seed":<22}{a.seed}')
    print(f'{"manifest":<22}{manifest}')
    print(f'{"stitches":<22}{Path(a.out) / "stitches"}')
    return 0


def _cmd_score(a) -> int:
    samples = read_haystacks(a.haystacks)
    answers = read_answers(a.answers)
    result = score_answers(samples, answers, a.protocol, where=f'--answers {a.answers}',
                           log=lambda line: print(line, flush=True))
    results, heatmap = write_report(result, a.out, a.title)
    print()
    print(table(result))
    print(f'\nresults: {results}\nheatmap: {heatmap}')
    return 0


def _cmd_run(a) -> int:
    from diffzoo.train.recipe import expand_env
    from .train import load_recipe
    samples = read_haystacks(a.haystacks)
    answer_fn = model_answer_fn(expand_env(load_recipe(a.recipe)), a.adapter, a.max_new_tokens, a.device)
    result = evaluate(samples, answer_fn, a.protocol, log=lambda line: print(line, flush=True))
    answers = write_answers(result, Path(a.out) / 'answers.jsonl')
    results, heatmap = write_report(result, a.out, a.title)
    print()
    print(table(result))
    print(f'\nresults: {results}\nheatmap: {heatmap}\nanswers: {answers}')
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return {'build': _cmd_build, 'score': _cmd_score, 'run': _cmd_run}[args.command](args)
    except NeedleError as exc:
        print(f'error: {exc}', file=sys.stderr)
        return 2


if __name__ == '__main__':
    sys.exit(main())
