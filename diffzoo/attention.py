"""Where the vision tower attends, and how diffuse its attention is: CLIP against DiffCLIP.

    python -m diffzoo.attention IMAGE [IMAGE ...] --model NAME[,PRETRAINED] [--model NAME2[,PRETRAINED] …]
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
at 0 (a patch the differential map cancels is shown as not attended), divided by its maximum.

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
tokens (less diffuse, less "noise").
"""
import argparse
import math
import sys
import time
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer

from diffzoo.layers.maps import capture_attention_maps, map_tap

DISPLAY_PX = 224  # side of each panel in the overlay figure


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
    left untouched.
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


def row_entropy(attn: torch.Tensor) -> torch.Tensor:
    """Shannon entropy (nats) of each row of `attn` (..., N) normalised by magnitude → (...)."""
    p = attn.float().abs()
    p = p / p.sum(-1, keepdim=True).clamp(min=torch.finfo(p.dtype).tiny)
    return -torch.special.xlogy(p, p).sum(-1)


def attention_entropy(model: nn.Module, images: torch.Tensor, batch_size: int = 16) -> torch.Tensor:
    """(blocks, heads) mean row entropy over query tokens and images, in nats."""
    total = None
    for start in range(0, len(images), batch_size):
        maps = attention_maps(model, images[start:start + batch_size])
        per_layer = torch.stack([row_entropy(a).sum((0, 2)) / a.shape[2] for a in maps.values()])  # (L, h)
        total = per_layer if total is None else total + per_layer
    return total / len(images)


def _square(image, side: int = DISPLAY_PX):
    """The centred square crop a model sees (open_clip resizes the short side, then centre-crops)."""
    from PIL import Image, ImageOps
    return ImageOps.fit(image.convert('RGB'), (side, side), method=Image.Resampling.BICUBIC)


def _display(heat: torch.Tensor, side: int = DISPLAY_PX) -> torch.Tensor:
    """(gh, gw) map → (side, side) in [0, 1]: negatives clipped at 0, divided by the maximum."""
    heat = heat.detach().float().cpu().clamp(min=0)
    heat = F.interpolate(heat[None, None], size=(side, side), mode='bilinear', align_corners=False)[0, 0]
    peak = heat.max()
    return heat / peak if peak > 0 else heat


def plot_overlays(pil_images: Sequence, maps: Mapping[str, torch.Tensor], out_png,
                  queries: Optional[Sequence] = None) -> Path:
    """A PNG grid: one row per image (per image and query for (B, Q, gh, gw) maps), the image and then
    one column per model (`maps`: model name → (B, gh, gw) or (B, Q, gh, gw)) with its map overlaid.

    `queries` labels the rows: Q strings shared by every image, or one list of Q strings per image."""
    from matplotlib.figure import Figure

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
    fig = Figure(figsize=(2.4 * cols, 2.4 * len(rows) + 0.3))
    axes = fig.subplots(len(rows), cols, squeeze=False)
    crops = [_square(image) for image in pil_images]
    for r, (b, q) in enumerate(rows):
        axes[r, 0].imshow(crops[b])
        axes[r, 0].set_ylabel(f'image {b}' + (f'\n"{labels[b][q]}"' if labels[b][q] is not None else ''))
        for c, (name, m) in enumerate(per_query.items(), start=1):
            axes[r, c].imshow(crops[b])
            axes[r, c].imshow(_display(m[b, q]).numpy(), cmap='jet', alpha=0.5, vmin=0, vmax=1)
        for ax in axes[r]:
            ax.set_xticks([])
            ax.set_yticks([])
    for c, name in enumerate(['image (centre crop)', *per_query], start=0):
        axes[0, c].set_title(name, fontsize=9)
    kind = 'gradient-weighted attention relevance per query' if labels[0][0] is not None \
        else 'CLS attention to patches, mean over heads (clipped at 0)'
    fig.suptitle(kind, fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.3 / fig.get_figheight()))
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=100)
    return out_png


