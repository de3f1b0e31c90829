"""A procedurally generated image–caption corpus: coloured shapes on textured, cluttered backgrounds.

Each scene holds one or two named objects — a shape (circle, square, triangle) of a colour and a
size — on a striped, noisy background strewn with small grey specks that no caption mentions (the
"noise" differential attention should learn to ignore). The caption says what is named and where:

    "a small red circle left of a large blue square"        (two objects, a spatial relation)
    "a large yellow triangle"                                (one object)

The first object named is the scene's *subject*; its shape and colour are the corpus's classes for
zero-shot classification. Every sample carries its description in the `json` member.

Scenes are written as webdataset shards laid out as img2dataset writes them (`NNNNN.tar` of
`KEY.jpg`, `KEY.txt`, `KEY.json`, plus `sizes.json`), one directory per split. Sample `i` of a split
depends only on (seed, split, i), so a corpus is the same on every machine and a split's size can
change without changing its other samples.
"""
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np
from PIL import Image, ImageDraw

from diffzoo.files import atomic_write, atomic_write_json

from .llava_qa import POPE_SPLITS  # the benchmark's splits, which the POPE-style questions follow
from .shards import DataError, write_sizes

SHAPES = ('circle', 'square', 'triangle')
COLOURS = {  # saturated, so no clutter speck (grey) reads as one of them
    'red': (215, 40, 40), 'green': (40, 165, 60), 'blue': (40, 80, 215),
    'yellow': (235, 205, 35), 'purple': (140, 55, 185), 'orange': (240, 125, 25),
}
SIZES = {'small': 0.11, 'large': 0.19}  # radius, as a fraction of the image side
RELATIONS = {'left of': (-1, 0), 'right of': (1, 0), 'above': (0, -1), 'below': (0, 1)}
SPLITS = ('train', 'val')
MANIFEST = 'corpus.json'


@dataclass(frozen=True)
class CorpusConfig:
    train: int = 4000
    val: int = 500
    image_size: int = 96
    per_shard: int = 500
    seed: int = 0
    two_object_fraction: float = 0.6

    def __post_init__(self):
        for name in ('train', 'val', 'per_shard'):
            if getattr(self, name) < 1:
                raise DataError(f'--{name.replace("_", "-")} {getattr(self, name)}: the corpus needs at least 1')
        if self.image_size < 32:
            raise DataError(f'--image-size {self.image_size}: shapes and clutter need at least 32 px')


@dataclass
class SceneObject:
    shape: str
    colour: str
    size: str
    centre: Tuple[float, float]  # pixels
    radius: float

    @property
    def phrase(self) -> str:
        return f'{self.size} {self.colour} {self.shape}'


def _place(rng: random.Random, side: int, radius: float, region: Tuple[float, float, float, float]):
    """A centre for an object of `radius` inside the fractional box (x0, y0, x1, y1) of the image."""
    x0, y0, x1, y1 = (v * side for v in region)
    return (rng.uniform(x0 + radius, max(x0 + radius, x1 - radius)),
            rng.uniform(y0 + radius, max(y0 + radius, y1 - radius)))


def _new_object(rng: random.Random, side: int, region, avoid: Optional[SceneObject] = None) -> SceneObject:
    shape, size = rng.choice(SHAPES), rng.choice(sorted(SIZES))
    colours = [c for c in COLOURS if avoid is None or (c, shape) != (avoid.colour, avoid.shape)]
    radius = SIZES[size] * side
    return SceneObject(shape, rng.choice(sorted(colours)), size, _place(rng, side, radius, region), radius)


def _background(rng: random.Random, side: int) -> Image.Image:
    """Grey stripes at a random angle and period, under per-pixel noise."""
    noise = np.random.default_rng(rng.getrandbits(64))
    base = rng.uniform(95, 165)
    angle, period = rng.uniform(0, np.pi), rng.uniform(5, 14)
    yy, xx = np.mgrid[0:side, 0:side]
    stripes = 14 * np.sign(np.sin((xx * np.cos(angle) + yy * np.sin(angle)) * 2 * np.pi / period))
    tint = noise.uniform(-6, 6, size=3)  # a slight colour cast, far from any named colour
    pixels = base + stripes[..., None] + tint + noise.normal(0, 9, size=(side, side, 3))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), 'RGB')


