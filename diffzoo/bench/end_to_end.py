"""Training end to end: `scripts/train.sh` on a synthetic corpus, images/s per GPU for each recipe.

Each recipe (a differential one and its baseline twin) trains for one epoch through
`scripts/train.sh` — torchrun, `python -m diffzoo.train`, open_clip_train's own loop and data
pipeline. open_clip_train logs every `--log_every_n_steps` steps (`log_every`: about four windows after the
warm-up, not every step), and each line gives its meters' means over the steps since the line before:
`Data (t)` (seconds the loop waited for a batch) and `Batch (t)` (seconds a step, data included); images/s per GPU
= per-GPU batch · accumulation / `Batch (t)`. Logging every step would distort both: the line reads the loss
(`.item()`, a synchronisation) after open_clip has stopped the step's clock, so the GPU's time to finish each
step would be counted as the next step's wait for data, and each step would start on an idle GPU. Once a
window, that synchronisation still lands in the next window's first step (at most one step's GPU time in a
window's `Data (t)`). Windows that begin in the first `warmup` steps (start-up, cuDNN autotuning) and an epoch's
last, shorter window are dropped; the rest are summarised, their figures per window (open_clip prints the means to
the millisecond).

`data_share` = Data (t) / Batch (t) per window: the loader is not the bottleneck when the loop hardly waits for
it (median share under `LOADER_BOUND`, plus `logging_share`: the at most one step a window that the log line's own
wait adds). The ratio is the differential recipe's step time over the baseline's:
baseline images/s / differential images/s, medians.
"""
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from diffzoo.data.synthetic import CorpusConfig, write_corpus

from .measure import BenchError, summarize

TRAIN_SH = Path(__file__).resolve().parents[2] / 'scripts' / 'train.sh'
LOADER_BOUND = 0.05  # the loop waits on data for more than 5 % of a step: the loader limits the run
WAIT_RE = re.compile(r'diffzoo data wait: epoch \d+: \d+ batches, [\d.]+ s of [\d.]+ s waiting for them \(.*?\); '
                     r'after the first, ([\d.]+) s of ([\d.]+) s')
STEP_RE = re.compile(r'Train Epoch: (\d+) \[\s*(\d+)/\d+ \(\d+%\)\] Data \(t\): ([\d.]+) Batch \(t\): ([\d.]+), '
                     r'([\d.e+-]+)/s, ([\d.e+-]+)/s/gpu')


