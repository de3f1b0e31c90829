"""`python -m diffzoo.demo` end to end on a small corpus: data, two trainings, evaluation, figures, reuse; and the
README's quick start, whose first command is that demo, run as a whole."""
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from PIL import Image

from diffzoo import demo_steps
from diffzoo.analysis import report as analysis_report
from diffzoo.data.shards import iter_samples
from diffzoo.demo import main
from diffzoo.demo_steps import METRICS
from diffzoo.eval.models import HASH_CHARS
from tests.factory import as_in_a_terminal, call, descendants, kill_tree, wilson
from tests.pages import ROOT, commands

pytestmark = pytest.mark.slow  # the demo trains two models

SMALL = ['--train', '128', '--val', '32', '--epochs', '1']
MODELS = ('clip-tiny-baseline', 'diffclip-tiny')


def demo_here(out, *extra):
    """The same command line through `diffzoo.demo.main` in this process."""
    return call(main, ['--out', out, *SMALL, *extra], cwd=out.parent)


QUICK_START = [c for c in commands('Quick start') if not c.startswith('source ')]  # make's environment is this one


@pytest.fixture(scope='module')
def first_run(tmp_path_factory):
    """The README quick start's demo command, in a scratch directory, at the sizes of SMALL (they set only how
    long it trains; every other word is the README's), through `diffzoo.demo.main` in this process (its trainings
    are processes of their own; a real `python -m diffzoo.demo` process is the Ctrl-C test's)."""
    cwd = tmp_path_factory.mktemp('demo')
    argv = QUICK_START[0].split()
    assert argv[:3] == ['python', '-m', 'diffzoo.demo'] and '--out' in argv, QUICK_START
    for flag in ('--train', '--epochs'):
        del argv[argv.index(flag):argv.index(flag) + 2]
    proc = call(main, [*argv[3:], *SMALL], cwd)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return cwd / argv[argv.index('--out') + 1], proc


ROW = re.compile(r'^  (\S+)\s+([\d.]+) \(([\d.]+)–([\d.]+)\)\s+([\d.]+) \(([\d.]+)–([\d.]+)\)\s+(?:([\d.]+)\s+)?'
                 r'(\d+)   (within chance|[+-][\d.]+)$')


def table_rows(stdout):
    """metric → (baseline value, its interval, model value, its interval, chance or None, n, verdict)."""
    rows = {}
    for line in stdout.splitlines():
        match = ROW.match(line)
        if match and match[1] in METRICS:
            g = match.groups()
            rows[g[0]] = (float(g[1]), (float(g[2]), float(g[3])), float(g[4]), (float(g[5]), float(g[6])),
                          g[7] and float(g[7]), int(g[8]), g[9])
    return rows


