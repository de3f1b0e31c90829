"""Evaluation results: one row per (model, dataset, task, metric), a JSON file, a table, a plot against epoch."""
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from diffzoo import confidence
from diffzoo.files import atomic_write_json


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
    n: Optional[int] = None  # the trials `value` is the share of hits over (None: not a share of hits)
    chance: Optional[float] = None  # the value of guessing, where one applies


def write_json(path, rows: Sequence[Row], settings: Dict) -> Path:
    """All rows so far, written atomically (a crash later loses nothing already measured)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write_json(path, {'settings': settings, 'results': [asdict(r) for r in rows]})


def read_json(path) -> List[Row]:
    with open(path) as f:
        return [Row(**r) for r in json.load(f)['results']]


def table(rows: Sequence[Row], trials: str = 'its samples') -> str:
    """Rows dataset / task / metric, one column per model in the order they were evaluated; an accuracy over
    counted trials (`trials` says what one is) with its interval, the chance level and, for two models, their
    difference or "within chance" (`diffzoo.confidence.table`, as the demos print them)."""
    columns = list(dict.fromkeys(r.column for r in rows))
    keys = list(dict.fromkeys((r.dataset, r.task, r.metric) for r in rows))
    values = {key: {} for key in keys}
    counts = {}
    for r in rows:
        key = (r.dataset, r.task, r.metric)
        values[key][r.column] = r.value
        counts[key] = (r.n, r.chance)
    return confidence.table(['dataset', 'task', 'metric'], columns,
                            [(key, values[key], *counts[key]) for key in keys], trials)


def plot_vs_epoch(rows: Sequence[Row], path) -> Optional[Path]:
    """One panel per dataset, one line per task/metric (and per training run, where there are several), against
    epoch; None without epochs to plot."""
    rows = [r for r in rows if r.epoch is not None and not r.metric.endswith('_ci95')]
    if not rows:
        return None
    runs = {r.pretrained: str(Path(r.pretrained).parent.parent) for r in rows}  # checkpoints/epoch_K.pt's run
    several = len(set(runs.values())) > 1
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    datasets = list(dict.fromkeys(r.dataset for r in rows))
    fig, axes = plt.subplots(1, len(datasets), figsize=(5.5 * len(datasets), 4), squeeze=False)
    for ax, dataset in zip(axes[0], datasets):
        series: Dict[str, List[Row]] = {}
        for r in rows:
            if r.dataset == dataset:
                series.setdefault(f'{r.task}: {r.metric}' + (f' ({runs[r.pretrained]})' if several else ''),
                                  []).append(r)
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
