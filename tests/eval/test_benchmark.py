import json

import numpy as np
import pytest
import torch
import webdataset as wds

pytest.importorskip('clip_benchmark')  # the eval extra: diffzoo.eval.benchmark runs CLIP_benchmark's own code

from diffzoo.data.shards import iter_samples, list_shards  # noqa: E402
from diffzoo.eval import benchmark  # noqa: E402
from diffzoo.eval.__main__ import main  # noqa: E402
from diffzoo.eval.models import EvalError, ModelSpec, load  # noqa: E402
from diffzoo.eval.results import read_json  # noqa: E402

MODELS = ['diffclip-tiny', 'clip-tiny-baseline']


def test_dummy_zero_shot_for_each_model(tmp_path):
    out = tmp_path / 'r.json'
    argv = ['--dataset', 'dummy', '--workers', '0', '--output', str(out), '--force-image-size', '224']
    assert main(sum((['--model', m] for m in MODELS), []) + argv) == 0
    rows = read_json(out)
    assert [(r.model, r.task, r.metric) for r in rows] == [
        (m, 'zeroshot_classification', k) for m in MODELS for k in ('acc1', 'mean_per_class_recall')]
    assert all(r.value in (0.0, 100.0) for r in rows)  # one image, two classes (no top-5 of 2 classes)


def test_dummy_at_another_image_size_is_refused_naming_the_fix(tmp_path, capsys):
    """CLIP_benchmark's dummy images are 224 × 224 whatever the transform: a 64-pixel model is told so, not sent a
    traceback from its patch embedding."""
    out = tmp_path / 'r.json'
    assert main(['--model', 'diffclip-tiny', '--dataset', 'dummy', '--workers', '0', '--output', str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith('error: --dataset dummy: CLIP_benchmark gives 224 × 224 images') and 'Traceback' not in err
    assert 'diffclip-tiny takes 64 × 64; add --force-image-size 224' in err and not out.exists()


def test_accuracy_matches_hand_count_where_clip_benchmarks_fails_on_numpy2():
    logits = torch.tensor([[0.1, 0.9, 0.0], [0.8, 0.1, 0.3], [0.2, 0.3, 0.5], [0.6, 0.3, 0.1]])
    target = torch.tensor([1, 2, 2, 1])
    from clip_benchmark.metrics import linear_probe, zeroshot_classification
    assert zeroshot_classification.accuracy is linear_probe.accuracy  # both references replaced
    assert zeroshot_classification.accuracy(logits, target, (1, 2)) == [0.5, 1.0]  # rows 0, 2 top-1; 1, 3 second
    original = zeroshot_classification.accuracy.__diffzoo_original__
    if np.lib.NumpyVersion(np.__version__) >= '2.0.0':  # when this passes, the seam can go
        with pytest.raises(TypeError, match='0-dimensional'):
            original(logits, target, (1,))


def _wds_retrieval(corpus, root):
    """The corpus's validation split as CLIP_benchmark's webdataset export of a retrieval set."""
    (root / 'test').mkdir(parents=True)
    with wds.TarWriter(str(root / 'test' / '0.tar')) as writer:
        for shard in list_shards(corpus / 'val'):
            for key, members in iter_samples(shard):
                writer.write({'__key__': key, 'jpg': members['jpg'], 'txt': members['txt']})
    (root / 'test' / 'nshards.txt').write_text('1')
    (root / 'dataset_type.txt').write_text('retrieval')
    return root


def test_webdataset_retrieval_set(corpus, tmp_path):
    root = _wds_retrieval(corpus, tmp_path / 'wds_flickr8k')
    loaded = load(ModelSpec('diffclip-tiny'))
    metrics = benchmark.zero_shot_retrieval(loaded, 'wds/flickr8k', root, 'cpu', amp=False, batch_size=8, workers=0)
    assert set(metrics) == {f'{d}_retrieval_recall@{k}' for d in ('image', 'text') for k in (1, 5, 10)}
    for d in ('image', 'text'):
        assert 0 <= metrics[f'{d}_retrieval_recall@1'] <= metrics[f'{d}_retrieval_recall@5'] \
            <= metrics[f'{d}_retrieval_recall@10'] <= 100


@pytest.mark.parametrize('dataset, expected, how', [
    ('cifar10', 'cifar-10-batches-py', 'cifar-10-python.tar.gz'),
    ('wds/flickr30k', 'test/nshards.txt', 'clip-benchmark/wds_flickr30k'),
    ('imagenet-r', '.', 'imagenet-r.tar'),
])
def test_missing_local_copy_names_the_path_and_the_source(tmp_path, capsys, dataset, expected, how):
    root = tmp_path / 'data'
    root.mkdir()
    assert main(['--model', 'diffclip-tiny', '--dataset', dataset, '--dataset-root', f'{root}/{{dataset}}',
                 '--output', str(tmp_path / 'r.json')]) == 2
    err = capsys.readouterr().err
    name = dataset.replace('wds/', '')
    assert f'--dataset {dataset}: no local copy at {root / name / expected}'.rstrip('/.') in err
    assert how in err and 'nothing is downloaded' in err
    assert not (tmp_path / 'r.json').exists() and sorted(root.iterdir()) == []  # checked before any model or file


def test_no_dataset_root_and_unknown_dataset(tmp_path, capsys):
    assert main(['--model', 'diffclip-tiny', '--dataset', 'cifar10']) == 2
    assert 'pass --dataset-root' in capsys.readouterr().err
    assert main(['--model', 'diffclip-tiny', '--dataset', 'cifar11']) == 2
    assert 'not a dataset of this command' in capsys.readouterr().err


def test_linear_probe_needs_a_train_split_and_cuda():
    with pytest.raises(EvalError, match='no predefined train split.*wds/'):
        benchmark.train_split('sun397')
    if not torch.cuda.is_available():
        with pytest.raises(EvalError, match='CUDA only'):
            benchmark.linear_probe(None, 'dummy', None, 'cpu', amp=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason='CLIP_benchmark linear probe needs CUDA')
def test_dummy_linear_probe_on_cuda(tmp_path):
    out = tmp_path / 'r.json'
    assert main(['--model', 'diffclip-tiny', '--dataset', 'dummy', '--task', 'linear_probe', '--workers', '0',
                 '--force-image-size', '224', '--output', str(out)]) == 0
    rows = {r.metric: r.value for r in read_json(out)}
    assert rows['lp_acc1'] == 100.0  # one training image of one class, tested on itself
    assert json.loads(out.read_text())['settings']['device'] == 'cuda'
