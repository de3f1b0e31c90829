"""Differential attention that starts from a pretrained attention layer's weights.

`PretrainedDifferentialAttention` is `DifferentialAttention` plus a record of where its weights came from
(`source`, the pretrained layer's H heads of width d = C / H, the variant and λ settings). It reads the
pretrained layer's own state-dict keys and converts them on load, so `open_clip.create_model(…,
pretrained=…)`, timm's loaders and `module.load_state_dict(plain_state_dict)` all carry the weights over; a
state dict that already holds λ is read as it is. The record is saved with the weights (`_extra_state`, a
JSON byte tensor, so safetensors and `weights_only` loads keep it), which is how a converted checkpoint
reloads into a plain model (`diffzoo.differential.load_converted`).

Sources and their keys (C = dim):

    timm          timm.layers.Attention     qkv.weight (3C, C), qkv.bias, proj.*, q_norm.*, k_norm.*, norm.*
    timm_eva      timm's EvaAttention        qkv.weight with q_bias, v_bias (K has none), or q_proj / k_proj /
                  (no rotary embedding)      v_proj; proj.*, q_norm.*, k_norm.*, norm.*
    open_clip     nn.MultiheadAttention of   in_proj_weight (3C, C), in_proj_bias, out_proj.*
                  ResidualAttentionBlock

How each variant lays out the pretrained heads j < H (Q_j, K_j, V_j rows of width d, W_O column block j):

    duplicate  h = H differential heads, head i = pretrained head i: Q, K, V and W_O unchanged (Differential
               PaliGemma, Eq. 5: both maps from the same Q_i K_iᵀ, so DiffAttn_i = (1 − λ)·A_i V_i)
    split      h = H / 2, query/key heads 2i and 2i+1 are Q1/K1 and Q2/K2 of head i, V_i = [V_a | V_b]:
               head_pairing "adjacent" (default): a, b = 2i, 2i+1, every tensor unchanged;
               "halves": a, b = i, i + H/2, the heads reordered (0, H/2, 1, H/2+1, …) in Q, K, V and W_O
    v2         h = H key/value heads, query heads 2i and 2i+1 both Q_i (so O1_i = O2_i = A_i V_i and
               head_i = (1 − σ(W_λ x)_i)·A_i V_i at the start); K, V, W_O unchanged, W_λ new

λ (λ_q1 … λ_k2, N(0, 0.1); v2's W_λ as `lambda_proj_init`), the sub-norm (weight 1) and (1 − λ_init) are new
and are the layer's own initial values. Only split with pairing "adjacent" and duplicate keep the qkv tensor
bit for bit; every variant keeps the query/key norms and the scale norm of the source as they are.
"""
import copy
import json
from typing import Dict, Optional

import torch
import torch.nn as nn

from .diff_attention import DifferentialAttention
from .lambdas import DIFFERENTIAL_KEYS, LAMBDA_PARAMETERS

SOURCES = ('timm', 'timm_eva', 'open_clip')
HEAD_PAIRINGS = ('adjacent', 'halves')
RECORD = '_extra_state'


def differential_heads(variant: str, heads: int) -> int:
    """The differential heads h a pretrained layer of `heads` ordinary heads becomes (module docstring)."""
    if variant == 'split':
        if heads % 2:
            raise ValueError(f'variant="split" pairs the pretrained heads, and this layer has {heads}; '
                             f'use variant="duplicate" or "v2"')
        return heads // 2
    return heads


