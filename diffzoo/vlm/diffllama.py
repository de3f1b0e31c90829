"""A differentialized Llama and transformers' DiffLlama, converted into each other exactly.

`differentialize(llama, variant='split', lambda_init='depth')` and `transformers.DiffLlamaForCausalLM`
compute the same attention; where their definitions differ, the weight map makes up for it:

    DiffLlama (reference code)                     differentialize, split
    pair i: query heads i and i + H/2, each on      head_pairing="halves" (the default for an even
    its own KV head (across KV heads under GQA)     H_kv < H); "adjacent" (2i, 2i + 1) is it with the
                                                    query, key and value heads reordered, under MHA only
    λ = exp(λ_q1·λ_k1) − exp(λ_q2·λ_k2) + λ_init    the same, λ in fp32
    λ_init = 0.8 − 0.6·exp(−0.3·l), l = 0, 1, …     lambda_init="depth" (the paper's 0.8 − 0.6·exp(−0.3·(l − 1))
                                                    with l counted from 1)
    (1 − λ_init)·RMSNorm_2d without a weight,       (1 − λ_init)·RMSNorm_2d with a weight w (`sub_norm`),
    eps = config.rms_norm_eps (also the decoder's)  eps 1e-5 (unilm's)
    pair i's 2d outputs: o_proj columns of query heads 2i, 2i + 1, in both

- w goes into o_proj: each pair's 2d input columns are multiplied by w (w = 1 coming back).
- eps: a head's output is linear in V and RMSNorm(c·x; ε) = RMSNorm(x; ε / c²), so v_proj (weight and
  bias) times c = √(ε_DiffLlama / 1e-5) makes DiffLlama's norm, with its eps, ours with 1e-5 (÷ c back).
Everything else (embeddings, RoPE, MLP, RMSNorms, lm_head) is Llama's in both, key for key.

Refused, with the fix: variant "duplicate", a constant λ_init, differential attention in some layers
only, "adjacent" pairs under GQA (both maps on one KV head, which DiffLlama never computes), an odd
number of KV heads (DiffLlama requires an even one), Llama's mlp_bias and attention dropout.

    llama_to_diffllama(state_dict, config) → state_dict      diffllama_config(config) → DiffLlamaConfig
    diffllama_to_llama(state_dict, config) → state_dict      llama_config(config) → LlamaConfig
    to_diffllama(model) → DiffLlamaForCausalLM               from_diffllama(model) → LlamaForCausalLM
"""
import math
from typing import Dict, List, Optional

import torch
import torch.nn as nn
import transformers

from .attention import DIFF_EAGER
from .differential import SUB_NORM_EPS, differentialize
from .hf_config import SETTINGS_KEY, saved_settings

# The configuration both models share; everything else of a DiffLlamaConfig is its default.
SHARED_FIELDS = ('vocab_size', 'hidden_size', 'intermediate_size', 'num_hidden_layers', 'num_attention_heads',
                 'num_key_value_heads', 'head_dim', 'hidden_act', 'max_position_embeddings', 'initializer_range',
                 'rms_norm_eps', 'use_cache', 'pad_token_id', 'bos_token_id', 'eos_token_id', 'tie_word_embeddings',
                 'rope_parameters', 'attention_bias', 'attention_dropout')
SETTINGS = dict(variant='split', lambda_init='depth', head_pairing='halves')  # what DiffLlama computes
ATTN = '.self_attn.'


