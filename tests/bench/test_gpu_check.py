"""`python -m diffzoo.bench.gpu`, the GPU check, run for real on the CPU with its cheap steps: every command's
record (status, exit status, seconds, time box), a failing command recorded and the run going on, commands past
their time box ended and recorded as timed out, a command the budget leaves no time skipped, the log, --help."""
import json
import os
import subprocess
import sys

import pytest
import torch

from diffzoo.bench.gpu import __main__ as cli
from diffzoo.bench.gpu import steps


def records(out):
    report = json.loads((out / 'gpu_check.json').read_text())
    assert report['status'] == 'complete' and report['packages']['torch'] == torch.__version__.split('+')[0]
    return report, {r['name']: r for r in report['steps']}


def test_help_names_every_step_and_the_dry_run(commands):
    done = commands.run('diffzoo.bench.gpu', ['--help'])
    assert done.returncode == 0
    assert all(f'\n  {step} ' in done.stdout for step in steps.STEPS) and '--device cpu' in done.stdout


def test_bad_steps_and_limits_are_refused_by_name(tmp_path, capsys):
    assert cli.main([str(tmp_path), 'tune', 'benches']) == 2
    assert 'unknown step benches: expected some of tune, tests' in capsys.readouterr().err
    assert cli.main([str(tmp_path), '--limit', 'tune=soon']) == 2
    assert '--limit tune=soon: expected STEP=SECONDS' in capsys.readouterr().err
    assert cli.main([str(tmp_path), 'commands', '--b16-steps', '5', '--b16-workers', '2']) == 2
    assert 'must be a multiple of --b16-workers 2' in capsys.readouterr().err
    assert not (tmp_path / 'gpu_check.json').exists()


@pytest.mark.slow  # real processes
@pytest.mark.skipif(torch.cuda.is_available(), reason='tunes for real where CUDA is there')
def test_a_failing_command_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    """--device cuda without a GPU: tune fails by name; the tests step, from an installed package (no tests/ folder
    beside it), is still reached and recorded as skipped with the reason."""
    monkeypatch.setattr(steps, 'PACKAGE', tmp_path / 'site-packages' / 'diffzoo')
    assert cli.main([str(tmp_path / 'out'), 'tune', 'tests', '--device', 'cuda']) == 1
    report, by_name = records(tmp_path / 'out')
    assert [r['name'] for r in report['steps']] == ['tune', 'loader-tests', 'kernel-tests', 'gpu-tests',
                                                    'lambda-error', 'lambda-rounding']
    for name in ('lambda-error', 'lambda-rounding'):
        assert by_name[name]['status'] == 'failed' and 'no CUDA device here' in by_name[name]['last_line']
    tune = by_name['tune']
    assert (tune['status'], tune['rc'], tune['timeout_s']) == ('failed', 2, 300) and tune['seconds'] > 0
    assert 'it needs a CUDA GPU' in tune['last_line'] and 'diffzoo.bench.tune --write' in tune['command']
    for name in ('loader-tests', 'kernel-tests', 'gpu-tests'):
        assert by_name[name]['status'] == 'skipped' and by_name[name]['rc'] is None
        assert 'tests/ folder is not here (an installed package)' in by_name[name]['reason']
    assert report['commit'].startswith('unknown')
    log = (tmp_path / 'out' / 'gpu_check.log').read_text()
    assert '=== tune/tune' in log and 'it needs a CUDA GPU' in log
    table = capsys.readouterr().out
    assert 'tests/kernel-tests' in table
    assert 'failed or timed out: tune/tune, tests/lambda-error, tests/lambda-rounding\n' in table


