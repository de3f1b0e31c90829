"""The attention functions transformers calls in a `differentialize`d decoder, through
`transformers.AttentionInterface`: `diffzoo_sdpa` (each map through SDPA, the difference and sub-norm
by the saved-outputs op of `diffzoo.layers.kernels`) and `diffzoo_eager` (the maps in fp32, A1 − λ·A2
returned as the attention weights). Layers that are not differential run the model's own code; eRAM-V's
injected keys and values are appended where given. The formulas, head pairings and numerics are in
the docstring of `diffzoo.vlm.differential`.
"""
import functools
import sys
from typing import Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask, sdpa_mask
from transformers.models.llama.modeling_llama import eager_attention_forward as llama_eager_attention

from diffzoo.layers.kernels import sub_normed_difference
from diffzoo.layers.lambdas import reparameterized_lambda
from diffzoo.layers.numerics import stats_dtype

DIFF_SDPA, DIFF_EAGER = 'diffzoo_sdpa', 'diffzoo_eager'
INJECTED = 'diffzoo_injected'  # the forward keyword carrying eRAM-V's injected keys/values (eramv.InjectedFeatures)


def layer_lambda(module: nn.Module) -> torch.Tensor:
    """λ of one layer (`diffzoo.layers.lambdas`), a 0-dim fp32 tensor (fp64 for fp64 parameters)."""
    return reparameterized_lambda(module.lambda_q1, module.lambda_k1, module.lambda_q2, module.lambda_k2,
                                  module.differential.lambda_init)


def _sub_norm_weight(module: nn.Module, like: torch.Tensor) -> torch.Tensor:
    weight = module.sub_norm.weight
    return (weight.to(stats_dtype(weight.dtype)) * (1 - module.differential.lambda_init)).to(like.dtype)


