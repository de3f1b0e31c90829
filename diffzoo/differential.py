"""Any timm or open_clip model made differential, its pretrained weights kept: `differentialize(model, …)`.

    import diffzoo, timm, open_clip
    vit = diffzoo.differentialize(timm.create_model('deit_small_patch16_224', pretrained=True), variant='duplicate')
    clip = diffzoo.differentialize(open_clip.create_model('ViT-B-16', pretrained='laion2b_s34b_b88k'))

Each block's self-attention in each block stack of `model` is replaced in place by a
`diffzoo.layers.PretrainedDifferentialAttention` that carries the pretrained weights over as its module
docstring lays out (duplicate: Q, K, V and W_O unchanged, Differential PaliGemma's Eq. 5; split: query heads
paired, "adjacent" or "halves"; v2: each query head twice). What converts:

    timm        blocks whose `attn` is timm.layers.Attention: ViT, DeiT, the SigLIP towers and the other models
                timm builds on VisionTransformer (their attention-pool heads stay as they are); EVA's
                EvaAttention where the model has no rotary embedding (EVA-01 and EVA-CLIP-01 style models,
                not EVA-02, whose RoPE is applied inside the attention)
    open_clip   the ResidualAttentionBlocks of its own VisionTransformer and TextTransformer (the causal mask
                is kept: open_clip hands it to the blocks as before), a whole CLIP model's both towers; a
                timm vision tower through its trunk

Anything else in a block stack (gated or narrowed timm attention, rotary attention, open_clip's
CustomResidualAttentionBlock, cross-attention blocks) is refused by name, and so is a model that is already
differential (converted, or built with diffzoo's or timm's differential attention). A block stack is every
ModuleList / Sequential of blocks with an `attn`; `blocks` is None (all) or a non-empty list of distinct
0-based indices into each stack (no negative ones), and λ_init "depth" uses the block's index in its stack.
transformers decoders go to `diffzoo.vlm.differentialize` (`blocks` is its `layers`).

The settings are saved with every converted layer's weights, so a fine-tuned checkpoint reloads into the
plain model without them: `load_converted(model, path)` (open_clip's `load_checkpoint` and
`create_model(name, pretrained=path)` do it by themselves after `import diffzoo`).
"""
import functools
import sys
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

import timm.layers
import timm.models.eva
import torch
import torch.nn as nn
from open_clip.transformer import ResidualAttentionBlock, TextTransformer

from diffzoo.checkpoint import model_state_dict, read_state_dict
from diffzoo.layers import DifferentialAttention
from diffzoo.layers.blocks import block_indices
from diffzoo.layers.diff_attention import check_options
from diffzoo.layers.pretrained import (HEAD_PAIRINGS, RECORD, PretrainedDifferentialAttention, copy_modules,
                                       differential_heads, read_record)
from diffzoo.layers.residual import DiffResidualAttentionBlock
from diffzoo.vlm.parts import find_decoder

SETTINGS = ('variant', 'lambda_init', 'blocks', 'head_pairing', 'lambda_proj_init')  # differentialize's keywords


class NotConvertible(ValueError):
    pass


def _settings(variant: str, lambda_init, head_pairing: Optional[str], lambda_proj_init: str) -> None:
    check_options(variant, lambda_init, lambda_proj_init)
    if head_pairing is not None and (variant != 'split' or head_pairing not in HEAD_PAIRINGS):
        raise ValueError(f'head_pairing={head_pairing!r}: pairs heads of variant="split", one of {HEAD_PAIRINGS}')