def _clutter(rng: random.Random, draw: ImageDraw.ImageDraw, side: int) -> None:
    for _ in range(rng.randint(6, 14)):
        grey = rng.randint(30, 230)
        x, y, r = rng.uniform(0, side), rng.uniform(0, side), rng.uniform(0.01, 0.035) * side
        if rng.random() < 0.5:
            draw.ellipse((x - r, y - r, x + r, y + r), fill=(grey, grey, grey))
        else:
            angle = rng.uniform(0, np.pi)
            dx, dy = 2 * r * np.cos(angle), 2 * r * np.sin(angle)
            draw.line((x - dx, y - dy, x + dx, y + dy), fill=(grey, grey, grey), width=max(1, int(r / 2)))


def draw_object(draw: ImageDraw.ImageDraw, obj: SceneObject) -> None:
    (x, y), r, fill = obj.centre, obj.radius, COLOURS[obj.colour]
    if obj.shape == 'circle':
        draw.ellipse((x - r, y - r, x + r, y + r), fill=fill)
    elif obj.shape == 'square':
        s = r * 0.886  # the square of a circle's area
        draw.rectangle((x - s, y - s, x + s, y + s), fill=fill)
    else:
        draw.polygon([(x, y - r), (x - r * 0.95, y + r * 0.75), (x + r * 0.95, y + r * 0.75)], fill=fill)


def make_scene(seed: int, split: str, index: int,
               config: CorpusConfig = CorpusConfig()) -> Tuple[Image.Image, Dict]:
    """Sample `index` of `split`: the picture and its description (caption, subject's classes, objects)."""
    rng = random.Random(f'{seed}/{split}/{index}')
    side = config.image_size
    image = _background(rng, side)
    draw = ImageDraw.Draw(image)
    _clutter(rng, draw, side)
    if rng.random() < config.two_object_fraction:
        relation = rng.choice(sorted(RELATIONS))
        dx, dy = RELATIONS[relation]
        # the subject in the half the relation names, the other object in the opposite half
        halves = {(-1, 0): (0, 0, .5, 1), (1, 0): (.5, 0, 1, 1), (0, -1): (0, 0, 1, .5), (0, 1): (0, .5, 1, 1)}
        subject = _new_object(rng, side, halves[dx, dy])
        other = _new_object(rng, side, halves[-dx, -dy], avoid=subject)
        objects = [subject, other]
        caption = f'a {subject.phrase} {relation} a {other.phrase}'
    else:
        relation, objects = None, [_new_object(rng, side, (0.1, 0.1, 0.9, 0.9))]
        caption = f'a {objects[0].phrase}'
    for obj in objects:
        draw_object(draw, obj)
    subject = objects[0]
    description = {'caption': caption, 'shape': subject.shape, 'colour': subject.colour, 'relation': relation,
                   'objects': [dict(asdict(o), centre=[round(c, 2) for c in o.centre]) for o in objects]}
    return image, description


def write_shard(directory, split: str, start: int, config: CorpusConfig) -> int:
    """Shard number start // per_shard of `split` into `directory`: scenes start … start + per_shard − 1
    (fewer at the split's end), written whole under its name. Each scene depends only on the seed, the
    split and its index, so shards can be written in any order or in parallel. Returns its scene count."""
    import io

    import webdataset as wds

    stop = min(getattr(config, split), start + config.per_shard)
    shard = Path(directory) / f'{start // config.per_shard:05d}.tar'
    with atomic_write(shard, shard.with_suffix('.tmp')) as tmp, wds.TarWriter(str(tmp)) as writer:
        for i in range(start, stop):
            image, description = make_scene(config.seed, split, i, config)
            buf = io.BytesIO()
            image.save(buf, 'JPEG', quality=92)
            writer.write({'__key__': f'{i:09d}', 'jpg': buf.getvalue(), 'txt': description['caption'],
                          'json': json.dumps(description).encode()})
    return stop - start


def write_split(out_dir, split: str, config: CorpusConfig, progress=print) -> int:
    """Shards of one split into OUT_DIR/<split>/, then its sizes.json. Returns the sample count."""
    directory = Path(out_dir) / split
    directory.mkdir(parents=True, exist_ok=True)
    for old in directory.glob('*.tar'):
        old.unlink()  # a split is written whole; a shorter new one leaves no stale shard behind
    total = getattr(config, split)
    for start in range(0, total, config.per_shard):
        write_shard(directory, split, start, config)
        if progress:
            progress(f'  {split}: {min(total, start + config.per_shard):,}/{total:,} scenes')
    return write_sizes(directory).total