def _pair_heads(num_heads: int, head_pairing: str) -> Tuple[slice, slice]:
    """The query heads of the first and of the second map of differential heads 0, 1, …, H/2 − 1."""
    if head_pairing == 'halves':
        return slice(0, num_heads // 2), slice(num_heads // 2, num_heads)
    return slice(0, num_heads, 2), slice(1, num_heads, 2)


def _kv_index(num_heads: int, num_kv_heads: int, heads: Tuple[int, int, int]) -> Union[slice, Tuple[int, ...]]:
    """Which KV heads the query heads range(*heads) read (query head j reads KV head j // (H / H_kv)):
    a slice when each of an evenly spaced run of KV heads serves equally many of them in order (SDPA's
    enable_gqa then maps it), otherwise one KV head per query head."""
    groups = num_heads // num_kv_heads
    kv = [j // groups for j in range(*heads)]
    distinct = sorted(set(kv))
    repeat = len(kv) // len(distinct)
    step = distinct[1] - distinct[0] if len(distinct) > 1 else 1
    if kv == [distinct[0] + (n // repeat) * step for n in range(len(kv))]:
        return slice(distinct[0], distinct[-1] + 1, step)
    return tuple(kv)


def _kv_for(t: torch.Tensor, num_heads: int, heads: slice) -> torch.Tensor:
    """K or V (B, H_kv, S, d) for the query heads `heads`: a view of grouped KV heads, or (B, n, S, d)
    gathered with one KV head per query head."""
    index = _kv_index(num_heads, t.shape[1], heads.indices(num_heads))
    if isinstance(index, slice):
        return t[:, index]
    return t.index_select(1, torch.tensor(index, device=t.device))


def _same_kv(num_heads: int, num_kv_heads: int, first: slice, second: slice) -> bool:
    """Whether the two maps' query heads read the same KV heads in the same order (adjacent pairs
    under MQA, or within one GQA group): decided from the head layout, not from the tensors."""
    return (_kv_index(num_heads, num_kv_heads, first.indices(num_heads))
            == _kv_index(num_heads, num_kv_heads, second.indices(num_heads)))


def _explicit_probs(query, key, mask, scaling, softcap, dropout, training) -> torch.Tensor:
    """softmax(Q Kᵀ·s + mask) in fp32 (fp64 for fp64), (B, Hq, L, S); K repeated onto the query heads."""
    acc = stats_dtype(query.dtype)
    key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
    scores = (query.to(acc) @ key.to(acc).transpose(-2, -1)) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float('-inf')) if mask.dtype == torch.bool else scores + mask.to(acc)
    return F.dropout(scores.softmax(dim=-1), p=dropout, training=training)


def _differential_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, explicit=False,
                          softcap=None, is_causal=None, **kwargs):
    """(attn_output (B, L, H, d), weights): the differential heads of one layer (module docstring)."""
    spec = module.differential
    B, H, L, d = query.shape
    scaling = module.head_dim ** -0.5 if scaling is None else scaling
    if attention_mask is not None and attention_mask.ndim == 4:
        attention_mask = attention_mask[:, :, :, :key.shape[-2]]
    lam = layer_lambda(module)
    if explicit:
        probs = functools.partial(_explicit_probs, mask=attention_mask, scaling=scaling, softcap=softcap,
                                  dropout=dropout, training=module.training)
        if spec.variant == 'duplicate':
            a = probs(query, key)  # (B, H, L, S)
            diff = a - lam * a
            out = diff @ value.repeat_interleave(H // value.shape[1], dim=1).to(diff.dtype)  # (B, H, L, d)
        else:
            first, second = _pair_heads(H, spec.head_pairing)
            a1, a2 = probs(query[:, first], _kv_for(key, H, first)), probs(query[:, second], _kv_for(key, H, second))
            diff = a1 - lam * a2  # (B, H/2, L, S)
            v1, v2 = _kv_for(value, H, first), _kv_for(value, H, second)
            v = torch.cat([v1.repeat_interleave(H // 2 // v1.shape[1], dim=1),
                           v2.repeat_interleave(H // 2 // v2.shape[1], dim=1)], dim=-1)  # (B, H/2, S, 2d)
            out = diff @ v.to(diff.dtype)  # (B, H/2, L, 2d)
        out = out.transpose(1, 2)  # (B, L, heads, width) fp32 (fp64 for fp64)
        out = F.rms_norm(out, (out.shape[-1],), _sub_norm_weight(module, out), module.sub_norm.eps)
        return out.to(query.dtype).reshape(B, L, H, d), diff
    if softcap is not None:
        raise ValueError(f'{type(module).__name__} soft-caps its attention logits, which SDPA cannot; load the '
                         f'model with attn_implementation="eager" before differentialize (it then uses {DIFF_EAGER})')
    if is_causal is None:
        is_causal = L > 1 and attention_mask is None and getattr(module, 'is_causal', True)
    sdpa = functools.partial(F.scaled_dot_product_attention, attn_mask=attention_mask,
                             dropout_p=dropout if module.training else 0., is_causal=is_causal, scale=scaling)

    def attend(q, k, v):  # (B, h, L, ·) → (B, L, h, ·), SDPA's memory layout
        return sdpa(q, k, v, enable_gqa=q.shape[1] != k.shape[1]).transpose(1, 2)

    if spec.variant == 'duplicate':
        o1 = o2 = [attend(query, key, value)]  # A1 = A2
    else:
        first, second = _pair_heads(H, spec.head_pairing)
        q1, q2 = query[:, first], query[:, second]  # (B, H/2, L, d) each
        k1, k2 = _kv_for(key, H, first), _kv_for(key, H, second)
        v1, v2 = _kv_for(value, H, first), _kv_for(value, H, second)
        a1v1, a2v1 = attend(q1, k1, v1), attend(q2, k2, v1)
        same = _same_kv(H, value.shape[1], first, second)  # [V | V]: one product per map serves both halves
        a1v2, a2v2 = (a1v1, a2v1) if same else (attend(q1, k1, v2), attend(q2, k2, v2))
        o1, o2 = [a1v1, a1v2], [a2v1, a2v2]  # parts of [V_a | V_b]
    out = sub_normed_difference(o1, o2, lam, _sub_norm_weight(module, o1[0]), module.sub_norm.eps)
    return out.reshape(B, L, H, d), None  # (B, L, heads, width) → the query heads' columns


@functools.lru_cache(maxsize=None)
def _model_eager(module_type: type):
    """The modelling file's own eager attention (Gemma 2's soft-capping included; Llama's where a
    modelling file has none of its own)."""
    return getattr(sys.modules[module_type.__module__], 'eager_attention_forward', llama_eager_attention)


def _with_injected(module, query, key, value, attention_mask, kwargs):
    """eRAM-V: the injected keys/values given as the `diffzoo_injected` input (`eramv.InjectedFeatures`)
    appended where this layer is one of its layers."""
    injected = kwargs.pop(INJECTED, None)
    if injected is None or module.layer_idx not in injected.kv:
        return key, value, attention_mask
    kwargs['is_causal'] = False
    return injected.extend(module.layer_idx, query, key, value, attention_mask)


def diffzoo_sdpa_attention(module, query, key, value, attention_mask, **kwargs):
    """`AttentionInterface` entry `diffzoo_sdpa`: differential heads where attached, else transformers' SDPA;
    eRAM-V's injected keys/values appended where given for the layer."""
    key, value, attention_mask = _with_injected(module, query, key, value, attention_mask, kwargs)
    if not hasattr(module, 'differential'):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return _differential_forward(module, query, key, value, attention_mask, **kwargs)


def diffzoo_eager_attention(module, query, key, value, attention_mask, **kwargs):
    """`AttentionInterface` entry `diffzoo_eager`: explicit maps, A1 − λ·A2 returned as the weights."""
    key, value, attention_mask = _with_injected(module, query, key, value, attention_mask, kwargs)
    if not hasattr(module, 'differential'):
        return _model_eager(type(module))(module, query, key, value, attention_mask, **kwargs)
    return _differential_forward(module, query, key, value, attention_mask, explicit=True, **kwargs)


def register_attention() -> None:
    """Register `diffzoo_sdpa` / `diffzoo_eager` with transformers' attention and mask interfaces (idempotent)."""
    AttentionInterface.register(DIFF_SDPA, diffzoo_sdpa_attention)
    AttentionInterface.register(DIFF_EAGER, diffzoo_eager_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(DIFF_SDPA, sdpa_mask)
    ALL_MASK_ATTENTION_FUNCTIONS.register(DIFF_EAGER, eager_mask)
