"""Attention maps of a CLIP vision tower: CLS maps, text-query relevance, entropy per block.

    python -m diffzoo.analysis.overlays IMAGE [IMAGE ...] --model NAME[,PRETRAINED] [--model NAME2[,PRETRAINED] …]
        [--query mug --query lamp] [--layer -1] [--out attention.png] [--entropy]

Attention maps. Every block of a timm ViT vision tower is read on its explicit attention path, at
the point where the map enters the value product, so the map is the one the model used:

    timm.layers.Attention (CLIP baseline)     A = softmax(Q Kᵀ / √d)    read at `attn_drop`
    DifferentialAttention (DiffCLIP)          A = A1 − λ·A2             read at `diff_map`

with Q, K after `q_norm`/`k_norm`. The fused (SDPA) path is switched off while reading and restored
after. Maps are (B, heads, N, N) in fp32, N = prefix tokens + gh·gw patches; heads are the layer's
own heads (differential heads for DiffCLIP). The differential map is signed: its rows sum to 1 − λ
and entries can be negative where the second map cancels the first.

CLS map (no query): the class token's row over the patch tokens, averaged over heads, at one block
(`--layer`, default the last): m_j = mean_h A_h[cls, j]. Returned signed; overlays show it clipped
at 0 (a patch the differential map cancels is shown as not attended), as each patch's share of the
map's total, on one colour scale for every panel of the figure.

Query map (text query "mug"): gradient-weighted attention relevance (Chefer, Gur & Wolf, "Generic
Attention-model Explainability for Interpreting Bi-Modal and Encoder-Decoder Transformers", ICCV
2021), the method commonly used to show what a CLIP ViT attends to for a text. The score is the
cosine similarity s = ⟨f_image, f_text⟩ of the normalised embeddings; over the blocks b in order,

    Ā_b = mean_h (∇_{A_b} s ⊙ A_b)⁺,    R ← R + Ā_b R,    R₀ = I,

and the map is R[cls, patches]. It is chosen over patch-token/text similarity because it reads the
attention maps themselves (the thing differential attention changes) and every token the CLS
output depends on, while CLIP's patch outputs are never trained to align with text. For
differential blocks A_b is the signed A1 − λ·A2. The DiffCLIP paper's text and project page show
such maps (CLIP vs DiffCLIP for "mug", "desk lamp") without stating how they were computed.

Attention entropy (attention noise; the per-row Shannon entropy used by eRAM-V's analysis): for
each block and head, averaged over query tokens i (all N rows) and images,

    H = −Σ_j p_ij log p_ij,    p_ij = |a_ij| / Σ_k |a_ik|,

in nats; 0 ≤ H ≤ log N, log N being uniform attention. For softmax attention p = a. A1 − λ·A2 is not
a distribution, so for differential blocks H is the entropy of the normalised magnitude |A1 − λA2|:
how spread out the map's mass is, whatever its sign. Lower means attention concentrated on fewer
tokens (less diffuse), whatever the model's accuracy.
"""
from typing import Dict, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer

from diffzoo.layers.maps import capture_attention_maps, map_tap

from .metrics import attention_entropy


def vision_trunk(model: nn.Module) -> VisionTransformer:
    """The timm ViT of an open_clip model (`model.visual.trunk`), or `model` if it is one."""
    trunk = getattr(getattr(model, 'visual', None), 'trunk', model)
    if not isinstance(trunk, VisionTransformer):
        tower = type(getattr(model, 'visual', model)).__name__
        raise ValueError(
            f'{type(model).__name__}: the vision tower is {tower}, not a timm VisionTransformer; attention '
            f'maps are read from timm ViT towers, i.e. open_clip configs whose vision_cfg names a '
            f'timm_model_name (diffclip-*, clip-*-baseline)')
    if trunk.cls_token is None:
        raise ValueError(f'{type(trunk).__name__} has no class token to read CLS attention from; '
                         f'use a ViT built with class_token=True (every diffzoo model is)')
    for i, block in enumerate(trunk.blocks):
        try:
            map_tap(block.attn)
        except ValueError as exc:
            raise ValueError(f'vision block {i}: {exc}') from None
    return trunk


