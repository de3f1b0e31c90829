import json
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from diffzoo.data.download import DataError, card_names, command_line, img2dataset_arguments, load_card, \
    prepare_url_list
from tests.factory import http_server, run, serve_dataset


def test_cards_ship_with_the_package_and_match_the_paper_preprocessing():
    assert {'cc3m', 'cc12m'} <= set(card_names())
    cc3m, cc12m = load_card('cc3m'), load_card('cc12m')
    assert cc3m.columns == ['caption', 'url'] and cc12m.columns == ['url', 'caption']
    for card in (cc3m, cc12m):
        assert card.img2dataset['image_size'] == 224 and card.img2dataset['resize_mode'] == 'keep_ratio'
        assert card.img2dataset['output_format'] == 'webdataset'
        assert card.img2dataset['incremental_mode'] == 'incremental'


def test_img2dataset_accepts_every_card_argument():
    import inspect
    from img2dataset import download
    accepted = set(inspect.signature(download).parameters)
    for name in card_names():
        args = img2dataset_arguments(load_card(name), 'urls.tsv', 'out', 2, 8, wandb=False)
        assert set(args) <= accepted, set(args) - accepted
        assert args['enable_wandb'] is False
    assert '--resize_mode keep_ratio' in command_line(args)


@pytest.mark.parametrize('dataset, line', [('cc3m', 'a dog\thttp://x/1.jpg'), ('cc12m', 'http://x/1.jpg\ta dog')])
def test_header_is_added_in_the_dataset_column_order(tmp_path, dataset, line):
    tsv = tmp_path / 'in.tsv'
    tsv.write_text(line + '\n')
    card = load_card(dataset)
    out = prepare_url_list(card, tsv, tmp_path / 'out')
    assert out.read_text().splitlines() == ['\t'.join(card.columns), line]
    assert prepare_url_list(card, tsv, tmp_path / 'out') == out  # reused, not rewritten


def test_a_file_with_its_own_header_is_copied_as_is(tmp_path):
    tsv = tmp_path / 'failed.tsv'
    tsv.write_text('url\tcaption\nhttp://x/1.jpg\ta dog\n')
    out = prepare_url_list(load_card('cc3m'), tsv, tmp_path / 'out')
    assert out.read_text() == tsv.read_text()


def test_the_wrong_dataset_file_is_refused_with_the_reason(tmp_path):
    tsv = tmp_path / 'cc12m.tsv'
    tsv.write_text('http://x/1.jpg\ta dog\n')
    with pytest.raises(DataError, match='column 2 of the first line is not a URL.*URL is in column 1'):
        prepare_url_list(load_card('cc3m'), tsv, tmp_path / 'out')
    with pytest.raises(DataError, match='not found'):
        prepare_url_list(load_card('cc3m'), tmp_path / 'missing.tsv', tmp_path / 'out')


@pytest.mark.slow
def test_a_card_without_columns_downloads_a_parquet_list_as_it_is(tmp_path):
    """LAION-400M and DataComp publish parquet metadata with named columns; a card for them has no `columns`."""
    rows = serve_dataset(tmp_path / 'www', 6, missing=1, corrupt=0)
    card = {'name': 'laion-like', 'title': 'parquet metadata', 'source': 'https://example.org', 'expected': {},
            'img2dataset': {'input_format': 'parquet', 'url_col': 'URL', 'caption_col': 'TEXT',
                            'output_format': 'webdataset', 'image_size': 64, 'resize_mode': 'keep_ratio',
                            'number_sample_per_shard': 4, 'incremental_mode': 'incremental'}}
    (tmp_path / 'laion-like.yaml').write_text(yaml.safe_dump(card))
    with http_server(tmp_path / 'www') as base:
        pq.write_table(pa.Table.from_pylist([{'URL': base + path, 'TEXT': text} for text, path in rows]),
                       tmp_path / 'meta.parquet')
        result = run([sys.executable, '-m', 'diffzoo.data', 'download', 'laion-like.yaml', 'meta.parquet', 'out',
                      '--processes', '1', '--threads', '2'], cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert json.loads((tmp_path / 'out' / 'sizes.json').read_text()) == {'00000.tar': 3, '00001.tar': 3}
    assert '2 shards, 6 samples' in result.stdout and 'ends with about' not in result.stdout
    assert not (tmp_path / 'out' / '_url_list').exists()
