"""An epoch trains every readable sample, on both data backends: real shards (written here, or downloaded by
img2dataset from a server on 127.0.0.1) through `python -m diffzoo.train` (its `main` in this process), one epoch of
the tiny recipe. The stages themselves, on shards read without training: tests/train/test_data_events.py."""
import io
import json
import sys

import pytest

from diffzoo.train.launch import main as train_main
from tests.factory import call, http_server, run, sample, serve_dataset, write_shards

pytestmark = pytest.mark.slow  # trainings, and a download
BACKENDS = ('open_clip', 'device')
KEYS = ('samples_trained', 'samples_distinct', 'samples_repeated', 'samples_readable', 'samples_untrained',
        'all_shards_read', 'skipped')


def _train(root, backend: str, batch: int):
    """One epoch of clip-tiny-baseline on root/shards: (data.jsonl's record, out.log)."""
    result = call(train_main, ['--recipe', 'clip-tiny-baseline', '--train_data', 'shards', '--epochs', '1',
                               '--global_batch_size', str(batch), '--data_backend', backend, '--name', backend],
                  cwd=root)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run_dir = root / 'runs' / backend
    return json.loads((run_dir / 'data.jsonl').read_text()), (run_dir / 'out.log').read_text()


def test_one_jpeg_cut_in_half_leaves_every_other_sample_trained_once_on_both_backends(tmp_path):
    """2 shards of 16, one JPEG cut in half, batches of 8: 4 batches, 31 readable samples. Each backend trains all 31
    and one again to make the fourth batch whole (the worker's pass goes on into its next; on the device, the
    training process fills the place of the image it could not decode), names the cut one, and warns of nothing
    (sizes.json counts the samples with an image, as the shards hold them: `sizes --recount` would write it again
    as it is)."""
    image = io.BytesIO()
    sample(0)[0].save(image, 'JPEG')
    write_shards(tmp_path / 'shards', 2, 16, members={(1, 5): {'jpg': image.getvalue()[:len(image.getvalue()) // 2]}})
    for backend in BACKENDS:
        record, log = _train(tmp_path, backend, 8)
        assert [record[k] for k in KEYS] == [32, 31, 1, 31, 0, True, {'undecodable_image': 1}], backend
        assert [(reason, key) for reason, _, key in record['examples']] == [('undecodable_image', '000010005')]
        assert ('epoch 1 data: 32 samples trained (31 distinct, 1 repeat: trained again in the same epoch, '
            'to fill the whole batches open_clip_train makes of each data-loader worker\'s share)' in log)
        assert 'not trained' not in log and '--recount' not in log and 'each sample is trained' not in log


def test_img2dataset_shards_of_60_images_in_batches_of_32_train_all_60_on_both_backends(tmp_path):
    """60 images served over HTTP, downloaded by `python -m diffzoo.data download cc3m` (img2dataset: one shard of
    60), batches of 32: 2 batches, so all 60 and 4 again, with no warning; open_clip_train alone trains 32 twice and
    never the other 28."""
    rows = serve_dataset(tmp_path / 'www', 60, missing=0, corrupt=0)
    with http_server(tmp_path / 'www') as base:
        (tmp_path / 'cc3m.tsv').write_text(''.join(f'{caption}\t{base}{path}\n' for caption, path in rows))
        download = run([sys.executable, '-m', 'diffzoo.data', 'download', 'cc3m', 'cc3m.tsv', 'shards',
                        '--processes', '1', '--threads', '4'], cwd=tmp_path)
    assert download.returncode == 0, download.stdout[-2000:] + download.stderr[-2000:]
    assert json.loads((tmp_path / 'shards' / 'sizes.json').read_text()) == {'00000.tar': 60}
    for backend in BACKENDS:
        record, log = _train(tmp_path, backend, 32)
        assert [record[k] for k in KEYS] == [64, 60, 4, 60, 0, True, {}], backend
        assert 'epoch 1 data: 64 samples trained (60 distinct, 4 repeats' in log
        assert 'WARNING | each sample' not in log and 'not trained' not in log
