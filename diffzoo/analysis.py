"""Layer by layer: how much each layer changes the visual tokens, and where the attention goes (eRAM-V).

    python -m diffzoo.analysis --vlm-recipe RECIPE [--adapter DIR] --images DIR --prompts "…" "…"
        [--compare RECIPE [--compare-adapter DIR]] [--out analysis/]
    python -m diffzoo.analysis --clip NAME[,PRETRAINED] --images DIR [--compare NAME[,PRETRAINED]]

writes `analysis.json` (every number below, per sample and averaged) and PNGs with the models
overlaid, and prints a table. Natural log throughout; l = 0 … L−1 are decoder layers or vision blocks.

Average cosine similarity (eRAM-V Eq. 1) of two (N, D) token matrices X, Y, token i of both at the
same position:

    S(X, Y) = (1/N) Σ_i ⟨x_i, y_i⟩ / (‖x_i‖ ‖y_i‖)

For layer l, X = h_l (its input) and Y = h_{l+1} (its output): h_0 is the input embeddings and h_l the
output of layer l − 1, all before the final norm (transformers' `output_hidden_states` puts the
final norm on its last entry, which would make the last pair compare a normalised state with an
unnormalised one). S near 1: the layer hardly changes those tokens.

Attention entropy (eRAM-V Eq. 2) of an attention row a over keys j, in nats, 0 ≤ H ≤ log N:

    H(a) = −Σ_j p_j log p_j,    p_j = |a_j| / Σ_k |a_k|,    0·log 0 = 0

For softmax attention p = a. A differential map A1 − λ·A2 is signed and its rows sum to 1 − λ; H is
then the entropy of its normalised magnitude (the convention and the helper of `diffzoo.attention`).

Attention mass on a token category c: m_c = Σ_{j∈c} p_j with the same p, so the masses of a row sum
to 1 in every layer, softmax or differential. `row_sum` = Σ_j a_j is recorded too (1 for softmax,
1 − λ for a differential layer).

Token categories of a VLM's sequence: visual (the image tokens: build_vlm's image prefix, PaliGemma's
`<image>` positions), special (the other positions whose id is one of the tokenizer's special ids:
BOS, EOS, pad, unk, added special tokens such as image-boundary tokens), text (the rest).

VLM, per layer: one image and one prompt per forward pass (no padding); the query is the last prompt
token, whose output predicts the first generated token. Entropy, masses and `row_sum` are means
over the layer's heads (differential heads in differential layers); cosine similarity is over the
visual tokens and, for contrast, the text tokens. Every per-layer number is the mean over all
(image, prompt) pairs.

Top-k overlap across prompts: each visual token j gets the score s_j = mean_l mean_h a_lhj / Σ_k |a_lhk|,
the query's signed share of attention averaged over heads and then layers (a token the differential
map cancels ranks low); T = the k highest (k = min(25, visual tokens)). For two prompts on the same
image, J = |T_A ∩ T_B| / |T_A ∪ T_B|, reported for every pair of prompts and as the mean over pairs.

eRAM-V models (`build_vlm(..., integration="eramv")`): the visual tokens of the sequence are the
anchors; at injection layers the P injected keys count as visual keys in the entropy and the masses,
and the top-k scores cover the sequence's (anchor) tokens only.

CLIP tower, per vision block: S over the patch tokens (prefix tokens excluded), and the entropy of
the CLS token's attention row over all N tokens, mean over heads; both averaged over the images.

Maps are read on explicit paths: decoders run with `eager` attention (`diffzoo_eager` when
differential) during the analysis, restored afterwards; vision towers through
`diffzoo.layers.capture_attention_maps`.
"""
import argparse
import itertools
import json
import math
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Set

import torch
import torch.nn as nn
import torch.nn.functional as F

from diffzoo.attention import row_entropy, vision_trunk
from diffzoo.layers.maps import capture_attention_maps