@pytest.mark.slow  # real processes
def test_the_dry_run_ends_commands_past_their_time_box_and_skips_what_the_budget_leaves_no_time(tmp_path):
    """A 12 s budget: tune (a 5 s box) and compile (what is left, about 7 s) are ended while they run and recorded
    as timed out; bench's three commands find no time left and are skipped. The run prints its plan first."""
    out = tmp_path / 'out'
    done = subprocess.run([sys.executable, '-m', 'diffzoo.bench.gpu', str(out), 'tune', 'compile', 'bench',
                           '--device', 'cpu', '--budget', '12', '--limit', 'tune=5'], capture_output=True, text=True)
    assert done.returncode == 1, done.stderr
    report, by_name = records(out)
    assert (report['device'], report['budget_s']) == ('cpu', 12)
    assert [r['name'] for r in report['steps']] == ['tune', 'compile', 'bench', 'bench-alone', 'bench-host',
                                                    'bench-fp16']
    tune, compiled, bench = by_name['tune'], by_name['compile'], by_name['bench']
    assert by_name['bench-fp16']['status'] == by_name['bench-alone']['status'] == by_name['bench-host']['status'] \
        == 'skipped'
    assert (tune['status'], tune['timeout_s']) == ('timed out', 5) and 5 <= tune['seconds'] < 9
    assert tune['command'].startswith('env TRITON_INTERPRET=1 ') and '--device cpu --tokens 20' in tune['command']
    assert compiled['status'] == 'timed out' and 5 <= compiled['timeout_s'] <= 7
    assert '--compile --no-explain' in compiled['command']  # breaks counted as they run, no explain trace first
    assert compiled['seconds'] < compiled['timeout_s'] + 4 and '--smoke' in compiled['command']
    assert (bench['status'], bench['rc'], bench['seconds']) == ('skipped', None, None)
    assert 'of the step left' in bench['reason']
    assert report['elapsed_s'] < 20
    assert 'failed or timed out: tune/tune, compile/compile' in done.stdout
    plan = done.stdout.split('\n[tune]')[0]
    assert '  tune         5 s' in plan and 'budget 12 s' in plan


ABSENT = '''"""As if the eval extra (clip_benchmark), lmms-eval and llava-torch were not installed: importing
them fails."""
import sys


class Absent:
    def find_spec(self, name, path=None, target=None):
        if name.partition('.')[0] in {'clip_benchmark', 'llava', 'lmms_eval'}:
            raise ModuleNotFoundError(f'No module named {name!r}', name=name)
        return None


sys.meta_path.insert(0, Absent())
'''


@pytest.mark.slow  # real processes
def test_the_gpu_tests_collect_without_the_eval_and_llava_packages(tmp_path):
    """The tests step's `pytest -m gpu tests` on a machine with the core and train packages alone: every module
    collects (those that need the missing packages skip), and the kernel tests are there."""
    (tmp_path / 'absent_packages.py').write_text(ABSENT)
    root = steps.PACKAGE.parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), str(tmp_path)]))
    done = subprocess.run([sys.executable, '-m', 'pytest', '-p', 'absent_packages', '-p', 'no:cacheprovider',
                           '--collect-only', '-q', '-rs', '-m', 'gpu', 'tests'], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:]
    assert 'error' not in done.stdout.lower().split('short test summary')[0][-2000:]
    assert "could not import 'clip_benchmark'" in done.stdout  # the blocker was in force
    assert 'tests/layers/test_kernels.py::test_bench_shapes_within_twice_sdpa' in done.stdout


def test_the_default_run_fits_ten_minutes_on_cuda_and_the_plan_says_so(tmp_path, capsys):
    """With no STEP, the run is the steps the issue's GPU checks need; their time boxes add up to at most 600 s, and
    --plan prints them, each with its commands, and runs nothing."""
    assert cli.main([str(tmp_path / 'out'), '--plan']) == 0
    plan = capsys.readouterr().out
    assert [line.split()[0] for line in plan.splitlines()[1:]] == [*steps.DEFAULT_STEPS, 'total']
    total = sum(steps.BOXES[name][0] for name in steps.DEFAULT_STEPS)
    assert total <= 600 and f'total      {total} s' in plan
    assert '2-train-diffclip-b16-cc3m@defaults' in plan and 'lambda-error' in plan
    assert not (tmp_path / 'out').exists()


