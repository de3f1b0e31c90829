"""The parts of a vision-language model that training and saving ask about: `model_parts(model) -> ModelParts`.

    decoder_model               the transformers model that holds the decoder: what `differentialize` changes and
                                LoRA wraps
    vision                      the vision tower, when the model holds it apart (None: inside the decoder model)
    projection                  the modules between the two that live outside the decoder model, by name (saved
                                beside an adapter): a `build_vlm` projector and eRAM-V's post-projection MLP
    attach(decoder_model)       the parts with a peft wrapper of the decoder model (or its merged weights) in its place
    differential()              λ and the sub-norm of the decoder's differential layers
    layer_module_pattern(names) where LoRA goes: a regular expression of the decoder layers' modules of those names

`find_decoder(model)` is a transformers model's decoder stack (the module holding `.layers`),
`differential_parameters(model)` the λ and sub-norm parameters `differentialize` added to it (`PARAMETER_NAMES`: their
state-dict key endings), and `trainable_parameters(model)` what trains, counted by part (LoRA adapters, λ and the
sub-norm, the projector, the rest).

A transformers model (a PaliGemma checkpoint, a causal LM, or the peft model around either) is its own decoder
model: its tower and projector are inside it and train or freeze with it. A `build_vlm` model (`VisionLanguageModel`)
holds its tower, projector and language model apart; `diffzoo.vlm.model`, which defines it, registers its parts. The
answer is chosen once, by the model's class (`functools.singledispatch`), so no caller branches on the kind of model.
"""
from dataclasses import dataclass, field
from functools import singledispatch
from typing import Dict, List, Optional, Sequence

import torch.nn as nn

from diffzoo.layers.lambdas import LAMBDA_VECTORS

PROJECTION = ('projector', 'post_mlp')  # a build_vlm model's children between tower and language model
PROJECTION_PREFIXES = tuple(f'{name}.' for name in PROJECTION)  # projector., post_mlp.
PARAMETER_NAMES = (*LAMBDA_VECTORS, 'sub_norm.weight')  # what differentialize adds, as state-dict key endings


def find_decoder(model: nn.Module) -> nn.Module:
    """The decoder stack (the module holding `.layers` and its text config) of a transformers model."""
    candidates = [model]
    if hasattr(model, 'get_decoder'):
        candidates.insert(0, model.get_decoder())
    for name in ('model', 'language_model', 'base_model'):
        sub = getattr(model, name, None)
        if isinstance(sub, nn.Module):
            candidates.append(sub)
            if hasattr(sub, 'get_decoder'):
                candidates.append(sub.get_decoder())
    for c in candidates:
        layers = getattr(c, 'layers', None)
        if isinstance(layers, nn.ModuleList) and len(layers) and hasattr(layers[0], 'self_attn'):
            return c
    raise ValueError(
        f'{type(model).__name__}: no decoder with `.layers[i].self_attn` found; differentialize takes a '
        f'transformers decoder model (e.g. PaliGemmaForConditionalGeneration, GemmaForCausalLM, LlamaForCausalLM)')


def differential_parameters(model: nn.Module) -> List[nn.Parameter]:
    """λ and sub-norm parameters that `differentialize` added."""
    return [p for m in model.modules() if hasattr(m, 'differential')
            for p in (*(getattr(m, name) for name in LAMBDA_VECTORS), m.sub_norm.weight)]


def trainable_parameters(model: nn.Module) -> Dict[str, int]:
    """Counts of trainable parameters by kind: lora, differential, projector (with eRAM-V's post-MLP), other."""
    counts = {'lora': 0, 'differential': 0, 'projector': 0, 'other': 0}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if 'lora_' in name:
            kind = 'lora'
        elif name.endswith(PARAMETER_NAMES):
            kind = 'differential'
        elif name.startswith(PROJECTION_PREFIXES):
            kind = 'projector'
        else:
            kind = 'other'
        counts[kind] += p.numel()
    counts['total'] = sum(counts.values())
    return counts


@dataclass(frozen=True)
class ModelParts:
    """What `model` is made of (module docstring)."""
    model: nn.Module
    decoder_model: nn.Module
    vision: Optional[nn.Module] = None
    projection: Dict[str, nn.Module] = field(default_factory=dict)

    def attach(self, decoder_model: nn.Module) -> 'ModelParts':
        """The parts with `decoder_model` (its peft wrapper, or the weights merged back) in place of the model's
        own: a model that holds its language model apart takes it in place; one that is its own decoder model
        is replaced by it."""
        if self.decoder_model is self.model:
            return model_parts(decoder_model)
        self.model.language_model = decoder_model
        return model_parts(self.model)

    def differential(self) -> List[nn.Parameter]:
        """λ and the sub-norm of the decoder's differential layers (`differentialize`); a tower's own are not
        among them."""
        return differential_parameters(self.decoder_model)

    def layer_module_pattern(self, names: Sequence[str]) -> str:
        """A regular expression of the decoder layers' modules called `names` (q_proj, gate_proj, …), by their
        names in the decoder model: where LoRA goes."""
        path = {module: name for name, module in self.decoder_model.named_modules()}[find_decoder(self.decoder_model)]
        prefix = f'{path}\\.' if path else ''  # '' when the decoder model is the decoder
        return rf'^{prefix}layers\.\d+\.(self_attn|mlp)\.({"|".join(names)})$'


@singledispatch
def model_parts(model: nn.Module) -> ModelParts:
    """A transformers model (PaliGemma, a causal LM, a peft model around one): its own decoder model."""
    return ModelParts(model, model)

