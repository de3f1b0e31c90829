"""The `commands` and `extras` steps: the project's commands on one GPU (or, with --device cpu, the CPU at tiny
sizes), nothing downloaded.

commands, about 140 s on an H100 or H200:
  0-env            environment, package versions, nvidia-smi, a one-process all_reduce over NCCL (gloo on CPU)
  2-train-diffclip-b16-cc3m@defaults
                   scripts/train.sh diffclip-b16-cc3m on synthetic shards (2-corpus) with every diffzoo default:
                   split_kernel auto, the recipe's data backend
  2-train-clip-b16-baseline-cc3m@open_clip
                   scripts/train.sh clip-b16-baseline-cc3m with open_clip's own pipeline (--data_backend
                   open_clip): with the run above, the two rows of the moonshot from one job, and the
                   differential's images/s over the baseline's (at least 1: DiffCLIP in diffzoo is faster
                   than CLIP in open_clip's pipeline)
  2-train-RECIPE@BACKEND
                   with --b16-backends: both recipes with the first backend, then the differential recipe
                   with each other one (their ratios too)
  Both B/16 runs use the flags diffzoo/bench/end_to_end.py passes (one epoch, one process, a log line every 19
  steps (end_to_end.log_every), no checkpoints) and the same batch, workers and precision: images/s per GPU and
  the share of each step spent waiting for data, per window of steps between log lines.
extras, about 200 s:
  1-train-tiny     scripts/train.sh diffclip-tiny on a small synthetic webdataset corpus (1-corpus-tiny), one
                   process, on the device
  3-vlm            one VLM fine-tuning stage: python -m diffzoo.train.vlm --recipe paligemma-3b-vqav2-diff on a
                   tiny random PaliGemma and a generated VQAv2-layout set (3-assets), and the device it trained on
  4-eramv          python -m diffzoo.bench.eramv --model diffclip-b16 LM --device cuda: FLOPs, forward latency,
                   time to first token and tokens/s, with a random local Gemma

The corpora and assets are written in the background while the commands before the ones that read them run.
Each command's time box is cut so that the commands after it keep their share of the step's box.
"""
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from diffzoo.train.run_record import recorded_data_backend

from .runner import Runner

VLM_RECIPE = 'paligemma-3b-vqav2-diff'
B16_RECIPES = ('diffclip-b16-cc3m', 'clip-b16-baseline-cc3m')
DEFAULTS = 'defaults'  # a B/16 run with train.sh's own --data_backend (no flag)
NO_TRAIN_SH = 'scripts/train.sh is not here (an installed package): run from a diffzoo checkout'
RUNNING_RE = re.compile(r'Running (with a single process|in distributed mode with multiple processes)\. '
                        r'Device:? ([\w:]+)')


@dataclass(frozen=True)
class Sizes:
    box: int  # seconds for the commands step
    extras_box: int  # seconds for the extras step
    slack: int  # every command's time box and reserve times this: the CPU runs the same commands slower
    b16_batch: int
    b16_steps: int  # one epoch: a multiple of b16_workers
    b16_workers: int
    b16_image_size: int  # RandomResizedCrop scales it to 224, as the recipes do
    b16_precision: Tuple[str, ...]
    b16_warmup: int  # steps left out of the images/s medians
    tiny_scenes: int
    vlm: Tuple[str, ...]
    lm: Tuple[int, int]  # the eRAM-V bench's Gemma: hidden, layers
    eramv_vision: str
    eramv_anchors: Tuple[str, ...]
    new_tokens: int


