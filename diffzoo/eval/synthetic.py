"""Zero-shot classification and retrieval on the synthetic corpus's validation split.

Zero-shot: for each class of a task (the subject's shape, or its colour) the text embedding is the
mean of the normalised embeddings of every caption-style prompt that names it, over every value of
the attributes the task does not ask about — "a small red circle", "a large red circle", "a small
blue circle", … for *circle* — then normalised again (CLIP's prompt ensembling, with the other
attributes marginalised). The prediction is the class of highest cosine similarity; top-1 accuracy.

Retrieval: many scenes share a caption ("a small red circle"), so captions are deduplicated. Image →
text: the gallery is the distinct captions and a hit is the image's own caption in the top k.
Text → image: each distinct caption queries all images and a hit is any image with that caption
in the top k. Both are reported as R@1, R@5, R@10 in percent.
"""
import io
import json
import tarfile
from pathlib import Path
from typing import Dict, Iterator, List, Sequence, Tuple

import torch

from diffzoo.data.shards import SIZES_FILE, DataError, iter_samples, list_shards, read_sizes
from diffzoo.data.synthetic import COLOURS, SHAPES, SIZES, class_names

RECALL_AT = (1, 5, 10)
METRICS = ('zero_shot_shape', 'zero_shot_colour', *(f'{d}_R@{k}' for d in ('image_to_text', 'text_to_image')
                                                       for k in RECALL_AT))
TRIALS = 'val scenes; distinct captions for text→image'  # what one trial of a metric is (`trials`)


def prompts(task: str) -> Dict[str, List[str]]:
    """Caption-style prompts for every class of `task` ('shape' or 'colour')."""
    if task == 'shape':
        return {s: [f'a {size} {c} {s}' for size in SIZES for c in COLOURS] for s in SHAPES}
    if task == 'colour':
        return {c: [f'a {size} {c} {s}' for size in SIZES for s in SHAPES] for c in COLOURS}
    raise ValueError(f'unknown task {task!r}; the synthetic corpus has shape and colour')


def _corpus_fix(directory: Path) -> str:
    return (f'check it with python -m diffzoo.data check {directory}, and write the corpus again with '
            f'python -m diffzoo.data synthetic {directory.parent} --fresh')


def _shard_samples(shard: Path, directory: Path) -> Iterator[Tuple[str, Dict[str, bytes]]]:
    """iter_samples, with a shard that cannot be read to the end named (and the last sample read)."""
    key = None
    try:
        for key, members in iter_samples(shard):
            yield key, members
    except (tarfile.TarError, OSError, EOFError) as exc:
        after = f' after sample {key}' if key is not None else ''
        raise DataError(f'{shard}: unreadable{after} ({type(exc).__name__}: {exc}); {_corpus_fix(directory)}') \
            from None


def split_shards(directory: Path) -> Tuple[List[Path], Dict[str, int]]:
    """A split's shards and its sizes.json ({} without one). A split without shards, and one missing a shard its
    sizes.json lists (deleted or moved: its samples would be left out of every metric), are DataErrors naming it."""
    if not directory.is_dir() or not any(directory.glob('*.tar')):
        raise DataError(f'no shards in {directory}; write the corpus with python -m diffzoo.data synthetic '
                        f'{directory.parent} --fresh')
    shards, sizes = list_shards(directory), read_sizes(directory) or {}
    gone = sorted(set(sizes) - {shard.name for shard in shards})
    if gone:
        shown = ', '.join(gone[:3]) + (' …' if len(gone) > 3 else '')
        raise DataError(f'{directory}: {len(gone)} shard(s) its {SIZES_FILE} lists are not there ({shown}; '
                        f'{sum(sizes[name] for name in gone)} samples); put them back, or '
                        f'{_corpus_fix(directory)}')
    return shards, sizes


def _scene(members: Dict[str, bytes], shard: Path, key: str, directory: Path) -> Dict:
    try:
        return json.loads(members['json'])
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise DataError(f'{shard} sample {key}: its json does not decode ({type(exc).__name__}: {exc}); '
                        f'{_corpus_fix(directory)}') from None


