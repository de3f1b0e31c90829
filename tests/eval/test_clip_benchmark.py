"""CLIP_benchmark's own command line with diffzoo's models, and its hub dataset roots (a local HTTP
server stands in for huggingface.co/datasets/clip-benchmark/wds_NAME)."""
import io
import json
import sys

import pytest
import webdataset as wds

from diffzoo.data.synthetic import SHAPES, CorpusConfig, make_scene
from diffzoo.eval.__main__ import main as eval_main
from diffzoo.eval.results import read_json
from tests.factory import http_server, python_env, run


def _wds_classification(root, n=12):
    """CLIP_benchmark's webdataset export of a classification set: the scenes' subject shape is the class."""
    (root / 'test').mkdir(parents=True)
    with wds.TarWriter(str(root / 'test' / '0.tar')) as writer:
        for i in range(n):
            image, description = make_scene(0, 'val', i, CorpusConfig(image_size=64))
            buf = io.BytesIO()
            image.save(buf, 'PNG')
            writer.write({'__key__': f's{i:04d}', 'png': buf.getvalue(), 'cls': SHAPES.index(description['shape'])})
    (root / 'test' / 'nshards.txt').write_text('1')
    (root / 'classnames.txt').write_text('\n'.join(SHAPES) + '\n')
    (root / 'zeroshot_classification_templates.txt').write_text('a photo of a {c}.\na drawing of a {c}.\n')
    return root


@pytest.mark.slow
def test_clip_benchmark_cli_evaluates_a_diffzoo_model_from_an_http_dataset_root(tmp_path):
    _wds_classification(tmp_path / 'served' / 'wds_shapes')
    out = tmp_path / 'result.json'
    with http_server(tmp_path / 'served') as url:
        result = run([sys.executable, '-m', 'diffzoo.clip_benchmark', 'eval', '--model', 'diffclip-tiny',
                      '--pretrained', '', '--dataset', 'wds/shapes', '--dataset_root', url + '/wds_{dataset_cleaned}',
                      '--task', 'zeroshot_classification', '--no_amp', '--num_workers', '0', '--batch_size', '4',
                      '--output', str(out)], cwd=tmp_path, **python_env())
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    metrics = json.loads(out.read_text())['metrics']  # CLIP_benchmark's own accuracy, NumPy 2 mended
    assert 0 <= metrics['acc1'] <= 1 and 0 <= metrics['mean_per_class_recall'] <= 1


def test_diffzoo_eval_reads_a_url_dataset_root(tmp_path):
    _wds_classification(tmp_path / 'served' / 'wds_shapes')
    out = tmp_path / 'r.json'
    with http_server(tmp_path / 'served') as url:
        assert eval_main(['--model', 'diffclip-tiny', '--dataset', 'wds/shapes', '--dataset-root',
                          url + '/wds_{dataset_cleaned}', '--task', 'zeroshot_classification', '--workers', '0',
                          '--output', str(out)]) == 0
        assert eval_main(['--model', 'diffclip-tiny', '--dataset', 'wds/missing', '--dataset-root',
                          url + '/wds_{dataset_cleaned}', '--output', str(tmp_path / 'x.json')]) == 2
    rows = {r.metric: r.value for r in read_json(out)}
    assert 0 <= rows['acc1'] <= 100