def plot_entropy(entropies: Mapping[str, torch.Tensor], out_png,
                 n_tokens: Optional[Mapping[str, int]] = None) -> Path:
    """Per-block attention entropy (mean over heads, band: min–max over heads) for each model, with
    the uniform maximum log N per model when `n_tokens` (model name → N) is given."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

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
    ax.set_title('attention entropy per block (lower = less diffuse); band: min–max over heads', fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=120)
    return out_png


def entropy_table(entropies: Mapping[str, torch.Tensor], n_tokens: Optional[Mapping[str, int]] = None) -> str:
    """Block × model mean-over-heads entropy, then one summary number per model."""
    names = list(entropies)
    width = max(14, *(len(n) + 2 for n in names))
    depth = max(e.shape[0] for e in entropies.values())
    lines = [f'  {"block":<8}' + ''.join(f'{n:>{width}}' for n in names)]
    lines.append('  ' + '─' * (len(lines[0]) - 2))
    for b in range(depth):
        cells = [f'{e[b].float().mean().item():>{width}.3f}' if b < e.shape[0] else f'{"":>{width}}'
                 for e in entropies.values()]
        lines.append(f'  {b:<8}' + ''.join(cells))
    if n_tokens:
        lines.append(f'  {"log N":<8}' + ''.join(
            f'{math.log(n_tokens[n]):>{width}.3f}' if n in n_tokens else f'{"":>{width}}' for n in names))
    lines.append('\n  mean attention entropy over layers and heads, in nats (lower = less diffuse/noise):')
    for name, e in entropies.items():
        uniform = f'   (uniform: log {n_tokens[name]} = {math.log(n_tokens[name]):.3f})' \
            if n_tokens and name in n_tokens else ''
        lines.append(f'    {name:<{width}}{e.float().mean().item():.3f}{uniform}')
    return '\n'.join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog='python -m diffzoo.attention', formatter_class=argparse.RawDescriptionHelpFormatter,
        description='Attention maps of each model\'s vision tower overlaid on images (one column per model),\n'
                    'and attention entropy per block and head (--entropy). The method is in the module docstring:\n'
                    '  python -c "import diffzoo.attention as a; print(a.__doc__)"',
        epilog='Models are spelled as in python -m diffzoo.eval and CLIP_benchmark: NAME,PRETRAINED with\n'
               'PRETRAINED a tag (cc3m) or a checkpoint file; NAME alone is randomly initialised. Example:\n'
               '  python -m diffzoo.attention office.jpg --model diffclip-b16,cc3m \\\n'
               '      --model clip-b16-baseline,cc3m --query mug --query lamp --entropy')
    parser.add_argument('images', nargs='+', metavar='IMAGE', help='image files (anything PIL opens)')
    parser.add_argument('--model', dest='models', action='append', default=[], metavar='NAME[,PRETRAINED]',
                        help='an open_clip model and its weights (tag or file); repeat for more columns')
    parser.add_argument('--query', action='append', default=[], metavar='TEXT',
                        help='text query (repeatable); without one, CLS attention is shown')
    parser.add_argument('--layer', type=int, default=-1, help='vision block of the CLS map (default -1, the last)')
    parser.add_argument('--out', default='attention.png', help='overlay PNG (default attention.png); with '
                        '--entropy the entropy plot goes next to it as <stem>_entropy.png')
    parser.add_argument('--entropy', action='store_true', help='also measure attention entropy per block and head')
    parser.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu',
                        help='torch device (default cuda if available, else cpu)')
    return parser


def _load_images(paths: Sequence[str]) -> List:
    from PIL import Image, UnidentifiedImageError
    images = []
    for path in paths:
        if not Path(path).is_file():
            raise SystemExit(f'error: IMAGE {path}: no such file; pass the path of an existing image')
        try:
            with Image.open(path) as image:
                images.append(image.convert('RGB'))
        except (UnidentifiedImageError, OSError) as exc:
            raise SystemExit(f'error: IMAGE {path}: not an image PIL can read ({exc}); pass a JPEG or PNG')
    return images


def main(argv: Optional[List[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not args.models:
        parser.error('give at least one --model NAME (e.g. --model diffclip-tiny --model clip-tiny-baseline)')
    import open_clip  # the models are registered by importing diffzoo (this package)

    from diffzoo.eval.models import EvalError, parse_model
    t0 = time.time()
    pil = _load_images(args.images)
    try:
        specs = [parse_model(text) for text in args.models]
    except EvalError as exc:
        raise SystemExit(f'error: {exc}')
    steps = 2 + len(args.models)
    print(f'[1/{steps}] {len(pil)} image(s): {", ".join(args.images)}', flush=True)

    maps, entropies, n_tokens = {}, {}, {}
    for step, (name, pretrained) in enumerate(((s.name, s.pretrained) for s in specs), start=2):
        column = f'{name} ({Path(pretrained).name})' if pretrained else name
        print(f'[{step}/{steps}] {column}: building' + ('' if pretrained else ' (random init: no --pretrained)'),
              flush=True)
        model, _, preprocess = open_clip.create_model_and_transforms(name, pretrained=pretrained, device=args.device)
        model.eval()
        try:
            trunk = vision_trunk(model)
        except ValueError as exc:
            raise SystemExit(f'error: --model {name}: {exc}')
        images = torch.stack([preprocess(p) for p in pil]).to(args.device)
        if args.query:
            print(f'      query maps for {", ".join(repr(q) for q in args.query)}', flush=True)
            maps[column] = query_attention(model, open_clip.get_tokenizer(name), images, args.query)
        else:
            print(f'      CLS attention of block {args.layer % len(trunk.blocks)}', flush=True)
            try:
                maps[column] = cls_attention(model, images, args.layer)
            except ValueError as exc:
                raise SystemExit(f'error: {exc}')
        if args.entropy:
            print('      attention entropy per block and head', flush=True)
            entropies[column] = attention_entropy(model, images)
            n_tokens[column] = trunk.patch_embed.num_patches + trunk.num_prefix_tokens
        del model

    print(f'[{steps}/{steps}] writing figures ({time.time() - t0:.0f} s so far)', flush=True)
    written = [plot_overlays(pil, maps, args.out, queries=args.query or None)]
    if args.entropy:
        out = Path(args.out)
        written.append(plot_entropy(entropies, out.with_name(f'{out.stem}_entropy.png'), n_tokens))
        print('\n' + entropy_table(entropies, n_tokens) + '\n')
    for path in written:
        print(f'wrote {path}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
