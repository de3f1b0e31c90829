"""LoRA on the decoder (peft), with the differential parameters trained alongside; the adapter's files.

`add_lora(model, …)` applies Differential PaliGemma's plan (`diffzoo.vlm.plan.lora_fine_tune`): LoRA (r 32,
α 64) on the decoder's q/k/v/o projections (optionally the MLP's gate/up/down), λ_q1/λ_k1/λ_q2/λ_k2 and
the sub-norm trainable, everything else frozen. A `build_vlm` model may also train its projector
(`train_projector=True`), which starts from random for a new vision–LM pairing. `merge_lora` merges the
adapters into the weights they adapted (a stage's output, `diffzoo.train.vlm.stage`).

`save_adapter(model, dir)` writes peft's adapter files with the differential parameters in
`adapter_model.safetensors` under their peft names (`base_model.model.….self_attn.lambda_q1`, …),
which peft's loader copies into the model like any other key of the file: `PeftModel.from_pretrained(
differentialize(base, **settings), dir)` alone restores the whole fine-tune. Next to them,
`diffzoo_extra.json` (the `differentialize` settings) and `diffzoo_extra.safetensors` (a `build_vlm`
projector and eRAM-V's post-MLP, which live outside the language model peft wraps; empty otherwise).
`load_adapter(base, dir)` makes a base model differential with those settings, attaches the adapter
and loads the projector. Adapters written before kept the differential parameters in
`diffzoo_extra.safetensors` only; `load_adapter` and `load_adapter_weights` still read them there.
(peft's own `save_pretrained` writes the LoRA weights only: save with `save_adapter`.)
"""
import json
from pathlib import Path
from typing import Dict, Optional, Set, Tuple, Union

import torch
import torch.nn as nn
from peft import PeftModel, set_peft_model_state_dict
from peft.tuners.lora import LoraLayer
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from .differential import _suffix, differential_state_dict, differentialize
from .hf_config import SETTINGS_KEY, saved_settings
from .parts import PARAMETER_NAMES, PROJECTION_PREFIXES, find_decoder, model_parts
from .plan import LoraSettings, apply_plan, lora_fine_tune

EXTRA_WEIGHTS, EXTRA_CONFIG = 'diffzoo_extra.safetensors', 'diffzoo_extra.json'
ADAPTER_WEIGHTS = 'adapter_model.safetensors'  # peft's


def add_lora(model: nn.Module, r: int = 32, alpha: int = 64, dropout: float = 0.0, mlp: bool = False,
             train_projector: bool = False) -> nn.Module:
    """LoRA adapters on the decoder of `model` (in place for a `VisionLanguageModel`, whose
    `language_model` becomes the peft model; otherwise the peft model is returned), differential
    parameters trainable, everything else frozen: `diffzoo.vlm.plan.lora_fine_tune` applied."""
    return apply_plan(model, lora_fine_tune(LoraSettings(r, alpha, dropout, mlp), projector=train_projector))


def merge_lora(model: nn.Module) -> Tuple[nn.Module, Set[int]]:
    """`model` with its LoRA adapters merged into the weights they adapted (peft's `merge_and_unload`), and the ids
    of those weights."""
    parts = model_parts(model)
    adapted = {id(m.base_layer.weight) for m in parts.decoder_model.modules() if isinstance(m, LoraLayer)}
    return parts.attach(parts.decoder_model.merge_and_unload()).model, adapted


def _peft_model(model: nn.Module) -> PeftModel:
    target = model_parts(model).decoder_model
    if not isinstance(target, PeftModel):
        raise ValueError(f'{type(model).__name__} has no LoRA adapter; call add_lora first')
    return target


def extra_state(model: nn.Module) -> Dict[str, torch.Tensor]:
    """Tensors outside the language model peft wraps: a build_vlm model's projector (and eRAM-V's
    post-MLP), trained or not (a new pairing's projector must not be redrawn)."""
    state = {}
    for name, module in model_parts(model).projection.items():
        state.update({f'{name}.{k}': v.detach().cpu() for k, v in module.state_dict().items()})
    return state


