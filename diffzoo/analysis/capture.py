"""Hooks that read a decoder (or ViT) forward pass: the residual stream and each layer's attention row."""
from contextlib import contextmanager
from typing import Dict, Iterator, List, Optional, Sequence

import torch
import torch.nn as nn

from diffzoo.vlm.attention import DIFF_EAGER, DIFF_SDPA
from diffzoo.vlm.parts import find_decoder


@contextmanager
def residual_stream(blocks: Sequence[nn.Module]) -> Iterator[List[Optional[torch.Tensor]]]:
    """Collects h_0 (the input of blocks[0]) and each block's output: L + 1 tensors per forward pass."""
    states: List[Optional[torch.Tensor]] = [None] * (len(blocks) + 1)

    def first(_m, args, kwargs):
        states[0] = args[0] if args else kwargs['hidden_states']

    def output(i, _m, _inp, out):
        states[i + 1] = out[0] if isinstance(out, tuple) else out

    handles = [blocks[0].register_forward_pre_hook(first, with_kwargs=True)]
    handles += [b.register_forward_hook(lambda m, i_, o, i=i: output(i, m, i_, o)) for i, b in enumerate(blocks)]
    try:
        yield states
    finally:
        for h in handles:
            h.remove()


@contextmanager
def capture_decoder(model: nn.Module) -> Iterator[Dict[str, list]]:
    """Eager attention in the decoder of `model` (a build_vlm model, PaliGemma, a causal LM; LoRA-wrapped
    or not) and hooks filling, per forward pass of one sequence: 'hidden' (L + 1 × (S, D), module
    docstring) and 'attention' (L × (heads, S): the last position's attention row). The attention
    implementation is restored and the hooks removed on exit."""
    decoder = find_decoder(model)
    config = decoder.config
    before = config._attn_implementation
    layers = decoder.layers
    record = {'hidden': None, 'attention': [None] * len(layers)}

    def weights(i, _m, _inp, out):
        if not isinstance(out, tuple) or len(out) < 2 or out[1] is None:
            raise RuntimeError(f'decoder layer {i}: its attention returned no weights under '
                               f'{config._attn_implementation!r}; the analysis needs an eager kernel')
        record['attention'][i] = out[1][0, :, -1]  # (heads, S): the last query's row

    handles = [layer.self_attn.register_forward_hook(lambda m, i_, o, i=i: weights(i, m, i_, o))
               for i, layer in enumerate(layers)]
    config._attn_implementation = DIFF_EAGER if before in (DIFF_SDPA, DIFF_EAGER) else 'eager'
    try:
        with residual_stream(layers) as hidden:
            record['hidden'] = hidden
            yield record
    finally:
        config._attn_implementation = before
        for h in handles:
            h.remove()
