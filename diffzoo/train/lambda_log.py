"""`RUN_DIR/lambda.jsonl` (written by `diffzoo.train.metrics.LambdaLog` while open_clip_train trains) read back and
plotted: no torch, so `python -m diffzoo.train plot-lambda` answers in the time matplotlib takes."""
import json
import os
from typing import Dict, List, Optional

LAMBDA_FILE = 'lambda.jsonl'


def read_lambda_log(run_dir: str) -> List[Dict]:
    path = os.path.join(run_dir, LAMBDA_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f'{path} not found: is {run_dir} a run directory of python -m diffzoo.train?')
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_lambda(run_dir: str, out: Optional[str] = None) -> str:
    """λ against step for every layer, vision and text towers side by side, to a PNG."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    records = read_lambda_log(run_dir)
    by_step = {}
    for r in records:
        by_step[r['step']] = r['lambda']  # a resumed run repeats steps; the latest record wins
    steps = sorted(by_step)
    names = list(by_step[steps[-1]]) if steps else []
    if not names:
        raise ValueError(f'{run_dir}: the model has no layer with a learned λ (a baseline run?)')
    towers = {'vision': [n for n in names if n.startswith('visual.')],
              'text': [n for n in names if not n.startswith('visual.')]}
    towers = {k: v for k, v in towers.items() if v}
    fig, axes = plt.subplots(1, len(towers), figsize=(6 * len(towers), 4), squeeze=False)
    for ax, (tower, layers) in zip(axes[0], towers.items()):
        colours = plt.cm.viridis([i / max(1, len(layers) - 1) for i in range(len(layers))])
        for i, (name, colour) in enumerate(zip(layers, colours)):
            xs = [s for s in steps if name in by_step[s]]
            ax.plot(xs, [by_step[s][name] for s in xs], color=colour, label=f'block {i}')
        ax.set_title(f'{tower} tower')
        ax.set_xlabel('optimizer step')
        ax.set_ylabel('λ')
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    fig.suptitle(f'{os.path.basename(os.path.normpath(run_dir))}\n'
                 f'λ = exp(λq1·λk1) − exp(λq2·λk2) + λ_init: at step 0 it is λ_init plus the difference that the '
                 f'random λ vectors give, not λ_init itself', fontsize=9)
    fig.tight_layout()
    out = out or os.path.join(run_dir, 'lambda.png')
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