def log_every(steps: int, warmup: int) -> int:
    """open_clip_train's log interval for an epoch of `steps`: about four windows after the first `warmup`."""
    return max(1, (steps - warmup) // 4)


def parse_steps(log: str) -> List[Dict]:
    """open_clip_train's log lines as windows of consecutive steps: the window's first step (counted over the
    epochs) and its number of steps (from the epoch's sample count: each epoch's first line is its first step
    alone), its mean data and batch seconds a step, and images/s per GPU from them (per-GPU batch from the line's
    own images/s against images/s/gpu)."""
    lines = [(int(m[1]), int(m[2]), float(m[3]), float(m[4]), round(float(m[5]) / float(m[6])))
             for m in STEP_RE.finditer(log) if float(m[6]) > 0]  # images/s over images/s/gpu: the processes
    windows, before, epoch, in_epoch = [], 0, None, 0
    per_step = lines[0][1] if lines else 0  # samples of one step, all processes
    for line_epoch, samples, data_s, batch_s, processes in lines:
        if line_epoch != epoch:  # open_clip counts an epoch's samples from 0
            epoch, before, in_epoch = line_epoch, before + in_epoch, 0
        steps = round(samples / per_step) - in_epoch if per_step else 0
        if steps <= 0 or batch_s <= 0:
            continue
        windows.append({'epoch': epoch, 'first_step': before + in_epoch, 'steps': steps, 'data_s': data_s,
                        'batch_s': batch_s, 'images_per_s_per_gpu': per_step / processes / batch_s})
        in_epoch += steps
    return windows


def train(recipe: str, shards: Path, logs: Path, batch: int, nproc: int, workers: int,
          precision: Optional[str], every: int) -> Path:
    """One epoch of `recipe` through scripts/train.sh, logging every `every` steps; returns its out.log."""
    if not TRAIN_SH.is_file():
        raise BenchError(f'train: {TRAIN_SH} not found; the end-to-end section runs from a diffzoo checkout')
    cmd = ['bash', str(TRAIN_SH), recipe, '--train_data', str(shards), '--epochs', '1', '--logs', str(logs),
           '--name', recipe, '--global_batch_size', str(batch * nproc), '--max_batch_per_gpu', str(batch),
           '--warmup_epochs', '0', '--workers', str(workers), '--log_every_n_steps', str(every),
           '--save_frequency', '0', '--save_most_recent', 'false', '--resume', 'null']
    if precision is not None:
        cmd += ['--precision', precision]
    env = dict(os.environ, NPROC_PER_NODE=str(nproc), PYTHON=sys.executable)
    print(f'  train: {recipe}, {nproc} process{"es" if nproc > 1 else ""}, batch {batch} per GPU', flush=True)
    done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = logs / recipe / 'out.log'
    if done.returncode != 0 or not log.is_file():
        raise BenchError(f'train: scripts/train.sh {recipe} exited {done.returncode}:\n{done.stdout[-3000:]}')
    return log


def summarise(recipe: str, log: Path, warmup: int) -> Dict:
    """One run's figures from the windows after the warm-up that are whole (as long as the longest: an epoch's
    last, shorter window is left out), and `data_wait_at_loader`: the share of the epochs after their first batch
    that the loop spent waiting inside the loader (diffzoo's `diffzoo data wait` lines; None without them).
    `loader_bound` when that share is over `LOADER_BOUND`; without it, when the median window's `Data (t)` share
    is over `LOADER_BOUND` plus what a log line's own wait can add to a window (one step in `steps`,
    `logging_share`)."""
    text = log.read_text()
    windows = parse_steps(text)
    whole = max((w['steps'] for w in windows), default=0)
    timed = [w for w in windows if w['first_step'] >= warmup and w['steps'] == whole]
    if len(timed) < 2:
        raise BenchError(f'train: {recipe} logged {sum(w["steps"] for w in windows)} steps in {len(windows)} '
                         f'windows, {len(timed)} of them whole and after the {warmup} warm-up steps; pass a larger '
                         f'--train-samples (or a smaller --batch) for at least two')
    share = summarize([w['data_s'] / w['batch_s'] for w in timed])
    logging = 1 / whole if whole > 1 else 0.0
    waits = [(float(m[1]), float(m[2])) for m in WAIT_RE.finditer(text)]  # per epoch: after its first batch
    waited, seconds = sum(w for w, _ in waits), sum(s for _, s in waits)
    at_loader = waited / seconds if seconds > 0 else None
    bound = at_loader > LOADER_BOUND if at_loader is not None else share['median'] > LOADER_BOUND + logging
    return {'recipe': recipe, 'steps': sum(w['steps'] for w in windows), 'windows': len(timed),
            'steps_timed': sum(w['steps'] for w in timed), 'log': str(log),
            'images_per_s_per_gpu': summarize([w['images_per_s_per_gpu'] for w in timed]),
            'batch_s': summarize([w['batch_s'] for w in timed]), 'data_share': share, 'logging_share': logging,
            'data_wait_at_loader': at_loader, 'loader_bound': bound}


def run(recipes: Sequence[str], batch: int, nproc: int, workers: int, samples: int, image_size: int,
        warmup: int, precision: Optional[str]) -> Dict:
    if len(recipes) != 2:
        raise BenchError(f'--train-recipes {" ".join(recipes)}: name two, the differential recipe and its baseline')
    with tempfile.TemporaryDirectory(prefix='diffzoo-bench-train-') as tmp:
        config = CorpusConfig(train=samples, val=1, image_size=image_size, per_shard=max(1, -(-samples // 32)))
        print(f'  train: writing {samples:,} synthetic {image_size} px scenes to {tmp}', flush=True)
        write_corpus(tmp, config, progress=None)
        every = log_every(samples // (batch * nproc), warmup)
        rows = [summarise(r, train(r, Path(tmp) / 'train', Path(tmp) / 'runs', batch, nproc, workers, precision,
                                   every), warmup) for r in recipes]
        for row in rows:  # the logs go with the temporary directory; keep what was read from them
            row['log'] = Path(row['log']).name
    diff, base = rows
    ratio = base['images_per_s_per_gpu']['median'] / diff['images_per_s_per_gpu']['median']
    return {'recipes': list(recipes), 'baseline': recipes[1], 'processes': nproc, 'batch_per_gpu': batch,
            'workers': workers, 'samples': samples, 'image_size': image_size, 'warmup_steps': warmup,
            'loader_bound_share': LOADER_BOUND, 'rows': rows, 'train_time_ratio': ratio}