def _refuse_differential(model: nn.Module) -> None:
    """Refuse a model any of whose attention layers is differential already, saying how to get the plain one."""
    for name, module in model.named_modules():
        if isinstance(module, PretrainedDifferentialAttention):
            how = ('it was converted by differentialize: build the plain model again by its name (timm.create_model /'
                   ' open_clip.create_model); a converted checkpoint reloads into it with '
                   'diffzoo.differential.load_converted')
        elif isinstance(module, DifferentialAttention):
            how = ('it is built differential (diffzoo\'s vit_diff_* / diffclip-* models): the same layout with plain '
                   'attention is vit_diff_baseline_<size> (timm) / clip-<size>-baseline (open_clip)')
        elif isinstance(module, timm.layers.DiffAttention):
            how = 'build the model with timm\'s plain attention (leave attn_layer out)'
        else:
            continue
        raise NotConvertible(f'{type(model).__name__} is already differential ({name or "the model"} is '
                             f'{type(module).__name__}); differentialize converts a plain model: {how}')


def _kind(block: nn.Module) -> Optional[str]:
    """'timm', 'timm_eva' or 'open_clip' for a block this module converts, 'done' for one converted, else None."""
    attn = getattr(block, 'attn', None)
    if isinstance(attn, PretrainedDifferentialAttention) or isinstance(block, DiffResidualAttentionBlock):
        return 'done'
    if type(block) is ResidualAttentionBlock and not hasattr(block, 'ln_1_kv'):
        return 'open_clip'
    if type(attn) is timm.layers.Attention:
        return 'timm'
    if type(attn) is timm.models.eva.EvaAttention:
        return 'timm_eva'
    return None