CATEGORIES = ('visual', 'text', 'special')
VISUAL, TEXT, SPECIAL = range(3)
TOP_K = 25
IMAGE_SUFFIXES = ('.jpg', '.jpeg', '.png', '.bmp', '.webp', '.gif', '.tif', '.tiff')
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
    """H of every row of `attn` (..., N) → (...) in nats; rows that are not distributions (signed
    differential maps) by their normalised magnitude (module docstring)."""
    if attn.ndim == 0 or attn.shape[-1] == 0:
        raise ValueError(f'attention_entropy: attn {tuple(attn.shape)}: expected rows over keys in the last dim')
    return row_entropy(attn)


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


@contextmanager
def _residual_stream(blocks: Sequence[nn.Module]) -> Iterator[List[Optional[torch.Tensor]]]:
    """Collects h_0 (the input of blocks[0]) and each block's output: L + 1 tensors per forward pass."""
    states: List[Optional[torch.Tensor]] = [None] * (len(blocks) + 1)

    def first(_m, args, kwargs):
        states[0] = args[0] if args else kwargs['hidden_states']

    def output(i, _m, _inp, out):
        states[i + 1] = out[0] if isinstance(out, tuple) else out

    handles = [blocks[0].register_forward_pre_hook(first, with_kwargs=True)]
    handles += [b.register_forward_hook(lambda m, i_, o, i=i: output(i, m, i_, o)) for i, b in enumerate(blocks)]
    try:
        yield states
    finally:
        for h in handles:
            h.remove()


def _decoder(model: nn.Module) -> nn.Module:
    from diffzoo.vlm.differential import find_decoder
    from diffzoo.vlm.model import VisionLanguageModel
    return find_decoder(model.language_model if isinstance(model, VisionLanguageModel) else model)


@contextmanager
def capture_decoder(model: nn.Module) -> Iterator[Dict[str, list]]:
    """Eager attention in the decoder of `model` (a build_vlm model, PaliGemma, a causal LM; LoRA-wrapped
    or not) and hooks filling, per forward pass of one sequence: 'hidden' (L + 1 × (S, D), module
    docstring) and 'attention' (L × (heads, S): the last position's attention row). The attention
    implementation is restored and the hooks removed on exit."""
    from diffzoo.vlm.differential import DIFF_EAGER, DIFF_SDPA
    decoder = _decoder(model)
    config = decoder.config
    before = config._attn_implementation
    layers = decoder.layers
    record = {'hidden': None, 'attention': [None] * len(layers)}

    def weights(i, _m, _inp, out):
        if not isinstance(out, tuple) or len(out) < 2 or out[1] is None:
            raise RuntimeError(f'decoder layer {i}: its attention returned no weights under '
                               f'{config._attn_implementation!r}; the analysis needs an eager kernel')
        record['attention'][i] = out[1][0, :, -1]  # (heads, S): the last query's row

    handles = [layer.self_attn.register_forward_hook(lambda m, i_, o, i=i: weights(i, m, i_, o))
               for i, layer in enumerate(layers)]
    config._attn_implementation = DIFF_EAGER if before in (DIFF_SDPA, DIFF_EAGER) else 'eager'
    try:
        with _residual_stream(layers) as hidden:
            record['hidden'] = hidden
            yield record
    finally:
        config._attn_implementation = before
        for h in handles:
            h.remove()


def _vlm_forward(model, tokenizer, transform, image, prompt: str) -> torch.Tensor:
    """Runs one image and prompt; returns the input ids of the text part (PaliGemma: the whole sequence)."""
    from diffzoo.vlm.model import VisionLanguageModel
    device = next(model.parameters()).device
    if isinstance(model, VisionLanguageModel):
        bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        ids = torch.tensor([bos + tokenizer(prompt, add_special_tokens=False)['input_ids']], device=device)
        model(transform(image)[None].to(device), ids)
        return ids[0]
    image_token = getattr(tokenizer, 'image_token', '<image>')  # PaliGemma: image tokens first, as in training
    batch = tokenizer(text=image_token + prompt, images=image, return_tensors='pt').to(device)
    batch.pop('labels', None)
    model(**batch)
    return batch['input_ids'][0]