def test_trains_both_models_with_one_recipe_and_prints_the_table(first_run):
    out, proc = first_run
    for step in ('[1/4] data', '[2/4] training', '[3/4] evaluating', '[4/4] figures'):
        assert step in proc.stdout
    header = next(line for line in proc.stdout.splitlines() if line.strip().startswith('metric'))
    assert header.split()[-5:] == [*MODELS, 'chance', 'n', 'difference']
    rows = table_rows(proc.stdout)
    assert set(rows) == set(METRICS)
    report = json.loads((out / 'results.json').read_text())
    scenes = [json.loads(members['json']) for shard in sorted((out / 'data' / 'val').glob('*.tar'))
              for _, members in iter_samples(shard)]
    captions = len({s['caption'] for s in scenes})
    assert len(scenes) == 32
    for metric, (a, a_ci, b, b_ci, chance, n, verdict) in rows.items():
        baseline, model = report['metrics'][MODELS[0]][metric], report['metrics'][MODELS[1]][metric]
        assert (a, b) == (round(baseline, 1), round(model, 1))
        assert n == (captions if metric.startswith('text_to_image') else 32)  # trials: scenes or distinct captions
        compared = report['comparison'][metric]
        assert compared['n'] == n
        for name, value, shown in ((MODELS[0], baseline, a_ci), (MODELS[1], model, b_ci)):
            hits = compared['hits'][name]
            assert 100 * hits / n == pytest.approx(value, abs=1e-3)  # the counts behind the percentages
            expected = wilson(hits, n)
            assert shown == pytest.approx(expected, abs=0.05 + 1e-9)  # printed to 0.1
            assert compared['interval'][name] == pytest.approx(expected, abs=1e-9)
        (a_low, a_high), (b_low, b_high) = (compared['interval'][name] for name in MODELS)
        overlap = a_low <= b_high and b_low <= a_high
        assert compared['within_chance'] == overlap
        assert verdict == ('within chance' if overlap else f'{model - baseline:+.1f}')
    assert rows['zero_shot_shape'][4] == 33.3 and rows['zero_shot_colour'][4] == 16.7  # chance column
    assert 'within chance' in proc.stdout and 'Wilson 95% interval' in proc.stdout

    # the two runs differ only in the model
    settings = {}
    for name in MODELS:
        run = out / 'runs' / f'{name}-128x1'
        params = dict(line.split(': ', 1) for line in (run / 'params.txt').read_text().splitlines() if ': ' in line)
        assert params.pop('model') == name
        for key in ('name', 'logs', 'checkpoint_path', 'log_path', 'tensorboard_path', 'wandb_notes'):
            params.pop(key, None)
        settings[name] = params
    assert settings[MODELS[0]] == settings[MODELS[1]]
    for name, entry in report['models'].items():
        digest = hashlib.sha256((out.parent / entry['checkpoint']).read_bytes()).hexdigest()  # relative to the cwd
        assert entry['sha256'] == digest[:HASH_CHARS]


def test_the_table_says_within_chance_only_where_the_intervals_overlap():
    results = {MODELS[0]: dict.fromkeys(METRICS, 10.0), MODELS[1]: dict.fromkeys(METRICS, 10.0)}
    results[MODELS[0]].update(zero_shot_shape=33.2, zero_shot_colour=17.8)
    results[MODELS[1]].update(zero_shot_shape=34.4, zero_shot_colour=60.0)
    n = dict.fromkeys(METRICS, 500)
    comparison = demo_steps.compare(results, *MODELS, n)
    printed = demo_steps.table(results, *MODELS, demo_steps.chance(), comparison)
    rows = table_rows(printed)
    assert rows['zero_shot_shape'][1:4:2] == ((29.2, 37.4), (30.4, 38.7))  # overlapping
    assert rows['zero_shot_shape'][6] == 'within chance'
    assert rows['zero_shot_colour'][6] == '+42.2' and not comparison['zero_shot_colour']['within_chance']
    assert comparison['zero_shot_shape']['hits'] == {MODELS[0]: 166, MODELS[1]: 172}
    assert 'At chance (the interval holds the chance level): clip-tiny-baseline zero_shot_shape, diffclip-tiny ' \
           'zero_shot_shape, clip-tiny-baseline zero_shot_colour.' in ' '.join(printed.split())
    with pytest.raises(ValueError, match='no whole number of hits out of 7'):
        demo_steps.compare(results, *MODELS, dict.fromkeys(METRICS, 7))


def test_writes_the_figures(first_run):
    out, proc = first_run
    report = json.loads((out / 'results.json').read_text())
    assert set(report['figures']) == {'attention_maps', 'attention_queries', 'attention_entropy', 'lambda', 'loss'}
    for png in report['figures'].values():
        assert f'figure:  {png}' in proc.stdout
        with Image.open(out.parent / png) as image:  # relative to the demo's cwd
            assert image.size[0] > 300 and image.size[1] > 200
            assert len(np.unique(np.asarray(image.convert('L')))) > 20  # not a blank canvas
    words = ' '.join(proc.stdout.split())  # the entropy table says what it measures, and no "better"
    assert ' '.join(analysis_report.SUMMARY.split()) in words and ' '.join(analysis_report.MEANING.split()) in words
    assert 'noise' not in words
    entropy = report['attention_entropy']
    assert set(entropy) == set(MODELS)
    assert [len(layer) for layer in entropy[MODELS[0]]] == [4] * 4  # 4 blocks of 4 heads
    assert [len(layer) for layer in entropy[MODELS[1]]] == [2] * 4  # 4 blocks of 2 differential heads


