"""What each kind of dataset `python -m diffzoo.eval` takes supports and how it runs: `suite_for(dataset)` chooses
the kind once, and the runner asks it the rest.

    CLIP_benchmark classification sets   zeroshot_classification (auto), linear_probe, fewshot
    wds/mscoco_captions, wds/flickr8k, …  zeroshot_retrieval (auto)
    synthetic   (the corpus directory)    zeroshot_classification + zeroshot_retrieval (auto), fewshot
    mmvp        (the MMVP-VLM folder)      mmvp (auto)
"""
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch
from timm.layers import to_2tuple

from diffzoo.data.synthetic import class_names

from . import benchmark, fewshot, mmvp, synthetic
from .options import MMVP, SYNTHETIC, EvalError

Results = Dict[str, Dict[str, float]]  # {task: {metric: value}}
DUMMY_SIZE = (224, 224)  # CLIP_benchmark's Dummy images


@dataclass(frozen=True)
class RunSettings:
    """How `python -m diffzoo.eval` runs every task: the device, autocast, data loading, few-shot and linear-probe
    settings."""
    device: str
    amp: bool
    batch_size: int
    workers: int
    fewshot: fewshot.FewShotConfig
    lp_epochs: int
    lp_lr: float


class Suite:
    """One kind of dataset (module docstring), for `dataset`: the tasks it supports and runs by default, the check
    of its local copy, its counted metrics, and one task run for a model."""
    supported: Tuple[str, ...] = ()
    default: Tuple[str, ...] = ()
    trials: Optional[str] = None  # what one trial of its counted metrics is (`counted`); None: it counts none

    def __init__(self, dataset: str):
        self.dataset = dataset

    def tasks(self, asked: List[str]) -> List[str]:
        """The tasks to run: the defaults for 'auto' (or nothing asked), plus those asked that the dataset has."""
        tasks = list(self.default) if not asked or 'auto' in asked else []
        return list(dict.fromkeys(tasks + [t for t in asked if t in self.supported]))

    def check(self, root: Optional[Path], tasks: List[str]) -> None:
        """Fail before any model is loaded when the dataset's local copy is missing."""
        raise NotImplementedError

    def counted(self, root: Optional[Path]) -> Dict[str, Tuple[int, Optional[float]]]:
        """{metric: (trials, chance level or None)} for the metrics that are shares of hits over counted trials."""
        return {}

    def run(self, loaded, root: Optional[Path], task: str, settings: RunSettings, progress: Callable) -> Results:
        raise NotImplementedError


class LocalSuite(Suite):
    """A dataset read from a local folder only (no URL root)."""

    def check(self, root: Optional[Path], tasks: List[str]) -> None:
        if benchmark.is_url(root):
            raise benchmark.DatasetMissing(f'--dataset {self.dataset}: --dataset-root {root} is a URL; '
                                           f'{self.dataset} is read from a local folder only')


class SyntheticSuite(LocalSuite):
    """diffzoo's synthetic corpus: one zero-shot pass answers classification and retrieval at once."""
    supported = ('zeroshot_classification', 'zeroshot_retrieval', 'fewshot')
    default = ('zeroshot_classification',)
    trials = synthetic.TRIALS

    def tasks(self, asked: List[str]) -> List[str]:
        """As `Suite.tasks`, the zero-shot pass run once however many of its two tasks are asked (it writes both)."""
        zero_shot = ('zeroshot_classification', 'zeroshot_retrieval')
        return list(dict.fromkeys(zero_shot[0] if task in zero_shot else task for task in super().tasks(asked)))

    def check(self, root: Optional[Path], tasks: List[str]) -> None:
        super().check(root, tasks)
        val = None if root is None else root / 'val'
        if val is None or not val.is_dir() or not any(val.glob('*.tar')):
            raise benchmark.DatasetMissing(
                f'--dataset {SYNTHETIC}: no shards in {val or "CORPUS_DIR/val"}; write the corpus with '
                f'`python -m diffzoo.data synthetic CORPUS_DIR` and pass --dataset-root CORPUS_DIR')
        synthetic.split_shards(val)  # every shard its sizes.json lists is there

    def counted(self, root: Optional[Path]) -> Dict[str, Tuple[int, Optional[float]]]:
        n, guess = synthetic.trials(synthetic.scenes(root / 'val')), synthetic.chance()
        return {metric: (n[metric], guess.get(metric)) for metric in synthetic.METRICS}

    def run(self, loaded, root: Optional[Path], task: str, settings: RunSettings, progress: Callable) -> Results:
        if task != 'fewshot':
            metrics = synthetic.evaluate(loaded.model, loaded.preprocess, loaded.tokenizer, root / 'val')
            return {'zeroshot_classification': {k: v for k, v in metrics.items() if k.startswith('zero_shot_')},
                    'zeroshot_retrieval': {k: v for k, v in metrics.items() if '_R@' in k}}
        images, scenes = synthetic.load_split(root / 'val', loaded.preprocess)
        features = synthetic.encode_images(loaded.model, images)
        out = {}
        for attribute, names in class_names().items():  # the subject's shape, and its colour
            labels = torch.tensor([names.index(s[attribute]) for s in scenes])
            out.update({f'{attribute}_{k}': v
                        for k, v in fewshot.evaluate(features, labels, settings.fewshot, progress).items()})
        return {task: out}