def _image_token_id(model) -> Optional[int]:
    from diffzoo.vlm.model import VisionLanguageModel
    if isinstance(model, VisionLanguageModel):
        return None
    config = model.config
    found = getattr(config, 'image_token_id', None)
    found = getattr(config, 'image_token_index', None) if found is None else found
    if found is None:
        raise ValueError(f'{type(model).__name__}: neither a build_vlm VisionLanguageModel nor a model whose '
                         f'config names its image token (PaliGemma: image_token_id); the visual tokens are unknown')
    return int(found)


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
def analyse_vlm(model: nn.Module, tokenizer, images: Sequence, prompts: Sequence[str], transform=None,
                top_k: int = TOP_K, image_names: Optional[Sequence[str]] = None, log=None) -> Dict:
    """Every number of the module docstring for a VLM over images × prompts.

    `model`: a build_vlm `VisionLanguageModel` (`tokenizer` its tokenizer, `transform` its vision
    tower's image transform) or a PaliGemma (`tokenizer` its processor). `images`: PIL images."""
    if not images or not prompts:
        raise ValueError(f'analyse_vlm: {len(images)} images and {len(prompts)} prompts; give at least one of each')
    image_token_id = _image_token_id(model)
    text_tokenizer = getattr(tokenizer, 'tokenizer', tokenizer)
    special_ids = set(text_tokenizer.all_special_ids)
    names = list(image_names) if image_names is not None else [f'image {i}' for i in range(len(images))]
    training = model.training
    model.eval()
    samples, scores = [], {}
    try:
        with capture_decoder(model) as record:
            for i, image in enumerate(images):
                if log:
                    log(f'      image {i + 1}/{len(images)} ({names[i]}): {len(prompts)} prompt(s)')
                for j, prompt in enumerate(prompts):
                    ids = _vlm_forward(model, tokenizer, transform, image, prompt)
                    hidden = [h[0] for h in record['hidden']]  # (S, D) each
                    S = hidden[0].shape[0]
                    categories = token_categories(ids.tolist(), special_ids, S - len(ids), image_token_id)
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
            with capture_attention_maps(trunk) as maps, _residual_stream(trunk.blocks) as hidden:
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


def _figure(out_png: Path, fig) -> Path:
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    return out_png


def _curve(ax, values, **kw):
    points = [(l, v) for l, v in enumerate(values) if v is not None]
    if points:
        return ax.plot(*zip(*points), **kw)[0]