# A B/16 training step at batch 256 in bf16 takes about 0.12-0.17 s on an H100 or H200, the model alone
# (bench/results), and each train.sh run spends ~13 s besides its steps; at 14 workers of 64 px scenes the loader
# fed ~1,200-1,500 images/s (commands.json: the per-sample transforms, not decoding, bound a 16-core machine, and
# the summary's loader_bound says so). 84 steps per run (6 per worker) take ~45 s each; the windows (19 steps
# between log lines) that begin in the first 5 are left out of the medians, and so is the epoch's last, shorter
# one. The corpus is written while 0-env runs.
SIZES = {
    'cuda': Sizes(box=135, extras_box=200, slack=1, b16_batch=256, b16_steps=84, b16_workers=14, b16_image_size=64,
                  b16_precision=(),
                  b16_warmup=5, tiny_scenes=1024,  # diffclip-tiny: 2 epochs of 32 steps at batch 32
                  vlm=('--max_steps', '48', '--log_every', '8', '--save_every', '48'), lm=(512, 8),
                  eramv_vision='diffclip-b16', eramv_anchors=(),  # 196 patches, 64 anchors (eRAM-V's)
                  new_tokens=32),
    'cpu': Sizes(box=600, extras_box=800, slack=4, b16_batch=4, b16_steps=4, b16_workers=2, b16_image_size=128,
                 b16_precision=('--precision', 'fp32'),  # bf16 autocast on a CPU only slows the dry run down
                 b16_warmup=1, tiny_scenes=256,
                 vlm=('--max_steps', '8', '--log_every', '4', '--save_every', '8', '--precision', 'fp32'),
                 lm=(48, 4), eramv_vision='diffclip-tiny', eramv_anchors=('--anchors', '16'),  # 64 patches
                 new_tokens=8),
}


def b16_runs(recipes: Sequence[str], backends: Sequence[str]) -> List[Tuple[str, str]]:
    """(recipe, data backend) of each B/16 run: the differential recipe on every default and the baseline on
    open_clip's pipeline (the moonshot's pair); with `backends`, both recipes with the first, then the
    differential recipe with each other one."""
    runs = [(recipes[0], DEFAULTS), (recipes[1], 'open_clip')]
    if backends:
        runs += [(r, backends[0]) for r in recipes] + [(recipes[0], b) for b in backends[1:]]
    return list(dict.fromkeys(runs))


def run_b16(runner: Runner, device: str, sizes: Sizes, recipes: Sequence[str], corpus_processes: int,
            train_sh: Optional[Path], backends: Sequence[str] = ()) -> Dict:
    """The commands step under `runner` (its step begun), then what its commands wrote; returns the summary."""
    py, work, k = sys.executable, runner.work, sizes.slack
    shards = 2 * sizes.b16_workers  # every data worker reads 2 shards of its own
    per_shard = sizes.b16_steps // sizes.b16_workers * sizes.b16_batch // 2  # and yields whole batches
    corpus = runner.start('2-corpus', [py, '-m', 'diffzoo.bench.gpu.tasks', 'corpus', str(work / 'b16'), '--train',
                                       str(shards * per_shard), '--per-shard', str(per_shard), '--image-size',
                                       str(sizes.b16_image_size), '--processes', str(corpus_processes)],
                          60 * k, grace=5, background=True)
    runs = b16_runs(recipes, backends)
    runner.run('0-env', ['env', 'NCCL_DEBUG=INFO', py, '-m', 'diffzoo.bench.gpu.tasks', 'env', str(work / 'env.json'),
                         '--device', device], 30 * k, reserve=45 * len(runs) * k)
    runner.wait(corpus)
    script = str(train_sh or 'scripts/train.sh')
    from diffzoo.bench.end_to_end import log_every  # the commands' packages are importable once they have run
    for i, (recipe, backend) in enumerate(runs):
        b16 = ['env', 'NPROC_PER_NODE=1', f'CC3M_SHARDS={work / "b16" / "train"}', 'bash', script, recipe,
               '--train_data', str(work / 'b16' / 'train'), '--epochs', '1', '--logs', str(work / 'runs-b16'),
               '--name', f'{recipe}-{backend}', *([] if backend == DEFAULTS else ['--data_backend', backend]),
               '--global_batch_size', str(sizes.b16_batch), '--max_batch_per_gpu',
               str(sizes.b16_batch), '--warmup_epochs', '0', '--workers', str(sizes.b16_workers),
               '--log_every_n_steps', str(log_every(sizes.b16_steps, sizes.b16_warmup)), '--save_frequency', '0',
               '--save_most_recent', 'false', '--resume', 'null',
               '--report_to', 'none', *sizes.b16_precision]
        if train_sh:
            runner.run(f'2-train-{recipe}@{backend}', b16, 65 * k, reserve=45 * (len(runs) - 1 - i) * k)
        else:
            runner.skip(f'2-train-{recipe}@{backend}', b16, NO_TRAIN_SH)
    return summarise_b16(work, runs, sizes)


