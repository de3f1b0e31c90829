"""Zero-shot classification, retrieval and linear probing through CLIP_benchmark, in this process.

The model is built here (`diffzoo.eval.models.load`, so diffzoo's registrations apply) and handed
to CLIP_benchmark's task functions — `metrics.zeroshot_classification.evaluate`,
`metrics.zeroshot_retrieval.evaluate`, `metrics.linear_probe.evaluate` — with datasets from its
`datasets.builder.build_dataset(..., download=False)`. Not `clip_benchmark.cli.run`: it calls
`build_dataset(download=True)`, reloads the model by name for every dataset and writes one JSON
per run. Several of its builders also fetch data whenever the root is missing, whatever
`download` says (ImageNet and its variants with wget, Flickr with kaggle, ImageNetV2 with
requests), so every dataset's local copy is checked here first and a missing one is an error that
names the path and where to get it — nothing is ever downloaded.

Datasets are CLIP_benchmark's names, read from `--dataset-root` exactly as its `--dataset_root`:
the dataset's own folder, or a template such as `/data/{dataset}` for several (`{dataset}` is the
name without `wds/`, `{dataset_cleaned}` the same with `/` -> `-`). `wds/NAME` is CLIP_benchmark's
webdataset export (`ROOT/test/nshards.txt`, `ROOT/test/0.tar`, …; the Hugging Face repository
`clip-benchmark/wds_NAME`); retrieval sets are read only in that form. Metrics are in percent.
"""
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Tuple, Union

import torch

from . import seams
from .models import EvalError

seams.install()  # CLIP_benchmark's accuracy under NumPy 2 (diffzoo.eval.seams)

RECALL_AT = (1, 5, 10)
WDS_REPO = 'https://huggingface.co/datasets/clip-benchmark/wds_{cleaned}'


class DatasetMissing(EvalError):
    pass


@dataclass(frozen=True)
class LocalCopy:
    """Where a torchvision-layout dataset lives under its root, and how to get it."""
    needs: Tuple[str, ...]  # any one of these paths under the root
    how: str
    train_split: Optional[str] = 'train'  # None: no predefined split to train a linear probe on


_IMAGENET_FOLDER = 'an ImageFolder of class folders: extract {tar} into the root'
CLASSIFICATION: Dict[str, LocalCopy] = {
    'imagenet1k': LocalCopy(('val', 'ILSVRC2012_img_val.tar'),
                            'ILSVRC2012_img_val.tar and ILSVRC2012_devkit_t12.tar.gz from image-net.org in the root'),
    'imagenetv2': LocalCopy(('ImageNetV2-matched-frequency',),
                            'imagenetv2-matched-frequency.tar.gz (huggingface.co/datasets/vaishaal/ImageNetV2) '
                            'extracted and renamed ImageNetV2-matched-frequency', train_split=None),
    'imagenet-a': LocalCopy(('.',), _IMAGENET_FOLDER.format(tar='imagenet-a.tar (people.eecs.berkeley.edu/~hendrycks)'),
                            train_split=None),
    'imagenet-r': LocalCopy(('.',), _IMAGENET_FOLDER.format(tar='imagenet-r.tar (people.eecs.berkeley.edu/~hendrycks)'),
                            train_split=None),
    'imagenet_sketch': LocalCopy(('.',), _IMAGENET_FOLDER.format(tar='ImageNet-Sketch.zip (Google Drive id '
                                                                     '1Mj0i5HBthqH1p_yeXzsg22gZduvgoNeA)'),
                                 train_split=None),
    'cifar10': LocalCopy(('cifar-10-batches-py',), 'cifar-10-python.tar.gz (cs.toronto.edu/~kriz) extracted'),
    'cifar100': LocalCopy(('cifar-100-python',), 'cifar-100-python.tar.gz (cs.toronto.edu/~kriz) extracted'),
    'caltech101': LocalCopy(('caltech101/101_ObjectCategories',),
                            '101_ObjectCategories.tar.gz extracted into ROOT/caltech101', train_split=None),
    'dtd': LocalCopy(('dtd/dtd',), 'dtd-r1.0.1.tar.gz (robots.ox.ac.uk/~vgg/data/dtd) extracted into ROOT/dtd'),
    'pets': LocalCopy(('oxford-iiit-pet',), 'images.tar.gz and annotations.tar.gz (robots.ox.ac.uk/~vgg/data/pets) '
                                            'extracted into ROOT/oxford-iiit-pet', train_split='trainval'),
    'flowers': LocalCopy(('flowers-102',), '102flowers.tgz, imagelabels.mat and setid.mat '
                                           '(robots.ox.ac.uk/~vgg/data/flowers/102) in ROOT/flowers-102'),
    'sun397': LocalCopy(('SUN397',), 'SUN397.tar.gz (vision.princeton.edu) extracted', train_split=None),
    'fgvc_aircraft': LocalCopy(('fgvc-aircraft-2013b',), 'fgvc-aircraft-2013b.tar.gz (robots.ox.ac.uk/~vgg) '
                                                         'extracted'),
    'food101': LocalCopy(('food-101',), 'food-101.tar.gz (data.vision.ee.ethz.ch) extracted'),
}
RETRIEVAL = ('wds/mscoco_captions', 'wds/flickr8k', 'wds/flickr30k')
DUMMY = 'dummy'  # CLIP_benchmark's one-image smoke-test set, for offline tests


