"""Per-layer analysis of a VLM decoder or a CLIP vision tower over images (× prompts): every number
the definitions of `diffzoo.analysis` name, per sample and averaged."""
import itertools
import math
from typing import Dict, Iterable, List, Mapping, Optional, Sequence

import torch
import torch.nn as nn

from diffzoo.layers.maps import capture_attention_maps
from diffzoo.vlm.factory import VLM

from .capture import capture_decoder, residual_stream
from .maps import vision_trunk
from .metrics import (CATEGORIES, CLIP_METRICS, TOP_K, VLM_METRICS, attention_entropy, average_cosine_similarity,
                      jaccard, layer_metrics, token_categories, top_k_tokens)

DEFINITIONS = {  # written into analysis.json; the module docstring has the formulas
    'cosine_visual': 'mean over visual tokens of cos(h_l, h_l+1), the input and output of layer l (eRAM-V Eq. 1)',
    'cosine_text': 'the same over the non-special text tokens',
    'entropy': 'attention entropy of the query row in nats, -sum p log p with p = |a| / sum |a|, mean over heads '
               '(eRAM-V Eq. 2); the query is the last prompt token (VLM) or the CLS token (CLIP)',
    'mass_visual/text/special': 'sum of p over the keys of each token category, mean over heads',
    'row_sum': 'sum of the signed attention row, mean over heads: 1 for softmax, 1 - lambda for differential',
    'jaccard': '|A & B| / |A | B| of the top-k visual tokens by signed attention share (a / sum |a|, mean over '
               'heads then layers) for two prompts on the same image',
    'max_entropy': 'log N, the entropy of uniform attention over the N keys',
}


def _means(rows: Sequence[Dict], names: Sequence[str]) -> Dict[str, List[Optional[float]]]:
    """Per-layer mean over samples of each metric (None entries skipped)."""
    return {name: [_mean(values) for values in zip(*(r[name] for r in rows))] for name in names}


def _mean(values: Iterable[Optional[float]]) -> Optional[float]:
    """Mean of the values that are not None; None if there are none."""
    kept = [v for v in values if v is not None]
    return sum(kept) / len(kept) if kept else None


def _summary(per_layer: Mapping[str, List[Optional[float]]]) -> Dict[str, Optional[float]]:
    return {name: _mean(values) for name, values in per_layer.items()}


@torch.no_grad()
def analyse_vlm(vlm: VLM, images: Sequence, prompts: Sequence[str], top_k: int = TOP_K,
                image_names: Optional[Sequence[str]] = None, log=None) -> Dict:
    """Every number of the definitions for a VLM (`diffzoo.vlm.load_vlm`) over images × prompts;
    `images`: PIL images, each prompt given verbatim."""
    if not images or not prompts:
        raise ValueError(f'analyse_vlm: {len(images)} images and {len(prompts)} prompts; give at least one of each')
    special_ids = set(vlm.tokenizer.all_special_ids)
    names = list(image_names) if image_names is not None else [f'image {i}' for i in range(len(images))]
    model = vlm.model
    training = model.training
    model.eval()
    samples, scores = [], {}
    try:
        with capture_decoder(vlm.decoder_model()) as record:
            for i, image in enumerate(images):
                if log:
                    log(f'      image {i + 1}/{len(images)} ({names[i]}): {len(prompts)} prompt(s)')
                for j, prompt in enumerate(prompts):
                    batch = vlm.prompts([image], [prompt])
                    model(**batch)
                    ids = batch['input_ids'][0]
                    hidden = [h[0] for h in record['hidden']]  # (S, D) each
                    S = hidden[0].shape[0]
                    categories = token_categories(ids.tolist(), special_ids, S - len(ids), vlm.image_token_id)
                    metrics = layer_metrics(hidden, record['attention'], categories.to(hidden[0].device))
                    visual = metrics.pop('visual_scores')
                    scores[i, j] = top_k_tokens(visual, top_k)
                    counts = torch.bincount(categories, minlength=len(CATEGORIES)).tolist()
                    samples.append({'image': names[i], 'prompt': prompt, 'tokens': dict(zip(CATEGORIES, counts)),
                                    'max_entropy': math.log(S), 'top_visual_tokens': sorted(scores[i, j]),
                                    'per_layer': metrics})
    finally:
        model.train(training)
    pairs = [{'image': names[i], 'prompts': [prompts[a], prompts[b]], 'jaccard': jaccard(scores[i, a], scores[i, b])}
             for i in range(len(images)) for a, b in itertools.combinations(range(len(prompts)), 2)]
    per_layer = _means([s['per_layer'] for s in samples], VLM_METRICS)
    return {'kind': 'vlm', 'layers': len(per_layer['entropy']), 'query': 'last prompt token',
            'max_entropy': sum(s['max_entropy'] for s in samples) / len(samples),
            'per_layer': per_layer, 'mean': _summary(per_layer),
            'jaccard': {'k': top_k, 'aggregation': 'signed attention share, mean over heads then layers',
                        'mean': sum(p['jaccard'] for p in pairs) / len(pairs) if pairs else None, 'pairs': pairs},
            'samples': samples}


@torch.no_grad()
def analyse_clip(model: nn.Module, images: torch.Tensor, batch_size: int = 16,
                 image_names: Optional[Sequence[str]] = None) -> Dict:
    """Per vision block of an open_clip model with a timm ViT tower (or the timm ViT itself): patch-token
    cosine similarity and CLS attention entropy (module docstring), `images` preprocessed (B, 3, H, W)."""
    if len(images) == 0:
        raise ValueError('analyse_clip: no images; pass a (B, 3, H, W) batch with B ≥ 1')
    trunk = vision_trunk(model)
    prefix = trunk.num_prefix_tokens
    names = list(image_names) if image_names is not None else [f'image {i}' for i in range(len(images))]
    device = next(trunk.parameters()).device
    training = trunk.training
    trunk.eval()
    samples = []
    try:
        for start in range(0, len(images), batch_size):
            batch = images[start:start + batch_size].to(device)
            with capture_attention_maps(trunk) as maps, residual_stream(trunk.blocks) as hidden:
                trunk.forward_features(batch)
            cls = [attention_entropy(maps[f'blocks.{l}.attn'][:, :, 0]).mean(1) for l in range(len(trunk.blocks))]
            for b in range(len(batch)):
                samples.append({'image': names[start + b], 'per_layer': {
                    'cosine_visual': [average_cosine_similarity(hidden[l][b, prefix:], hidden[l + 1][b, prefix:])
                                      for l in range(len(trunk.blocks))],
                    'entropy': [e[b].item() for e in cls]}})
            n_tokens = hidden[0].shape[1]
    finally:
        trunk.train(training)
    per_layer = _means([s['per_layer'] for s in samples], CLIP_METRICS)
    return {'kind': 'clip', 'layers': len(trunk.blocks), 'query': 'CLS token', 'max_entropy': math.log(n_tokens),
            'per_layer': per_layer, 'mean': _summary(per_layer), 'samples': samples}