def test_rerun_reuses_data_and_checkpoints(first_run):
    out, _ = first_run
    before = {p: p.stat().st_mtime_ns for p in (out / 'runs').rglob('*.pt')}
    shards = {p: p.stat().st_mtime_ns for p in (out / 'data').rglob('*.tar')}
    first = json.loads((out / 'results.json').read_text())
    proc = demo_here(out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert 'reusing it' in proc.stdout  # the corpus
    for name in MODELS:
        assert f'{name}: reusing {out}/runs/{name}-128x1/checkpoints/epoch_1.pt' in proc.stdout
    assert {p: p.stat().st_mtime_ns for p in (out / 'runs').rglob('*.pt')} == before
    assert {p: p.stat().st_mtime_ns for p in (out / 'data').rglob('*.tar')} == shards
    assert json.loads((out / 'results.json').read_text())['metrics'] == first['metrics']


def test_ctrl_c_ends_on_one_line_and_stops_the_training(first_run, tmp_path):
    """Ctrl-C (SIGINT to the demo's process group, as a terminal sends it) while a model trains: one line saying
    what a rerun keeps, exit 130, no traceback, and the training process ends with the demo."""
    shutil.copytree(first_run[0] / 'data', tmp_path / 'out' / 'data')
    log = tmp_path / 'out' / 'runs' / f'{MODELS[0]}-128x1' / 'train.log'
    proc = subprocess.Popen([sys.executable, '-m', 'diffzoo.demo', '--out', 'out', *SMALL], cwd=tmp_path, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            preexec_fn=as_in_a_terminal)
    try:
        start = time.monotonic()
        while not (log.exists() and 'Train Epoch: 0' in log.read_text()) and time.monotonic() - start < 240:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        training = descendants(proc.pid)[1:]
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=120)
        ended = time.monotonic() + 10  # the training ends with the demo; its data workers follow within a second
        while [pid for pid in training if _running(pid)] and time.monotonic() < ended:
            time.sleep(0.1)
        assert training and not [pid for pid in training if _running(pid)]
    finally:
        kill_tree(proc.pid)
    assert proc.returncode == 130 and 'Traceback' not in out + err, out[-3000:] + err[-3000:]
    assert err.strip().splitlines() == ['interrupted: run the same command again to go on (it reuses out/data and '
                                        'every finished training, and resumes an unfinished one from its last '
                                        'finished epoch)']


def _running(pid):
    try:
        return open(f'/proc/{pid}/stat').read().rsplit(') ', 1)[1][0] != 'Z'  # a zombie has ended
    except FileNotFoundError:
        return False


def test_unknown_model_is_refused_before_any_work(tmp_path):
    proc = demo_here(tmp_path / 'out', '--model', 'diffclip-tiny-typo')
    assert proc.returncode == 2
    assert 'diffclip-tiny-typo' in proc.stderr and 'recipe' in proc.stderr
    assert not (tmp_path / 'out').exists()