def head_order(variant: str, heads: int, head_pairing: Optional[str]) -> Optional[list]:
    """The pretrained heads in the order the differential layer's query heads read them; None: unchanged."""
    if variant == 'v2':
        return [j for j in range(heads) for _ in (0, 1)]  # query heads 2i, 2i+1 ← Q_i
    if variant == 'split' and head_pairing == 'halves':
        return [j for i in range(heads // 2) for j in (i, i + heads // 2)]
    return None


def _rows(weight: torch.Tensor, order: list, d: int) -> torch.Tensor:
    """Rows of `weight` (or entries of a bias) grouped in heads of width d, taken in `order`."""
    return weight.reshape(-1, d, *weight.shape[1:])[order].reshape(len(order) * d, *weight.shape[1:])


def map_heads(qkv_weight: torch.Tensor, qkv_bias: Optional[torch.Tensor], proj_weight: torch.Tensor, variant: str,
              heads: int, head_pairing: Optional[str]) -> Dict[str, Optional[torch.Tensor]]:
    """A pretrained layer's qkv (3C, C) / (3C,) and output projection (C, C) laid out for `variant`
    (module docstring): {'qkv.weight', 'qkv.bias', 'proj.weight'}; a pure function of its arguments."""
    C = proj_weight.shape[1]
    d = C // heads
    order = head_order(variant, heads, head_pairing)
    if order is None:
        return {'qkv.weight': qkv_weight, 'qkv.bias': qkv_bias, 'proj.weight': proj_weight}
    same_kv = variant == 'v2'  # v2 repeats Q only; halves reorders Q, K, V and W_O's columns alike
    kv_order = list(range(heads)) if same_kv else order

    def lay_out(t: torch.Tensor) -> torch.Tensor:
        q, k, v = t.split(C, dim=0)
        return torch.cat([_rows(q, order, d), _rows(k, kv_order, d), _rows(v, kv_order, d)], 0)

    proj = proj_weight if same_kv else _rows(proj_weight.t(), order, d).t()
    return {'qkv.weight': lay_out(qkv_weight), 'qkv.bias': None if qkv_bias is None else lay_out(qkv_bias),
            'proj.weight': proj.contiguous()}


def source_tensors(state_dict: Dict[str, torch.Tensor], prefix: str, source: str) -> Dict[str, torch.Tensor]:
    """Pop a pretrained layer's tensors from `state_dict` as {'qkv.weight', 'qkv.bias', 'proj.weight',
    'proj.bias'} (bias entries may be None); the norms' keys stay where they are (same names)."""
    take = lambda name: state_dict.pop(prefix + name, None)  # noqa: E731

    def eva_bias(q_b, v_b):  # EVA's K has no bias: zeros between Q's and V's
        return None if q_b is None else torch.cat([q_b, torch.zeros_like(q_b), v_b])

    if source == 'open_clip':
        return {'qkv.weight': take('in_proj_weight'), 'qkv.bias': take('in_proj_bias'),
                'proj.weight': take('out_proj.weight'), 'proj.bias': take('out_proj.bias')}
    if source == 'timm_eva' and prefix + 'q_proj.weight' in state_dict:
        weight = torch.cat([take('q_proj.weight'), take('k_proj.weight'), take('v_proj.weight')])
        return {'qkv.weight': weight, 'qkv.bias': eva_bias(take('q_proj.bias'), take('v_proj.bias')),
                'proj.weight': take('proj.weight'), 'proj.bias': take('proj.bias')}
    weight, bias = take('qkv.weight'), take('qkv.bias')
    if source == 'timm_eva':
        bias = eva_bias(take('q_bias'), take('v_bias'))
        take('k_bias')  # a zero, non-persistent buffer in EVA; present in some exports
    return {'qkv.weight': weight, 'qkv.bias': bias, 'proj.weight': take('proj.weight'), 'proj.bias': take('proj.bias')}


class PretrainedDifferentialAttention(DifferentialAttention):
    """`DifferentialAttention` converted from a pretrained layer (module docstring). Besides
    `DifferentialAttention`'s arguments: `source` (one of SOURCES), `pretrained_heads` H and `head_pairing`
    (split only). `num_heads` is the differential heads, `differential_heads(variant, H)`. `forward` also
    takes EVA's `rope` keyword, which must be None (a rotary embedding is not applied here)."""

    def __init__(self, dim: int, num_heads: int = 8, *, source: str = 'timm', pretrained_heads: int = 8,
                 head_pairing: Optional[str] = None, **kwargs) -> None:
        if source not in SOURCES:
            raise ValueError(f'source={source!r}: expected one of {SOURCES}')
        variant = kwargs.get('variant', 'split')
        if variant == 'split':
            head_pairing = head_pairing or 'adjacent'
            if head_pairing not in HEAD_PAIRINGS:
                raise ValueError(f'head_pairing={head_pairing!r}: expected one of {HEAD_PAIRINGS}')
        elif head_pairing is not None:
            raise ValueError(f'head_pairing={head_pairing!r} pairs the heads of variant="split"; leave it out')
        if num_heads != differential_heads(variant, pretrained_heads):
            raise ValueError(f'num_heads={num_heads}: a {pretrained_heads}-head layer becomes '
                             f'{differential_heads(variant, pretrained_heads)} differential heads as {variant!r}')
        super().__init__(dim, num_heads, **kwargs)
        self.source, self.pretrained_heads, self.head_pairing = source, pretrained_heads, head_pairing

    def record(self) -> Dict:
        """What this layer was converted from and with (saved as its `_extra_state`)."""
        return {'source': self.source, 'pretrained_heads': self.pretrained_heads, 'variant': self.variant,
                'lambda_init': self.lambda_init_policy, 'head_pairing': self.head_pairing,
                'lambda_proj_init': self.lambda_proj_init, 'depth': self.depth}

    def get_extra_state(self) -> torch.Tensor:
        # on the CPU whatever device the model is built on (a meta-device build still records its settings)
        return torch.tensor(list(json.dumps(self.record(), sort_keys=True).encode()), dtype=torch.uint8, device='cpu')

    def set_extra_state(self, state) -> None:
        if isinstance(state, torch.Tensor) and state.is_meta:  # a meta-device copy holds no settings to compare
            return
        saved = read_record(state)
        mine = self.record()
        differs = {k: (saved.get(k), mine[k]) for k in ('source', 'pretrained_heads', 'variant', 'head_pairing',
                                                       'depth') if saved.get(k) != mine[k]}
        if differs:
            raise ValueError(f'a differential layer converted with {differs} (saved, here): load it into a model '
                             f'converted with the saved settings (diffzoo.differential.load_converted does)')
        if saved.get('lambda_init', mine['lambda_init']) != mine['lambda_init']:  # the trained layer's λ_init
            self.lambda_init_policy = saved['lambda_init']
            self.set_lambda_init(self.depth)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """A pretrained layer's keys (no λ among them) are converted to this layout first (module docstring)."""
        if not any(prefix + k in state_dict for k in DIFFERENTIAL_KEYS) and self._holds_source(state_dict, prefix):
            tensors = source_tensors(state_dict, prefix, self.source)
            mapped = map_heads(tensors['qkv.weight'], tensors['qkv.bias'], tensors['proj.weight'], self.variant,
                               self.pretrained_heads, self.head_pairing)
            mapped['proj.bias'] = tensors['proj.bias']
            order = head_order(self.variant, self.pretrained_heads, self.head_pairing)
            if order is not None and self.variant == 'split':  # the scale norm's channels follow W_O's columns
                d = mapped['proj.weight'].shape[1] // self.pretrained_heads
                for name in ('norm.weight', 'norm.bias'):
                    if prefix + name in state_dict:
                        state_dict[prefix + name] = _rows(state_dict[prefix + name], order, d)
            state_dict.update({prefix + k: v for k, v in mapped.items() if v is not None})
            own = self.state_dict()
            for name, value in own.items():  # λ, W_λ and the sub-norm: the layer's own initial values
                if name.split('.')[0] in LAMBDA_PARAMETERS and prefix + name not in state_dict:
                    state_dict[prefix + name] = value
        state_dict.setdefault(prefix + RECORD, self.get_extra_state())
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _holds_source(self, state_dict, prefix: str) -> bool:
        key = {'open_clip': 'in_proj_weight'}.get(self.source, 'qkv.weight')
        if self.source == 'timm_eva' and prefix + 'q_proj.weight' in state_dict:
            return True
        return prefix + key in state_dict

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False,
                rope: Optional[torch.Tensor] = None) -> torch.Tensor:
        if rope is not None:
            raise RuntimeError('a rotary position embedding reached a converted differential layer, which does not '
                               'apply one; EVA models with RoPE are not converted')
        return self.attend(x, attn_mask, is_causal)


def read_record(state) -> Dict:
    """The conversion record saved as a layer's `_extra_state` (a JSON byte tensor)."""
    if isinstance(state, torch.Tensor):
        state = bytes(state.to(torch.uint8).tolist()).decode()
    return json.loads(state) if isinstance(state, str) else dict(state)


def copy_modules(target: nn.Module, source: nn.Module, names=('q_norm', 'k_norm', 'norm')) -> None:
    """Put copies of the source layer's own norm modules (their class and weights) into the converted layer."""
    for name in names:
        module = getattr(source, name, None)
        if isinstance(module, nn.Module):
            setattr(target, name, copy.deepcopy(module))
