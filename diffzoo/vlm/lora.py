"""LoRA on the decoder (peft), with the differential parameters trained alongside.

Differential PaliGemma's recipe: LoRA (r 32, α 64) on the decoder's q/k/v/o projections (optionally
the MLP's gate/up/down), λ_q1/λ_k1/λ_q2/λ_k2 and the sub-norm trainable, everything else frozen.
Only decoder layers get adapters (PaliGemma's SigLIP tower also has q/k/v projections; they stay
frozen). A `build_vlm` model may also train its projector (`train_projector=True`), which starts
from random for a new vision–LM pairing.

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
from typing import Dict, Optional, Union

import torch
import torch.nn as nn
from peft import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from .differential import _suffix, differential_parameters, differential_state_dict, differentialize, find_decoder
from .hf_config import SETTINGS_KEY, saved_settings
from .model import VisionLanguageModel

ATTENTION_TARGETS = ('q_proj', 'k_proj', 'v_proj', 'o_proj')
MLP_TARGETS = ('gate_proj', 'up_proj', 'down_proj')
EXTRA_WEIGHTS, EXTRA_CONFIG = 'diffzoo_extra.safetensors', 'diffzoo_extra.json'
ADAPTER_WEIGHTS = 'adapter_model.safetensors'  # peft's


def _decoder_path(model: nn.Module) -> str:
    """Dotted path of the decoder stack inside `model` ('' when the model is the decoder)."""
    decoder = find_decoder(model)
    for name, module in model.named_modules():
        if module is decoder:
            return name
    raise ValueError(f'{type(model).__name__}: decoder not found among its modules')


def _language_model(model: nn.Module) -> nn.Module:
    """The module LoRA wraps: a build_vlm model's language model, or the transformers model itself."""
    return model.language_model if isinstance(model, VisionLanguageModel) else model


def _attach(model: nn.Module, peft_model: nn.Module) -> nn.Module:
    """What callers get back: a build_vlm model around its peft-wrapped language model, or the peft model."""
    if isinstance(model, VisionLanguageModel):
        model.language_model = peft_model
        return model
    return peft_model


def projection_modules(model: nn.Module) -> Dict[str, nn.Module]:
    """A build_vlm model's projector (and eRAM-V's post-projection MLP), saved with the adapter; none
    for a pretrained PaliGemma, whose projector is part of the base checkpoint."""
    if not isinstance(model, VisionLanguageModel):
        return {}
    return {'projector': model.projector, **({'post_mlp': model.post_mlp} if hasattr(model, 'post_mlp') else {})}


def add_lora(model: nn.Module, r: int = 32, alpha: int = 64, dropout: float = 0.0, mlp: bool = False,
             train_projector: bool = False) -> nn.Module:
    """LoRA adapters on the decoder of `model` (in place for a `VisionLanguageModel`, whose
    `language_model` becomes the peft model; otherwise the peft model is returned), differential
    parameters trainable, everything else frozen."""
    projection = projection_modules(model)
    if train_projector and not projection:
        raise ValueError('train_projector=True applies to build_vlm models; a pretrained PaliGemma keeps its projector')
    target = _language_model(model)
    path = _decoder_path(target)
    names = ATTENTION_TARGETS + (MLP_TARGETS if mlp else ())
    prefix = f'{path}\\.' if path else ''
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, bias='none',
                        target_modules=rf'^{prefix}layers\.\d+\.(self_attn|mlp)\.({"|".join(names)})$')
    peft_model = get_peft_model(target, config)  # freezes every non-LoRA parameter of the language model
    for p in differential_parameters(peft_model):
        p.requires_grad_(True)
    if projection:  # a build_vlm model: its vision tower stays frozen, the projector trains as asked
        model.vision.requires_grad_(False)
        for module in projection.values():
            module.requires_grad_(train_projector)
    return _attach(model, peft_model)


def _peft_model(model: nn.Module):
    target = _language_model(model)
    if not isinstance(target, PeftModel):
        raise ValueError(f'{type(model).__name__} has no LoRA adapter; call add_lora first')
    return target


def extra_state(model: nn.Module) -> Dict[str, torch.Tensor]:
    """Tensors outside the language model peft wraps: a build_vlm model's projector (and eRAM-V's
    post-MLP), trained or not (a new pairing's projector must not be redrawn)."""
    state = {}
    for name, module in projection_modules(model).items():
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
    target = _language_model(model)
    if spec:
        differentialize(target, **saved_settings(spec))
    model = _attach(model, PeftModel.from_pretrained(target, str(directory), is_trainable=trainable))
    for p in differential_parameters(model):  # loaded by peft with the adapter (older adapters: below)
        p.requires_grad_(trainable)
    _load_extra(model, directory, trainable)
    return model


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
            if key in extra and (name.endswith(('lambda_q1', 'lambda_k1', 'lambda_q2', 'lambda_k2', 'sub_norm.weight'))
                                 or key.startswith(('projector.', 'post_mlp.'))):
                p.copy_(extra[key])
                if trainable is not None:
                    p.requires_grad_(trainable)
                loaded.add(key)
    missing = sorted(set(extra) - loaded)
    if missing:
        raise ValueError(f'{directory}: {len(missing)} saved tensors have no parameter in the model '
                         f'(e.g. {missing[0]}); is it the base model the adapter was trained on?')


def trainable_parameters(model: nn.Module) -> Dict[str, int]:
    """Counts of trainable parameters by kind: lora, differential, projector (with eRAM-V's post-MLP), other."""
    counts = {'lora': 0, 'differential': 0, 'projector': 0, 'other': 0}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if 'lora_' in name:
            kind = 'lora'
        elif name.endswith(('lambda_q1', 'lambda_k1', 'lambda_q2', 'lambda_k2', 'sub_norm.weight')):
            kind = 'differential'
        elif name.startswith(('projector.', 'post_mlp.')):
            kind = 'projector'
        else:
            kind = 'other'
        counts[kind] += p.numel()
    counts['total'] = sum(counts.values())
    return counts
