"""Which tasks each dataset supports, the check of its local copy, and running one (dataset, task) for a model.

    CLIP_benchmark classification sets   zeroshot_classification (auto), linear_probe, fewshot
    wds/mscoco_captions, wds/flickr8k, …  zeroshot_retrieval (auto)
    synthetic   (the corpus directory)    zeroshot_classification + zeroshot_retrieval (auto), fewshot
    mmvp        (the MMVP-VLM folder)      mmvp (auto)
"""
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

from diffzoo.data.shards import list_shards
from diffzoo.data.synthetic import class_names

from . import benchmark, fewshot, mmvp, synthetic
from .models import EvalError
from .options import MMVP, SYNTHETIC


TRIALS = {SYNTHETIC: synthetic.TRIALS}  # what one trial of a dataset's counted metrics is (`counted`)


def supported_tasks(dataset: str):
    """(every task `dataset` supports, its default ones)."""
    if dataset == SYNTHETIC:
        return ('zeroshot_classification', 'zeroshot_retrieval', 'fewshot'), ['zeroshot_classification']
    if dataset == MMVP:
        return ('mmvp',), ['mmvp']
    default = benchmark.default_task(dataset)
    if default != 'zeroshot_classification':
        return (default,), [default]
    return ('zeroshot_classification', 'linear_probe', 'fewshot'), [default]


def tasks_for(dataset: str, asked: List[str]) -> List[str]:
    """The tasks to run on `dataset`: its defaults for 'auto' (or nothing asked), plus those asked that it has."""
    supported, auto = supported_tasks(dataset)
    tasks = auto if not asked or 'auto' in asked else []
    return list(dict.fromkeys(tasks + [t for t in asked if t in supported]))


def check_tasks(datasets: List[str], asked: List[str]) -> None:
    """A task asked for that none of the datasets has is a mistake, not something to skip quietly."""
    for task in dict.fromkeys(asked):
        if task != 'auto' and not any(task in supported_tasks(d)[0] for d in datasets):
            has = '; '.join(f'{d}: {", ".join(supported_tasks(d)[0])}' for d in datasets)
            raise EvalError(f'--task {task}: none of the datasets has it ({has})')


def check_dataset(dataset: str, root: Optional[Path], tasks: List[str]) -> None:
    """Fail before any model is loaded when a dataset's local copy is missing."""
    if dataset in (SYNTHETIC, MMVP) and benchmark.is_url(root):
        raise benchmark.DatasetMissing(f'--dataset {dataset}: --dataset-root {root} is a URL; {dataset} is read '
                                       f'from a local folder only')
    if dataset == SYNTHETIC:
        val = None if root is None else root / 'val'
        if val is None or not val.is_dir() or not list_shards(val):
            raise benchmark.DatasetMissing(
                f'--dataset {SYNTHETIC}: no shards in {val or "CORPUS_DIR/val"}; write the corpus with '
                f'`python -m diffzoo.data synthetic CORPUS_DIR` and pass --dataset-root CORPUS_DIR')
    elif dataset == MMVP:
        mmvp.read_pairs(root if root is not None else Path('.'))
    else:
        benchmark.check_local(dataset, root, 'test')
        if 'linear_probe' in tasks:
            benchmark.check_local(dataset, root, benchmark.train_split(dataset))


def counted(dataset: str, root: Optional[Path]) -> Dict[str, Tuple[int, Optional[float]]]:
    """{metric: (trials, chance level or None)} for the metrics of `dataset` that are shares of hits over counted
    trials (the synthetic corpus's zero-shot and retrieval); the others are absent."""
    if dataset != SYNTHETIC:
        return {}
    n, guess = synthetic.trials(synthetic.scenes(root / 'val')), synthetic.chance()
    return {metric: (n[metric], guess.get(metric)) for metric in synthetic.METRICS}


def run(loaded, dataset: str, root: Optional[Path], task: str, device: str, amp: bool, batch_size: int,
        workers: int, fewshot_config: fewshot.FewShotConfig, lp_epochs: int, lp_lr: float,
        progress=print) -> Dict[str, Dict[str, float]]:
    """{task: {metric: value}} for one model on one dataset (the synthetic corpus answers two tasks at once)."""
    if dataset == SYNTHETIC:
        return _synthetic(loaded, root, task, fewshot_config, progress)
    if dataset == MMVP:
        return {task: mmvp.evaluate(loaded, root, device)}
    common = dict(device=device, batch_size=batch_size, workers=workers)
    if task == 'zeroshot_classification':
        return {task: benchmark.zero_shot_classification(loaded, dataset, root, amp=amp, **common)}
    if task == 'zeroshot_retrieval':
        return {task: benchmark.zero_shot_retrieval(loaded, dataset, root, amp=amp, **common)}
    if task == 'linear_probe':
        return {task: benchmark.linear_probe(loaded, dataset, root, amp=amp, epochs=lp_epochs, lr=lp_lr,
                                             seed=fewshot_config.seed, **common)}
    features, labels = benchmark.image_features(loaded, dataset, root, **common)
    try:
        return {task: fewshot.evaluate(features, labels, fewshot_config, progress)}
    except EvalError as exc:
        raise EvalError(f'--dataset {dataset}: {exc}') from None


def _synthetic(loaded, root: Path, task: str, config: fewshot.FewShotConfig, progress) -> Dict[str, Dict[str, float]]:
    if task != 'fewshot':
        metrics = synthetic.evaluate(loaded.model, loaded.preprocess, loaded.tokenizer, root / 'val')
        return {'zeroshot_classification': {k: v for k, v in metrics.items() if k.startswith('zero_shot_')},
                'zeroshot_retrieval': {k: v for k, v in metrics.items() if '_R@' in k}}
    images, scenes = synthetic.load_split(root / 'val', loaded.preprocess)
    features = synthetic.encode_images(loaded.model, images)
    out = {}
    for attribute, names in class_names().items():  # the subject's shape, and its colour
        labels = torch.tensor([names.index(s[attribute]) for s in scenes])
        out.update({f'{attribute}_{k}': v for k, v in fewshot.evaluate(features, labels, config, progress).items()})
    return {task: out}
