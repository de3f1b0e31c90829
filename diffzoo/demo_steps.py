"""The steps of `python -m diffzoo.demo` (data, training, evaluation, figures) and `run`, which takes them
in order for the command's parsed arguments."""
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Tuple

import torch
from matplotlib.figure import Figure
from PIL import Image

from diffzoo.analysis import maps, plots, report
from diffzoo.checkpoint import run_settings
from diffzoo import confidence
from diffzoo.data.shards import iter_samples, list_shards
from diffzoo.data.synthetic import CorpusConfig, write_corpus
from diffzoo.eval.models import load as load_model
from diffzoo.eval.models import run_checkpoints
from diffzoo.eval.synthetic import METRICS, TRIALS, chance, trials
from diffzoo.eval.synthetic import evaluate as evaluate_synthetic
from diffzoo.train import loss_report
from diffzoo.train.lambda_log import plot_lambda, read_lambda_log

PROGRESS = re.compile(r'Train Epoch: (\d+) \[\s*(\d+)/(\d+) .*?Loss: ([\d.]+)')
PROGRESS_EVERY = 10  # seconds between progress lines when the output is not a terminal (a pipe, a CI log)
ATTENTION_IMAGES = 3


class TrainingFailed(RuntimeError):
    """A training run of the demo ended without its last checkpoint; the message has its log's tail."""


def load(checkpoint: Path):
    """The trained model with the transforms of its run (the recipe's image mean, std, interpolation)."""
    spec = next(s for s in run_checkpoints(checkpoint.parents[1]) if s.pretrained == str(checkpoint))
    return load_model(spec)


def run_dir(loaded) -> Path:
    """The training run a loaded model's checkpoint belongs to (RUN/checkpoints/epoch_K.pt)."""
    return Path(loaded.spec.pretrained).parents[1]


