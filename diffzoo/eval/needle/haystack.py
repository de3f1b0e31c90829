"""MMNeedle haystacks: captions of an image folder, stitched N×N images, the sample sets and their manifest."""
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

from PIL import Image

from diffzoo.files import atomic_write_json

MANIFEST = 'haystacks.json'
FORMAT = 'diffzoo-mmneedle-1'
COCO_CAPTIONS = 'captions_val2014.json'
# needle.py of MMNeedle, single needle, word for word: answers are compared with the paper's.
MMNEEDLE_PROMPT = ("Given {m} {images} indexed from 1 to {m}, each divided into {n}*{n} {subimages}, identify the "
                   "subimage that best matches the provided caption. Respond with 'index, row, column' and nothing "
                   "else. For example, '1, 2, 3' indicates the subimage in the first image, second row, and third "
                   "column. If no match is found, respond only with '-1'.")


class NeedleError(ValueError):
    pass


class Location(NamedTuple):
    """1-based (index, row, column); (-1, -1, -1) is "absent", None a field an answer did not give."""
    index: Optional[int]
    row: Optional[int]
    column: Optional[int]


ABSENT = Location(-1, -1, -1)
UNREADABLE = Location(None, None, None)


def mmneedle_prompt(m: int, n: int, caption: str) -> str:
    prompt = MMNEEDLE_PROMPT.format(m=m, n=n, images='images' if m > 1 else 'image',
                                    subimages='subimages' if n > 1 else 'subimage')
    return f'{prompt}\nCaption: {caption}'


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


class UsableCaptions(NamedTuple):
    """What `usable_captions` keeps, and what it leaves out (file names, in the captions file's order)."""
    captions: Dict[str, str]  # file name → caption, for the files that exist with a caption
    missing: List[str]  # named by the captions, not under the folder
    blank: List[str]  # there, but their caption is empty


def usable_captions(source, captions: Dict[str, str]) -> UsableCaptions:
    """The captions whose image file exists under `source` (a captions file may cover more images) and
    is not blank; the files left out are named."""
    source = Path(source)
    if not source.is_dir():
        raise NeedleError(f'--source {source}: no such folder; pass the folder of images (for COCO: val2014/)')
    found, missing, blank = {}, [], []
    for name, caption in captions.items():
        if not (source / name).is_file():
            missing.append(name)
        elif not caption_key(caption):
            blank.append(name)
        else:
            found[name] = caption
    if not found:
        first = next(iter(captions))
        raise NeedleError(f'--source {source}: none of the {len(captions)} files the captions name is there (first: '
                          f'{first}); pass the folder that holds them (for COCO: val2014/)')
    return UsableCaptions(found, missing, blank)


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
                                      f'python -m diffzoo.eval.needle build')
                with Image.open(path) as image:
                    images.append(image.convert('RGB'))
            return images
        return [stitch([self.root / name for name in names], self.n, self.size) for names in self.cells]


class Progress:
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
    except (OSError, Image.DecompressionBombError) as exc:  # PIL's errors, an image past its pixel limit
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
    captions = usable_captions(source, captions).captions
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
    entries, progress = [], Progress(log, 'build', len(samples), 'samples stitched')
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
    return atomic_write_json(manifest, {'format': FORMAT, 'settings': settings, 'samples': entries})


def read_haystacks(directory) -> List[Sample]:
    """The samples of a set `write` left in `directory`, their stitches read from its PNGs."""
    directory = Path(directory)
    manifest = directory / MANIFEST
    if not manifest.is_file():
        raise NeedleError(f'--haystacks {directory}: no {MANIFEST}; build the set first with '
                          f'python -m diffzoo.eval.needle build --source DIR --out {directory}')
    rebuild = (f'rebuild the set: python -m diffzoo.eval.needle build --source DIR --out {directory} --overwrite '
               f'(with the settings it was built with)')
    try:
        data = json.loads(manifest.read_bytes())
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError: a manifest cut short or damaged
        raise NeedleError(f'{manifest}: not JSON ({exc}); {rebuild}') from None
    if not isinstance(data, dict) or data.get('format') != FORMAT:
        found = data.get('format') if isinstance(data, dict) else type(data).__name__
        raise NeedleError(f'{manifest}: format {found!r}, expected {FORMAT!r}; {rebuild}')
    samples = []
    try:
        settings = data['settings']
        n = settings['n']
        for i, entry in enumerate(data['samples']):
            truth = Location(entry['index'], entry['row'], entry['column'])
            m = len(entry['cells'])  # (M, N²): its images
            inside = truth.index in range(1, m + 1) and truth.row in range(1, n + 1) and truth.column in range(1, n + 1)
            if truth != ABSENT and not inside:
                raise ValueError(f'sample {i}: the needle at {tuple(truth)}, outside {m} images of {n}×{n}')
            samples.append(Sample(entry['id'], tuple(tuple(c) for c in entry['cells']), entry['needle'],
                                  entry['needle_source'], truth, n, settings['size'], Path(settings['source']),
                                  tuple(directory / s for s in entry['stitches'])))
    except (KeyError, TypeError, ValueError) as exc:  # a field missing, of another type, out of range
        what = f'no {exc}' if isinstance(exc, KeyError) else str(exc)
        raise NeedleError(f'{manifest}: not a set `build` wrote ({what}); {rebuild}') from None
    return samples
