"""eRAM-V's efficient visual integration for `build_vlm(..., integration="eramv")`.

Instead of all P visual tokens in the LLM's sequence (LLaVA/PaliGemma-style, `integration="full"`):

- Visual features: as LLaVA-1.5, which eRAM-V follows, the output of the tower's penultimate block
  without the final norm (`select_layer=-2`; `diffzoo.vlm.model` names the other choices,
  `select_layer='final_norm'` the last block through the final norm), projected by LLaVA-1.5's
  Linear → GELU → Linear (`projector='mlp2x_gelu'`; 'linear': one Linear, as PaliGemma).
- Visual anchors: the vision tower's [CLS] token followed by the k patch tokens with the highest CLS
  attention in the block the features come from (the penultimate one by default; score of patch j =
  mean over heads of A[CLS, j]; for a differential tower, its A1 − λ·A2), in their original order
  (CLS first), projected by the same projector as the features, then fed with the text. eRAM-V's
  default is k = 64 plus [CLS]: 65 anchors (`anchors=64`; Appendix I); `include_cls=False` keeps the k
  patches alone. A tower without a class token is refused by name; asking for as many anchors as there
  are patches, or more, is said once, when the model is built.
- Fine-grained features: all P patch tokens, projected the same way, become extra keys and values
  at the chosen decoder layers, made by each layer's own input norm and K/V projections (no new
  attention parameters). As in eRAM-V's Eq. 8, the whole multimodal sequence (anchors and text)
  attends to them (`injected_queries='all'`); `injected_queries='text'` lets only text positions read
  them (the anchors' path then stays as without injection).
- Injection layers count from 1, as the paper does: its "8, 10, …, 22" of a 32-layer LLM (section 3.3,
  and Table 3's ablation of the layers) are `inject_layers=[8, 10, …, 22]`, the decoder modules 7, 9, …, 21 (`layer_base=0` takes 0-based
  module indices instead). Other depths L get every second layer over the same relative span:
  from round(8/32·L) to round(22/32·L), stepping by 2 (`default_inject_layers`).
- Post-projection MLP on the visual tokens: v + W2·GELU(W1·v), W2 zero-initialised so the model
  starts as the plain projection.

- The sequence attends causally, as published ("Attn refers to the causal attention mechanism", Eq. 4 in
  section 3.3, as in LLaVA-1.5 which eRAM-V builds on): `sequence_mask='causal'`, in forward, training
  and `generate()`. `sequence_mask='prefix_lm'` gives PaliGemma's prefix-LM mask instead (anchors and
  prompt attend to each other in both directions, answers causally), the default of `integration="full"`.

Choices the paper leaves open, and ours: the injected keys carry no rotary position (they are a
set; keys at position 0 for no rotation); and the post-projection MLP's form (the residual
v + W2·GELU(W1·v) with W2 = 0 at init above).

The injected keys and values are an input of the language model's forward: `InjectedFeatures`
travels as the keyword `diffzoo_injected` (`attention.INJECTED`) through transformers' layers to
diffzoo's attention functions, which append them where the layer is one of the chosen ones; so they
compose with `differentialize` (both maps then span the injected keys as well), SDPA, eager and the
KV cache. `python -m diffzoo.bench.eramv` reports eRAM-V's FLOPs and latency.
"""
import warnings
from typing import Dict, List, Sequence, Tuple

import torch
import torch.nn as nn

from diffzoo.layers.maps import capture_attention_maps

REFERENCE_DEPTH = 32
REFERENCE_LAYERS = tuple(range(8, 23, 2))  # eRAM-V's injection layers in a 32-layer LLM, counted from 1
# build_vlm(..., integration="eramv")'s settings when not given: the paper's (module docstring)
ERAMV_DEFAULTS = {'select_layer': -2, 'projector': 'mlp2x_gelu', 'sequence_mask': 'causal', 'anchors': 64,
                  'include_cls': True,
                  'injected_queries': 'all', 'layer_base': 1, 'post_mlp': True}


def default_inject_layers(depth: int) -> List[int]:
    """eRAM-V's injection layers for a `depth`-layer LLM, counted from 1 as the paper does: every second
    layer from round(8/32·depth) to round(22/32·depth) (its 8, 10, …, 22 of 32); at least layer 1."""
    first = max(1, int(REFERENCE_LAYERS[0] * depth / REFERENCE_DEPTH + 0.5))
    last = min(depth, int(REFERENCE_LAYERS[-1] * depth / REFERENCE_DEPTH + 0.5))
    return list(range(first, max(first, last) + 1, 2))


def module_indices(layers: Sequence[int], depth: int, layer_base: int = 1) -> List[int]:
    """0-based decoder module indices of `layers`, counted from `layer_base` (1: the paper's count)."""
    if layer_base not in (0, 1):
        raise ValueError(f'layer_base={layer_base!r}: expected 1 (layers counted from 1, as eRAM-V) or 0 (module indices)')
    layers = sorted(set(int(l) for l in layers))
    bad = [l for l in layers if not layer_base <= l < depth + layer_base]
    if bad:
        raise ValueError(f'inject_layers={bad}: the decoder has layers {layer_base}..{depth - 1 + layer_base} '
                         f'(counted from {layer_base}; layer_base=1 counts as eRAM-V, layer_base=0 gives module indices)')
    return [l - layer_base for l in layers]


class PostProjectionMLP(nn.Module):
    """v + W2·GELU(W1·v) on projected visual tokens; W2 = 0 at init."""

    def __init__(self, dim: int):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, dim)
        nn.init.zeros_(self.fc2.weight)
        nn.init.zeros_(self.fc2.bias)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(x)))