def test_the_b16_runs_start_with_the_moonshot_pair_and_its_ratio_is_read_from_their_logs(tmp_path):
    """diffclip-b16-cc3m on every default and clip-b16-baseline-cc3m on open_clip's pipeline come first (further
    backends after them); the moonshot's ratio is the first's median images/s over the second's, read from
    open_clip_train's own step lines."""
    from diffzoo.bench.gpu import commands
    recipes = commands.B16_RECIPES
    assert commands.b16_runs(recipes, []) == [(recipes[0], 'defaults'), (recipes[1], 'open_clip')]
    assert commands.b16_runs(recipes, ['device', 'open_clip']) == [
        (recipes[0], 'defaults'), (recipes[1], 'open_clip'), (recipes[0], 'device'), (recipes[1], 'device'),
        (recipes[0], 'open_clip')]
    line = ('2026-11-24,14:00:00 | INFO | Train Epoch: 0 [{n:>4}/2048 (17%)] Data (t): 0.012 Batch (t): {t:.3f}, '
            '{ips:#g}/s, {ips:#g}/s/gpu LR: 0.000100 Logit Scale: 14.286 Contrastive_loss: 2.0794 (2.0794)')
    for (recipe, backend), ips, record in zip(commands.b16_runs(recipes, []), (1500.0, 1200.0),
                                              ({'data_backend': 'device'}, {})):
        log = tmp_path / 'runs-b16' / f'{recipe}-{backend}' / 'out.log'
        log.parent.mkdir(parents=True)
        (log.parent / 'diffzoo-run.json').write_text(json.dumps({'model': recipe, **record}))  # as train.sh records
        log.write_text('Running with a single process. Device cuda:0\n'  # a line a step, batch 256
                       + '\n'.join(line.format(n=256 * (i + 1), t=256 / (ips + i), ips=ips + i) for i in range(8))
                       + '\n')
    result = commands.summarise_b16(tmp_path, commands.b16_runs(recipes, []), commands.SIZES['cuda'])
    moon = result['train_b16']['moonshot']
    assert (moon['differential'], moon['baseline']) == (f'{recipes[0]}@defaults', f'{recipes[1]}@open_clip')
    # steps 5-7, from their Batch (t), which open_clip prints to the millisecond
    assert (moon['differential_images_per_s'], moon['baseline_images_per_s']) == (256 / 0.170, 256 / 0.212)
    assert moon['ratio'] == pytest.approx(0.212 / 0.170) and moon['met']
    assert result['notes'][f'2-train-{recipes[0]}@defaults'].startswith(
        '8 steps on cuda:0, data_backend device, 1505.9 images/s/gpu')
    rows = result['train_b16']['rows']  # the backend each trained on, read from its run record
    assert [r['data_backend_trained'] for r in rows] == ['device', 'open_clip']
    assert moon['differential_data_backend'] == 'device'


@pytest.mark.slow  # real processes
def test_the_dispatch_task_says_which_rows_of_auto_s_table_the_kernel_tests_support(tmp_path):
    """From the kernel tests' JUnit XML: bf16 passing at every bench shape supports its row to 4096 tokens; fp16
    failing at 4096 tokens (batch 256) supports its row to 577 tokens and no further."""
    cases = []
    for dtype in ('bf16', 'fp16'):
        for n, mask in ((77, 'causal'), (197, 'none'), (577, 'none'), (4096, 'none')):
            for batch in (1, 256):
                failed = dtype == 'fp16' and n == 4096 and batch == 256
                cases.append(f'<testcase classname="tests.layers.test_kernels" '
                             f'name="test_bench_shapes_within_twice_sdpa[{n}-{mask}-{dtype}-{batch}]" time="1.0">'
                             + ('<failure message="lambda_q1">AssertionError</failure>' if failed else '')
                             + '</testcase>')
    junit = tmp_path / 'kernel-tests.xml'
    junit.write_text('<?xml version="1.0"?><testsuites><testsuite name="pytest">' + ''.join(cases)
                     + '<testcase classname="tests.layers.test_kernels" name="test_other" time="0.1"/>'
                     + '</testsuite></testsuites>')
    out = tmp_path / 'dispatch.json'
    done = subprocess.run([sys.executable, '-m', 'diffzoo.bench.gpu.tasks', 'dispatch', str(junit), str(out)],
                          capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(steps.PACKAGE.parent)))
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert (report['bf16']['passed_up_to'], report['bf16']['supports_row']) == (4096, True)
    assert (report['fp16']['passed_up_to'], report['fp16']['supports_row']) == (577, True)
    assert [(c['tokens'], c['batch']) for c in report['fp16']['not_passed']] == [(4096, 256)]
    assert 'could extend' not in report['fp16']['verdict']
    assert 'bf16: the row (to 4096 tokens) is supported' in done.stdout


@pytest.mark.slow  # a real model section
def test_first_steps_reads_each_block_s_first_step_of_a_model_section_alone(tmp_path):
    """bench-alone's summary: the model section of one model as its own baseline, each block's first training step
    and the median of the others, from the section's own JSON."""
    from diffzoo.bench.__main__ import main as bench
    out = tmp_path / 'alone.json'
    assert bench(['--device', 'cpu', '--smoke', '--sections', 'model', '--model', 'diffclip-tiny', '--baseline',
                  'diffclip-tiny', '--blocks', '3', '--block-steps', '3', '--out', str(out)]) == 0
    result = json.loads(out.read_text())
    summary = steps.first_steps(result)
    blocks = result['models']['rows'][0]['train']['blocks']
    assert summary['model'] == 'diffclip-tiny' and len(blocks) == 3
    assert summary['first_step_s'] == [block[0] for block in blocks]
    assert summary['other_steps_median_s'] == sorted(t for block in blocks for t in block[1:])[3]

