"""The steps of `python -m diffzoo.bench.gpu`, each a function of the runner (its step begun) and the run's
settings; `STEPS` names them with their time boxes on CUDA and on the CPU, in their default order."""
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Optional, Sequence

import yaml

from . import commands
from .runner import Runner

PACKAGE = Path(__file__).resolve().parents[2]  # diffzoo/
LAUNCH_CONFIGS = PACKAGE / 'layers' / 'kernels' / 'launch_configs.json'
KERNEL_TESTS = ('tests/layers/test_kernels.py', 'tests/clip/test_official_checkpoint.py::'
                'test_official_outputs_on_cuda_in_fp32_and_with_the_triton_kernel_in_bf16')
LOADER_TESTS = 'tests/train/test_device_data.py'  # the device data backend's CUDA tests (marked gpu)


@dataclass
class Settings:
    device: str  # cuda or cpu
    out: Path
    checkout: Optional[Path]  # the repository root; None for an installed package (no tests/, no scripts/)
    sizes: commands.Sizes
    b16_recipes: Sequence[str]
    b16_backends: Sequence[str]
    b16_only: bool
    corpus_processes: int
    test_workers: int


def tune(runner: Runner, s: Settings) -> None:
    """python -m diffzoo.bench.tune --write: the Triton split kernel's launches for this GPU, into the package's
    launch_configs.json (copied to OUT); on the CPU the Triton interpreter checks the program at 20 tokens."""
    py = sys.executable
    if s.device == 'cuda':
        done = runner.run('tune', [py, '-m', 'diffzoo.bench.tune', '--write', '--out', str(s.out / 'tune.json')])
        if done.status == 'ok':
            shutil.copy(LAUNCH_CONFIGS, s.out / LAUNCH_CONFIGS.name)
    else:
        runner.run('tune', ['env', 'TRITON_INTERPRET=1', py, '-m', 'diffzoo.bench.tune', '--device', 'cpu', '--tokens',
                            '20', '--tokens-per-batch', '20', '--limit', '1', '--out', str(s.out / 'tune.json')])


def tests(runner: Runner, s: Settings) -> None:
    """First the CUDA device loader's tests (whether `data_backend: device` is exact on this GPU: the CUDA default
    waits on them), then the kernel tests (tests/layers/test_kernels.py and the official checkpoint's CUDA test),
    which rows of `split_kernel="auto"`'s table they support, the fp16 λ gradient's error row by row and in the layer
    whole at 4096 tokens, on the GPU test's own layer and draws (diffzoo.bench.lambda_error --as-test), every other
    test marked gpu, then in what the box has left the error per sample
    at batch 1, the kernel beside each path's rounding modelled (diffzoo.bench.lambda_rounding); on the CPU only
    the tests marked gpu are collected (and skip, no CUDA), and both λ benches run under the interpreter at small
    sizes: the plumbing."""
    py, cuda = sys.executable, s.device == 'cuda'
    # -v: each test's outcome is logged as it ends, so a step cut by its box still names what passed and failed
    pytest = [py, '-m', 'pytest', '-v', '-p', 'no:cacheprovider']
    workers = ['-n', str(s.test_workers), '--dist', 'loadgroup'] if cuda else []  # xdist_group marks
    junit = s.out / 'kernel-tests.xml'
    loader = [*pytest, '-rA', '-m', 'gpu', LOADER_TESTS]  # one process: two tests
    kernel = [*pytest, '-rP', *workers, *([] if cuda else ['-m', 'gpu']), '--junitxml', str(junit), *KERNEL_TESTS]
    rest = [*pytest, '-rA', *workers, '-m', 'gpu', 'tests', '--ignore', KERNEL_TESTS[0], '--ignore', LOADER_TESTS,
            '--deselect', KERNEL_TESTS[1]]  # the official checkpoint's CUDA test ran with the kernel tests
    # the GPU test's own layer and draws, the layer whole beside its rows; on the CPU, the interpreter at small sizes
    shape = ['--tokens', '4096', '--batch', '256', '--seeds', '2'] if cuda else [
        '--tokens', '300', '--batch', '1', '--dim', '128', '--heads', '1', '--seeds', '1']
    error = [*([] if cuda else ['env', 'TRITON_INTERPRET=1']), py, '-m', 'diffzoo.bench.lambda_error', '--device',
             s.device, *shape, '--dtype', 'fp16', '--as-test', '--out', str(s.out / 'lambda-error.json')]
    checkout = s.checkout is not None and (s.checkout / KERNEL_TESTS[0]).is_file()
    if not checkout:
        reason = "the repository's tests/ folder is not here (an installed package): run from a diffzoo checkout"
        for name, cmd in (('loader-tests', loader), ('kernel-tests', kernel), ('gpu-tests', rest)):
            runner.skip(name, cmd, reason)
    else:
        runner.run('loader-tests', loader, 40 if cuda else 120, reserve=120)
        runner.run('kernel-tests', kernel, reserve=65)  # dispatch, lambda-error and gpu-tests after it
        support = runner.run('dispatch', [py, '-m', 'diffzoo.bench.gpu.tasks', 'dispatch', str(junit),
                                          str(s.out / 'dispatch.json')], 20, reserve=40, grace=5)
        if support.status == 'ok':
            runner.results['dispatch'] = json.loads((s.out / 'dispatch.json').read_text())
    if runner.run('lambda-error', error, 45 if cuda else 120, reserve=15).status == 'ok':
        runner.results['lambda_error'] = json.loads((s.out / 'lambda-error.json').read_text())['summary']
    if checkout:
        runner.run('gpu-tests', rest, 30 if cuda else 300)
    size = ['--tokens', '4096', '--draws', '24'] if cuda else ['--tokens', '64', '--dim', '128', '--heads', '1',
                                                              '--draws', '2']
    rounding = [*([] if cuda else ['env', 'TRITON_INTERPRET=1']), py, '-m', 'diffzoo.bench.lambda_rounding', '--device',
                s.device, *size, '--triton', '--out', str(s.out / 'lambda-rounding.json')]
    if runner.run('lambda-rounding', rounding, 25 if cuda else 60).status == 'ok':  # last: what the box has left
        runner.results['lambda_rounding'] = json.loads((s.out / 'lambda-rounding.json').read_text())['summary']


