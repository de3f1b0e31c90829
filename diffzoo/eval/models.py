"""The models an evaluation compares, and loading them through open_clip (after `import diffzoo`).

A model is `NAME[,PRETRAINED]` — CLIP_benchmark's own `model,pretrained` spelling — where NAME is
any registered open_clip model and PRETRAINED is a checkpoint file (an open_clip_train
`epoch_K.pt`, an official DiffCLIP `checkpoint_best.pt`, a state dict) or a pretrained tag of NAME
(`cc3m`). Without PRETRAINED the model is randomly initialised from `--seed`.

A training run directory (`runs/NAME/`) gives its checkpoints `checkpoints/epoch_K.pt`; the model
name and the image normalisation it was trained with come from the run's `diffzoo-run.json`
(written by `python -m diffzoo.train`), or open_clip_train's own `params.txt`.
"""
import difflib
import hashlib
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from diffzoo.checkpoint import PARAMS_TXT, RUN_CONFIG, run_settings

from .options import EvalError

RUN_TRANSFORM_KWARGS = ('image_mean', 'image_std', 'image_interpolation')  # run flags create_model_and_transforms takes
HASH_CHARS = 12


@dataclass(frozen=True)
class ModelSpec:
    name: str
    pretrained: Optional[str] = None  # a file, a tag, or None (random init)
    epoch: Optional[int] = None  # set for the checkpoints of a training run
    preprocess: Dict = field(default_factory=dict, hash=False, compare=False)  # create_model_and_transforms kwargs

    @property
    def label(self) -> str:
        """The column header of this model in the results table."""
        if self.epoch is not None:
            return f'epoch {self.epoch}'
        if self.pretrained is None:
            return f'{self.name} (random)'
        shown = os.path.basename(self.pretrained) if os.path.isfile(self.pretrained) else self.pretrained
        return f'{self.name},{shown}'

    @property
    def long_label(self) -> str:
        """The column header where another model has the same `label`: the run or the file as given."""
        if self.epoch is not None:
            return f'{Path(self.pretrained).parent.parent} epoch {self.epoch}'
        return f'{self.name},{self.pretrained}' if self.pretrained else self.label


def column_labels(specs: List['ModelSpec']) -> List[str]:
    """Each model's column in the table: its `label`, or its `long_label` where another model shares that label
    (two files named `epoch_1.pt`) and for every checkpoint of a run where there are several runs (`runs/a epoch 2`),
    so no column holds two models. The same weights asked for twice are refused."""
    for i, spec in enumerate(specs):
        if spec in specs[:i]:
            raise EvalError(f'{spec.long_label} is asked for twice (by --model and --run-dir, or twice by one); ask '
                            f'for each model once')
    shared = Counter(spec.label for spec in specs)
    several_runs = len({Path(spec.pretrained).parent for spec in specs if spec.epoch is not None}) > 1
    labels = [spec.long_label if shared[spec.label] > 1 or (several_runs and spec.epoch is not None) else spec.label
              for spec in specs]
    if len(set(labels)) < len(labels):
        clash = next(label for label in labels if labels.count(label) > 1)
        raise EvalError(f'two models would share the column {clash!r}; give their checkpoints by paths that differ')
    return labels


@dataclass
class LoadedModel:
    spec: ModelSpec
    model: object
    preprocess: object
    tokenizer: object
    checkpoint_sha256: Optional[str]


def parse_model(text: str) -> ModelSpec:
    """'diffclip-b16,cc3m' -> ModelSpec('diffclip-b16', 'cc3m'); 'diffclip-tiny' -> random init."""
    name, _, pretrained = text.partition(',')
    name, pretrained = name.strip(), pretrained.strip() or None
    if not name:
        raise EvalError(f'--model {text!r}: give a model name, NAME or NAME,PRETRAINED')
    check_model_name(name, f'--model {text}')
    if pretrained is not None and not os.path.isfile(pretrained):
        import open_clip
        tags = open_clip.list_pretrained_tags_by_model(name)
        if pretrained not in tags:
            known = f'its tags: {", ".join(tags)}' if tags else f'{name} has no pretrained tags'
            raise EvalError(f'--model {text}: {pretrained!r} is neither a checkpoint file nor a pretrained tag '
                            f'of {name} ({known}); pass a path to a .pt/.safetensors file or one of the tags')
    return ModelSpec(name, pretrained)