def test_the_vlm_demo_trains_a_vlm_on_each_tower_and_prints_pope_side_by_side(first_run):
    """`python -m diffzoo.demo_vlm --towers` over the demo's towers (reused, not retrained): how much they learned,
    the same two stages on each, recipes identical but for the tower, POPE's three splits on val scenes, a table
    with both towers, intervals and the paired test from the answers' counts, one loss figure; on the console
    the steps counted once, one progress line per stage at these few steps, no per-step dicts or bars."""
    import re

    from diffzoo.demo_vlm import main as demo_vlm
    from diffzoo.eval.lmm.metrics import pope_answer
    from diffzoo.train.lambda_log import read_lambda_log
    from tests.test_demo_vlm import check_pope_table
    out, _ = first_run
    done = call(demo_vlm, ['--out', out, '--towers', out, '--scenes', '48', '--pope-scenes', '12', '--steps', '3'],
                out.parent)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f'from {out} (128 scenes × 1 epoch), reused as they are' in done.stdout
    for tower in MODELS:  # the towers are the demo's
        assert f'{tower}: reusing {out}/runs/{tower}-128x1/checkpoints/epoch_1.pt' in done.stdout
    assert re.findall(r'^\[(\d)/(\d)\] ', done.stdout, re.M) == [(str(k), '6') for k in range(1, 7)]
    console = done.stdout + done.stderr
    progress = re.findall(r'^  \S+-(?:pretrain|finetune): step (\d+)/3  loss [\d.]+  elapsed \d+s  eta (\d+)s', console,
                          re.M)
    assert progress == [('3', '0')] * 4  # one line per stage: its last step
    assert "{'loss'" not in console and 'it/s]' not in console and 'Loading weights' not in console
    assert len(re.findall(r'^epoch \d+: ', console, re.M)) <= 4  # no stage repeats what it lost each epoch
    assert len(console.splitlines()) < 130, console  # steps, each stage's and POPE's few lines, the tables
    report = json.loads((out / 'vlm' / 'results.json').read_text())
    assert set(report['pope']) == set(MODELS)
    for tower in MODELS:
        assert set(report['pope'][tower]) == {'random', 'popular', 'adversarial'}
    table = [line.split() for line in done.stdout.splitlines()
             if line.split()[:1] in (['random'], ['adversarial']) and line.split()[1] in ('precision', 'recall', 'f1',
                                                                                          'yes_ratio')]
    assert len(table) == 8 and all(len(row) == 4 for row in table)  # split, metric, one column per tower

    # the towers' table: their steps and zero-shot accuracy (the demo's own) with intervals from the hits
    demo = json.loads((out / 'results.json').read_text())
    for tower in MODELS:
        learned = report['towers'][tower]
        steps = max(r['step'] for r in read_lambda_log(str(out / 'runs' / f'{tower}-128x1')) if r['loss'] is not None)
        assert learned['steps'] == steps and f'{tower} ({steps} steps of 32)' in done.stdout
        for task, z in learned['zero_shot'].items():
            assert z['accuracy'] == pytest.approx(demo['metrics'][tower][f'zero_shot_{task}'], abs=1e-6)
            assert 100 * z['hits'] / 32 == pytest.approx(z['accuracy'])
            low, high = wilson(z['hits'], 32)
            assert f'{z["accuracy"]:.1f} ({low:.1f}–{high:.1f})' in done.stdout
    assert 'synthetic corpus (128 scenes × 1 epoch;' in ' '.join(done.stdout.split())

    # POPE: accuracies, intervals and verdicts from each question's answer by both VLMs
    pope_dir = out / 'vlm' / 'data' / 'pope'
    questions = {split: [f'{split}-{json.loads(line)["question_id"]}' for line in
                         (pope_dir / f'coco_pope_{split}.json').read_text().splitlines()]
                 for split in ('random', 'popular', 'adversarial')}
    correct = {}
    for tower in MODELS:
        rows = [json.loads(line) for line in
                (out / 'vlm' / 'pope' / tower / 'pope_predictions.jsonl').read_text().splitlines()]
        correct[tower] = {r['id']: pope_answer(r['prediction']) == r['label'] for r in rows}
    check_pope_table(done.stdout, correct, questions)
    words = ' '.join(done.stdout.split())  # the verdict: one seed, and each VLM's yes-ratio where it departs from 50
    assert 'one seed of each training' in words
    for tower in MODELS:
        biased = [split for split, row in report['pope'][tower].items()
                  if not wilson(round(row['yes_ratio'] * row['questions']), row['questions'])[0] <= 50
                  <= wilson(round(row['yes_ratio'] * row['questions']), row['questions'])[1]]
        assert (f"{tower}'s VLM answers yes to" in words) == bool(biased), (tower, biased, words[-1500:])

    # one figure, both towers in each stage
    assert done.stdout.count('figure:  ') == 1 and f'figure:  {out / "vlm" / "loss.png"}' in done.stdout
    assert report['figure'] == str(out / 'vlm' / 'loss.png')
    with Image.open(report['figure']) as image:
        assert image.size[0] > 800 and len(np.unique(np.asarray(image.convert('L')))) > 20
    import yaml
    first, second = (yaml.safe_load((out / 'vlm' / 'recipes' / f'{t}-finetune.yaml').read_text()) for t in MODELS)
    assert first['model'].pop('vision').startswith(MODELS[0]) and second['model'].pop('vision').startswith(MODELS[1])
    assert {k: v for k, v in first.items() if k != 'init_from'} == {k: v for k, v in second.items() if k != 'init_from'}
    pope = out / 'vlm' / 'data' / 'pope' / 'coco_pope_popular.json'
    rows = [json.loads(line) for line in pope.read_text().splitlines()]
    assert {r['label'] for r in rows} == {'yes', 'no'} and sum(r['label'] == 'yes' for r in rows) * 2 == len(rows)