def _axes(ax, ylabel: str, what: str):
    from matplotlib.ticker import MaxNLocator
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel(what)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def plot_analysis(reports: Mapping[str, Dict], out_dir) -> List[Path]:
    """Per-layer curves with the models overlaid: cosine_similarity.png, attention_entropy.png and, for
    VLMs, attention_mass.png and jaccard.png (when prompts were compared)."""
    from matplotlib.figure import Figure
    out_dir = Path(out_dir)
    kind = next(iter(reports.values()))['kind']
    what = 'decoder layer' if kind == 'vlm' else 'vision block'
    colours = {name: f'C{i}' for i, name in enumerate(reports)}
    written = []

    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    for name, r in reports.items():
        _curve(ax, r['per_layer']['cosine_visual'], marker='o', color=colours[name], label=f'{name}: visual tokens')
        if 'cosine_text' in r['per_layer']:
            _curve(ax, r['per_layer']['cosine_text'], marker='s', linestyle='--', color=colours[name],
                   label=f'{name}: text tokens')
    ax.set_title(f'cosine similarity of tokens between the input and output of each {what}', fontsize=10)
    _axes(ax, 'average cosine similarity', what)
    written.append(_figure(out_dir / 'cosine_similarity.png', fig))

    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    for name, r in reports.items():
        _curve(ax, r['per_layer']['entropy'], marker='o', color=colours[name], label=name)
        ax.axhline(r['max_entropy'], color=colours[name], linestyle=':', linewidth=1)
    query = 'the last prompt token' if kind == 'vlm' else 'the CLS token'
    ax.set_title(f'attention entropy of {query}, mean over heads (dotted: uniform, log N)', fontsize=10)
    _axes(ax, 'entropy (nats)', what)
    written.append(_figure(out_dir / 'attention_entropy.png', fig))
    if kind != 'vlm':
        return written

    fig = Figure(figsize=(13, 3.8))
    for ax, category in zip(fig.subplots(1, 3), CATEGORIES):
        for name, r in reports.items():
            _curve(ax, r['per_layer'][f'mass_{category}'], marker='o', color=colours[name], label=name)
        ax.set_title(f'attention mass on {category} tokens', fontsize=10)
        ax.set_ylim(-0.02, 1.02)
        _axes(ax, 'share of |attention| of the last prompt token', what)
    written.append(_figure(out_dir / 'attention_mass.png', fig))

    if any(r['jaccard']['pairs'] for r in reports.values()):
        fig = Figure(figsize=(1.5 + 1.6 * len(reports), 4))
        ax = fig.subplots()
        for x, (name, r) in enumerate(reports.items()):
            values = [p['jaccard'] for p in r['jaccard']['pairs']]
            if values:
                ax.bar(x, r['jaccard']['mean'], color=colours[name], alpha=0.6)
                ax.scatter([x] * len(values), values, color='black', s=10, zorder=3)
        ax.set_xticks(range(len(reports)), list(reports), fontsize=8)
        ax.set_ylim(0, 1)
        ax.set_ylabel(f'Jaccard of the top-{next(iter(reports.values()))["jaccard"]["k"]} visual tokens')
        ax.set_title('overlap across prompts on the same image\n(bar: mean, dots: prompt pairs)', fontsize=10)
        written.append(_figure(out_dir / 'jaccard.png', fig))
    return written


def _fmt(value: Optional[float], width: int) -> str:
    return f'{value:>{width}.3f}' if value is not None else f'{"–":>{width}}'


def summary_table(reports: Mapping[str, Dict]) -> str:
    """Layers × (metric, model), a mean-over-layers row, the top-k Jaccard, and which letter is which model."""
    kind = next(iter(reports.values()))['kind']
    metrics = {'cosine_visual': 'cos vis', 'cosine_text': 'cos txt', 'entropy': 'entropy',
               'mass_visual': 'mass vis', 'mass_text': 'mass txt', 'mass_special': 'mass spc'}
    if kind == 'clip':
        metrics = {'cosine_visual': 'cos vis', 'entropy': 'CLS ent'}
    letters = {name: chr(ord('A') + i) for i, name in enumerate(reports)}
    width = 9
    group = width * len(reports)
    what = 'layer' if kind == 'vlm' else 'block'
    titles = ''.join(f'{title:>{group}}' for title in metrics.values())
    if len(reports) == 1:
        lines = [f'  {what:<7}' + titles]
    else:
        lines = [f'  {"":<7}' + titles,
                 f'  {what:<7}' + ''.join(f'{letters[n]:>{width}}' for _ in metrics for n in reports)]
    lines.append('  ' + '─' * (len(lines[-1]) - 2))
    depth = max(r['layers'] for r in reports.values())
    for l in range(depth):
        cells = [_fmt(r['per_layer'][m][l] if l < r['layers'] else None, width)
                 for m in metrics for r in reports.values()]
        lines.append(f'  {l:<7}' + ''.join(cells))
    lines.append('  ' + '─' * (len(lines[-1]) - 2))
    lines.append(f'  {"mean":<7}' + ''.join(_fmt(r['mean'][m], width) for m in metrics for r in reports.values()))
    if kind == 'vlm':
        for name, r in reports.items():
            j = r['jaccard']
            shown = f'{j["mean"]:.3f} over {len(j["pairs"])} prompt pair(s)' if j['pairs'] else \
                'n/a (give two or more --prompts)'
            lines.append(f'  top-{j["k"]} visual-token Jaccard across prompts, {letters[name]}: {shown}')
    lines.append('  ' + '; '.join(f'{letters[n]} = {n}' for n in reports)
                 + '   (entropy in nats; uniform = log N ≈ '
                 + ', '.join(f'{r["max_entropy"]:.2f}' for r in reports.values()) + ')')
    return '\n'.join(lines)


