"""Differential attention in Hugging Face decoders: `differentialize(model, ...)`.

Each chosen decoder layer's attention module (PaliGemma's Gemma, Gemma 2, Llama, Qwen2, …) keeps
its pretrained q/k/v/o projections and gains λ_q1, λ_k1, λ_q2, λ_k2 (head_dim each, N(0, 0.1)), a
per-head RMSNorm `sub_norm` and λ_init. Its attention kernel is swapped through
`transformers.AttentionInterface` (names `diffzoo_sdpa`, `diffzoo_eager`); transformers' modelling
code is not edited. λ and its λ_init policies are `diffzoo.layers.lambdas`' (l, for "depth", the 0-based
decoder layer index). With d the model's head_dim and H its query heads:

duplicate (Differential PaliGemma, Eq. 5): both maps from the pretrained, undivided Q and K,

    head_j = (1 − λ_init) · RMSNorm_d((softmax(Q_j K_jᵀ·s) − λ·softmax(Q_j K_jᵀ·s)) V_j),   j < H

split (Differential Transformer applied to pretrained heads): two query heads a(i), b(i) form
differential head i, its value is their values side by side; every query head j keeps the model's
own K, V head, KV head j // (H / H_kv), written K_j, V_j below,

    head_i = (1 − λ_init) · RMSNorm_2d((softmax(Q_a K_aᵀ·s) − λ·softmax(Q_b K_bᵀ·s)) [V_a | V_b]),  i < H/2

and head_i fills the columns of query heads 2i, 2i+1 in front of o_proj. `head_pairing` chooses a, b:

    "halves"    a = i, b = i + H/2: transformers' DiffLlama. With an even number of KV heads the two
                maps read KV heads m and m + H_kv/2 (m = i // (H / H_kv)), V_pair = [V_m | V_m+H_kv/2]:
                the pairing across KV heads of the reference code, unilm's FlashDiff1 included (its
                interleaved layout, q1/q2 = even/odd heads of 2·H/2 and k1/k2 of 2·H_kv/2, is this one
                with the heads reordered). Default when H_kv is even and H_kv < H (GQA).
    "adjacent"  a = 2i, b = 2i + 1. Under GQA with an even group size both maps read one KV head
                (K_a = K_b, V_pair = [V | V]); under MQA always. Default for MHA (H_kv = H, where
                "halves" is this pairing with the heads reordered), MQA and an odd H_kv; the split
                variant's only pairing before `head_pairing` existed.

The pairing across KV heads under GQA is reference-code behaviour (unilm's code, DiffLlama), not a
formula of the paper. s is the model's scaling
(Gemma's query_pre_attn_scalar included); masks, KV cache, sliding windows and soft-capping (eager)
are the model's own. `diffzoo_sdpa` runs each map through `F.scaled_dot_product_attention` and
forms the difference and sub-norm with the fused op of `diffzoo.layers` (only SDPA's outputs are
saved for backward); `diffzoo_eager` computes the maps in fp32 and returns A1 − λ·A2 as the
attention weights (`output_attentions=True`). Layers not made differential use the model's own
SDPA / eager code. λ, softmax (eager) and the sub-norm's statistics are computed in
torch.promote_types(dtype, float32): fp32 for fp32, bf16 and fp16, fp64 for fp64.

eRAM-V's injected keys and values reach the attention functions as the forward keyword
`diffzoo_injected` (`INJECTED`; `diffzoo.vlm.eramv.InjectedFeatures`), appended in the layers it names.

`mlp="swiglu"` is the paper's SwiGLU option: a gated feed-forward (gate_proj, up_proj, down_proj)
keeps its weights and takes SiLU as its gate activation (Llama/Qwen2 already have it; Gemma's GELU
gate becomes SiLU).

The settings are stored on the decoder's config (`diffzoo_differential`), and the model's config
saves as the `diffzoo_differential` model type (`diffzoo.vlm.hf_config`), so `save_pretrained` writes
them with the weights and transformers' Auto classes (after `import diffzoo`) or
`load_differential(path)` rebuild and reload the model. The decoder stack is `diffzoo.vlm.parts.find_decoder`'s,
and `diffzoo.vlm.parts.differential_parameters` lists what was added to it.
"""
from pathlib import Path
from typing import Dict, Iterable, Optional, Sequence, Union

import safetensors
import torch
import torch.nn as nn
import transformers
from timm.layers import RmsNorm

from diffzoo.layers import resolve_lambda_init
from diffzoo.layers.blocks import block_indices
from diffzoo.layers.lambdas import LAMBDA_STD, LAMBDA_VECTORS
from .attention import DIFF_EAGER, DIFF_SDPA, layer_lambda, register_attention
from .hf_config import SETTINGS_KEY, mark_differential, saved_settings
from .options import HEAD_PAIRINGS, MLPS, VARIANTS
from .parts import PARAMETER_NAMES, find_decoder