def bench(runner: Runner, s: Settings) -> None:
    """python -m diffzoo.bench, model and steps sections in bf16: diffclip-b16 on the default path (`auto`),
    diffclip-b16@two_calls and the baseline, each step timed in interleaved blocks, then consecutive steps
    profiled, the slowest against the fastest (OUT/bench.json, OUT/bench-steps.txt); then diffclip-b16 alone
    (OUT/bench-alone.json); the host's time a layer call (python -m diffzoo.bench.host, OUT/bench-host.json); then,
    in what the box has left, the model section in fp16 with a gradient scaler, as
    open_clip's --precision amp (OUT/bench-fp16.json)."""
    py = sys.executable
    base = [py, '-m', 'diffzoo.bench', '--device', s.device]
    if s.device == 'cuda':
        bf16 = [*base, '--sections', 'model', 'steps', '--model', 'diffclip-b16', 'diffclip-b16@two_calls',
                'clip-b16-baseline', '--blocks', '5', '--block-steps', '8', '--steps', '6']
        fp16 = [*base, '--sections', 'model', '--precision', 'fp16', '--model', 'diffclip-b16', 'clip-b16-baseline',
                '--blocks', '3', '--block-steps', '6']
    else:  # the interpreted Triton kernel takes seconds a call: the CPU's own kernel at smoke sizes
        bf16 = [*base, '--smoke', '--sections', 'model', 'steps', '--model', 'diffclip-tiny', 'diffclip-tiny@two_calls',
                'clip-tiny-baseline']
        fp16 = [*base, '--smoke', '--sections', 'model', '--precision', 'fp16', '--model', 'diffclip-tiny',
                'clip-tiny-baseline']
    runner.run('bench', [*bf16, '--out', str(s.out / 'bench.json')], reserve=45)
    # the differential model alone (its own baseline): do the first steps of its blocks still grow where no other
    # model's block runs between them, as in a training?
    alone = (['--model', 'diffclip-b16', '--baseline', 'diffclip-b16', '--blocks', '3', '--block-steps', '6']
             if s.device == 'cuda' else ['--smoke', '--model', 'diffclip-tiny', '--baseline', 'diffclip-tiny'])
    if runner.run('bench-alone', [*base, '--sections', 'model', *alone, '--out', str(s.out / 'bench-alone.json')],
                  25 if s.device == 'cuda' else 120, reserve=20).status == 'ok':
        runner.results['bench_alone'] = first_steps(json.loads((s.out / 'bench-alone.json').read_text()))
    # the host's time a layer call, the kernel's path against two_calls and timm's: what a step after a
    # synchronisation waits on
    if runner.run('bench-host', [py, '-m', 'diffzoo.bench.host', '--device', s.device, '--out',
                                 str(s.out / 'bench-host.json')], 10 if s.device == 'cuda' else 60,
                  reserve=15).status == 'ok':
        runner.results['bench_host'] = json.loads((s.out / 'bench-host.json').read_text())['layers']
    runner.run('bench-fp16', [*fp16, '--out', str(s.out / 'bench-fp16.json')])  # last: what the box has left


