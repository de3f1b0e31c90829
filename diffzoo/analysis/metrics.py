"""Layer metrics of one forward pass (definitions in `diffzoo.analysis`): token similarity between
a layer's input and output, attention entropy and mass by token category, top-k overlap."""
from typing import Dict, Iterable, Optional, Sequence, Set

import torch
import torch.nn.functional as F

CATEGORIES = ('visual', 'text', 'special')
VISUAL, TEXT, SPECIAL = range(3)
TOP_K = 25
VLM_METRICS = ('cosine_visual', 'cosine_text', 'entropy', 'mass_visual', 'mass_text', 'mass_special', 'row_sum')
CLIP_METRICS = ('cosine_visual', 'entropy')


def average_cosine_similarity(before: torch.Tensor, after: torch.Tensor) -> float:
    """S(before, after) of two (N, D) token matrices (module docstring), computed in fp64."""
    if before.ndim != 2 or before.shape != after.shape:
        raise ValueError(f'average_cosine_similarity: before {tuple(before.shape)}, after {tuple(after.shape)}: '
                         f'expected two (N, D) matrices of one shape, token i of both at the same position; '
                         f'pass one sample\'s tokens, e.g. hidden[0, visual]')
    if before.shape[0] == 0:
        raise ValueError('average_cosine_similarity: no tokens (N = 0); select at least one token')
    return F.cosine_similarity(before.double(), after.double(), dim=-1).mean().item()


def attention_entropy(attn: torch.Tensor) -> torch.Tensor:
    """H of every row of `attn` (..., N) → (...) in nats, p = |a| / Σ|a|: rows that are not
    distributions (signed differential maps) by their normalised magnitude."""
    if attn.ndim == 0 or attn.shape[-1] == 0:
        raise ValueError(f'attention_entropy: attn {tuple(attn.shape)}: expected rows over keys in the last dim')
    p = attn.float().abs()
    p = p / p.sum(-1, keepdim=True).clamp(min=torch.finfo(p.dtype).tiny)
    return -torch.special.xlogy(p, p).sum(-1)


def attention_mass(attn: torch.Tensor, categories: torch.Tensor) -> torch.Tensor:
    """(..., N) rows and (N,) token categories (VISUAL/TEXT/SPECIAL) → (..., 3) mass per category."""
    if categories.shape != attn.shape[-1:]:
        raise ValueError(f'attention_mass: categories {tuple(categories.shape)} do not label the '
                         f'{attn.shape[-1]} keys of attn {tuple(attn.shape)}; pass one category per key')
    p = attn.float().abs()
    p = p / p.sum(-1, keepdim=True).clamp(min=torch.finfo(p.dtype).tiny)
    return p @ F.one_hot(categories.long().to(p.device), len(CATEGORIES)).to(p.dtype)  # (..., 3)


def top_k_tokens(scores: torch.Tensor, k: int = TOP_K) -> Set[int]:
    """Indices of the k highest of (N,) `scores` (all N when N < k)."""
    return set(scores.topk(min(k, scores.numel())).indices.tolist())


def jaccard(a: Iterable[int], b: Iterable[int]) -> float:
    """|A ∩ B| / |A ∪ B|."""
    a, b = set(a), set(b)
    if not a | b:
        raise ValueError('jaccard: both sets are empty')
    return len(a & b) / len(a | b)


def token_categories(input_ids: Sequence[int], special_ids: Iterable[int], image_tokens: int = 0,
                     image_token_id: Optional[int] = None) -> torch.Tensor:
    """(image_tokens + T,) categories of [image_tokens visual positions | input_ids]; ids equal to
    `image_token_id` are visual, other `special_ids` special, the rest text."""
    special = set(special_ids) - {image_token_id}
    text = [VISUAL if i == image_token_id else SPECIAL if i in special else TEXT for i in map(int, input_ids)]
    return torch.tensor([VISUAL] * image_tokens + text, dtype=torch.long)


def layer_metrics(hidden: Sequence[torch.Tensor], attention: Sequence[torch.Tensor],
                  categories: torch.Tensor) -> Dict:
    """One forward pass: `hidden` L + 1 states (S, D), `attention` L rows (heads, S) of the query token,
    `categories` (S,) → per-layer lists of VLM_METRICS (module docstring; `cosine_text` None when the
    prompt has no text token) and `visual_scores` (P,), the top-k scores of the visual tokens."""
    if len(hidden) != len(attention) + 1:
        raise ValueError(f'layer_metrics: {len(hidden)} hidden states for {len(attention)} layers; expected L + 1 '
                         f'(the input embeddings, then each layer\'s output)')
    visual, text = categories == VISUAL, categories == TEXT
    if not visual.any():
        raise ValueError('layer_metrics: no visual token in the sequence; the image tokens are missing')
    out = {name: [] for name in VLM_METRICS}
    shares = []
    S = categories.shape[0]
    for l, a in enumerate(attention):
        a = a.float()  # (heads, S), or (heads, S + P) where eRAM-V injected P visual keys after the sequence
        keys = categories if a.shape[-1] == S else torch.cat([categories, categories.new_full((a.shape[-1] - S,), VISUAL)])
        h0, h1 = hidden[l], hidden[l + 1]  # (S, D)
        out['cosine_visual'].append(average_cosine_similarity(h0[visual], h1[visual]))
        out['cosine_text'].append(average_cosine_similarity(h0[text], h1[text]) if text.any() else None)
        out['entropy'].append(attention_entropy(a).mean().item())
        for name, m in zip(('mass_visual', 'mass_text', 'mass_special'), attention_mass(a, keys).mean(0)):
            out[name].append(m.item())
        out['row_sum'].append(a.sum(-1).mean().item())
        share = a / a.abs().sum(-1, keepdim=True).clamp(min=torch.finfo(a.dtype).tiny)
        shares.append(share[:, :S].mean(0))  # (S,): the sequence's tokens
    shares = torch.stack(shares)  # (L, S)
    out['visual_scores'] = shares.mean(0)[visual.to(shares.device)]  # (P,)
    return out
