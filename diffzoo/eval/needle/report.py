"""MMNeedle's report: the accuracy table, the per-cell heatmap and the results file."""
import math
from pathlib import Path
from typing import Dict, Optional, Tuple

import matplotlib
import numpy as np
from matplotlib.figure import Figure

from diffzoo.files import atomic_write_json

RESULTS = 'needle_results.json'
HEATMAP = 'needle_heatmap.png'


def plot_cells(result: Dict, path, title: Optional[str] = None) -> Path:
    """Exact accuracy by the needle's cell in its stitch (MMNeedle's per-sub-image heatmap); each cell
    shows its accuracy and count, blank where no positive sample had its needle there."""
    n = result['n']
    values = np.array([[math.nan if v is None else v for v in row] for row in result['per_cell']['exact_accuracy']])
    fig = Figure(figsize=(max(3.6, 1.1 * n + 1.6), max(3.0, 1.1 * n + 0.9)))
    ax = fig.subplots()
    cmap = matplotlib.colormaps['RdYlGn'].with_extremes(bad='#dddddd')
    image = ax.imshow(np.ma.masked_invalid(values), cmap=cmap, vmin=0, vmax=1)
    for r in range(n):
        for c in range(n):
            count = result['per_cell']['count'][r][c]
            text = f'{values[r, c]:.0%}\nn={count}' if count else 'n=0'
            ax.text(c, r, text, ha='center', va='center', fontsize=max(6, 11 - n))
    ax.set_xticks(range(n), [str(c + 1) for c in range(n)])
    ax.set_yticks(range(n), [str(r + 1) for r in range(n)])
    ax.set_xlabel('needle column')
    ax.set_ylabel('needle row')
    metrics = result['metrics']
    ax.set_title(title or f'MMNeedle ({result["protocol"]} protocol), M={result["m"]}, {n}x{n}\n'
                          f'exact {_format_percent(metrics["exact_accuracy"])}, '
                          f'index {_format_percent(metrics["index_accuracy"])}',
                 fontsize=9)
    fig.colorbar(image, ax=ax, label='exact accuracy', fraction=0.046, pad=0.04)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    return path


def _format_percent(value: Optional[float]) -> str:
    return '-' if value is None else f'{100 * value:.2f}%'


def table(result: Dict) -> str:
    """The metrics with their counts, and exact accuracy by the needle's cell."""
    m, c, n = result['metrics'], result['counts'], result['n']
    rows = [('existence', m['existence_accuracy'], c['existence_correct'], c['answered']),
            ('existence, needle present', m['existence_accuracy_positives'], c['existence_correct_positives'],
             c['positives']),
            ('existence, needle absent', m['existence_accuracy_negatives'], c['existence_correct_negatives'],
             c['negatives']),
            ('index (needle present)', m['index_accuracy'], c['index_correct'], c['positives']),
            ('exact (needle present)', m['exact_accuracy'], c['exact_correct'], c['positives']),
            ('overall (exact, or -1)', m['overall_accuracy'], c['overall_correct'], c['answered'])]
    lines = [f'MMNeedle, {result["protocol"]} protocol: M={result["m"]} image(s) of {n}x{n} sub-images, '
             f'{c["samples"]} samples ({c["positives"]} with the needle, {c["negatives"]} without)',
             f'{"metric":<28}{"accuracy":>10}  correct / total']
    lines += [f'{name:<28}{_format_percent(value):>10}  {right} / {total}' for name, value, right, total in rows]
    lines.append(f'queries {c["queries"]}, unreadable answers {c["unreadable_answers"]}, '
                 f'samples left out (no answer) {c["empty"]}')
    lines.append('exact accuracy by the needle\'s cell (row \\ column):')
    lines.append('      ' + ''.join(f'{col + 1:>10}' for col in range(n)))
    for r in range(n):
        lines.append(f'{r + 1:>6}' + ''.join(f'{_format_percent(v):>10}' for v in result['per_cell']['exact_accuracy'][r]))
    return '\n'.join(lines)


def write_report(result: Dict, out, title: Optional[str] = None) -> Tuple[Path, Path]:
    """out/needle_results.json (every number, every answer) and out/needle_heatmap.png."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    return atomic_write_json(out / RESULTS, result), plot_cells(result, out / HEATMAP, title)