def make_data(out: Path, args) -> Dict:
    per_shard = max(1, min(500, args.train // 8))
    config = CorpusConfig(train=args.train, val=args.val, per_shard=per_shard)
    return write_corpus(out / 'data', config, progress=lambda msg: print(f'      {msg}', flush=True))


def train(model: str, out: Path, args) -> Path:
    """Train `model` with its shipped recipe; skip a finished run. Returns the last checkpoint."""
    run_dir = out / 'runs' / f'{model}-{args.train}x{args.epochs}'
    last = run_dir / 'checkpoints' / f'epoch_{args.epochs}.pt'
    if last.exists():
        print(f'      {model}: reusing {last}', flush=True)
        return last
    shards = sorted((out / 'data' / 'train').glob('*.tar'))
    pattern = str(out / 'data' / 'train' / f'{{{shards[0].stem}..{shards[-1].stem}}}.tar')
    cmd = [sys.executable, '-m', 'diffzoo.train', '--recipe', model, '--train-data', pattern,
           '--epochs', str(args.epochs), '--seed', '0', '--logs', str(out / 'runs'), '--name', run_dir.name]
    run_dir.mkdir(parents=True, exist_ok=True)
    log_path = run_dir / 'train.log'
    start, interactive = time.time(), sys.stdout.isatty()
    shown = start  # when a progress line last went to a pipe or log (not a terminal): one every PROGRESS_EVERY s
    with open(log_path, 'a', buffering=1) as log:  # line-buffered: the file follows the training as it goes
        log.write('$ ' + ' '.join(cmd) + '\n')
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                env={**os.environ, 'PYTHONUNBUFFERED': '1'})
        try:
            for line in proc.stdout:
                log.write(line)
                match = PROGRESS.search(line)
                if match:
                    epoch, done, total, loss = match.groups()
                    status = (f'      {model}: epoch {int(epoch) + 1}/{args.epochs} {int(done):>6,}/{int(total):,} '
                              f'loss {float(loss):.3f}  {time.time() - start:5.0f}s')
                    if interactive:
                        print('\r' + status, end='', flush=True)
                    elif done == total or time.time() - shown >= PROGRESS_EVERY:
                        shown = time.time()
                        print(status, flush=True)
            code = proc.wait()
        except BaseException:  # Ctrl-C or an error here: the training ends with the demo, not after it
            stop(proc)
            raise
    if interactive:
        print(flush=True)
    if code != 0 or not last.exists():
        tail = ''.join(open(log_path).readlines()[-15:])
        raise TrainingFailed(f'training {model} failed (exit {code}); the log is {log_path}:\n{tail}\n'
                             f'Re-running the demo resumes from the last finished epoch.')
    return last


def stop(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """End a training child: it has had SIGINT from the terminal already, or gets SIGTERM now; SIGKILL after
    `grace` seconds."""
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def val_samples(out: Path) -> List[Dict[str, bytes]]:
    """The val split's samples (webdataset members by extension), in key order."""
    return [members for shard in list_shards(out / 'data' / 'val') for _, members in iter_samples(shard)]


def evaluate(models: Dict, out: Path) -> Dict[str, Dict[str, float]]:
    return {name: evaluate_synthetic(m.model, m.preprocess, m.tokenizer, out / 'data' / 'val')
            for name, m in models.items()}


def compare(results: Dict[str, Dict[str, float]], baseline: str, model: str,
            n: Dict[str, int]) -> Dict[str, Dict]:
    """Per metric: its trials, each model's hits and interval, and `model − baseline`, which is within
    chance where the two intervals overlap."""
    rows = {}
    for metric in METRICS:
        try:
            cells = {name: confidence.interval(results[name][metric], n[metric]) for name in (baseline, model)}
        except ValueError as exc:
            raise ValueError(f'{exc}; the val split changed since the evaluation? Re-run the demo with --fresh') \
                from None
        rows[metric] = {'n': n[metric], 'hits': {name: c[0] for name, c in cells.items()},
                        'interval': {name: [c[1], c[2]] for name, c in cells.items()},
                        'difference': results[model][metric] - results[baseline][metric],
                        'within_chance': confidence.overlap(cells[baseline][1:], cells[model][1:])}
    return rows


def table(results: Dict[str, Dict[str, float]], baseline: str, model: str, reference: Dict[str, float],
          comparison: Dict[str, Dict]) -> str:
    """Both models per metric with their intervals (`compare`), the chance level, and the difference or
    "within chance"; below it, what the intervals are and which zero-shot results are at chance."""
    rows = [((metric,), {name: results[name][metric] for name in (baseline, model)}, comparison[metric]['n'],
             reference.get(metric)) for metric in METRICS]
    return confidence.table(['metric (val split, %)'], [baseline, model], rows, TRIALS)


def global_batch(run_dir: Path) -> int:
    """Pairs the contrastive loss of a run compares at each step."""
    return loss_report.global_batch(run_settings(run_dir))


def loss_curves(runs: Dict[str, Path], out_png: Path) -> Path:
    """Training loss against optimizer step for every run, raw and smoothed, with the loss of a model that
    matches no pair better than guessing: ln(global batch)."""
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    smoothed = False
    for (name, run_dir), colour in zip(runs.items(), ('tab:blue', 'tab:red', 'tab:green')):
        by_step = {r['step']: r['loss'] for r in read_lambda_log(str(run_dir)) if r.get('loss') is not None}
        steps = sorted(by_step)
        losses = [by_step[s] for s in steps]
        window = max(1, len(losses) // 25)
        smoothed |= window > 1
        smooth = [sum(losses[max(0, i - window + 1):i + 1]) / len(losses[max(0, i - window + 1):i + 1])
                  for i in range(len(losses))]
        ax.plot(steps, losses, color=colour, alpha=0.2, linewidth=0.8)
        ax.plot(steps, smooth, color=colour, label=name if window == 1 else f'{name} (mean of {window} steps)')
    for batch in sorted({global_batch(run_dir) for run_dir in runs.values()}):
        ax.axhline(math.log(batch), color='grey', linestyle='--', linewidth=1,
                   label=f'ln {batch} = {math.log(batch):.2f}: chance (batch of {batch})')
    ax.set_xlabel('optimizer step')
    ax.set_ylabel('contrastive loss')
    ax.set_title('training loss of both runs (same recipe and data)' + ('; faint: every step' if smoothed else ''),
                 fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    return out_png


def figures(models: Dict, out: Path, model_name: str) -> Tuple[Dict[str, str], Dict[str, list]]:
    """Attention overlays and entropy for both models, λ and loss plots. Returns PNG paths, entropies."""
    samples = val_samples(out)
    pil = [Image.open(io.BytesIO(m['jpg'])).convert('RGB') for m in samples]
    scenes = [json.loads(m['json']) for m in samples]
    # two-object scenes, each queried with its own objects ("blue square", "purple triangle")
    shown = [i for i, s in enumerate(scenes) if len(s['objects']) == 2][:ATTENTION_IMAGES]
    queries = [[f'{o["colour"]} {o["shape"]}' for o in scenes[i]['objects']] for i in shown]

    cls_maps, query_maps, per_image, n_tokens = {}, {}, {}, {}
    for name, loaded in models.items():
        model, preprocess, tokenizer = loaded.model, loaded.preprocess, loaded.tokenizer
        images = torch.stack([preprocess(pil[i]) for i in shown])
        query_maps[name] = torch.cat([maps.query_attention(model, tokenizer, image[None], texts)
                                      for image, texts in zip(images, queries)])  # (B, 2, gh, gw)
        with torch.no_grad():
            cls_maps[name] = maps.cls_attention(model, images)
            per_image[name] = maps.image_entropy(model, torch.stack([preprocess(p) for p in pil[:64]]))
        trunk = maps.vision_trunk(model)
        n_tokens[name] = trunk.patch_embed.num_patches + trunk.num_prefix_tokens
    entropies = {name: e.mean(0) for name, e in per_image.items()}  # (blocks, heads)
    captions = [scenes[i]['caption'] for i in shown]
    paths = {
        'attention_maps': plots.plot_overlays([pil[i] for i in shown], cls_maps, out / 'attention_maps.png'),
        'attention_queries': plots.plot_overlays([pil[i] for i in shown], query_maps,
                                                 out / 'attention_queries.png', queries=queries),
        'attention_entropy': plots.plot_entropy(entropies, out / 'attention_entropy.png', n_tokens),
        'lambda': plot_lambda(str(run_dir(models[model_name])), str(out / 'lambda.png')),
        'loss': loss_curves({n: run_dir(m) for n, m in models.items()}, out / 'loss.png'),
    }
    print('\n      val images in the attention figures: ' + '; '.join(f'"{c}"' for c in captions))
    print('\n' + report.entropy_table(entropies, n_tokens, per_image))
    return {k: str(v) for k, v in paths.items()}, {n: e.tolist() for n, e in entropies.items()}


def run(args) -> int:
    """The demo for the parsed (and checked) arguments of `python -m diffzoo.demo`; 0 when done."""
    out = Path(args.out)
    if args.fresh:
        for sub in ('data', 'runs'):
            shutil.rmtree(out / sub, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    timings = {}

    print(f'[1/4] data: {args.train:,} train and {args.val:,} val scenes in {out / "data"}', flush=True)
    make_data(out, args)
    timings['data_s'] = time.time() - start

    print(f'[2/4] training {args.baseline} and {args.model}, {args.epochs} epoch{"s" * (args.epochs != 1)} each, '
          f'same recipe', flush=True)
    try:
        checkpoints = {name: train(name, out, args) for name in (args.baseline, args.model)}
    except TrainingFailed as exc:
        print(f'error: {exc}', file=sys.stderr)
        return 1
    timings['train_s'] = time.time() - start - timings['data_s']

    print('[3/4] evaluating both on the val split', flush=True)
    models = {name: load(checkpoint) for name, checkpoint in checkpoints.items()}  # with their runs' transforms
    results = evaluate(models, out)
    reference = chance()
    comparison = compare(results, args.baseline, args.model,
                         trials([json.loads(m['json']) for m in val_samples(out)]))

    print('[4/4] figures', flush=True)
    pngs, entropies = figures(models, out, args.model)
    timings['total_s'] = time.time() - start

    summary = {
        'models': {n: {'checkpoint': m.spec.pretrained, 'sha256': m.checkpoint_sha256} for n, m in models.items()},
        'data': str(out / 'data'), 'epochs': args.epochs, 'train_scenes': args.train, 'val_scenes': args.val,
        'metrics': results, 'chance': reference, 'comparison': comparison, 'attention_entropy': entropies,
        'figures': pngs,
        'timings': {k: round(v, 1) for k, v in timings.items()},
    }
    with open(out / 'results.json', 'w') as f:
        json.dump(summary, f, indent=2)

    print('\n' + table(results, args.baseline, args.model, reference, comparison))
    print(f'\n  results: {out / "results.json"}')
    for png in pngs.values():
        print(f'  figure:  {png}')
    print(f'  done in {timings["total_s"]:.0f}s')
    return 0