def run_extras(runner: Runner, device: str, sizes: Sizes, train_sh: Optional[Path], out: Path) -> Dict:
    """The extras step under `runner` (its step begun), then what its commands wrote; returns the summary."""
    py, work, k = sys.executable, runner.work, sizes.slack
    lm_hidden, lm_layers = sizes.lm
    # CPU work, started now so that it overlaps the commands before the ones that read it
    corpus_tiny = runner.start('1-corpus-tiny', [py, '-m', 'diffzoo.data', 'synthetic', str(work / 'tiny'),
                                                 '--train', str(sizes.tiny_scenes), '--val', '32', '--image-size',
                                                 '64', '--per-shard', '128'], 30 * k, grace=5, background=True)
    assets = runner.start('3-assets', [py, '-m', 'diffzoo.bench.gpu.tasks', 'assets', str(work / 'assets'),
                                       '--lm-hidden', str(lm_hidden), '--lm-layers', str(lm_layers)],
                          90 * k, grace=5, background=True)
    # 1. train.sh diffclip-tiny, one process (the recipe says cpu: --device overrides it). open_clip_train makes
    #    no process group for a world of one, so NCCL carries nothing here (the commands step's 0-env all_reduce is
    #    the NCCL check); NCCL_DEBUG=INFO would show any communicator in the log.
    runner.wait(corpus_tiny)
    tiny = ['env', 'NPROC_PER_NODE=1', 'NCCL_DEBUG=INFO', 'bash', str(train_sh or 'scripts/train.sh'), 'diffclip-tiny',
            '--device', device, '--train_data', str(work / 'tiny' / 'train'), '--logs', str(work / 'runs'), '--name',
            'diffclip-tiny', '--workers', '2']
    if train_sh:
        runner.run('1-train-tiny', tiny, 60 * k, reserve=100 * k)
    else:
        runner.skip('1-train-tiny', tiny, NO_TRAIN_SH)

    # 3. one VLM fine-tuning stage (LoRA + λ on a differential decoder, VQA accuracy on the val split)
    runner.wait(assets)
    runner.run('3-vlm', ['env', f'PALIGEMMA_DIR={work / "assets" / "paligemma"}',
                         f'VQAV2_DIR={work / "assets" / "vqav2"}', py, '-m', 'diffzoo.bench.gpu.tasks', 'vlm',
                         str(work / 'vlm-device.json'), '--', '--recipe', VLM_RECIPE, '--output', str(work / 'vlm'),
                         '--report_to', 'none', '--workers', '2', '--batch_size', '8', '--data.fraction', '1.0',
                         '--data.val_fraction', '1.0', '--eval_max_new_tokens', '3', '--device', device, *sizes.vlm],
               90 * k, reserve=30 * k)

    # 4. eRAM-V against the full-token model: FLOPs, forward latency, time to first token, tokens/s
    runner.run('4-eramv', [py, '-m', 'diffzoo.bench.eramv', '--model', sizes.eramv_vision, str(work / 'assets' / 'lm'),
                           *sizes.eramv_anchors,
                           '--device', device, '--new-tokens', str(sizes.new_tokens), '--out', str(out / 'eramv.json')],
               60 * k, reserve=8 * k)
    return summarise_extras(work, out)


def _read(path: Path) -> str:
    try:
        return path.read_text(errors='replace')
    except OSError:
        return ''