def adapter_differential_state(peft_model: nn.Module) -> Dict[str, torch.Tensor]:
    """The differential parameters under their names in the peft model, as `adapter_model.safetensors` holds them."""
    return {k: v.detach().cpu().contiguous() for k, v in differential_state_dict(peft_model).items()}


def save_adapter(model: nn.Module, directory: Union[str, Path]) -> Path:
    """peft's adapter files, the differential parameters added to peft's weights file; a trained
    projector and the `differentialize` settings beside them."""
    directory = Path(directory)
    peft_model = _peft_model(model)
    peft_model.save_pretrained(directory)
    weights = directory / ADAPTER_WEIGHTS
    with safe_open(str(weights), framework='pt') as f:
        metadata = f.metadata()
    save_file({**load_file(str(weights)), **adapter_differential_state(peft_model)}, str(weights), metadata=metadata)
    spec = getattr(find_decoder(peft_model).config, SETTINGS_KEY, None)
    save_file({k: v.contiguous() for k, v in extra_state(model).items()}, str(directory / EXTRA_WEIGHTS))
    (directory / EXTRA_CONFIG).write_text(json.dumps({'differential': spec}, indent=1) + '\n')
    return directory


def _check_adapter_dir(directory: Path) -> None:
    for name in (EXTRA_CONFIG, EXTRA_WEIGHTS, ADAPTER_WEIGHTS):
        if not (directory / name).is_file():
            raise FileNotFoundError(f'{directory}: no {name}; pass a directory written by save_adapter')


def load_adapter(model: nn.Module, directory: Union[str, Path], trainable: bool = False) -> nn.Module:
    """`model` (a base, not differential yet) made differential as saved, with the adapter and the
    extra tensors loaded; returns the model (the peft model for a plain transformers model)."""
    directory = Path(directory)
    _check_adapter_dir(directory)
    spec = json.loads((directory / EXTRA_CONFIG).read_text())['differential']
    parts = model_parts(model)
    if spec:
        differentialize(parts.decoder_model, **saved_settings(spec))
    parts = parts.attach(PeftModel.from_pretrained(parts.decoder_model, str(directory), is_trainable=trainable))
    for p in parts.differential():  # loaded by peft with the adapter (older adapters: below)
        p.requires_grad_(trainable)
    _load_extra(parts.model, directory, trainable)
    return parts.model


def load_adapter_weights(model: nn.Module, directory: Union[str, Path]) -> nn.Module:
    """The adapter and extra tensors `save_adapter` wrote, loaded into a model already prepared the
    same way (differential as saved, `add_lora` with the same settings): resuming a checkpoint."""
    directory = Path(directory)
    _check_adapter_dir(directory)
    peft_model = _peft_model(model)
    unexpected = set_peft_model_state_dict(peft_model, load_file(str(directory / ADAPTER_WEIGHTS))).unexpected_keys
    if unexpected:
        raise ValueError(f'{directory}: adapter tensors without a LoRA parameter in the model (e.g. {unexpected[0]}); '
                         f'resume with the recipe that wrote it')
    _load_extra(model, directory, trainable=None)
    return model


def _load_extra(owner: nn.Module, directory: Path, trainable: Optional[bool]) -> None:
    """Copy the saved projector and post-MLP (and an older adapter's differential parameters) into
    `owner`'s parameters, setting their requires_grad to `trainable` (None: left as they are)."""
    extra = load_file(str(directory / EXTRA_WEIGHTS))
    loaded = set()
    with torch.no_grad():
        for name, p in owner.named_parameters():
            key = _suffix(name) if 'layers.' in name else name
            if key in extra and (name.endswith(PARAMETER_NAMES) or key.startswith(PROJECTION_PREFIXES)):
                p.copy_(extra[key])
                if trainable is not None:
                    p.requires_grad_(trainable)
                loaded.add(key)
    missing = sorted(set(extra) - loaded)
    if missing:
        raise ValueError(f'{directory}: {len(missing)} saved tensors have no parameter in the model '
                         f'(e.g. {missing[0]}); is it the base model the adapter was trained on?')