SUB_NORM_EPS = 1e-5  # unilm's and timm's DiffAttention sub-norm


class DifferentialSpec:
    """What `differentialize` attached to one attention module (kept as `module.differential`)."""

    def __init__(self, variant: str, lambda_init: float, head_pairing: Optional[str] = None):
        self.variant, self.lambda_init, self.head_pairing = variant, lambda_init, head_pairing

    def __repr__(self):
        return (f'DifferentialSpec(variant={self.variant!r}, lambda_init={self.lambda_init:.4f}, '
                f'head_pairing={self.head_pairing!r})')


def _check_attention(attn: nn.Module, variant: str, index: int) -> None:
    missing = [n for n in ('q_proj', 'k_proj', 'v_proj', 'o_proj', 'head_dim', 'layer_idx') if not hasattr(attn, n)]
    if missing:
        raise ValueError(f'layer {index}: {type(attn).__name__} lacks {missing}; differentialize needs a '
                         f'transformers attention module with q/k/v/o projections')
    heads = attn.q_proj.out_features // attn.head_dim
    if variant == 'split' and heads % 2:
        raise ValueError(f'layer {index}: variant="split" pairs query heads but {type(attn).__name__} has '
                         f'{heads}; use variant="duplicate"')


def _resolve_head_pairing(head_pairing: Optional[str], variant: str, attn: nn.Module) -> Optional[str]:
    """The split variant's pairing: as given, or by default "halves" (DiffLlama's, across KV heads) for
    an even number of KV heads fewer than the query heads, "adjacent" otherwise; None for duplicate."""
    if variant != 'split':
        if head_pairing is not None:
            raise ValueError(f'head_pairing={head_pairing!r}: pairs the query heads of variant="split"; '
                             f'variant={variant!r} has no pairs; leave head_pairing out')
        return None
    if head_pairing is not None:
        return head_pairing
    heads, kv_heads = attn.q_proj.out_features // attn.head_dim, attn.k_proj.out_features // attn.head_dim
    return 'halves' if kv_heads < heads and kv_heads % 2 == 0 else 'adjacent'


def _add_parameters(attn: nn.Module, variant: str, lambda_init: float, head_pairing: Optional[str]) -> None:
    """λ vectors N(0, 0.1) and the sub-norm (weight 1) on `attn`, in its projection's dtype and device."""
    weight = attn.q_proj.weight
    dd = {'device': weight.device, 'dtype': weight.dtype}
    d = attn.head_dim
    for name in LAMBDA_VECTORS:
        setattr(attn, name, nn.Parameter(torch.empty(d, **dd).normal_(0, LAMBDA_STD)))
    attn.sub_norm = RmsNorm(2 * d if variant == 'split' else d, eps=SUB_NORM_EPS, **dd)
    attn.differential = DifferentialSpec(variant, lambda_init, head_pairing)


def _swiglu(mlp: nn.Module, index: int) -> None:
    if not all(hasattr(mlp, n) for n in ('gate_proj', 'up_proj', 'down_proj', 'act_fn')):
        raise ValueError(f'layer {index}: mlp="swiglu" needs a gated feed-forward (gate_proj, up_proj, down_proj, '
                         f'act_fn); {type(mlp).__name__} is not one; use mlp="original"')
    mlp.act_fn = nn.SiLU()


