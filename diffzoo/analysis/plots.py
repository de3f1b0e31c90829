"""Figures of the analysis: attention overlays and entropy per block (CLIP towers), per-layer curves."""
import math
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence

import torch
import torch.nn.functional as F
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator
from PIL import Image, ImageOps

from .metrics import CATEGORIES

DISPLAY_PX = 224  # side of each panel in the overlay figure


def _square(image, side: int = DISPLAY_PX):
    """The centred square crop a model sees (open_clip resizes the short side, then centre-crops)."""
    return ImageOps.fit(image.convert('RGB'), (side, side), method=Image.Resampling.BICUBIC)


def _display(heat: torch.Tensor, side: int = DISPLAY_PX) -> torch.Tensor:
    """(gh, gw) map → (side, side), bilinear: each patch's share of the map's total, negatives clipped at 0.
    Shares, not raw values, so maps of different totals (softmax rows sum to 1, differential rows to 1 − λ,
    relevance to whatever the gradients give) compare on one scale; a uniform map is 1 / (gh·gw) everywhere."""
    heat = heat.detach().float().cpu().clamp(min=0)
    total = heat.sum()
    heat = heat / total if total > 0 else heat
    return F.interpolate(heat[None, None], size=(side, side), mode='bilinear', align_corners=False)[0, 0]


def overlay_figure(pil_images: Sequence, maps: Mapping[str, torch.Tensor],
                   queries: Optional[Sequence] = None) -> Figure:
    """A grid: one row per image (per image and query for (B, Q, gh, gw) maps), the image and then one
    column per model (`maps`: model name → (B, gh, gw) or (B, Q, gh, gw)) with its map overlaid.

    Each map is shown as each patch's share of its total (negatives clipped at 0), and every panel shares
    one colour scale, 0 to the largest share in the figure, with the uniform share 1 / (gh·gw) marked on the
    colour bar: a flat map looks flat and low, and the models compare directly. `queries` labels the rows:
    Q strings shared by every image, or one list of Q strings per image."""
    if not maps:
        raise ValueError('plot_overlays: no maps; pass {model name: (B, gh, gw) tensor}')
    per_query = {name: m if m.ndim == 4 else m.unsqueeze(1) for name, m in maps.items()}  # (B, Q, gh, gw)
    shapes = {name: tuple(m.shape[:2]) for name, m in per_query.items()}
    n_queries = next(iter(shapes.values()))[1]
    for name, (b, q) in shapes.items():
        if b != len(pil_images) or q != n_queries:
            raise ValueError(f'plot_overlays: maps[{name!r}] covers {b} images × {q} queries, expected '
                             f'{len(pil_images)} images (one per PIL image) × {n_queries} queries')
    if queries is None:
        queries = [None] if n_queries == 1 else [f'query {q}' for q in range(n_queries)]
    labels = [list(queries)] * len(pil_images) if not queries or isinstance(queries[0], (str, type(None))) \
        else [list(q) for q in queries]  # per image
    if len(labels) != len(pil_images) or any(len(q) != n_queries for q in labels):
        raise ValueError(f'plot_overlays: queries {list(queries)} do not label {n_queries} queries per image '
                         f'for {len(pil_images)} images')

    rows = [(b, q) for b in range(len(pil_images)) for q in range(n_queries)]
    cols = 1 + len(per_query)
    heats = {name: [_display(m[b, q]) for b, q in rows] for name, m in per_query.items()}
    vmax = max(h.max().item() for panels in heats.values() for h in panels) or 1.0  # all zero: any scale
    fig = Figure(figsize=(2.4 * cols + 0.8, 2.4 * len(rows) + 0.3), layout='constrained')
    axes = fig.subplots(len(rows), cols, squeeze=False)
    shown = None
    crops = [_square(image) for image in pil_images]
    for r, (b, q) in enumerate(rows):
        axes[r, 0].imshow(crops[b])
        axes[r, 0].set_ylabel(f'image {b}' + (f'\n"{labels[b][q]}"' if labels[b][q] is not None else ''))
        for c, name in enumerate(per_query, start=1):
            axes[r, c].imshow(crops[b])
            shown = axes[r, c].imshow(heats[name][r].numpy(), cmap='jet', alpha=0.5, vmin=0, vmax=vmax)
        for ax in axes[r]:
            ax.set_xticks([])
            ax.set_yticks([])
    for c, name in enumerate(['image (centre crop)', *per_query], start=0):
        axes[0, c].set_title(name, fontsize=9)
    per_query_maps = labels[0][0] is not None
    kind = 'gradient-weighted attention relevance per query' if per_query_maps \
        else 'CLS attention to patches, mean over heads (clipped at 0)'
    fig.suptitle(kind, fontsize=10)
    value = 'relevance R[CLS, patch]' if per_query_maps else 'CLS → patch attention'
    uniform = 1 / next(iter(per_query.values()))[0, 0].numel()
    bar = fig.colorbar(shown, ax=axes[:, 1:].ravel().tolist(), shrink=0.8,
                       label=f'share of the map\'s {value} on each patch; one scale for every panel\n'
                             f'(0 to the figure\'s largest share; black line: uniform, 1/{round(1 / uniform)})')
    bar.ax.axhline(uniform, color='black', linewidth=1.5)
    return fig


def plot_overlays(pil_images: Sequence, maps: Mapping[str, torch.Tensor], out_png,
                  queries: Optional[Sequence] = None) -> Path:
    """`overlay_figure` written to `out_png` (its folder made if missing)."""
    fig = overlay_figure(pil_images, maps, queries)
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=100)
    return out_png


def plot_entropy(entropies: Mapping[str, torch.Tensor], out_png,
                 n_tokens: Optional[Mapping[str, int]] = None) -> Path:
    """Per-block attention entropy (mean over heads, band: min–max over heads) for each model, with
    the uniform maximum log N per model when `n_tokens` (model name → N) is given."""
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    for name, e in entropies.items():
        e = e.detach().float().cpu()
        blocks = range(e.shape[0])
        line, = ax.plot(blocks, e.mean(1), marker='o', label=f'{name} (mean over {e.shape[1]} heads)')
        ax.fill_between(blocks, e.min(1).values, e.max(1).values, color=line.get_color(), alpha=0.15)
    for n in sorted(set((n_tokens or {}).values())):
        ax.axhline(math.log(n), color='grey', linestyle='--', linewidth=1)
        ax.annotate(f'uniform: log {n} = {math.log(n):.2f}', (0, math.log(n)), textcoords='offset points',
                    xytext=(2, -11), fontsize=8, color='grey')
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel('vision block')
    ax.set_ylabel('attention entropy (nats)')
    ax.set_title('attention entropy per block (lower: weight on fewer tokens); band: min–max over heads', fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=120)
    return out_png


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
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel(what)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def plot_analysis(reports: Mapping[str, Dict], out_dir) -> List[Path]:
    """Per-layer curves with the models overlaid: cosine_similarity.png, attention_entropy.png and, for
    VLMs, attention_mass.png and jaccard.png (when prompts were compared)."""
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
