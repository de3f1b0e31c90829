"""Text tables of the analysis: per-layer metrics of one or two models, entropy per block."""
import math
import textwrap
from typing import Dict, Mapping, Optional

import torch

SUMMARY = ('mean attention entropy over layers and heads, in nats: how spread each attention row\'s weight is over '
           'the tokens (lower: on fewer tokens):')
MEANING = ('Softmax attention: the entropy of A; differential attention: of |A1 − λ·A2| normalised, another map, in '
           'which the two softmaxes partly cancel. A lower entropy says the weight sits on fewer tokens, not that a '
           'model is more accurate.')


def entropy_table(entropies: Mapping[str, torch.Tensor], n_tokens: Optional[Mapping[str, int]] = None,
                  per_image: Optional[Mapping[str, torch.Tensor]] = None) -> str:
    """Block × model mean-over-heads entropy, then one summary number per model.

    With `per_image` (model name → (B, blocks, heads), `maps.image_entropy` of the same B images for every
    model) each summary number gets its 95 % interval over the images (Student's t), and two models get
    a paired t-test of their difference over the images, said to be within chance where p ≥ 0.05."""
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
    lines.append(f'\n  {SUMMARY}')
    image_means = {n: e.float().mean((1, 2)).double().numpy() for n, e in (per_image or {}).items()}  # (B,)
    for name, e in entropies.items():
        uniform = f'   (uniform: log {n_tokens[name]} = {math.log(n_tokens[name]):.3f})' \
            if n_tokens and name in n_tokens else ''
        spread = f'   95 % interval {_t_interval(image_means[name])} over {len(image_means[name])} images' \
            if len(image_means.get(name, ())) > 1 else ''
        lines.append(f'    {name:<{width}}{e.float().mean().item():.3f}{spread}{uniform}')
    if len(names) == 2 and all(len(image_means.get(n, ())) > 1 for n in names):
        lines.append('  ' + _paired_difference(*names, *(image_means[n] for n in names)))
    lines += textwrap.wrap(MEANING, width=110, initial_indent='  ', subsequent_indent='  ')
    return '\n'.join(lines)


def _t_interval(values) -> str:
    """'a–b': the 95 % Student's t interval of the mean of `values`."""
    from scipy import stats  # optional dependency (it comes with the train extra); only tables with spreads use it

    if values.max() - values.min() < 1e-9:  # the same on every image (a uniform map): no spread to estimate
        return f'{values.mean():.3f}–{values.mean():.3f}'
    low, high = stats.ttest_1samp(values, 0.0).confidence_interval(0.95)
    return f'{low:.3f}–{high:.3f}'


def _paired_difference(a: str, b: str, values_a, values_b) -> str:
    """One line on b − a over the same images: the mean difference, its 95 % interval and a paired t-test."""
    from scipy import stats  # optional dependency, as in _t_interval

    if len(values_a) != len(values_b):
        return f'{b} − {a}: not compared (measured on {len(values_b)} and {len(values_a)} images)'
    diff = values_b - values_a
    n = len(diff)
    if diff.max() - diff.min() < 1e-9:  # the same difference on every image: no spread to test against
        return f'{b} − {a}: {diff.mean():+.3f} nats on every one of the {n} images'
    test = stats.ttest_rel(values_b, values_a)
    p = test.pvalue
    low, high = test.confidence_interval(0.95)
    shown = 'p < 0.001' if p < 1e-3 else f'p = {p:.2f}'
    verdict = 'within chance' if p >= 0.05 else 'a difference in spread beyond chance'
    return (f'{b} − {a}: {diff.mean():+.3f} nats (95 % interval {low:+.3f} to {high:+.3f}), {verdict} '
            f'(paired t-test over the {n} images, {shown})')


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