def check_model_name(name: str, where: str) -> None:
    import open_clip
    known = open_clip.list_models()
    if name not in known:
        close = difflib.get_close_matches(name, known, n=3)
        raise EvalError(f'{where}: {name!r} is not an open_clip model'
                        + (f'; did you mean {", ".join(close)}?' if close else '')
                        + ' (all of them: python -c "import diffzoo, open_clip; print(open_clip.list_models())")')


def run_checkpoints(run_dir, model_name: Optional[str] = None, every: bool = True) -> List[ModelSpec]:
    """The `epoch_K.pt` checkpoints of a training run in epoch order (only the last unless `every`)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise EvalError(f'--run-dir {run_dir}: no such directory; pass a training run directory such as runs/NAME')
    found = {}
    for path in (run_dir / 'checkpoints').glob('epoch_*.pt'):
        m = re.fullmatch(r'epoch_(\d+)\.pt', path.name)
        if m:  # epoch_latest.pt repeats the newest epoch
            found[int(m.group(1))] = path
    if not found:
        raise EvalError(f'--run-dir {run_dir}: no checkpoints/epoch_K.pt in it; train with --save-frequency 1 '
                        f'(the recipes do) or pass a checkpoint with --model NAME,PATH')
    settings = run_settings(run_dir)
    name = model_name or settings.get('model')
    if not name:
        raise EvalError(f'--run-dir {run_dir}: neither {RUN_CONFIG} nor {PARAMS_TXT} names the model; '
                        f'pass --model NAME,{run_dir} (NAME: the open_clip model the run trained)')
    check_model_name(name, f'--run-dir {run_dir}')
    preprocess = {key: settings[key] for key in RUN_TRANSFORM_KWARGS if settings.get(key) is not None}
    epochs = sorted(found) if every else [max(found)]
    return [ModelSpec(name, str(found[k]), epoch=k, preprocess=preprocess) for k in epochs]


_HASHES: Dict[str, str] = {}


def file_sha256(path) -> str:
    """sha256 of a file, first 12 hex digits (remembered per path for this process)."""
    path = os.path.realpath(path)
    if path not in _HASHES:
        digest = hashlib.sha256()
        with open(path, 'rb') as f:
            for block in iter(lambda: f.read(1 << 20), b''):
                digest.update(block)
        _HASHES[path] = digest.hexdigest()[:HASH_CHARS]
    return _HASHES[path]


def checkpoint_file(spec: ModelSpec) -> Optional[str]:
    """The file the weights come from: the path given, or the cached download of a tag; None for random init."""
    if spec.pretrained is None:
        return None
    if os.path.isfile(spec.pretrained):
        return spec.pretrained
    import open_clip
    cfg = open_clip.get_pretrained_cfg(spec.name, spec.pretrained)
    return open_clip.download_pretrained(cfg) or None  # already downloaded: create_model read it from there


def load(spec: ModelSpec, device: str = 'cpu', force_image_size: Optional[int] = None, seed: int = 0) -> LoadedModel:
    """The model in eval mode on `device`, its validation transform and tokenizer, and its checkpoint hash."""
    import open_clip
    import torch
    torch.manual_seed(seed)  # random-init models are the same in every call
    kwargs = dict(spec.preprocess)
    if force_image_size:
        kwargs['force_image_size'] = force_image_size
    try:
        model, _, preprocess = open_clip.create_model_and_transforms(spec.name, pretrained=spec.pretrained, **kwargs)
    except RuntimeError as exc:
        if not force_image_size:
            raise
        # the tower's patch grid resized to the forced size: fewer pixels than one patch leave it empty
        raise EvalError(f'--force-image-size {force_image_size}: {spec.name} cannot take images of that size '
                        f'({exc}); give a size of at least one patch (e.g. 224)') from None
    model = model.to(device).eval()
    path = checkpoint_file(spec)
    return LoadedModel(spec, model, preprocess, open_clip.get_tokenizer(spec.name),
                       file_sha256(path) if path else None)