def test_the_quick_start_runs_as_written(first_run):
    """The README's quick start, its commands in order in the demo's scratch directory, in the environment this
    suite runs in: the demo (first_run), a training with scripts/train.sh (a real torchrun job), its evaluation and
    its λ plot; then docs/evaluation.md's evaluation of `make demo`'s run (demo/, 4000 scenes × 4 epochs) on that
    smaller demo. The `python -m diffzoo.…` commands run through their `main` in this process (each has a
    real-process test of its own: tests/test_cli.py, tests/test_readme.py)."""
    from diffzoo.eval.__main__ import main as evaluate
    from diffzoo.train.launch import main as train
    out, _ = first_run
    cwd = out.parent
    assert len(QUICK_START) == 4, QUICK_START
    mains = {'diffzoo.eval': evaluate, 'diffzoo.train': train}
    env = dict(os.environ, HF_HUB_OFFLINE='1', PYTHON=sys.executable, NPROC_PER_NODE='1')
    for command in QUICK_START[1:]:
        argv = command.split()
        if argv[0] == 'python':
            assert argv[1] == '-m', command
            done = call(mains[argv[2]], argv[3:], cwd)
        else:
            done = done_training = subprocess.run(['bash', str(ROOT / argv[0]), *argv[1:]], capture_output=True,
                                                  text=True, timeout=600, cwd=cwd, env=env)
        assert done.returncode == 0, (command, done.stdout[-2000:], done.stderr[-2000:])
    train = next(c.split() for c in QUICK_START if c.startswith('scripts/train.sh'))
    epochs = train[train.index('--epochs') + 1]
    assert (cwd / 'runs' / 'first' / 'checkpoints' / f'epoch_{epochs}.pt').is_file()
    assert done_training.stdout.strip().splitlines()[-1].startswith('trained: loss ')  # against chance, ln 32
    assert 'chance ln 32 = 3.466 (global batch 32): ' in done_training.stdout
    assert (cwd / 'runs' / 'first' / 'eval' / 'results.json').is_file()
    assert (cwd / 'runs' / 'first' / 'lambda.png').stat().st_size > 0
    scenes, epochs = (SMALL[SMALL.index(flag) + 1] for flag in ('--train', '--epochs'))
    demo_eval = next(c for c in commands() if c.startswith('python -m diffzoo.eval --run-dir demo/runs/'))
    argv = demo_eval.replace('demo/', f'{out.name}/').replace('-4000x4', f'-{scenes}x{epochs}').split()
    done = call(evaluate, argv[3:], cwd)
    assert done.returncode == 0, (demo_eval, done.stdout[-2000:], done.stderr[-2000:])
    assert (out / 'runs' / f'diffclip-tiny-{scenes}x{epochs}' / 'eval' / 'results.json').is_file()