def _train_run(log: Path, warmup: int) -> Dict:
    """What a train.sh run's out.log says: device, process group, steps and images/s (the bench's way); and the
    data backend it trained on (`data_backend_trained`, from its run record)."""
    text = _read(log)
    if not text:
        return {'log': str(log), 'found': False}
    running = RUNNING_RE.search(text)
    row = {'log': str(log), 'found': True, 'device': running[2] if running else None,
           'process_group': None if running is None else ('none (one process)' if 'single' in running[1] else 'yes'),
           'data_backend_trained': recorded_data_backend(str(log.parent))}
    backend = re.search(r'dist_backend: (\S+)', text)
    row['dist_backend'] = backend[1] if backend else None
    try:  # torch, through the bench's measure module: imported once the commands have run
        from diffzoo.bench import end_to_end
    except ImportError as exc:  # the packages on the commands' PYTHONPATH only, not this process's
        return dict(row, summary_error=f'{type(exc).__name__}: {exc}'[:300])
    try:
        row.update(end_to_end.summarise(log.parent.name, log, warmup))
    except end_to_end.BenchError as exc:  # too few windows (a run cut short): the bare figures
        parsed = end_to_end.parse_steps(text)
        timed = sorted(w['images_per_s_per_gpu'] for w in parsed if w['first_step'] >= warmup)
        row.update(steps=sum(w['steps'] for w in parsed), summary_error=str(exc)[:300])
        if timed:
            row['images_per_s_per_gpu'] = {'median': timed[len(timed) // 2], 'n': len(timed)}
    return row


def summarise_b16(work: Path, runs: Sequence[Tuple[str, str]], sizes: Sizes) -> Dict:
    """What the commands step measured, read from its outputs, and a one-line note per command for the table."""
    env = json.loads(_read(work / 'env.json') or '{}')
    result = {key: env.get(key) for key in ('environment', 'packages', 'missing_packages', 'nvidia_smi',
                                            'cuda_available', 'dev_shm_gb', 'collective_check')}
    rows = [dict(_train_run(work / 'runs-b16' / f'{r}-{b}' / 'out.log', warmup=sizes.b16_warmup), name=f'{r}@{b}',
                 data_backend=b) for r, b in runs]
    diff, base = rows[0], rows[1]  # the moonshot's pair: b16_runs puts it first
    ips = [(r.get('images_per_s_per_gpu') or {}).get('median') for r in (diff, base)]
    moonshot = {'differential': diff['name'], 'baseline': base['name'], 'differential_images_per_s': ips[0],
                'baseline_images_per_s': ips[1], 'ratio': _ratio(diff, base),
                'differential_data_backend': diff.get('data_backend_trained')}
    moonshot['met'] = None if moonshot['ratio'] is None else moonshot['ratio'] >= 1
    result['train_b16'] = {'runs': [r['name'] for r in rows], 'rows': rows, 'moonshot': moonshot}
    if len(rows) > 2:  # --b16-backends: baseline images/s / differential images/s on the first backend, and
        first = rows[2:4]  # the differential recipe's images/s on each other backend / on the first
        result['train_b16']['train_time_ratio'] = _ratio(first[1], first[0]) if len(first) > 1 else None
        result['train_b16']['backend_ratios'] = {row['name']: _ratio(row, first[0]) for row in rows[4:]}
    lines = {'0-env': (f'{(result["environment"] or {}).get("device")}, '
                       f'{(result["collective_check"] or {}).get("backend")} all_reduce '
                       f'{"ok" if (result["collective_check"] or {}).get("ok") else "FAILED"}, /dev/shm '
                       f'{result["dev_shm_gb"]} GB'),
             '2-corpus': _last_line(work, 'commands-2-corpus')}
    for row in rows:
        ips = (row.get('images_per_s_per_gpu') or {}).get('median')
        share = (row.get('data_share') or {}).get('median')
        at_loader = row.get('data_wait_at_loader')
        lines[f'2-train-{row["name"]}'] = (f'{row.get("steps", 0)} steps on {row.get("device")}, '
                                           f'data_backend {row.get("data_backend_trained")}, {_fmt(ips)} '
                                           f'images/s/gpu (median), data wait '
                                           f'{_fmt(at_loader * 100 if at_loader is not None else None)} % at the '
                                           f'loader (Data (t): {_fmt(share * 100 if share is not None else None)} %)')
    result['notes'] = lines
    return result


def summarise_extras(work: Path, out: Path) -> Dict:
    """What the extras step measured, read from its outputs, and a one-line note per command for the table."""
    tiny = _train_run(work / 'runs' / 'diffclip-tiny' / 'out.log', warmup=1)
    tiny['nccl_lines'] = len(re.findall(r'NCCL INFO', _read(work / 'logs' / 'extras-1-train-tiny.log')))
    tiny['nccl_used'] = tiny['nccl_lines'] > 0
    if not tiny['nccl_used'] and (tiny.get('process_group') or '').startswith('none'):
        tiny['nccl_note'] = ('one process: open_clip_train creates no process group when WORLD_SIZE is 1 '
                             '(open_clip_train.distributed.is_using_distributed), so no NCCL communicator exists; '
                             "the commands step's collective_check shows NCCL itself working on this machine")
    vlm_dir = work / 'vlm' / VLM_RECIPE
    settings = json.loads(_read(vlm_dir / 'recipe.json') or '{}')
    vlm = {'recipe': VLM_RECIPE, 'run_dir': str(vlm_dir),
           'results': json.loads(_read(vlm_dir / 'results.json') or 'null'),
           'log': [json.loads(line) for line in _read(vlm_dir / 'log.jsonl').splitlines() if line.strip()],
           'ran_on': json.loads(_read(work / 'vlm-device.json') or 'null'),
           'settings': {k: settings.get(k) for k in ('device', 'precision', 'batch_size', 'max_steps', 'differential',
                                                     'lora')}}
    result = {'train_tiny': tiny, 'vlm': vlm, 'eramv': json.loads(_read(out / 'eramv.json') or 'null')}
    results = vlm['results'] or {}
    lines = {
        '1-train-tiny': (f'{tiny.get("steps", 0)} steps on {tiny.get("device")}, process group '
                         f'{tiny.get("process_group")}, NCCL {"yes" if tiny.get("nccl_used") else "no"}'),
        '3-vlm': (f'{results.get("steps")} steps on {(vlm["ran_on"] or {}).get("device")} '
                  f'({vlm["settings"].get("precision")}), final loss {_fmt(results.get("final_loss"), ".3f")}, '
                  f'VQA accuracy {_fmt(results.get("vqa_accuracy"))} (random model)'),
        '1-corpus-tiny': next((line.strip()[:120] for line in reversed(_read(work / 'logs' / 'extras-1-corpus-tiny.log')
                                                                       .splitlines())
                               if re.search(r'train: [\d,]+ scenes$', line)), ''),
        '3-assets': _last_line(work, 'extras-3-assets')}
    e = result['eramv'] or {}
    if e.get('full') and e.get('eramv'):
        lines['4-eramv'] = ' | '.join(
            f'{k}: TTFT {_fmt(e[k]["ttft_s"] * 1e3 if "ttft_s" in e[k] else None)} ms, '
            f'{_fmt(e[k].get("tokens_per_s"))} tok/s, x FLOPs {_fmt(e[k].get("flops_ratio"), ".2f")}'
            for k in ('full', 'eramv'))
    result['notes'] = lines
    return result


def _last_line(work: Path, log: str) -> str:
    return next((line.strip()[:120] for line in reversed(_read(work / 'logs' / f'{log}.log').splitlines())
                 if line.strip()), '')


def _ratio(a: Dict, b: Dict) -> Optional[float]:
    """a's median images/s over b's."""
    try:
        return a['images_per_s_per_gpu']['median'] / b['images_per_s_per_gpu']['median']
    except (KeyError, TypeError, ZeroDivisionError):
        return None


def _fmt(x, spec: str = '.1f') -> str:
    return '-' if x is None else format(x, spec)
