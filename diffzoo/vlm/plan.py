"""What a run trains: decided once from its recipe (`training_plan`), applied once (`apply_plan`).

A `TrainingPlan` says of each part of the model (`diffzoo.vlm.parts`) whether it trains:

    vision                  the vision tower
    projector               the projector (and eRAM-V's post-projection MLP)
    language_model          every weight of the language model (full fine-tuning)
    lora                    LoRA adapters (r, α, dropout) on the decoder layers' q/k/v/o projections (and the
                            MLP's gate/up/down with `mlp`), the weights they adapt frozen; None: no adapters
    differential            λ_q1, λ_k1, λ_q2, λ_k2 and the sub-norm of the decoder's differential layers
    gradient_checkpointing  the language model's layers recomputed in backward

A stage's recipe (`train:`, `diffzoo.train.vlm.stage`) states each, its language model frozen, full or lora;
`differential` left null trains when the language model does. A recipe of `train: null` is Differential
PaliGemma's LoRA fine-tune (`lora_fine_tune`): the adapters, λ and the sub-norm, the projector as
`train_projector` says, nothing else. Only the decoder's layers get adapters (PaliGemma's SigLIP tower also has
q/k/v projections; they stay frozen).

`apply_plan` freezes the whole model, then makes trainable what the plan trains; a plan that trains a part the
model does not hold apart (a PaliGemma checkpoint's tower and projector) is refused.
"""
from dataclasses import dataclass
from typing import Mapping, Optional

import torch.nn as nn
from peft import LoraConfig, get_peft_model

from .parts import model_parts

ATTENTION_TARGETS = ('q_proj', 'k_proj', 'v_proj', 'o_proj')
MLP_TARGETS = ('gate_proj', 'up_proj', 'down_proj')


@dataclass(frozen=True)
class LoraSettings:
    """LoRA on the decoder layers (a recipe's `lora` section)."""
    r: int = 32
    alpha: float = 64
    dropout: float = 0.0
    mlp: bool = False  # adapters on gate/up/down too


@dataclass(frozen=True)
class TrainingPlan:
    """Which parts of the model train (module docstring); everything else is frozen."""
    vision: bool = False
    projector: bool = False
    language_model: bool = False
    lora: Optional[LoraSettings] = None
    differential: bool = False
    gradient_checkpointing: bool = False


def lora_fine_tune(lora: LoraSettings, projector: bool = False) -> TrainingPlan:
    """Differential PaliGemma's fine-tune: LoRA adapters, λ and the sub-norm; a `build_vlm` projector when asked."""
    return TrainingPlan(projector=projector, lora=lora, differential=True)


def training_plan(recipe: Mapping) -> TrainingPlan:
    """What a validated VLM recipe (`diffzoo.vlm.recipe.check`) trains: its stage's `train:` section, or
    `lora_fine_tune` for `train: null`."""
    train = recipe['train']
    if train is None:
        return lora_fine_tune(LoraSettings(**recipe['lora']), recipe['train_projector'])
    language_model = train['language_model']  # frozen | full | lora
    differential = train['differential']
    return TrainingPlan(vision=train['vision'], projector=train['projector'], language_model=language_model == 'full',
                        lora=LoraSettings(**recipe['lora']) if language_model == 'lora' else None,
                        differential=language_model != 'frozen' if differential is None else differential,
                        gradient_checkpointing=train['gradient_checkpointing'])


def apply_plan(model: nn.Module, plan: TrainingPlan) -> nn.Module:
    """`model` with what `plan` trains trainable and the rest frozen. With LoRA, a `build_vlm` model takes the peft
    model as its language model and is returned; a transformers model's peft model is returned."""
    parts = model_parts(model)
    if parts.vision is None and (plan.vision or plan.projector or plan.language_model):
        raise ValueError(f'{type(model).__name__} holds no vision tower or projector apart from its language model (a '
                         f'PaliGemma checkpoint\'s are inside it), so it trains with LoRA alone (train: null, '
                         f'train_projector: false); training a tower, a projector or the whole language model applies '
                         f'to build_vlm models')
    model.requires_grad_(False)
    if plan.lora is not None:  # peft freezes the rest of what it wraps (frozen already), not its adapters
        lora = plan.lora
        targets = parts.layer_module_pattern(ATTENTION_TARGETS + (MLP_TARGETS if lora.mlp else ()))
        config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, bias='none',
                            target_modules=targets)
        parts = parts.attach(get_peft_model(parts.decoder_model, config))
    if plan.language_model:
        parts.decoder_model.requires_grad_(True)
    if plan.vision:
        parts.vision.requires_grad_(True)
    if plan.projector:
        for module in parts.projection.values():
            module.requires_grad_(True)
    for p in parts.differential():
        p.requires_grad_(plan.differential)
    if plan.gradient_checkpointing:  # non-reentrant, the KV cache off
        lm = parts.decoder_model
        if hasattr(lm, 'activation_checkpointing_enable'):  # transformers ≥ 5.2x's name
            lm.activation_checkpointing_enable(activation_checkpointing_kwargs={'use_reentrant': False})
        else:
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})
        lm.config.use_cache = False
    return parts.model