def require_class_token(vision) -> None:
    """eRAM-V ranks patches by the [CLS] token's attention (Appendix I): a tower without a class token is refused
    by name (its first prefix token would be a register token)."""
    tower = vision.tower
    has_cls = getattr(tower, 'has_class_token', vision.prefix_tokens > 0)
    if vision.kind != 'timm' or not has_cls:
        registers = getattr(tower, 'num_reg_tokens', 0)
        what = f'{registers} register token(s)' if registers else f'{vision.prefix_tokens or "no"} prefix token(s)'
        raise ValueError(f'eRAM-V anchors rank patches by the [CLS] token\'s attention, and this {vision.kind} tower '
                         f'({type(tower).__name__}) has no class token ({what}); use a ViT with a class token '
                         f'(class_token=True in timm, a diffzoo or open_clip timm trunk), or integration="full"')


def check_tower(vision, anchors: int) -> None:
    """At build: `require_class_token`, and asking for at least as many anchors as the tower has patches is said
    once, here (every patch is then an anchor)."""
    require_class_token(vision)
    patches = getattr(getattr(vision.tower, 'patch_embed', None), 'num_patches', None)
    if patches is not None and anchors >= patches:
        warnings.warn(f'anchors={anchors} ≥ the {patches} patches of the tower: every patch is an anchor, so the '
                      f'sequence holds the whole image (as integration="full") and the anchors save nothing', stacklevel=3)


def anchor_scores(vision, pixel_values: torch.Tensor, with_cls: bool = False):
    """(patch tokens (B, P, D_v), scores (B, P)): the tower's tokens at its `select_layer` and the CLS
    attention of the block they come out of; with_cls: also the [CLS] token (B, D_v), third."""
    require_class_token(vision)
    with capture_attention_maps(vision.feature_block()) as maps:
        every = vision(pixel_values, prefix=True)  # (B, prefix + P, D_v); only the map-read block runs explicitly
    attn = maps[list(maps)[-1]]  # (B, heads, N, N)
    tokens, scores = every[:, vision.prefix_tokens:], attn[:, :, 0, vision.prefix_tokens:].float().mean(1)  # (B, P)
    return (tokens, scores, every[:, 0]) if with_cls else (tokens, scores)


def select_anchors(tokens: torch.Tensor, scores: torch.Tensor, k: int):
    """(anchors (B, k, D), indices (B, k) ascending): the k best-scored tokens in their original order."""
    k = min(k, tokens.shape[1])
    index = scores.topk(k, dim=1).indices.sort(dim=1).values  # (B, k)
    return tokens.gather(1, index[..., None].expand(-1, -1, tokens.shape[-1])), index


def injected_kv(layer: nn.Module, features: torch.Tensor):
    """Keys and values (B, H_kv, P, d) of `features` (B, P, D) by a decoder layer's own norm and projections."""
    attn = layer.self_attn
    B, P, _ = features.shape
    h = layer.input_layernorm(features)
    k = attn.k_proj(h).view(B, P, -1, attn.head_dim).transpose(1, 2)
    v = attn.v_proj(h).view(B, P, -1, attn.head_dim).transpose(1, 2)
    if hasattr(attn, 'k_norm'):
        k = attn.k_norm(k)
    return k, v


class InjectedFeatures:
    """eRAM-V's extra keys and values for some decoder layers, and which query positions read them.

    kv: {0-based layer index: (keys, values), each (B, H_kv, P, d)}; queries: (B, L) bool over the
    prompt's positions (all True for eRAM-V's Eq. 8; positions generated after the prompt are text and
    read them).
    """

    def __init__(self, kv: Dict[int, Tuple[torch.Tensor, torch.Tensor]], queries: torch.Tensor):
        self.kv, self.queries = kv, queries

    @classmethod
    def from_features(cls, decoder: nn.Module, layers: Sequence[int], features: torch.Tensor,
                      queries: torch.Tensor) -> 'InjectedFeatures':
        """Each chosen layer's keys and values of `features` (B, P, D), by its own norm and projections."""
        return cls({i: injected_kv(decoder.layers[i], features) for i in layers}, queries)

    def extend(self, layer_idx: int, query, key, value, attention_mask):
        """(key, value, mask) with layer `layer_idx`'s injected keys and values appended, the mask
        extended (only the chosen queries see them); unchanged for a layer without injection."""
        if layer_idx not in self.kv:
            return key, value, attention_mask
        k, v = self.kv[layer_idx]
        B, _, L, _ = query.shape
        S = key.shape[2]
        queries = self.queries
        if queries.shape[1] < L:  # generated tokens appended after the prompt: text
            queries = torch.cat([queries, queries.new_ones(B, L - queries.shape[1])], dim=1)
        elif queries.shape[1] > L:  # decoding with a cache: the newest positions, text
            queries = queries[:, -L:]
        k, v = k.to(key.dtype), v.to(value.dtype)
        if attention_mask is None:  # causal over the sequence, the cache in front
            q_pos = torch.arange(L, device=query.device)[:, None] + (S - L)
            attention_mask = (torch.arange(S, device=query.device)[None] <= q_pos)[None, None].expand(B, 1, L, S)
        extra = queries[:, None, :, None].expand(B, 1, L, k.shape[2])  # (B, 1, L, P)
        if attention_mask.dtype != torch.bool:
            blocked = torch.finfo(attention_mask.dtype).min
            extra = torch.zeros(extra.shape, dtype=attention_mask.dtype, device=extra.device).masked_fill_(~extra, blocked)
        mask = torch.cat([attention_mask.expand(B, -1, -1, -1), extra], dim=-1)
        return torch.cat([key, k], dim=2), torch.cat([value, v], dim=2), mask

