"""λ and the sub-norm at their own learning rate inside open_clip_train (`lambda_lr` in a recipe).

open_clip_train builds one AdamW over two groups (no weight decay for gains and biases, `--wd` for the
rest) and its schedulers set every group's lr to the schedule's value. For one run, `python -m
diffzoo.train` puts three things in their place as `open_clip_train.main` and its scheduler see them:
`create_model_and_transforms` notes the model's differential parameters (each `DifferentialAttention`'s
`LAMBDA_PARAMETERS`: λ_q1 … λ_k2, v2's W_λ, the sub-norm weights), `optim.AdamW` moves them into groups of their own (same weight decay as
where they were) carrying `lr_scale` = lambda_lr / lr, and `assign_learning_rate` sets each group's lr to
the schedule's value × its `lr_scale` (1 for the others), so warm-up and decay apply to both rates.
A resumed run reads its checkpoint's optimizer state into this run's groups and keeps this run's `lr_scale`, so
a changed lambda_lr applies from the resume on; a checkpoint grouped otherwise (a run without lambda_lr) is
refused by name.
"""
import functools
from typing import Iterable, Set

import torch

from diffzoo.layers import DifferentialAttention
from diffzoo.layers.lambdas import LAMBDA_PARAMETERS


def differential_parameter_ids(model: torch.nn.Module) -> Set[int]:
    """The λ, W_λ and sub-norm parameters of every differential layer in `model`."""
    return {id(p) for m in model.modules() if isinstance(m, DifferentialAttention)
            for name, p in m.named_parameters() if name.split('.')[0] in LAMBDA_PARAMETERS}


def model_creator(original, noted: Set[int]):
    @functools.wraps(original)
    def create_model_and_transforms(*args, **kwargs):
        result = original(*args, **kwargs)
        noted.update(differential_parameter_ids(result[0]))
        return result
    return create_model_and_transforms


def split_groups(groups: Iterable[dict], noted: Set[int], lr_scale: float) -> list:
    """open_clip_train's parameter groups with the noted parameters moved to groups of their own."""
    out = []
    for group in groups:
        params = list(group['params'])
        rest = [p for p in params if id(p) not in noted]
        moved = [p for p in params if id(p) in noted]
        if rest:
            out.append({**group, 'params': rest})
        if moved:
            out.append({**group, 'params': moved, 'lr_scale': lr_scale})
    return out


class OptimWithLambdaGroups:
    """`torch.optim` whose AdamW puts the noted parameters in their own groups (`split_groups`)."""

    def __init__(self, optim, noted: Set[int], lr_scale: float):
        self._optim, self._noted, self._lr_scale = optim, noted, lr_scale

    def __getattr__(self, name):
        return getattr(self._optim, name)

    def AdamW(self, params, *args, **kwargs):  # noqa: N802  (torch's name)
        if not self._noted:
            raise ValueError('lambda_lr: the model has no differential parameters (λ, W_λ, sub-norm) to give their '
                             'own learning rate; leave lambda_lr out or train a differential model')
        optimizer = self._optim.AdamW(split_groups(params, self._noted, self._lr_scale), *args, **kwargs)
        optimizer.load_state_dict = _keeping_lr_scale(optimizer, optimizer.load_state_dict)
        return optimizer


def _keeping_lr_scale(optimizer, original):
    """`optimizer.load_state_dict` (a resume) that keeps this run's groups and `lr_scale`: the checkpoint's
    state is read into them, so a resumed run trains λ at the lambda_lr it is given now; a checkpoint from a
    run with another grouping (without lambda_lr, or before it) is named."""
    def load_state_dict(state_dict):
        scales = [g.get('lr_scale') for g in optimizer.param_groups]
        saved = len(state_dict.get('param_groups', []))
        if saved != len(scales):
            raise ValueError(f'lambda_lr: the checkpoint\'s optimizer has {saved} parameter groups and this run has '
                             f'{len(scales)} (λ and the sub-norm in groups of their own); resume with the lambda_lr '
                             f'setting the run started with, or start a new run (--name NEW)')
        original(state_dict)
        for group, scale in zip(optimizer.param_groups, scales):
            if scale is None:
                group.pop('lr_scale', None)
            else:
                group['lr_scale'] = scale
    return load_state_dict


def assign_learning_rate(optimizer, new_lr):
    for group in optimizer.param_groups:
        group['lr'] = new_lr * group.get('lr_scale', 1.0)