def _convertible(config) -> Optional[str]:
    """The Llama config's differential settings, checked: the pairing, or ValueError naming each problem."""
    model_type = getattr(config, 'model_type', None)
    if model_type != 'llama':
        raise ValueError(f'{type(config).__name__} (model_type={model_type!r}): DiffLlama is a Llama; convert a '
                         f'LlamaForCausalLM made differential with differentialize(model, variant="split", '
                         f'lambda_init="depth")')
    spec = getattr(config, SETTINGS_KEY, None)
    if spec is None:
        raise ValueError(f'the Llama config has no "{SETTINGS_KEY}" settings: the model is not differential; call '
                         f'differentialize(model, variant="split", lambda_init="depth") first')
    spec = saved_settings(spec)
    heads, kv_heads, depth = config.num_attention_heads, config.num_key_value_heads, config.num_hidden_layers
    problems = []
    if spec['variant'] != 'split':
        problems.append(f'variant={spec["variant"]!r}: DiffLlama computes the split variant; differentialize with '
                        f'variant="split"')
    if spec['lambda_init'] != 'depth':
        problems.append(f'lambda_init={spec["lambda_init"]!r}: DiffLlama fixes λ_init = 0.8 − 0.6·exp(−0.3·l); '
                        f'differentialize with lambda_init="depth"')
    if list(spec['layers']) != list(range(depth)):
        problems.append(f'layers={spec["layers"]}: DiffLlama is differential in all {depth} layers; '
                        f'differentialize without layers=')
    if kv_heads % 2:
        problems.append(f'num_key_value_heads={kv_heads}: DiffLlama needs an even number of KV heads; this '
                        f'model has no DiffLlama equivalent')
    elif spec.get('head_pairing') == 'adjacent' and kv_heads < heads:
        problems.append(f'head_pairing="adjacent" with {heads} query heads on {kv_heads} KV heads: both maps of a '
                        f'pair read one KV head, which DiffLlama never computes; differentialize with '
                        f'head_pairing="halves" (DiffLlama\'s pairing)')
    if getattr(config, 'mlp_bias', False):
        problems.append('mlp_bias=True: DiffLlama\'s MLP has no biases; no DiffLlama equivalent')
    if config.attention_dropout:
        problems.append(f'attention_dropout={config.attention_dropout}: DiffLlama refuses attention dropout; '
                        f'set config.attention_dropout = 0.0')
    if problems:
        raise ValueError('this differential Llama cannot become a DiffLlama: ' + '; '.join(problems))
    return spec.get('head_pairing')


def diffllama_config(config: transformers.LlamaConfig) -> transformers.DiffLlamaConfig:
    """The DiffLlamaConfig of a differentialized Llama's config (checked convertible)."""
    _convertible(config)
    target = transformers.DiffLlamaConfig(**{k: getattr(config, k) for k in SHARED_FIELDS})
    target._attn_implementation = 'eager' if config._attn_implementation in ('eager', DIFF_EAGER) else 'sdpa'
    return target


def llama_config(config: transformers.DiffLlamaConfig) -> transformers.LlamaConfig:
    """The LlamaConfig of a DiffLlama's config (to be made differential with `SETTINGS`)."""
    if getattr(config, 'model_type', None) != 'diffllama':
        raise ValueError(f'{type(config).__name__} (model_type={getattr(config, "model_type", None)!r}): expected a '
                         f'DiffLlamaConfig; pass a DiffLlamaForCausalLM\'s config')
    target = transformers.LlamaConfig(**{k: getattr(config, k) for k in SHARED_FIELDS})
    target._attn_implementation = 'eager' if config._attn_implementation == 'eager' else 'sdpa'
    return target


def _value_scale(rms_norm_eps: float) -> float:
    """c with RMSNorm(c·x; rms_norm_eps) = RMSNorm(x; SUB_NORM_EPS): v_proj's factor into DiffLlama."""
    return math.sqrt(rms_norm_eps / SUB_NORM_EPS)


def _scaled(t: torch.Tensor, factor) -> torch.Tensor:
    """t · factor computed in fp64, in t's dtype."""
    return (t.double() * factor).to(t.dtype)


def _reorder_heads(t: torch.Tensor, order: List[int], head_dim: int) -> torch.Tensor:
    """Rows of a q/k/v projection (weight (n·d, C) or bias (n·d,)) with head `order[j]` as head j."""
    heads = t.reshape(-1, head_dim, *t.shape[1:])  # (n, d, …)
    return heads[order].reshape(t.shape)