def load_vlm(recipe: str, adapter: Optional[str] = None, device: str = 'cpu'):
    """(model in eval mode, tokenizer or processor, image transform or None) for a `diffzoo.vlm.train`
    recipe: made differential as the recipe says or, with `adapter`, as the adapter was saved (the
    model `diffzoo.vlm.needle.model_answer_fn` builds)."""
    from diffzoo.vlm.differential import differentialize
    from diffzoo.vlm.lora import load_adapter
    from diffzoo.vlm.model import VisionLanguageModel
    from diffzoo.train.recipe import expand_env
    from diffzoo.vlm.train import build_model, image_transform, load_recipe
    spec = expand_env(load_recipe(recipe))
    model, _, _, tokenizer, kind = build_model(spec, torch.device(device))
    if adapter is not None:
        model = load_adapter(model, adapter)
    elif spec.get('differential'):
        differentialize(model.language_model if isinstance(model, VisionLanguageModel) else model,
                        **spec['differential'])
    transform = image_transform(spec['model']['vision'], model) if kind == 'build_vlm' else None
    return model.to(device).eval(), tokenizer, transform


def image_files(paths: Sequence[str]) -> List[Path]:
    """Image files named, and those inside named directories (sorted, by suffix)."""
    found = []
    for text in paths:
        path = Path(text)
        if path.is_dir():
            inside = sorted(p for p in path.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
            if not inside:
                raise ValueError(f'--images {path}: no image files ({", ".join(IMAGE_SUFFIXES)}) in this directory')
            found += inside
        elif path.is_file():
            found.append(path)
        else:
            raise ValueError(f'--images {path}: no such file or directory; pass image files or a directory of them')
    return found


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog='python -m diffzoo.analysis', fromfile_prefix_chars='@',
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description='Per-layer token similarity and attention (entropy, mass by token category, top-k overlap\n'
                    'across prompts) of a VLM or a CLIP vision tower; two models overlaid. Definitions:\n'
                    '  python -c "import diffzoo.analysis as a; print(a.__doc__)"',
        epilog='Example (vanilla vs differential decoder, each with its trained adapter):\n'
               '  python -m diffzoo.analysis --vlm-recipe paligemma-3b-vqav2-diff --adapter runs/vlm/diff/adapter \\\n'
               '      --compare paligemma-3b-vqav2-baseline --compare-adapter runs/vlm/base/adapter \\\n'
               '      --images coco/ --prompts "answer en what is on the table?" "answer en how many people?"\n'
               'Arguments can be read from a file, one per line: --prompts @prompts.txt')
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument('--vlm-recipe', metavar='RECIPE', help='a diffzoo.vlm.train recipe (file or shipped name)')
    model.add_argument('--clip', metavar='NAME[,PRETRAINED]', help='an open_clip model (diffclip-*, clip-*-baseline)')
    p.add_argument('--adapter', metavar='DIR', help='a LoRA adapter saved by diffzoo.vlm.train (with --vlm-recipe)')
    p.add_argument('--compare', metavar='RECIPE|NAME[,PRETRAINED]',
                   help='a second model of the same kind, overlaid on every plot')
    p.add_argument('--compare-adapter', metavar='DIR', help='the adapter of the --compare recipe')
    p.add_argument('--label', help='name of the first model in plots and tables (default: recipe / model name)')
    p.add_argument('--compare-label', help='name of the --compare model')
    p.add_argument('--images', nargs='+', required=True, metavar='PATH', help='image files or directories')
    p.add_argument('--prompts', nargs='+', default=[], metavar='TEXT',
                   help='prompts for a VLM, each asked about every image (two or more for the top-k overlap); '
                        'given verbatim: VQA-tuned models expect "answer en QUESTION"')
    p.add_argument('--top-k', type=int, default=TOP_K, help=f'visual tokens compared across prompts (default {TOP_K})')
    p.add_argument('--out', default='analysis', metavar='DIR', help='output directory (default analysis/)')
    p.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    p.add_argument('--seed', type=int, default=0, help='seed for randomly initialised parts (same for both models)')
    return p


