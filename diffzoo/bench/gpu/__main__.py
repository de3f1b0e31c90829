"""python -m diffzoo.bench.gpu: the command line of diffzoo.bench.gpu (its docstring says what each step does)."""
import argparse
import datetime
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

from . import __doc__ as DOC
from . import commands, steps, tasks
from .runner import Record, Runner

ENV = dict(PYTHONUNBUFFERED='1', NO_ALBUMENTATIONS_UPDATE='1', HF_HUB_OFFLINE='1', TRANSFORMERS_OFFLINE='1',
           HF_DATASETS_OFFLINE='1', WANDB_MODE='disabled', TOKENIZERS_PARALLELISM='false', MPLBACKEND='Agg')


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog='python -m diffzoo.bench.gpu', description=DOC,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('out', metavar='OUT', help='folder for gpu_check.json, gpu_check.log and the steps\' results')
    p.add_argument('steps', metavar='STEP', nargs='*',
                   help=f'steps to run, in the order given (default: {" ".join(steps.DEFAULT_STEPS)}; also '
                        f'{", ".join(n for n in steps.STEPS if n not in steps.DEFAULT_STEPS)})')
    p.add_argument('--device', choices=('cuda', 'cpu'), default='cuda',
                   help='cuda (default), or cpu: a dry run of the same commands at tiny sizes')
    p.add_argument('--budget', type=float, default=None,
                   help="seconds for the whole run (default: the sum of the steps' time boxes)")
    p.add_argument('--plan', action='store_true', help='print the steps, their time boxes and the total, run nothing')
    p.add_argument('--limit', action='append', default=[], metavar='STEP=SECONDS',
                   help="a step's time box, repeatable (defaults: see above; on the CPU tests 300, bench 500, "
                        'compile 600, commands 600, extras 800, stages 600)')
    p.add_argument('--b16-recipes', nargs=2, default=list(commands.B16_RECIPES), metavar=('RECIPE', 'BASELINE'),
                   help='commands: the differential B/16 recipe and its baseline (default %(default)s)')
    p.add_argument('--b16-backends', nargs='+', default=[], choices=('device', 'open_clip'),
                   metavar='BACKEND', help='commands: B/16 runs besides the moonshot\'s pair, with these train.sh '
                                           '--data_backend values: the first for both recipes, each other for the '
                                           'first recipe (default: none)')
    p.add_argument('--b16-only', action='store_true',
                   help='kept for earlier command lines: commands runs the environment and the B/16 runs alone '
                        '(the tiny run, VLM stage and eRAM-V are the extras step)')
    p.add_argument('--b16-batch', type=int, default=None, help='commands: B/16 batch (default cuda 256, cpu 4)')
    p.add_argument('--b16-steps', type=int, default=None,
                   help='commands: B/16 steps, one epoch, a multiple of --b16-workers (default cuda 84, cpu 4)')
    p.add_argument('--b16-workers', type=int, default=None, help='commands: data workers (default cuda 14, cpu 2)')
    p.add_argument('--b16-image-size', type=int, default=None,
                   help='commands: synthetic scenes\' size in px, cropped to 224 (default cuda 64, cpu 128)')
    p.add_argument('--corpus-processes', type=int, default=None,
                   help='commands: processes writing the B/16 corpus (default: CPUs - 2, at most 10)')
    p.add_argument('--test-workers', type=int, default=8, help='tests: pytest-xdist workers on CUDA (default 8)')
    p.add_argument('--work', default=None, help='scratch folder (default: a new one under TMPDIR, removed at the end)')
    p.add_argument('--keep-work', action='store_true', help='keep the scratch folder (corpora, runs, logs)')
    return p


def fail(message: str) -> int:
    print(f'error: {message}', file=sys.stderr)
    return 2


def interrupt(signum, frame):
    raise KeyboardInterrupt  # SIGTERM from outside ends the commands' process groups, as Ctrl-C does


def limits(args, names: List[str]) -> Dict[str, float]:
    """Each chosen step's time box: its default on the device, or --limit STEP=SECONDS."""
    boxes = {name: steps.BOXES[name][args.device == 'cpu'] for name in names}
    for item in args.limit:
        name, _, seconds = item.partition('=')
        if name not in steps.STEPS or not seconds.replace('.', '', 1).isdigit():
            raise ValueError(f'--limit {item}: expected STEP=SECONDS with STEP one of {", ".join(steps.STEPS)}')
        boxes[name] = float(seconds)
    return boxes


