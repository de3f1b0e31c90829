"""`python -m diffzoo.demo` end to end on a small corpus: data, two trainings, evaluation, figures, reuse."""
import hashlib
import json
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from diffzoo.demo import main
from diffzoo.demo_steps import METRICS
from diffzoo.eval.models import HASH_CHARS
from tests.factory import call

pytestmark = pytest.mark.slow  # the demo trains two models

SMALL = ['--train', '128', '--val', '32', '--epochs', '1']
MODELS = ('clip-tiny-baseline', 'diffclip-tiny')


def demo(out, *extra):
    """`python -m diffzoo.demo --out OUT …` in a real process."""
    return subprocess.run([sys.executable, '-m', 'diffzoo.demo', '--out', str(out), *SMALL, *extra],
                          capture_output=True, text=True, timeout=600)


def demo_here(out, *extra):
    """The same command line through `diffzoo.demo.main` in this process."""
    return call(main, ['--out', out, *SMALL, *extra], cwd=out.parent)


@pytest.fixture(scope='module')
def first_run(tmp_path_factory):
    out = tmp_path_factory.mktemp('demo')
    proc = demo(out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc


def test_trains_both_models_with_one_recipe_and_prints_the_table(first_run):
    out, proc = first_run
    for step in ('[1/4] data', '[2/4] training', '[3/4] evaluating', '[4/4] figures'):
        assert step in proc.stdout
    header = next(line for line in proc.stdout.splitlines() if line.strip().startswith('metric'))
    assert header.split()[-4:-2] == list(MODELS)
    rows = {line.split()[0]: line.split()[1:] for line in proc.stdout.splitlines()
            if line.strip().split()[:1] and line.split()[0] in METRICS}
    assert set(rows) == set(METRICS)
    report = json.loads((out / 'results.json').read_text())
    for metric, cells in rows.items():
        baseline, model = report['metrics'][MODELS[0]][metric], report['metrics'][MODELS[1]][metric]
        assert cells[:3] == [f'{baseline:.1f}', f'{model:.1f}', f'{model - baseline:+.1f}']
    assert rows['zero_shot_shape'][3] == '33.3' and rows['zero_shot_colour'][3] == '16.7'  # chance column

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
        digest = hashlib.sha256(open(entry['checkpoint'], 'rb').read()).hexdigest()
        assert entry['sha256'] == digest[:HASH_CHARS]


def test_writes_the_figures(first_run):
    out, proc = first_run
    report = json.loads((out / 'results.json').read_text())
    assert set(report['figures']) == {'attention_maps', 'attention_queries', 'attention_entropy', 'lambda', 'loss'}
    for png in report['figures'].values():
        assert f'figure:  {png}' in proc.stdout
        with Image.open(png) as image:
            assert image.size[0] > 300 and image.size[1] > 200
            assert len(np.unique(np.asarray(image.convert('L')))) > 20  # not a blank canvas
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


def test_unknown_model_is_refused_before_any_work(tmp_path):
    proc = demo_here(tmp_path / 'out', '--model', 'diffclip-tiny-typo')
    assert proc.returncode == 2
    assert 'diffclip-tiny-typo' in proc.stderr and 'recipe' in proc.stderr
    assert not (tmp_path / 'out').exists()


def test_the_vlm_demo_trains_a_vlm_on_each_tower_and_prints_pope_side_by_side(first_run):
    """`python -m diffzoo.demo_vlm` over the demo's towers (reused, not retrained): the same two stages on each,
    recipes identical but for the tower, POPE's three splits on val scenes, a table with both towers."""
    from diffzoo.demo_vlm import main as demo_vlm
    out, _ = first_run
    done = call(demo_vlm, ['--out', out, *SMALL, '--scenes', '48', '--pope-scenes', '12', '--steps', '3'], out.parent)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert 'reusing' in done.stdout and 'epoch 1/1' not in done.stdout  # the towers are the demo's
    report = json.loads((out / 'vlm' / 'results.json').read_text())
    assert set(report['pope']) == set(MODELS)
    for tower in MODELS:
        assert set(report['pope'][tower]) == {'random', 'popular', 'adversarial'}
    table = [line.split() for line in done.stdout.splitlines()
             if line.split()[:1] in (['random'], ['adversarial']) and line.split()[1] in ('accuracy', 'precision',
                                                                                          'recall', 'f1', 'yes_ratio')]
    assert len(table) == 10 and all(len(row) == 4 for row in table)  # split, metric, one column per tower
    import yaml
    first, second = (yaml.safe_load((out / 'vlm' / 'recipes' / f'{t}-finetune.yaml').read_text()) for t in MODELS)
    assert first['model'].pop('vision').startswith(MODELS[0]) and second['model'].pop('vision').startswith(MODELS[1])
    assert {k: v for k, v in first.items() if k != 'init_from'} == {k: v for k, v in second.items() if k != 'init_from'}
    pope = out / 'vlm' / 'data' / 'pope' / 'coco_pope_popular.json'
    rows = [json.loads(line) for line in pope.read_text().splitlines()]
    assert {r['label'] for r in rows} == {'yes', 'no'} and sum(r['label'] == 'yes' for r in rows) * 2 == len(rows)
