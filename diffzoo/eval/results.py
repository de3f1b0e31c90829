"""Evaluation results: one row per (model, dataset, task, metric), a JSON file, a table, a plot against epoch."""
import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence


@dataclass(frozen=True)
class Row:
    model: str
    pretrained: Optional[str]  # checkpoint path or tag; None for random init
    checkpoint_sha256: Optional[str]  # first 12 hex digits of the weights file's sha256
    dataset: str
    task: str
    metric: str
    value: float
    column: str  # the model's column in the table
    epoch: Optional[int] = None


def write_json(path, rows: Sequence[Row], settings: Dict) -> Path:
    """All rows so far, written atomically (a crash later loses nothing already measured)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + '.tmp')
    tmp.write_text(json.dumps({'settings': settings, 'results': [asdict(r) for r in rows]}, indent=1) + '\n')
    os.replace(tmp, path)
    return path


def read_json(path) -> List[Row]:
    with open(path) as f:
        return [Row(**r) for r in json.load(f)['results']]


def _fmt(value: Optional[float]) -> str:
    return '-' if value is None or (isinstance(value, float) and math.isnan(value)) else f'{value:.2f}'


def table(rows: Sequence[Row]) -> str:
    """Rows dataset / task / metric, one column per model in the order they were evaluated."""
    columns = list(dict.fromkeys(r.column for r in rows))
    keys = list(dict.fromkeys((r.dataset, r.task, r.metric) for r in rows))
    values = {(r.dataset, r.task, r.metric, r.column): r.value for r in rows}
    header = ['dataset', 'task', 'metric'] + columns
    body = [[d, t, m] + [_fmt(values.get((d, t, m, c))) for c in columns] for d, t, m in keys]
    widths = [max(len(str(line[i])) for line in [header] + body) for i in range(len(header))]

    def line(cells):
        return '  '.join(str(c).ljust(w) if i < 3 else str(c).rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return '\n'.join([line(header), '  '.join('-' * w for w in widths)] + [line(b) for b in body])


def plot_vs_epoch(rows: Sequence[Row], path) -> Optional[Path]:
    """One panel per dataset, one line per task/metric, against epoch; None without epochs to plot."""
    rows = [r for r in rows if r.epoch is not None and not r.metric.endswith('_ci95')]
    if not rows:
        return None
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    datasets = list(dict.fromkeys(r.dataset for r in rows))
    fig, axes = plt.subplots(1, len(datasets), figsize=(5.5 * len(datasets), 4), squeeze=False)
    for ax, dataset in zip(axes[0], datasets):
        series: Dict[str, List[Row]] = {}
        for r in rows:
            if r.dataset == dataset:
                series.setdefault(f'{r.task}: {r.metric}', []).append(r)
        for label, points in series.items():
            points = sorted(points, key=lambda r: r.epoch)
            ax.plot([p.epoch for p in points], [p.value for p in points], marker='o', label=label)
        ax.set_title(dataset)
        ax.set_xlabel('epoch')
        ax.set_ylabel('%')
        epochs = sorted({r.epoch for r in rows if r.dataset == dataset})
        ax.set_xticks(epochs)  # whole epochs only
        if len(epochs) == 1:  # one checkpoint: a readable 0–100 % axis instead of matplotlib's ±4 % around it
            ax.set_xlim(epochs[0] - 1, epochs[0] + 1)
            ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc='upper left', bbox_to_anchor=(1.02, 1))  # beside the axes: no curve hidden
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches='tight')  # the legends beside the axes included
    plt.close(fig)
    return path