def differentialize(
        model: nn.Module,
        variant: str = 'duplicate',
        lambda_init: Union[float, str] = 'depth',
        layers: Optional[Iterable[int]] = None,
        mlp: str = 'original',
        head_pairing: Optional[str] = None,
) -> nn.Module:
    """Make the decoder attention of a transformers model differential, in place; returns the model.

    variant: "duplicate" (Differential PaliGemma) or "split" (module docstring); lambda_init: a float
    or "depth"; layers: decoder layer indices (default all); mlp: "original" or "swiglu";
    head_pairing (split only): "halves" (DiffLlama's, across KV heads under GQA) or "adjacent"
    (query heads 2i, 2i + 1); by default "halves" for an even number of KV heads fewer than the
    query heads, else "adjacent". The chosen pairing is saved with the settings.
    """
    if variant not in VARIANTS:
        raise ValueError(f'variant={variant!r}: expected one of {VARIANTS}')
    if mlp not in MLPS:
        raise ValueError(f'mlp={mlp!r}: expected one of {MLPS}')
    if head_pairing is not None and head_pairing not in HEAD_PAIRINGS:
        raise ValueError(f'head_pairing={head_pairing!r}: expected one of {HEAD_PAIRINGS} or None (the default '
                         f'for the model\'s head layout)')
    resolve_lambda_init(lambda_init, 0)
    decoder = find_decoder(model)
    blocks = decoder.layers
    done = [i for i, block in enumerate(blocks) if hasattr(block.self_attn, 'differential')]
    if done:  # a second call would leave layers of two settings, and the config would record only the last
        raise ValueError(f'{type(model).__name__} is already differential (decoder layers {done}); differentialize '
                         f'converts a plain model: load it again from its pretrained files (from_pretrained) and '
                         f'call differentialize once, with every layer to convert')
    chosen = block_indices(layers, len(blocks), f'{type(model).__name__}\'s decoder', key='layers')
    for i in chosen:
        _check_attention(blocks[i].self_attn, variant, i)
    inits = [resolve_lambda_init(lambda_init, blocks[i].self_attn.layer_idx) for i in chosen]  # λ_init per layer
    pairing = _resolve_head_pairing(head_pairing, variant, blocks[chosen[0]].self_attn)
    for i, init in zip(chosen, inits):
        _add_parameters(blocks[i].self_attn, variant, init, pairing)
        if mlp == 'swiglu':
            _swiglu(blocks[i].mlp, i)
    register_attention()
    config = decoder.config
    setattr(config, SETTINGS_KEY, {'variant': variant, 'lambda_init': lambda_init, 'layers': chosen, 'mlp': mlp,
                                 'head_pairing': pairing})
    if config._attn_implementation not in (DIFF_SDPA, DIFF_EAGER):
        config._attn_implementation = DIFF_EAGER if config._attn_implementation == 'eager' else DIFF_SDPA
    mark_differential(model)  # saved as the `diffzoo_differential` model type (diffzoo.vlm.hf_config)
    return model


def differential_state_dict(model: nn.Module) -> dict:
    """{name: tensor} of the added parameters, names as in `model.state_dict()`."""
    return {k: v for k, v in model.state_dict().items() if k.endswith(PARAMETER_NAMES) and '.self_attn.' in k}


@torch.no_grad()
def layer_lambdas(model: nn.Module) -> Dict[int, float]:
    """{decoder layer index: λ} of every differential layer of `model`."""
    return {m.layer_idx: layer_lambda(m).item() for m in model.modules() if hasattr(m, 'differential')}


def _saved_tensors(path: Path, names: Sequence[str]) -> dict:
    """The checkpoint tensors whose names end with one of `names`' layer-relative suffixes."""
    files = sorted(path.glob('*.safetensors'))
    if not files:
        raise FileNotFoundError(f'{path}: no *.safetensors files; save the model with save_pretrained first')
    found = {}
    for f in files:
        with safetensors.safe_open(str(f), framework='pt') as sf:
            for key in sf.keys():
                if key.endswith(PARAMETER_NAMES) and '.self_attn.' in key:
                    found[key] = sf.get_tensor(key)
    return found


def _suffix(name: str) -> str:
    """'…layers.3.self_attn.lambda_q1' → 'layers.3.self_attn.lambda_q1'."""
    i = name.rfind('layers.')
    return name[i:] if i >= 0 else name


def load_differential(path: Union[str, Path], model_class=None, **kwargs) -> nn.Module:
    """A model written by `save_pretrained` after `differentialize`: loaded with transformers, made
    differential with the saved settings, and given its saved λ / sub-norm parameters."""
    path = Path(path)
    config = transformers.AutoConfig.from_pretrained(path)
    spec = getattr(config.get_text_config(), SETTINGS_KEY, None) or getattr(config, SETTINGS_KEY, None)
    if spec is None:
        raise ValueError(f'{path}: config.json has no "{SETTINGS_KEY}" settings; it was not saved from a '
                         f'differentialized model; load it with transformers and call differentialize()')
    classes = getattr(type(config), 'model_classes', None) or {}  # diffzoo.vlm.hf_auto
    if model_class is None:
        arch = (config.architectures or [None])[0]
        model_class = classes.get(arch) or (getattr(transformers, arch, None) if arch else None)
        if model_class is None:
            raise ValueError(f'{path}: config.architectures={config.architectures!r} names no transformers class; '
                             f'pass model_class=')
    if model_class.__name__ in classes:  # saved as `diffzoo_differential`: its class loads it differential
        return classes[model_class.__name__].from_pretrained(path, config=config, **kwargs)
    model = model_class.from_pretrained(path, **kwargs)
    differentialize(model, **saved_settings(spec))
    saved = {_suffix(k): v for k, v in _saved_tensors(path, PARAMETER_NAMES).items()}
    state = differential_state_dict(model)
    missing = [k for k in state if _suffix(k) not in saved]
    if missing:
        raise ValueError(f'{path}: {len(missing)} differential parameters are not in the checkpoint '
                         f'(e.g. {missing[0]}); it was saved before differentialize or is incomplete')
    model.load_state_dict({k: saved[_suffix(k)] for k in state}, strict=False)
    return model