def header(args, checkout: Optional[Path]) -> Dict:
    commit = 'unknown (an installed package)'
    if checkout is not None:
        rev = subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], cwd=checkout, capture_output=True, text=True)
        dirty = subprocess.run(['git', 'diff', '--quiet', 'HEAD'], cwd=checkout, capture_output=True).returncode
        commit = rev.stdout.strip() + (' (modified)' if dirty else '') if rev.returncode == 0 else 'unknown'
    return {'command': shlex.join(['python', '-m', 'diffzoo.bench.gpu', *sys.argv[1:]]), 'device': args.device,
            'started': datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M:%S UTC'),
            'commit': commit, 'python': sys.version.split()[0], 'nvidia_smi': tasks.nvidia_smi(),
            'packages': tasks.versions()}


def table(runner: Runner) -> str:
    notes = dict(runner.results.get('commands', {}).get('notes', {}))
    notes.update(runner.results.get('extras', {}).get('notes', {}))
    notes.update(steps.stage_notes(runner.results.get('stages', {})))
    rows = [(f'{r.step}/{r.name}', r.status, '-' if r.seconds is None else f'{r.seconds:.1f}',
             notes.get(r.name) or r.reason or r.last_line) for r in runner.records]
    width = max([len(r[0]) for r in rows] + [4]) + 2
    lines = [f'{"step":<{width}}{"status":<11}{"s":>7}  result']
    lines += [f'{name:<{width}}{status:<11}{seconds:>7}  {note}'[:200] for name, status, seconds, note in rows]
    for dtype, r in runner.results.get('dispatch', {}).items():
        lines.append(f'split_kernel="auto" on CUDA, {dtype}: {r["verdict"]}')
    error = runner.results.get('lambda_error')
    if error:
        rms = error['dlambda_error_rms']
        lines.append(f'fp16 dL/dλ error against fp64 on the same inputs (rms of draws): kernel {rms["kernel"]:.3e}, '
                     f'two_calls {rms["two_calls"]:.3e} (the kernel\'s as its op sums the rows in fp32 '
                     f'{error["kernel_dlambda_error_as_op_rms"]:.3e}); per-row z-scores kernel '
                     f'{error["mean_z"]["kernel"]}, two_calls {error["mean_z"]["two_calls"]}')
        layer = error.get('layer')
        if layer:
            fp64, ref = (', '.join(f'{k} {v:.3e}' for k, v in layer[side].items())
                         for side in ('against_fp64', 'against_fp32_reference'))
            lines.append(f'the GPU test\'s layer whole (rms of draws), against fp64: {fp64}; against the fp32 '
                         f'reference: {ref}; the test\'s rule ' + ('holds' if layer['test_rule_holds'] else 'fails'))
    alone = runner.results.get('bench_alone')
    if alone:
        lines.append(f'{alone["model"]} alone, training: the first step of each block '
                     + ', '.join(f'{t * 1e3:.1f}' for t in alone['first_step_s'])
                     + f' ms; the other steps\' median {alone["other_steps_median_s"] * 1e3:.1f} ms')
    host = runner.results.get('bench_host')
    if host:
        calls = ', '.join(f'{name} {row["train"]["median_us"]:.0f} ({row["train"]["over_sdpa_us"]:+.0f})'
                          for name, row in host.items())
        lines.append(f'host time a layer call, µs, forward and backward (over timm\'s attention): {calls}')
    rounding = runner.results.get('lambda_rounding')
    if rounding:
        lines.append('fp16 dL/dλ error a sample against fp64 (rms, mean ± se): ' + '; '.join(
            f'{path} {r["rms"]:.2e}, {r["mean"]:+.1e} ± {r["mean_se"]:.0e}' for path, r in rounding.items()))
    b16 = runner.results.get('commands', {}).get('train_b16', {})
    moon = b16.get('moonshot')
    if moon and moon['ratio'] is not None:
        lines.append(f'moonshot: {moon["differential"]} (all defaults, train.sh; data_backend '
                     f'{moon.get("differential_data_backend")}) '
                     f'{moon["differential_images_per_s"]:,.1f} images/s against {moon["baseline"]} (open_clip\'s '
                     f'pipeline) {moon["baseline_images_per_s"]:,.1f}: '
                     f'{moon["ratio"]:.3f} ({"met" if moon["met"] else "not met"}: at least 1 is DiffCLIP in diffzoo '
                     f'faster than CLIP in open_clip)')
    if b16.get('train_time_ratio') is not None:
        lines.append(f'B/16 train-time ratio on one backend (baseline images/s / differential images/s, medians): '
                     f'{b16["train_time_ratio"]:.3f}')
    for name, r in b16.get('backend_ratios', {}).items():
        if r is not None:
            lines.append(f'B/16 images/s of {name} / of the first backend (medians): {r:.3f}')
    bad = [r[0] for r in rows if r[1] in ('failed', 'timed out', 'interrupted')]
    lines.append(f'{runner.report["elapsed_s"]:.0f} s of a {runner.report["budget_s"]:.0f} s budget; failed or timed '
                 f'out: {", ".join(bad) or "none"}')
    return '\n'.join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    args = parser().parse_args(argv)
    names = list(dict.fromkeys(args.steps or steps.DEFAULT_STEPS))
    unknown = [n for n in names if n not in steps.STEPS]
    if unknown:
        return fail(f'unknown step {" ".join(unknown)}: expected some of {", ".join(steps.STEPS)}')
    try:
        boxes = limits(args, names)
    except ValueError as exc:
        return fail(str(exc))
    default = commands.SIZES[args.device]
    sizes = commands.Sizes(**{**default.__dict__, **{k: v for k, v in (
        ('b16_batch', args.b16_batch), ('b16_steps', args.b16_steps), ('b16_workers', args.b16_workers),
        ('b16_image_size', args.b16_image_size)) if v is not None}})
    if min(sizes.b16_batch, sizes.b16_steps, sizes.b16_workers, sizes.b16_image_size) < 1 \
            or sizes.b16_steps % sizes.b16_workers or sizes.b16_batch % 2:
        return fail(f'--b16-steps {sizes.b16_steps} must be a multiple of --b16-workers {sizes.b16_workers}, '
                    f'--b16-batch {sizes.b16_batch} even, all positive')
    budget = args.budget if args.budget is not None else sum(boxes.values())
    if args.plan:
        print(f'python -m diffzoo.bench.gpu on {args.device}: the plan\n{steps.plan(names, boxes, budget)}')
        return 0
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work).resolve() if args.work else Path(tempfile.mkdtemp(prefix='diffzoo-gpu-check-'))
    repo = steps.PACKAGE.parent
    checkout = repo if (repo / 'pyproject.toml').is_file() and (repo / 'scripts').is_dir() else None
    paths = [str(checkout)] if checkout else []
    env = dict(os.environ, **ENV, PYTHON=sys.executable,  # scripts/train.sh starts torchrun with it
               PYTHONPATH=os.pathsep.join(paths + [p for p in [os.environ.get('PYTHONPATH')] if p]))
    cpus = os.cpu_count() or 4
    settings = steps.Settings(args.device, out, checkout, sizes, args.b16_recipes,
                              list(dict.fromkeys(args.b16_backends)), args.b16_only,
                              args.corpus_processes or (10 if cpus > 12 else cpus - 2 if cpus > 2 else 1),
                              args.test_workers)
    runner = Runner(out, work, budget, env, checkout or work, header(args, checkout))
    print(f'diffzoo.bench.gpu on {args.device}: {" ".join(names)}; budget {budget:.0f} s; {out}\n'
          f'{steps.plan(names, boxes, budget)}', flush=True)
    runner.write_log(f'plan:\n{steps.plan(names, boxes, budget)}\n\n')
    status = 'complete'
    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        for name in names:
            runner.begin(name, boxes[name])
            try:
                steps.STEPS[name](runner, settings)
            except Exception as exc:  # noqa: BLE001  a step that cannot go on is recorded; the next one runs
                runner.add(Record(name, '(step)', name, 'failed', reason=f'{type(exc).__name__}: {exc}'[:300]))
    except KeyboardInterrupt:
        status = 'interrupted'
    finally:
        runner.close(status)
        signal.signal(signal.SIGTERM, previous)
        if not args.work and not args.keep_work:
            shutil.rmtree(work, ignore_errors=True)
    print('\n' + table(runner))
    print(f'results: {runner.json_path}, log: {runner.log_path}' + (f', scratch: {work}' if args.keep_work else ''))
    if status == 'interrupted':
        return 130
    return 1 if any(r.status in ('failed', 'timed out') for r in runner.records) else 0


if __name__ == '__main__':
    sys.exit(main())