def attention_maps(model: nn.Module, images: torch.Tensor) -> Dict[str, torch.Tensor]:
    """Block name → (B, heads, N, N) fp32 attention map of the vision tower (see the module docstring)."""
    trunk = vision_trunk(model)
    with torch.no_grad(), capture_attention_maps(trunk, detach=False) as maps:
        trunk.forward_features(images)
        return {name: a.detach().float() for name, a in maps.items()}


def _grid(trunk: VisionTransformer) -> Tuple[int, int]:
    return tuple(trunk.patch_embed.grid_size)


def cls_attention(model: nn.Module, images: torch.Tensor, layer: int = -1) -> torch.Tensor:
    """(B, gh, gw) signed CLS → patch attention of block `layer`, averaged over heads."""
    trunk = vision_trunk(model)
    maps = list(attention_maps(model, images).values())
    if not -len(maps) <= layer < len(maps):
        raise ValueError(
            f'--layer {layer}: the vision tower has {len(maps)} blocks; pass -{len(maps)}..{len(maps) - 1}')
    cls_row = maps[layer][:, :, 0, trunk.num_prefix_tokens:].mean(1)  # (B, gh·gw)
    return cls_row.reshape(len(images), *_grid(trunk))  # (B, gh, gw)


def query_attention(model: nn.Module, tokenizer, images: torch.Tensor, queries: Sequence[str]) -> torch.Tensor:
    """(B, Q, gh, gw) gradient-weighted attention relevance of each image for each text query.

    Gradients are enabled inside even when called under `torch.no_grad()`; parameter `.grad`s are
    left untouched. Two queries' maps differ as far as their text embeddings do: a model that learned
    nothing embeds every text alike and gives every query the same map.
    """
    trunk = vision_trunk(model)
    device = next(model.parameters()).device
    with torch.no_grad():
        text = F.normalize(model.encode_text(tokenizer(list(queries)).to(device)).float(), dim=-1)  # (Q, D)
    images = images.detach().requires_grad_(True)  # a graph even when every parameter is frozen
    with torch.enable_grad(), capture_attention_maps(trunk, detach=False) as maps:
        image = F.normalize(model.encode_image(images).float(), dim=-1)  # (B, D)
        scores = image @ text.T  # (B, Q)
        layers = list(maps.values())
        B, N = images.shape[0], layers[0].shape[-1]
        relevance = []
        for q in range(len(queries)):
            grads = torch.autograd.grad(scores[:, q].sum(), layers, retain_graph=q < len(queries) - 1)
            R = torch.eye(N, device=device).expand(B, N, N)  # (B, N, N)
            for a, g in zip(layers, grads):
                weighted = (g.float() * a.detach().float()).clamp(min=0).mean(1)  # (B, N, N)
                R = R + weighted @ R
            relevance.append(R[:, 0, trunk.num_prefix_tokens:])  # (B, gh·gw)
    return torch.stack(relevance, 1).reshape(B, len(queries), *_grid(trunk))  # (B, Q, gh, gw)


def image_entropy(model: nn.Module, images: torch.Tensor, batch_size: int = 16) -> torch.Tensor:
    """(B, blocks, heads) mean row entropy over the query tokens of each image, in nats."""
    per_batch = []
    for start in range(0, len(images), batch_size):
        maps = attention_maps(model, images[start:start + batch_size])
        per_batch.append(torch.stack([attention_entropy(a).mean(2) for a in maps.values()], 1))  # (b, L, h)
    return torch.cat(per_batch)  # (B, L, h)


def block_entropy(model: nn.Module, images: torch.Tensor, batch_size: int = 16) -> torch.Tensor:
    """(blocks, heads) mean row entropy over query tokens and images, in nats."""
    return image_entropy(model, images, batch_size).mean(0)
