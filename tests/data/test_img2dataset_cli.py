"""Shards made by img2dataset's own command, as its README downloads CC3M (a header added to the TSV, `img2dataset
--url_list cc3m.tsv --input_format tsv --url_col url --caption_col caption --output_format webdataset …`), against a
real HTTP server: no sizes.json, and one caption that starts with `"` and no closing quote, which img2dataset's TSV
reader runs on over the rows after it."""
import json
import re
import shutil
import sys
from pathlib import Path

import pytest

from diffzoo.data.__main__ import main as data_main
from diffzoo.train.launch import main as train_main
from diffzoo.train.recipe import RecipeError, load_recipe, resolve
from tests.factory import call, http_server, run, serve_dataset

pytestmark = pytest.mark.slow  # img2dataset's own command, a training

IMAGES, PER_SHARD = 12, 4
OPEN_QUOTE = 3  # the row whose caption opens a quote; the next row and the one after it end up in its caption


@pytest.fixture(scope='module')
def cli_shards(tmp_path_factory):
    """(the shard directory img2dataset's command wrote, the captions the list gave)."""
    root = tmp_path_factory.mktemp('img2dataset_cli')
    rows = serve_dataset(root / 'www', IMAGES, missing=0, corrupt=0)
    captions = [caption for caption, _ in rows]
    captions[OPEN_QUOTE] = '"an open quote never closed'
    captions[OPEN_QUOTE + 2] = 'a cat "on" a mat'
    with http_server(root / 'www') as base:
        (root / 'cc3m.tsv').write_text('caption\turl\n' + ''.join(
            f'{caption}\t{base}{path}\n' for caption, (_, path) in zip(captions, rows)))
        result = run([str(Path(sys.executable).parent / 'img2dataset'), '--url_list', 'cc3m.tsv', '--input_format',
                      'tsv', '--url_col', 'url', '--caption_col', 'caption', '--output_format', 'webdataset',
                      '--output_folder', 'cc3m', '--processes_count', '1', '--thread_count', '4', '--image_size', '64',
                      '--number_sample_per_shard', str(PER_SHARD), '--enable_wandb', 'False'], cwd=root)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    shards = root / 'cc3m'
    assert sorted(p.name for p in shards.glob('*_stats.json')) == ['00000_stats.json', '00001_stats.json',
                                                                     '00002_stats.json']
    assert not (shards / 'sizes.json').exists()
    return shards, captions


def copy_of(cli_shards, tmp_path) -> Path:
    return Path(shutil.copytree(cli_shards[0], tmp_path / 'cc3m'))


def test_check_names_the_caption_that_holds_other_rows(cli_shards, tmp_path):
    """img2dataset made 10 samples of 12 rows; `sizes` agrees with the tars, so only the merge is left to see."""
    shards = copy_of(cli_shards, tmp_path)
    assert call(data_main, ['sizes', shards], cwd=tmp_path).returncode == 0
    result = call(data_main, ['check', shards, '--workers', '1'], cwd=tmp_path)
    assert result.returncode == 1, result.stdout
    assert re.search(r'captions holding other rows +1\n', result.stdout)
    problems = [line.strip() for line in result.stdout.splitlines() if line.startswith('  000')]
    assert problems == [
        '00000.tar: 1 captions hold other rows of the URL list, a tab or line break and then a URL (000003): '
        'img2dataset read a caption starting with " as a quoted field, and the rows it ran over were neither '
        'downloaded nor counted; download the list again into a new directory with python -m diffzoo.data download, '
        'which hands img2dataset every row as it is']


def test_training_sizes_its_epoch_from_img2dataset_stats(cli_shards, tmp_path):
    """No sizes.json: the recipe's checks and open_clip read the one written from the 3 _stats.json (10 samples)."""
    shards = copy_of(cli_shards, tmp_path)
    stats = [json.loads((shards / f'0000{i}_stats.json').read_text())['successes'] for i in range(3)]
    assert sum(stats) == IMAGES - 2
    result = call(train_main, ['--recipe', 'clip-tiny-baseline', '--train_data', 'cc3m', '--epochs', '1',
                               '--global_batch_size', '4', '--workers', '1'], cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.splitlines()[0] == (
        "no sizes.json in cc3m: wrote it from img2dataset's 3 *_stats.json (10 samples in 3 shards), "
        'as python -m diffzoo.data sizes does')
    assert json.loads((shards / 'sizes.json').read_text()) == {f'0000{i}.tar': n for i, n in enumerate(stats)}
    record = json.loads((tmp_path / 'runs' / 'clip-tiny-baseline' / 'data.jsonl').read_text().splitlines()[0])
    assert record['samples_readable'] == 10


def test_a_shard_img2dataset_did_not_finish_is_named(cli_shards, tmp_path):
    shards = copy_of(cli_shards, tmp_path)
    (shards / '00001_stats.json').unlink()
    with pytest.raises(RecipeError, match=r'no sizes.json in .*cc3m, and 1 of its 3 shards have no img2dataset '
                                          r'_stats.json to count them \(00001.tar\): img2dataset did not finish them'):
        resolve(dict(load_recipe('clip-tiny-baseline'), train_data=str(shards)), 'x', 1)
    assert not (shards / 'sizes.json').exists()