def load_split(directory, preprocess, limit: int = 0) -> Tuple[torch.Tensor, List[Dict]]:
    """Preprocessed images (N, 3, H, W) and the scene descriptions of a split's shards, in key order.
    A shard or sample that does not read, a shard holding fewer samples than its sizes.json says
    (a tar cut at a member boundary reads without error) and a shard it lists that is gone (`split_shards`) are
    DataErrors naming it."""
    from PIL import Image

    directory = Path(directory)
    shards, sizes = split_shards(directory)
    images, scenes = [], []
    for shard in shards:
        read = 0
        for key, members in _shard_samples(shard, directory):
            if limit and len(scenes) == limit:
                break
            missing = [ext for ext in ('jpg', 'json') if ext not in members]
            if missing:
                raise DataError(f'{shard} sample {key}: no {" or ".join(missing)} member; {_corpus_fix(directory)}')
            try:
                with Image.open(io.BytesIO(members['jpg'])) as image:
                    rgb = image.convert('RGB')
            except (OSError, ValueError, Image.DecompressionBombError) as exc:  # PIL's
                raise DataError(f'{shard} sample {key}: does not decode ({type(exc).__name__}: {exc}); '
                                f'{_corpus_fix(directory)}') from None
            images.append(preprocess(rgb))
            scenes.append(_scene(members, shard, key, directory))
            read += 1
        else:
            if shard.name in sizes and read != sizes[shard.name] and not (limit and len(scenes) == limit):
                raise DataError(f'{shard}: {read} samples, but {directory / SIZES_FILE} says {sizes[shard.name]} '
                                f'(a shard cut short?); {_corpus_fix(directory)}')
        if limit and len(scenes) == limit:
            break
    if not scenes:
        raise DataError(f'{directory}: no samples in its shards; {_corpus_fix(directory)}')
    return torch.stack(images), scenes


@torch.no_grad()
def encode_texts(model, tokenizer, texts: Sequence[str], batch_size: int = 256) -> torch.Tensor:
    device = _device(model)
    out = [model.encode_text(tokenizer(list(texts[i:i + batch_size])).to(device), normalize=True)
           for i in range(0, len(texts), batch_size)]
    return torch.cat(out).float().cpu()


@torch.no_grad()
def encode_images(model, images: torch.Tensor, batch_size: int = 256) -> torch.Tensor:
    device = _device(model)
    out = [model.encode_image(images[i:i + batch_size].to(device), normalize=True)
           for i in range(0, len(images), batch_size)]
    return torch.cat(out).float().cpu()


def _device(model) -> torch.device:
    """Where the model's weights are (inputs go there, features come back to the CPU)."""
    return next(model.parameters()).device


def zero_shot_accuracy(image_features: torch.Tensor, scenes: List[Dict], model, tokenizer, task: str) -> float:
    classes = prompts(task)
    weights = torch.stack([encode_texts(model, tokenizer, texts).mean(0) for texts in classes.values()])
    weights = torch.nn.functional.normalize(weights, dim=-1)  # (classes, D)
    predicted = (image_features @ weights.T).argmax(dim=1)
    truth = torch.tensor([list(classes).index(s[task]) for s in scenes])
    return 100.0 * (predicted == truth).float().mean().item()


def recall_at_k(similarity: torch.Tensor, own: torch.Tensor, ks: Sequence[int] = RECALL_AT) -> Dict[str, float]:
    """R@k both ways from `similarity` (N images, C distinct captions) and `own` (N,), each image's caption."""
    n_images, n_captions = similarity.shape
    metrics = {}
    for k in ks:
        top_texts = similarity.topk(min(k, n_captions), dim=1).indices  # (N, k)
        metrics[f'image_to_text_R@{k}'] = 100.0 * (top_texts == own[:, None]).any(1).float().mean().item()
        top_images = similarity.T.topk(min(k, n_images), dim=1).indices  # (C, k)
        hits = (own[top_images] == torch.arange(n_captions)[:, None]).any(1)
        metrics[f'text_to_image_R@{k}'] = 100.0 * hits.float().mean().item()
    return metrics


def retrieval_recall(image_features: torch.Tensor, scenes: List[Dict], model, tokenizer) -> Dict[str, float]:
    captions = sorted({s['caption'] for s in scenes})
    own = torch.tensor([captions.index(s['caption']) for s in scenes])
    return recall_at_k(image_features @ encode_texts(model, tokenizer, captions).T, own)


def trials(scenes: List[Dict]) -> Dict[str, int]:
    """How many trials each metric counts hits over: every val scene (zero-shot, image→text), every distinct caption
    (text→image: `retrieval_recall` queries with each caption once)."""
    captions = len({s['caption'] for s in scenes})
    return {m: captions if m.startswith('text_to_image') else len(scenes) for m in METRICS}


def chance() -> Dict[str, float]:
    """Accuracy of guessing, in percent: 1/classes for zero-shot; retrieval chance needs no row of its own."""
    return {f'zero_shot_{task}': 100.0 / len(names) for task, names in class_names().items()}


def scenes(val_dir) -> List[Dict]:
    """The scene descriptions of a split's shards, in key order (their images left unread)."""
    directory = Path(val_dir)
    return [_scene(members, shard, key, directory) for shard in split_shards(directory)[0]
            for key, members in _shard_samples(shard, directory) if 'json' in members]


def evaluate(model, preprocess, tokenizer, val_dir, limit: int = 0) -> Dict[str, float]:
    """Every metric of the corpus for one model: zero-shot shape and colour accuracy, retrieval recall."""
    model.eval()
    images, scenes = load_split(Path(val_dir), preprocess, limit)
    image_features = encode_images(model, images)
    metrics = {f'zero_shot_{task}': zero_shot_accuracy(image_features, scenes, model, tokenizer, task)
               for task in class_names()}
    metrics.update(retrieval_recall(image_features, scenes, model, tokenizer))
    return metrics