def _label(text: str, adapter: Optional[str]) -> str:
    name = Path(text).stem if text.endswith(('.yaml', '.yml')) else text
    return f'{name} + {Path(adapter).name}' if adapter else name


def main(argv: Optional[List[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    kind = 'vlm' if args.vlm_recipe else 'clip'
    if kind == 'vlm' and not args.prompts:
        parser.error('--vlm-recipe needs --prompts (one or more; two or more for the top-k overlap)')
    if kind == 'clip' and (args.prompts or args.adapter or args.compare_adapter):
        parser.error('--prompts, --adapter and --compare-adapter apply to --vlm-recipe models, not --clip')
    if args.compare_adapter and not args.compare:
        parser.error('--compare-adapter needs --compare RECIPE')
    if args.top_k < 1:
        parser.error(f'--top-k {args.top_k}: give a positive number of visual tokens')
    from diffzoo.attention import _load_images
    try:
        files = image_files(args.images)
    except ValueError as exc:
        raise SystemExit(f'error: {exc}')
    pil = _load_images([str(f) for f in files])
    names = [f.name for f in files]
    models = [(args.label or _label(args.vlm_recipe or args.clip, args.adapter), args.vlm_recipe or args.clip,
               args.adapter)]
    if args.compare:
        label = args.compare_label or _label(args.compare, args.compare_adapter)
        models.append((label if label != models[0][0] else f'{label} (compare)', args.compare, args.compare_adapter))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {'images': [str(f) for f in files], 'prompts': args.prompts, 'top_k': args.top_k,
              'definitions': DEFINITIONS, 'models': {}}
    steps = len(models) + 1
    t0 = time.time()
    print(f'[0/{steps}] {len(pil)} image(s)' + (f' × {len(args.prompts)} prompt(s)' if kind == 'vlm' else ''),
          flush=True)
    for step, (label, source, adapter) in enumerate(models, start=1):
        print(f'[{step}/{steps}] {label}: building {source}' + (f' with adapter {adapter}' if adapter else ''),
              flush=True)
        torch.manual_seed(args.seed)
        try:
            if kind == 'vlm':
                model, tokenizer, transform = load_vlm(source, adapter, args.device)
                print(f'      analysing ({time.time() - t0:.0f} s so far)', flush=True)
                report = analyse_vlm(model, tokenizer, pil, args.prompts, transform, args.top_k, names,
                                     log=lambda s: print(s, flush=True))
            else:
                from diffzoo.eval.models import EvalError, load, parse_model
                try:
                    loaded = load(parse_model(source), args.device, seed=args.seed)
                except EvalError as exc:
                    raise ValueError(str(exc)) from None
                model = loaded.model
                print(f'      analysing ({time.time() - t0:.0f} s so far)', flush=True)
                report = analyse_clip(model, torch.stack([loaded.preprocess(im) for im in pil]), image_names=names)
        except (ValueError, FileNotFoundError) as exc:
            done = f'; {out / "analysis.json"} holds the models analysed before it' if result['models'] else ''
            raise SystemExit(f'error: {label} ({source}): {exc}{done}')
        result['models'][label] = {'source': source, 'adapter': adapter, **report}
        (out / 'analysis.json').write_text(json.dumps(result, indent=1) + '\n')  # kept if a later model fails
        del model
    print(f'[{steps}/{steps}] writing figures ({time.time() - t0:.0f} s so far)', flush=True)
    reports = {label: r for label, r in result['models'].items()}
    written = [out / 'analysis.json', *plot_analysis(reports, out)]
    print('\n' + summary_table(reports) + '\n')
    for path in written:
        print(f'wrote {path}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