def short_name(dataset: str) -> str:
    return dataset[len('wds/'):] if dataset.startswith('wds/') else dataset


def is_benchmark_dataset(dataset: str) -> bool:
    return dataset in CLASSIFICATION or dataset == DUMMY or dataset.startswith('wds/')


def default_task(dataset: str) -> str:
    from clip_benchmark.datasets.builder import get_dataset_default_task
    return get_dataset_default_task(short_name(dataset))


def dataset_root(template: Optional[str], dataset: str) -> Union[Path, str, None]:
    """CLIP_benchmark's rule: `--dataset-root` formatted with {dataset} and {dataset_cleaned}; a URL
    (CLIP_benchmark's usual https://huggingface.co/datasets/clip-benchmark/wds_{dataset_cleaned}/tree/main,
    or any http(s) server with the same files) stays a string."""
    if template is None:
        return None
    name = short_name(dataset)
    try:
        root = template.format(dataset=name, dataset_cleaned=name.replace('/', '-'))
    except (KeyError, IndexError, ValueError) as exc:  # an unknown field, a positional one, a lone brace
        raise EvalError(f'--dataset-root {template}: not a template of {{dataset}} and {{dataset_cleaned}} '
                        f'({type(exc).__name__}: {exc}); write a literal brace as {{{{ or }}}}') from None
    return root if is_url(root) else Path(root)


def is_url(root) -> bool:
    return isinstance(root, str) and '://' in root


def check_known(dataset: str) -> None:
    if not (is_benchmark_dataset(dataset) or dataset in RETRIEVAL):
        known = ', '.join(sorted(CLASSIFICATION) + list(RETRIEVAL))
        raise EvalError(f'--dataset {dataset}: not a dataset of this command; CLIP_benchmark datasets: {known}, '
                        f'any wds/NAME, {DUMMY}; and synthetic, mmvp')


def _present(path: Path) -> bool:
    return any(path.iterdir()) if path.is_dir() else path.exists()


def check_local(dataset: str, root: Optional[Path], split: str = 'test') -> None:
    """Raise DatasetMissing, naming the path expected and how to get it, unless the local copy is there."""
    if dataset == DUMMY:
        return
    if dataset.startswith('wds/'):
        cleaned = short_name(dataset).replace('/', '-')
        needs = (f'{split}/nshards.txt',)
        how = (f'git lfs install && git clone {WDS_REPO.format(cleaned=cleaned)} (CLIP_benchmark\'s webdataset '
               f'export: {split}/nshards.txt, {split}/0.tar, …)')
    else:
        check_known(dataset)
        needs, how = CLASSIFICATION[dataset].needs, CLASSIFICATION[dataset].how
    if root is None:
        raise DatasetMissing(f'--dataset {dataset}: pass --dataset-root (its local copy, or a template such as '
                             f'/data/{{dataset}}); get it with: {how}')
    if is_url(root):
        if not dataset.startswith('wds/'):
            raise DatasetMissing(f'--dataset {dataset}: --dataset-root {root} is a URL, which CLIP_benchmark reads '
                                 f'only for its webdataset exports (wds/NAME); pass the local copy: {how}')
        return  # read (streamed) by CLIP_benchmark's webdataset builder
    if not any(_present(root / p) for p in needs):
        expected = ' or '.join(str(root / p) for p in needs)
        raise DatasetMissing(f'--dataset {dataset}: no local copy at {expected} (nothing is downloaded); get it '
                             f'with: {how}; then pass its folder as --dataset-root')


def build(dataset: str, root: Optional[Path], transform, split: str, task: str):
    """CLIP_benchmark's dataset, local copy only, checked first."""
    from clip_benchmark.datasets.builder import build_dataset
    check_local(dataset, root, split)
    try:
        return build_dataset(dataset_name=dataset, root=str(root or '.'), transform=transform, split=split,
                             download=False, task=task)
    except FileNotFoundError as exc:
        if not is_url(root):
            raise
        raise DatasetMissing(f'--dataset {dataset}: --dataset-root {root}: no {split}/nshards.txt could be read '
                             f'there ({exc}); pass the URL of a webdataset export') from None


def loader(dataset: str, ds, batch_size: int, workers: int):
    from clip_benchmark.datasets.builder import get_dataset_collate_fn
    if dataset.startswith('wds/'):
        return torch.utils.data.DataLoader(ds.batched(batch_size), batch_size=None, shuffle=False,
                                           num_workers=workers)
    return torch.utils.data.DataLoader(ds, batch_size=batch_size, shuffle=False, num_workers=workers,
                                       collate_fn=get_dataset_collate_fn(dataset))