class MMVPSuite(LocalSuite):
    """MMVP-VLM's 150 image pairs."""
    supported = default = ('mmvp',)

    def check(self, root: Optional[Path], tasks: List[str]) -> None:
        super().check(root, tasks)
        mmvp.read_pairs(root if root is not None else Path('.'))

    def run(self, loaded, root: Optional[Path], task: str, settings: RunSettings, progress: Callable) -> Results:
        return {task: mmvp.evaluate(loaded, root, settings.device)}


class BenchmarkSuite(Suite):
    """A CLIP_benchmark dataset: a classification set (zero-shot, linear probe, few-shot on its image features) or a
    retrieval set (zero-shot retrieval)."""

    def __init__(self, dataset: str):
        benchmark.check_known(dataset)
        super().__init__(dataset)
        task = benchmark.default_task(dataset)
        self.default = (task,)
        self.supported = ('zeroshot_classification', 'linear_probe', 'fewshot') \
            if task == 'zeroshot_classification' else (task,)

    def check(self, root: Optional[Path], tasks: List[str]) -> None:
        benchmark.check_local(self.dataset, root, 'test')
        if 'linear_probe' in tasks:
            benchmark.check_local(self.dataset, root, benchmark.train_split(self.dataset))

    def run(self, loaded, root: Optional[Path], task: str, settings: RunSettings, progress: Callable) -> Results:
        dataset, common = self.dataset, dict(device=settings.device, batch_size=settings.batch_size,
                                             workers=settings.workers)
        if task == 'fewshot':
            features, labels = benchmark.image_features(loaded, dataset, root, **common)
            try:
                return {task: fewshot.evaluate(features, labels, settings.fewshot, progress)}
            except EvalError as exc:
                raise EvalError(f'--dataset {dataset}: {exc}') from None
        run = {'zeroshot_classification': benchmark.zero_shot_classification,
               'zeroshot_retrieval': benchmark.zero_shot_retrieval,
               'linear_probe': functools.partial(benchmark.linear_probe, epochs=settings.lp_epochs, lr=settings.lp_lr,
                                                 seed=settings.fewshot.seed)}[task]
        return {task: run(loaded, dataset, root, amp=settings.amp, **common)}


class DummySuite(BenchmarkSuite):
    """CLIP_benchmark's `dummy` smoke-test set: zero images of 224 × 224 pixels, made without the model's transform."""

    def run(self, loaded, root: Optional[Path], task: str, settings: RunSettings, progress: Callable) -> Results:
        size = tuple(to_2tuple(loaded.model.visual.image_size))
        if size != DUMMY_SIZE:
            raise EvalError(f'--dataset {self.dataset}: CLIP_benchmark gives 224 × 224 images, whatever the model\'s '
                            f'transform, and {loaded.spec.name} takes {size[0]} × {size[1]}; add --force-image-size '
                            f'224, or evaluate on a dataset read through the model\'s transform')
        return super().run(loaded, root, task, settings, progress)


def suite_for(dataset: str) -> Suite:
    """The kind of `dataset` (an unknown CLIP_benchmark name is refused here, naming the known ones)."""
    kinds = {SYNTHETIC: SyntheticSuite, MMVP: MMVPSuite, benchmark.DUMMY: DummySuite}
    return kinds.get(dataset, BenchmarkSuite)(dataset)


def check_tasks(suites: List[Suite], asked: List[str]) -> None:
    """A task asked for that none of the datasets has is a mistake, not something to skip quietly."""
    for task in dict.fromkeys(asked):
        if task != 'auto' and not any(task in s.supported for s in suites):
            has = '; '.join(f'{s.dataset}: {", ".join(s.supported)}' for s in suites)
            raise EvalError(f'--task {task}: none of the datasets has it ({has})')
