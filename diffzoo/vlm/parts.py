"""The parts of a vision-language model that training and saving ask about: `model_parts(model) -> ModelParts`.

    decoder_model          the transformers model that holds the decoder: what `differentialize` changes and
                           LoRA wraps
    vision                 the vision tower, when the model holds it apart (None: inside the decoder model)
    projection             the modules between the two that live outside the decoder model, by name (saved
                           beside an adapter): a `build_vlm` projector and eRAM-V's post-projection MLP
    attach(decoder_model)  the parts with a peft wrapper of the decoder model (or its merged weights) in its place
    differential()         λ and the sub-norm of the decoder's differential layers
    layer_modules(names)   where LoRA goes: the decoder layers' modules of those names

A `build_vlm` model (`VisionLanguageModel`) holds its tower, projector and language model apart. A transformers
model (a PaliGemma checkpoint, a causal LM, or the peft model around either) is its own decoder model: its tower
and projector are inside it and train or freeze with it. The answer is chosen once, by the model's class
(`functools.singledispatch`), so no caller branches on the kind of model.
"""
from dataclasses import dataclass, field
from functools import singledispatch
from typing import Dict, List, Optional, Sequence

import torch.nn as nn

from .differential import differential_parameters, find_decoder
from .model import VisionLanguageModel

PROJECTION = ('projector', 'post_mlp')  # a build_vlm model's children between tower and language model


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

    def layer_modules(self, names: Sequence[str]) -> str:
        """A regular expression of the decoder layers' modules called `names` (q_proj, gate_proj, …), by their
        names in the decoder model: where LoRA goes."""
        path = {module: name for name, module in self.decoder_model.named_modules()}[find_decoder(self.decoder_model)]
        prefix = f'{path}\\.' if path else ''  # '' when the decoder model is the decoder
        return rf'^{prefix}layers\.\d+\.(self_attn|mlp)\.({"|".join(names)})$'


@singledispatch
def model_parts(model: nn.Module) -> ModelParts:
    """A transformers model (PaliGemma, a causal LM, a peft model around one): its own decoder model."""
    return ModelParts(model, model)


@model_parts.register
def _(model: VisionLanguageModel) -> ModelParts:
    projection = {name: module for name, module in model.named_children() if name in PROJECTION}
    return ModelParts(model, model.language_model, model.vision, projection)