def first_steps(bench: Dict) -> Dict:
    """Of a model section's first row, training: the first step of each block and the median of the others (s)."""
    row = bench['models']['rows'][0]
    blocks = row['train']['blocks']
    rest = sorted(t for block in blocks for t in block[1:])
    return {'model': row['model'], 'first_step_s': [block[0] for block in blocks],
            'other_steps_median_s': rest[len(rest) // 2] if rest else None}


def compile_models(runner: Runner, s: Settings) -> None:
    """The model section with both towers under torch.compile, on the default path (OUT/bench-compile.json)."""
    cmd = [sys.executable, '-m', 'diffzoo.bench', '--device', s.device, '--sections', 'model', '--compile',
           '--no-explain']
    if s.device == 'cuda':
        cmd += ['--model', 'diffclip-b16', 'clip-b16-baseline', '--blocks', '3', '--block-steps', '5']
    else:
        cmd += ['--smoke', '--model', 'diffclip-tiny', 'clip-tiny-baseline']
    runner.run('compile', [*cmd, '--out', str(s.out / 'bench-compile.json')])


def run_commands(runner: Runner, s: Settings) -> None:
    """diffclip-b16-cc3m through scripts/train.sh on every default against clip-b16-baseline-cc3m on open_clip's
    own pipeline, in one job: images/s and their ratio (diffzoo.bench.gpu.commands)."""
    train_sh = s.checkout / 'scripts' / 'train.sh' if s.checkout else None
    runner.results['commands'] = commands.run_b16(runner, s.device, s.sizes, s.b16_recipes, s.corpus_processes,
                                                  train_sh if train_sh and train_sh.is_file() else None,
                                                  s.b16_backends)


def extras(runner: Runner, s: Settings) -> None:
    """scripts/train.sh diffclip-tiny, a VLM fine-tuning stage on a tiny PaliGemma and the eRAM-V bench
    (diffzoo.bench.gpu.commands)."""
    train_sh = s.checkout / 'scripts' / 'train.sh' if s.checkout else None
    runner.results['extras'] = commands.run_extras(runner, s.device, s.sizes,
                                                   train_sh if train_sh and train_sh.is_file() else None, s.out)


# LLaVA-style stages on the suite's tiny DiffCLIP tower and Qwen2-style LM: name -> (data JSON, format, train,
# init_from, lr, extra keys)
MODEL = dict(type='build_vlm', vision='diffclip-tiny', select_layer=-2, projector='mlp2x_gelu', sequence_mask='causal')
STAGES = {
    'stage1': ('pretrain.json', 'plain', dict(projector=True), None, 3e-3, {}),
    'stage2': ('qa.json', 'qwen2_instruct', dict(projector=True, vision=True), 'stage1', 1e-3, {}),
    'stage3': ('instruct.json', 'chat_template',
               dict(projector=True, language_model='full', gradient_checkpointing=True), 'stage2', 3e-3, {}),
    'stage3-fsdp': ('instruct.json', 'chat_template', dict(projector=True, language_model='full'), 'stage2', 3e-3,
                    dict(fsdp=dict(version=2))),
}


def stages(runner: Runner, s: Settings) -> None:
    """The LLaVA-style chain, stage 1 -> 2 -> 3 of `python -m diffzoo.train.vlm` (bf16, 16 steps each on CUDA), and
    stage 3 again under FSDP2 through torchrun (on CUDA only: accelerate shards on GPUs only); per stage its loss
    per step and summary lines, to the results' `stages`."""
    py, root = sys.executable, runner.work / 'stages'
    runner.run('stage-assets', [py, '-m', 'diffzoo.bench.gpu.tasks', 'stage-assets', str(root), '--scenes', '64'],
               120, grace=5)
    cuda = s.device == 'cuda'
    report = runner.results['stages'] = {}
    for name, (json_name, fmt, train, init_from, lr, extra) in STAGES.items():
        recipe = dict(model=dict(MODEL, language_model=str(root / 'lm')),
                      attention=dict(type='differential', lambda_init=0.5),
                      data=dict(type='conversations', json=str(root / json_name), format=fmt,
                                image_folder=str(root / 'images'), max_length=128),  # 64 image positions
                      train=train, init_from=init_from, lr=lr, global_batch_size=16, batch_size=8,
                      max_steps=16 if cuda else 4, warmup_ratio=0.03, lr_scheduler='cosine', log_every=1,
                      save_every=8 if cuda else 4, report_to='none', device=s.device,
                      precision='bf16' if cuda else 'fp32', output=str(root / 'runs'), **extra)
        root.mkdir(parents=True, exist_ok=True)
        (root / f'{name}.yaml').write_text(yaml.safe_dump(recipe))
        launcher = [py, '-m', 'torch.distributed.run', '--nproc-per-node', '1'] if extra else [py]
        cmd = [*launcher, '-m', 'diffzoo.train.vlm', '--recipe', str(root / f'{name}.yaml')]
        if extra and not cuda:
            runner.skip(name, cmd, 'accelerate shards with FSDP on GPUs only (tests/vlm/test_fsdp.py shards on CPUs)')
            continue
        done = runner.run(name, cmd, 150)
        log = root / 'runs' / name / 'log.jsonl'
        text = (runner.work / 'logs' / f'stages-{name}.log').read_text(errors='replace') if done.rc is not None else ''
        report[name] = {
            'status': done.status, 'seconds': done.seconds,
            'losses': [round(json.loads(line)['loss'], 4) for line in log.read_text().splitlines() if line.strip()]
            if log.is_file() else [],
            'lines': [line for line in text.splitlines() if line.startswith(('stage', 'FSDP', 'resuming'))]}


def data_profile(runner: Runner, s: Settings) -> None:
    """python -m diffzoo.bench.data_profile: B/16's data path taken apart, each backend (OUT/data_profile.json):
    the worker's CPU a sample, each stage of the device backend's making of a batch, and a training step's wait
    for data with 8 workers at batch 256 on 256 px scenes (16 shards of 768, written in parallel first)."""
    py, corpus = sys.executable, runner.work / 'data-profile'
    cmd = [py, '-m', 'diffzoo.bench.data_profile', '--device', s.device, '--out', str(s.out / 'data_profile.json')]
    if s.device == 'cuda':
        runner.run('data-corpus', [py, '-m', 'diffzoo.bench.gpu.tasks', 'corpus', str(corpus), '--train', '12288',
                                   '--per-shard', '768', '--image-size', '256', '--processes',
                                   str(s.corpus_processes)], 90, grace=5)
        cmd += ['--data', str(corpus / 'train'), '--workers', '8', '--batch', '256', '--batches', '40']
    else:
        cmd += ['--smoke']
    runner.run('data-profile', cmd)


def stage_notes(report: Dict) -> Dict[str, str]:
    return {name: f'{len(r["losses"])} steps, loss ' + (f'{r["losses"][0]:.2f} -> {r["losses"][-1]:.2f}'
                                                        if r['losses'] else '-') for name, r in report.items()}


STEPS: Dict[str, Callable[[Runner, Settings], None]] = {
    'tune': tune, 'tests': tests, 'bench': bench, 'compile': compile_models, 'commands': run_commands,
    'extras': extras, 'stages': stages, 'data': data_profile}
DEFAULT_STEPS = ('tests', 'bench', 'compile', 'commands')  # the run without STEP arguments: 600 s on CUDA
BOXES = {  # seconds per step: cuda, cpu
    'tune': (300, 300), 'tests': (165, 300), 'bench': (155, 500), 'compile': (145, 600),
    'commands': (commands.SIZES['cuda'].box, commands.SIZES['cpu'].box),
    'extras': (commands.SIZES['cuda'].extras_box, commands.SIZES['cpu'].extras_box), 'stages': (720, 600),
    'data': (300, 600)}


RUNS = {  # what each step runs, for the plan
    'tune': 'tune', 'tests': 'loader-tests (40 s), kernel-tests, dispatch, lambda-error (45 s), gpu-tests (30 s), '
                             'lambda-rounding (what is left, up to 25 s)',
    'bench': 'bench (bf16: model and steps sections), bench-alone (25 s), bench-host (10 s), bench-fp16 (model '
             'section, what is left)',
    'compile': 'compile',
    'commands': '0-env beside 2-corpus, 2-train-diffclip-b16-cc3m@defaults, 2-train-clip-b16-baseline-cc3m@open_clip',
    'extras': '1-train-tiny, 3-vlm, 4-eramv (their corpus and assets behind them)',
    'stages': 'stage-assets, stage1, stage2, stage3, stage3-fsdp',
    'data': 'data-profile (each data backend taken apart: decode and check, worker CPU, a batch\'s making, the wait)'}


def plan(names: Sequence[str], boxes: Dict[str, float], budget: float) -> str:
    """The steps to run, each with its time box and its commands, and the total against the budget."""
    lines = [f'  {name:<9}{boxes[name]:>5.0f} s  {RUNS[name]}' for name in names]
    total = sum(boxes[n] for n in names)
    lines.append(f'  {"total":<9}{total:>5.0f} s  (budget {budget:.0f} s: every box is cut to what is left of it)')
    return '\n'.join(lines)