def _as_percent(metrics: Dict, keys) -> Dict[str, float]:
    """CLIP_benchmark's fractions as percentages; a metric it could not compute (NaN) is left out."""
    return {k: 100.0 * float(metrics[k]) for k in keys if k in metrics and metrics[k] == metrics[k]}


def zero_shot_classification(loaded, dataset: str, root, device: str, amp: bool, batch_size: int = 64,
                             workers: int = 4) -> Dict[str, float]:
    """Top-1/top-5 accuracy and mean per-class recall, with CLIP_benchmark's class names, prompt ensemble
    (`zero_shot_classifier`) and logits (`run_classification`); the scoring of its `evaluate`."""
    from clip_benchmark.metrics import zeroshot_classification as zsc
    from sklearn.metrics import balanced_accuracy_score
    ds = build(dataset, root, loaded.preprocess, 'test', 'zeroshot_classification')
    classifier = zsc.zero_shot_classifier(loaded.model, loaded.tokenizer, ds.classes, ds.templates, device, amp=amp)
    logits, target = zsc.run_classification(loaded.model, classifier, loader(dataset, ds, batch_size, workers),
                                            device, amp=amp)
    if target.ndim == 2:
        raise EvalError(f'--dataset {dataset} is multi-label; this command scores single-label classification')
    ks = (1, 5) if len(ds.classes) >= 5 else (1,)
    metrics = dict(zip(('acc1', 'acc5'), seams.accuracy(logits, target, ks)))
    metrics['mean_per_class_recall'] = balanced_accuracy_score(target, logits.argmax(1))
    return _as_percent(metrics, ('acc1', 'acc5', 'mean_per_class_recall'))


def zero_shot_retrieval(loaded, dataset: str, root, device: str, amp: bool, batch_size: int = 64,
                        workers: int = 4) -> Dict[str, float]:
    """Image and text retrieval recall@1/5/10 (CLIP-paper recall: a hit if any true match is in the top k)."""
    from clip_benchmark.metrics import zeroshot_retrieval
    ds = build(dataset, root, loaded.preprocess, 'test', 'zeroshot_retrieval')
    metrics = zeroshot_retrieval.evaluate(loaded.model, loader(dataset, ds, batch_size, workers), loaded.tokenizer,
                                          device=device, amp=amp, recall_k_list=list(RECALL_AT))
    return _as_percent(metrics, [f'{d}_retrieval_recall@{k}' for d in ('image', 'text') for k in RECALL_AT])


def train_split(dataset: str) -> str:
    if dataset in CLASSIFICATION and CLASSIFICATION[dataset].train_split is None:
        raise EvalError(f'--dataset {dataset} has no predefined train split to fit a linear probe on; use its '
                        f'webdataset export (wds/{dataset} or wds/vtab/{dataset}), which has train and test')
    return CLASSIFICATION[dataset].train_split if dataset in CLASSIFICATION else 'train'


def linear_probe(loaded, dataset: str, root, device: str, amp: bool, batch_size: int = 64, workers: int = 4,
                 epochs: int = 10, lr: float = 0.1, seed: int = 0) -> Dict[str, float]:
    """CLIP_benchmark's linear probe: a linear layer trained with AdamW and a cosine schedule on frozen,
    normalised image features of the train split, tested on the test split. It needs CUDA."""
    import tempfile

    from clip_benchmark.metrics import linear_probe as probe
    if not str(device).startswith('cuda'):
        raise EvalError(f'--task linear_probe on {dataset}: CLIP_benchmark\'s linear probe runs on CUDA only '
                        f'(its linear_probe.evaluate asserts device == "cuda"); run on a GPU machine')
    split = train_split(dataset)
    check_local(dataset, root, split)
    train = build(dataset, root, loaded.preprocess, split, 'linear_probe')
    test = build(dataset, root, loaded.preprocess, 'test', 'linear_probe')
    with tempfile.TemporaryDirectory(prefix='diffzoo-probe-') as features:  # never a stale cache of other weights
        metrics = probe.evaluate(loaded.model, loader(dataset, train, batch_size, workers),
                                 loader(dataset, test, batch_size, workers), -1, batch_size, workers, lr,
                                 epochs, 'features', seed, features, device='cuda', normalize=True, amp=amp)
    return _as_percent(metrics, ('lp_acc1', 'lp_acc5', 'lp_mean_per_class_recall'))


@torch.no_grad()
def image_features(loaded, dataset: str, root, device: str, batch_size: int = 64, workers: int = 4,
                   split: str = 'test') -> Tuple[torch.Tensor, torch.Tensor]:
    """Normalised image features (N, D) and labels (N,) of a classification dataset's split."""
    ds = build(dataset, root, loaded.preprocess, split, 'zeroshot_classification')
    features, labels = [], []
    for images, target in loader(dataset, ds, batch_size, workers):
        features.append(loaded.model.encode_image(images.to(device), normalize=True).float().cpu())
        labels.append(torch.as_tensor(target))
    return torch.cat(features), torch.cat(labels)

