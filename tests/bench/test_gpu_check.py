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


def test_help_names_every_step_and_the_dry_run():
    done = subprocess.run([sys.executable, '-m', 'diffzoo.bench.gpu', '--help'], capture_output=True, text=True)
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


@pytest.mark.skipif(torch.cuda.is_available(), reason='tunes for real where CUDA is there')
def test_a_failing_command_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    """--device cuda without a GPU: tune fails by name; the tests step, from an installed package (no tests/ folder
    beside it), is still reached and recorded as skipped with the reason."""
    monkeypatch.setattr(steps, 'PACKAGE', tmp_path / 'site-packages' / 'diffzoo')
    assert cli.main([str(tmp_path / 'out'), 'tune', 'tests', '--device', 'cuda']) == 1
    report, by_name = records(tmp_path / 'out')
    assert [r['name'] for r in report['steps']] == ['tune', 'kernel-tests', 'gpu-tests']
    tune = by_name['tune']
    assert (tune['status'], tune['rc'], tune['timeout_s']) == ('failed', 2, 300) and tune['seconds'] > 0
    assert 'it needs a CUDA GPU' in tune['last_line'] and 'diffzoo.bench.tune --write' in tune['command']
    for name in ('kernel-tests', 'gpu-tests'):
        assert by_name[name]['status'] == 'skipped' and by_name[name]['rc'] is None
        assert 'tests/ folder is not here (an installed package)' in by_name[name]['reason']
    assert report['commit'].startswith('unknown')
    log = (tmp_path / 'out' / 'gpu_check.log').read_text()
    assert '=== tune/tune' in log and 'it needs a CUDA GPU' in log
    table = capsys.readouterr().out
    assert 'tests/kernel-tests' in table and 'failed or timed out: tune/tune\n' in table


def test_the_dry_run_ends_commands_past_their_time_box_and_skips_what_the_budget_leaves_no_time(tmp_path):
    """A 12 s budget: tune (a 5 s box) and compile (what is left, about 7 s) are ended while they run and recorded
    as timed out; bench finds no time left and is skipped."""
    out = tmp_path / 'out'
    done = subprocess.run([sys.executable, '-m', 'diffzoo.bench.gpu', str(out), 'tune', 'compile', 'bench',
                           '--device', 'cpu', '--budget', '12', '--limit', 'tune=5'], capture_output=True, text=True)
    assert done.returncode == 1, done.stderr
    report, by_name = records(out)
    assert (report['device'], report['budget_s']) == ('cpu', 12)
    assert [r['name'] for r in report['steps']] == ['tune', 'compile', 'bench']
    tune, compiled, bench = by_name['tune'], by_name['compile'], by_name['bench']
    assert (tune['status'], tune['timeout_s']) == ('timed out', 5) and 5 <= tune['seconds'] < 9
    assert tune['command'].startswith('env TRITON_INTERPRET=1 ') and '--device cpu --tokens 20' in tune['command']
    assert compiled['status'] == 'timed out' and 5 <= compiled['timeout_s'] <= 7
    assert compiled['seconds'] < compiled['timeout_s'] + 4 and '--smoke' in compiled['command']
    assert (bench['status'], bench['rc'], bench['seconds']) == ('skipped', None, None)
    assert 'of the step left' in bench['reason']
    assert report['elapsed_s'] < 20
    assert 'failed or timed out: tune/tune, compile/compile' in done.stdout


ABSENT = '''"""As if the eval extra (clip_benchmark), lmms-eval and llava-torch were not installed: importing them fails."""
import sys


class Absent:
    def find_spec(self, name, path=None, target=None):
        if name.partition('.')[0] in {'clip_benchmark', 'llava', 'lmms_eval'}:
            raise ModuleNotFoundError(f'No module named {name!r}', name=name)
        return None


sys.meta_path.insert(0, Absent())
'''


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