def read_manifest(out_dir) -> Optional[Dict]:
    """The corpus's manifest; None without one; a DataError naming a damaged one."""
    path = Path(out_dir) / MANIFEST
    if not path.exists():
        return None
    fix = f'write the corpus again with python -m diffzoo.data synthetic {out_dir} --fresh'
    try:
        manifest = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:  # JSONDecodeError, UnicodeDecodeError, a folder of that name
        raise DataError(f'{path}: unreadable ({type(exc).__name__}: {exc}); {fix}') from None
    if not isinstance(manifest, dict):
        raise DataError(f'{path}: a JSON {type(manifest).__name__}, not the corpus\'s manifest; {fix}')
    return manifest


def write_corpus(out_dir, config: CorpusConfig = CorpusConfig(), fresh: bool = False, progress=print) -> Dict:
    """Write every split, or reuse a finished corpus made with the same settings (unless `fresh`).

    The manifest goes first without its sample counts and is completed last, so a corpus interrupted half-way is
    rewritten, not reused; shards in a folder without a manifest (not a corpus this wrote) are refused unless
    `fresh`, as writing would delete them."""
    out_dir = Path(out_dir)
    manifest = None if fresh else read_manifest(out_dir)
    if manifest is not None and manifest.get('samples') is not None and manifest.get('config') == asdict(config):
        if progress:
            counts = ', '.join(f'{split} {manifest["samples"][split]:,}' for split in SPLITS)
            progress(f'synthetic corpus in {out_dir}: reusing it ({counts} scenes)')
        return manifest
    if manifest is None and not fresh:
        for split in SPLITS:
            held = sorted((out_dir / split).glob('*.tar'))
            if held:
                raise DataError(f'{out_dir / split} holds {len(held)} shard(s) ({held[0].name}, …) and {out_dir} has '
                                f'no {MANIFEST}: not a synthetic corpus, and writing one would delete them; choose '
                                f'an empty folder, or pass --fresh to replace them')
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out_dir / MANIFEST, {'config': asdict(config), 'samples': None})  # unfinished until counted
    if progress:
        progress(f'synthetic corpus -> {out_dir} (seed {config.seed}, {config.image_size} px)')
    samples = {split: write_split(out_dir, split, config, progress) for split in SPLITS}
    manifest = {'config': asdict(config), 'samples': samples, 'classes': class_names()}
    atomic_write_json(out_dir / MANIFEST, manifest)
    return manifest


def class_names() -> Dict[str, List[str]]:
    """Zero-shot classification tasks of the corpus: the subject's shape and colour."""
    return {'shape': list(SHAPES), 'colour': list(COLOURS)}


# POPE-style object-presence questions (Li et al., 2023), over the corpus's 18 object classes (colour + shape)


def object_classes() -> List[str]:
    """The object classes presence questions ask about: 'red circle', … (colour and shape; size aside)."""
    return [f'{c} {s}' for c in COLOURS for s in SHAPES]


def scene_objects(description: Dict) -> List[str]:
    """The object classes a scene holds, in the order its caption names them."""
    return list(dict.fromkeys(f'{o["colour"]} {o["shape"]}' for o in description['objects']))


def presence_question(name: str) -> str:
    return f'Is there a {name} in the image?'


def class_frequency(descriptions: List[Dict]) -> Dict[str, int]:
    """How many scenes hold each object class (POPE's 'popular' negatives are the most frequent absent ones)."""
    counts = {name: 0 for name in object_classes()}
    for d in descriptions:
        for name in scene_objects(d):
            counts[name] += 1
    return counts


def pope_negatives(description: Dict, split: str, rng: random.Random, frequency: Dict[str, int]) -> List[str]:
    """As many absent object classes as the scene holds, chosen as POPE chooses them: `random` at random,
    `popular` the most frequent in the corpus (`class_frequency`), `adversarial` the ones most easily
    confused with the scene's own. POPE's adversarial negatives co-occur most often with the present
    objects; in this corpus any two classes co-occur equally often by construction, so its analogue here
    is a class sharing the colour or the shape of a present object (random among those)."""
    present = scene_objects(description)
    absent = [c for c in object_classes() if c not in present]
    k = len(present)
    if split == 'random':
        return rng.sample(absent, k)
    if split == 'popular':
        return sorted(absent, key=lambda c: (-frequency[c], c))[:k]
    if split == 'adversarial':
        near = [c for c in absent if any(c.split()[0] == p.split()[0] or c.split()[1] == p.split()[1]
                                         for p in present)]
        return rng.sample(near, min(k, len(near))) + rng.sample([c for c in absent if c not in near],
                                                                k - min(k, len(near)))
    raise ValueError(f'POPE split {split!r}: one of {POPE_SPLITS}')
