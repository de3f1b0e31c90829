"""Read the attention maps of every layer of a model on its explicit path.

Differential layers give A1 − λ·A2 (read at `diff_map`); timm's `Attention` (the CLIP baselines'
blocks) gives softmax(QKᵀ/√d) (read at `attn_drop`, the map its value product uses).
"""
from contextlib import contextmanager
from typing import Dict, Iterator

import torch
import torch.nn as nn
from timm.layers import Attention

from .diff_attention import DifferentialAttention

# attention class → the module its explicit path passes the (B, h, N, N) map through
MAP_TAPS = {DifferentialAttention: 'diff_map', Attention: 'attn_drop'}


def map_tap(module: nn.Module) -> nn.Module:
    """The submodule whose input is `module`'s attention map on its explicit path."""
    for cls, tap in MAP_TAPS.items():
        if isinstance(module, cls):
            return getattr(module, tap)
    raise ValueError(f'{type(module).__name__} has no explicit-path map to read; supported are '
                     f'{", ".join(c.__name__ for c in MAP_TAPS)}')


@contextmanager
def capture_attention_maps(model: nn.Module, detach: bool = True) -> Iterator[Dict[str, torch.Tensor]]:
    """Switch every `DifferentialAttention` and timm `Attention` in `model` to the explicit path and
    collect its maps.

    Yields a dict filled during forward passes inside the block: module name → (B, h, N, N) map of
    the latest call, in the layer's compute dtype (fp32 for differential maps); `detach=False` keeps
    them in the autograd graph. Each layer's fused/explicit choice is restored and hooks removed on exit.

        with capture_attention_maps(model) as maps:
            model.encode_image(images)
        maps['visual.trunk.blocks.11.attn'].shape  # (B, 6, 197, 197)
    """
    maps: Dict[str, torch.Tensor] = {}
    layers = {name: m for name, m in model.named_modules() if isinstance(m, tuple(MAP_TAPS))}
    if not layers:
        raise ValueError(f'{type(model).__name__} has no DifferentialAttention or timm Attention layer '
                         f'to read maps from')
    fused = {name: m.fused_attn for name, m in layers.items()}
    handles = []
    try:
        for name, m in layers.items():
            m.fused_attn = False
            handles.append(map_tap(m).register_forward_hook(
                lambda _mod, inp, _out, name=name: maps.__setitem__(name, inp[0].detach() if detach else inp[0])))
        yield maps
    finally:
        for h in handles:
            h.remove()
        for name, m in layers.items():
            m.fused_attn = fused[name]