def llama_to_diffllama(state_dict: Dict[str, torch.Tensor], config: transformers.LlamaConfig) -> Dict[str, torch.Tensor]:
    """A differentialized Llama's state dict (e.g. `model.state_dict()`) as DiffLlama's, same key names:
    sub_norm weights into o_proj, v_proj times √(rms_norm_eps / 1e-5), "adjacent" heads reordered."""
    pairing = _convertible(config)
    heads, d = config.num_attention_heads, config.head_dim
    # "adjacent" under MHA: our query (and KV) heads 0, 2, 4, … are DiffLlama's first half, 1, 3, 5, … its second
    order = list(range(0, heads, 2)) + list(range(1, heads, 2)) if pairing == 'adjacent' else None
    c = _value_scale(config.rms_norm_eps)
    sub_norms = {k[:-len('sub_norm.weight')]: v for k, v in state_dict.items() if k.endswith(ATTN + 'sub_norm.weight')}
    if len(sub_norms) != config.num_hidden_layers:
        raise ValueError(f'state dict: {len(sub_norms)} "…self_attn.sub_norm.weight" tensors for '
                         f'{config.num_hidden_layers} layers; pass the differentialized model\'s state_dict()')
    out = {}
    for key, t in state_dict.items():
        prefix, sep, leaf = key.rpartition(ATTN)
        if not sep:
            out[key] = t
            continue
        if leaf == 'sub_norm.weight':
            continue
        if order is not None and leaf.split('.')[0] in ('q_proj', 'k_proj', 'v_proj'):
            t = _reorder_heads(t, order, d)
        if leaf.startswith('v_proj.'):
            t = _scaled(t, c)
        if leaf == 'o_proj.weight':
            t = _scaled(t, sub_norms[prefix + sep].double().repeat(heads // 2))  # (C, H·d) · (H·d,): w per pair's columns
        out[key] = t
    return out


def diffllama_to_llama(state_dict: Dict[str, torch.Tensor],
                       config: transformers.DiffLlamaConfig) -> Dict[str, torch.Tensor]:
    """A DiffLlama's state dict as a Llama's made differential with `SETTINGS`: v_proj ÷ √(rms_norm_eps /
    1e-5), sub_norm weights 1, every other tensor as it is."""
    c = _value_scale(config.rms_norm_eps)
    out = {}
    for key, t in state_dict.items():
        prefix, sep, leaf = key.rpartition(ATTN)
        if sep and leaf.startswith('v_proj.'):
            t = _scaled(t, 1 / c)
        out[key] = t
        if sep and leaf == 'q_proj.weight':
            out[prefix + sep + 'sub_norm.weight'] = torch.ones(2 * config.head_dim, dtype=t.dtype, device=t.device)
    return out


def to_diffllama(model: nn.Module) -> transformers.DiffLlamaForCausalLM:
    """A transformers DiffLlamaForCausalLM computing what the differentialized `model` computes."""
    if not isinstance(model, transformers.LlamaForCausalLM):
        raise ValueError(f'{type(model).__name__}: to_diffllama converts a LlamaForCausalLM made differential; '
                         f'for another layout map its state dict with llama_to_diffllama')
    target = transformers.DiffLlamaForCausalLM(diffllama_config(model.config))
    target.load_state_dict(llama_to_diffllama(model.state_dict(), model.config))
    weight = model.model.embed_tokens.weight
    return target.to(device=weight.device, dtype=weight.dtype).train(model.training)


def from_diffllama(model: nn.Module) -> transformers.LlamaForCausalLM:
    """A LlamaForCausalLM made differential (split, λ_init by depth, "halves") computing what the
    transformers DiffLlamaForCausalLM `model` computes."""
    if not isinstance(model, transformers.DiffLlamaForCausalLM):
        raise ValueError(f'{type(model).__name__}: from_diffllama converts a DiffLlamaForCausalLM; for another '
                         f'layout map its state dict with diffllama_to_llama')
    target = differentialize(transformers.LlamaForCausalLM(llama_config(model.config)), **SETTINGS)
    target.load_state_dict(diffllama_to_llama(model.state_dict(), model.config))
    weight = model.model.embed_tokens.weight
    return target.to(device=weight.device, dtype=weight.dtype).train(model.training)