def block_stacks(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """(name, stack) for every ModuleList / Sequential of blocks with an `attn` in `model`, outermost first."""
    stacks = []
    for name, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and len(module) and \
                all(hasattr(b, 'attn') for b in module) and not any(name.startswith(s + '.') for s, _ in stacks):
            stacks.append((name, module))
    return stacks


def _refuse(model: nn.Module, where: str, block: nn.Module) -> None:
    attn = getattr(block, 'attn', block)
    raise NotConvertible(
        f'{type(model).__name__}.{where}: {type(block).__name__} with {type(attn).__module__}.{type(attn).__name__} '
        f'is not converted; differentialize takes blocks with timm.layers.Attention (ViT, DeiT, SigLIP), '
        f'EvaAttention without RoPE, or open_clip\'s ResidualAttentionBlock (self-attention)')


def _check(model: nn.Module, where: str, block: nn.Module, kind: str, variant: str) -> None:
    attn = block.attn
    if kind == 'open_clip':
        heads = attn.num_heads
        if not attn._qkv_same_embed_dim or attn.bias_k is not None or not attn.batch_first:
            raise NotConvertible(f'{type(model).__name__}.{where}.attn: an nn.MultiheadAttention with separate k/v '
                                 f'widths, bias_k or batch_first=False is not converted (open_clip\'s own towers are '
                                 f'batch first)')
    else:
        dim, heads = attn.proj.in_features, attn.num_heads
        out = attn.proj.out_features
        in_dim = attn.qkv.in_features if getattr(attn, 'qkv', None) is not None else attn.q_proj.in_features
        if getattr(attn, 'gate', None) is not None or in_dim != dim or out != dim:
            raise NotConvertible(f'{type(model).__name__}.{where}.attn: a gated attention or one whose heads are not '
                                 f'dim / num_heads wide is not converted (dim {in_dim}, heads {heads} × {attn.head_dim}'
                                 f', out {out})')
    if variant == 'split' and heads % 2:
        raise NotConvertible(f'{type(model).__name__}.{where}.attn: variant="split" pairs heads and this layer has '
                             f'{heads}; use variant="duplicate" or "v2"')


def _converted_attention(attn: nn.Module, kind: str, depth: int, variant: str, lambda_init, head_pairing,
                         lambda_proj_init) -> PretrainedDifferentialAttention:
    """A `PretrainedDifferentialAttention` holding `attn`'s weights (its norms are `attn`'s own modules)."""
    if kind == 'open_clip':
        dim, heads = attn.embed_dim, attn.num_heads
        qkv_bias, proj_bias = attn.in_proj_bias is not None, attn.out_proj.bias is not None
        attn_drop, proj_drop, fused = attn.dropout, 0., True
        weight = attn.in_proj_weight
    else:
        dim, heads = attn.proj.in_features, attn.num_heads
        proj_bias = attn.proj.bias is not None
        if kind == 'timm':
            qkv_bias = attn.qkv.bias is not None
        else:
            qkv_bias = attn.q_bias is not None if attn.qkv is not None else attn.q_proj.bias is not None
        attn_drop, proj_drop, fused = attn.attn_drop.p, attn.proj_drop.p, attn.fused_attn
        weight = attn.proj.weight
    new = PretrainedDifferentialAttention(
        dim, differential_heads(variant, heads), source=kind, pretrained_heads=heads, head_pairing=head_pairing,
        qkv_bias=qkv_bias, proj_bias=proj_bias, attn_drop=attn_drop, proj_drop=proj_drop, depth=depth,
        lambda_init=lambda_init, variant=variant, lambda_proj_init=lambda_proj_init, device=weight.device,
        dtype=weight.dtype)
    if kind != 'open_clip':
        copy_modules(new, attn)
    new.fused_attn = fused
    new.train(attn.training)
    new.load_state_dict(attn.state_dict(), strict=True)
    return new


def convert_block(block: nn.Module, kind: str, depth: int, variant: str = 'duplicate', lambda_init='depth',
                  head_pairing: Optional[str] = None, lambda_proj_init: str = 'unilm') -> nn.Module:
    """The block with differential self-attention: timm blocks in place (their `attn` replaced), open_clip's
    ResidualAttentionBlock as a `DiffResidualAttentionBlock` holding its own norms, MLP and layer scales."""
    make = functools.partial(_converted_attention, kind=kind, depth=depth, variant=variant, lambda_init=lambda_init,
                             head_pairing=head_pairing, lambda_proj_init=lambda_proj_init)
    if kind != 'open_clip':
        block.attn = make(block.attn)
        return block
    d_model = block.ln_1.normalized_shape[0]
    new = DiffResidualAttentionBlock(d_model, 1, mlp_ratio=block.mlp.c_fc.out_features / d_model,
                                     attn_layer=lambda *a, **k: nn.Identity())
    new.attn = make(block.attn)
    for name in ('ln_1', 'ls_1', 'ln_2', 'mlp', 'ls_2'):
        setattr(new, name, getattr(block, name))
    new.train(block.training)
    return new


def _hf(model: nn.Module) -> bool:
    transformers = sys.modules.get('transformers')  # a transformers model implies transformers was imported
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


def differentialize(model: nn.Module, variant: str = 'duplicate', lambda_init: Union[float, str] = 'depth',
                    blocks: Optional[Sequence[int]] = None, head_pairing: Optional[str] = None,
                    lambda_proj_init: str = 'unilm') -> nn.Module:
    """Make `model`'s self-attention differential in place, pretrained weights carried over; returns the model.

    variant: "duplicate" (default, Differential PaliGemma), "split" or "v2"; lambda_init: a number in [0, 1) or
    "depth"; blocks: a list of distinct 0-based indices into each block stack (default None: all); head_pairing
    (split): "adjacent" (default) or "halves"; lambda_proj_init (v2): "unilm" or "zeros". See the module docstring
    for what converts."""
    if _hf(model):
        if lambda_proj_init != 'unilm':
            raise ValueError('lambda_proj_init is v2\'s; transformers decoders take variant "duplicate" or "split"')
        from diffzoo.vlm.differential import differentialize as hf_differentialize  # transformers only
        if blocks is not None:
            blocks = block_indices(blocks, len(find_decoder(model).layers), f'{type(model).__name__}\'s decoder')
        return hf_differentialize(model, variant=variant, lambda_init=lambda_init, layers=blocks,
                                  head_pairing=head_pairing)
    _settings(variant, lambda_init, head_pairing, lambda_proj_init)
    _refuse_differential(model)
    stacks = block_stacks(model)
    if not stacks:
        raise NotConvertible(f'{type(model).__name__}: no block stack (a ModuleList / Sequential of blocks with an '
                             f'`attn`) found; differentialize takes timm ViT-style models and open_clip towers')
    plans = []
    for text in (m for m in model.modules() if isinstance(m, TextTransformer)):
        if text.cls_emb is not None or getattr(text, 'use_pad_mask', False):  # a (B·H, L, L) mask for H heads
            raise NotConvertible(f'{type(model).__name__}: an open_clip text tower with a class token or a padding '
                                 f'mask hands its blocks a mask per pretrained head, which a converted layer does not '
                                 f'take; convert the vision tower alone (model.visual)')
    for name, stack in stacks:
        for i in block_indices(blocks, len(stack), f'{type(model).__name__}.{name}' if name else type(model).__name__):
            kind = _kind(stack[i])
            if kind is None:
                _refuse(model, f'{name}.{i}', stack[i])
            owner = dict(model.named_modules())[name.rpartition('.')[0]]  # the model whose stack it is
            if kind == 'timm_eva' and getattr(owner, 'rope', None) is not None:
                raise NotConvertible(f'{type(model).__name__}: EVA with a rotary position embedding (EVA-02 style) '
                                     f'applies RoPE inside EvaAttention, which DifferentialAttention does not; '
                                     f'only EVA models without RoPE convert')
            _check(model, f'{name}.{i}', stack[i], kind, variant)
            plans.append((stack, i, kind))
    for stack, i, kind in plans:
        stack[i] = convert_block(stack[i], kind, i, variant, lambda_init, head_pairing, lambda_proj_init)
    return model


def converted_layers(state_dict: Mapping[str, torch.Tensor]) -> Dict[str, Dict]:
    """{attention prefix: its conversion record} for the converted layers a state dict holds."""
    return {k[:-len(RECORD)]: read_record(v) for k, v in state_dict.items() if k.endswith('.attn.' + RECORD)}


def prepare_for(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> int:
    """Convert the blocks of `model` that `state_dict` holds converted (and `model` does not yet), each with the
    settings saved beside its weights; returns how many it converted."""
    modules = dict(model.named_modules())
    count = 0
    for prefix, record in converted_layers(state_dict).items():
        block_name = prefix[:-len('.attn.')]
        stack_name, _, index = block_name.rpartition('.')
        stack = modules.get(stack_name)
        if stack is None or not index.isdigit() or int(index) >= len(stack):
            raise ValueError(f'the checkpoint holds a converted layer at {prefix[:-1]}, which '
                             f'{type(model).__name__} does not have: load it into the model it was converted from')
        kind = _kind(stack[int(index)])
        if kind == 'done':
            continue
        if kind != record['source']:
            raise ValueError(f'{block_name}: the checkpoint converted a {record["source"]} layer there, the model '
                             f'has {type(stack[int(index)]).__name__}')
        stack[int(index)] = convert_block(stack[int(index)], kind, record['depth'], record['variant'],
                                          record['lambda_init'], record['head_pairing'], record['lambda_proj_init'])
        count += 1
    return count


def load_converted(model: nn.Module, checkpoint: Union[str, Path, Mapping[str, torch.Tensor]],
                   strict: bool = True):
    """Load a checkpoint of a converted model into `model` (plain or converted): the blocks it holds converted
    are converted first, with the saved settings; returns load_state_dict's result. For timm:
    `diffzoo.differential.load_converted(timm.create_model(name), path)`."""
    state_dict = (read_state_dict(checkpoint) if isinstance(checkpoint, (str, Path))
                  else dict(model_state_dict(dict(checkpoint))))
    prepare_for(model, state_dict)
    return model.load_state_dict(state_dict, strict=strict)


def settings_of(model: nn.Module) -> List[Dict]:
    """The conversion record of every converted layer in `model`, in module order."""
    return [m.record() for m in model.modules() if isinstance(m, PretrainedDifferentialAttention)]
