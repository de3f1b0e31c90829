import json
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from diffzoo.data.__main__ import main as data_main
from diffzoo.data.download import DataError, card_names, command_line, img2dataset_arguments, load_card
from diffzoo.data.url_list import describe, prepare_url_list
from diffzoo.data.shards import iter_samples
from tests.factory import call, http_server, run, serve_dataset


def test_cards_ship_with_the_package_and_match_the_paper_preprocessing():
    assert {'cc3m', 'cc12m'} <= set(card_names())
    cc3m, cc12m = load_card('cc3m'), load_card('cc12m')
    assert cc3m.columns == ['caption', 'url'] and cc12m.columns == ['url', 'caption']
    for card in (cc3m, cc12m):
        assert card.img2dataset['image_size'] == 224 and card.img2dataset['resize_mode'] == 'keep_ratio'
        assert card.img2dataset['output_format'] == 'webdataset'
        assert card.img2dataset['incremental_mode'] == 'incremental'


CARD = {'name': 'mine', 'title': 'My pairs', 'source': 'https://example.org', 'columns': ['url', 'caption'],
        'expected': {}, 'img2dataset': {'input_format': 'tsv', 'url_col': 'url', 'caption_col': 'caption'}}


@pytest.mark.parametrize('change, problem', [
    (dict(expected=None), 'no `expected` key (figures to compare a download with: urls: N, downloaded: [LOW, HIGH]; '
                          '{} when there are none)'),
    (dict(expected=None, source=None), 'no `source` key (where the URL list is published (a URL)); no `expected` key'),
    (dict(expect={}), 'unknown key expect; a card\'s keys are name, title, source, img2dataset, expected, columns, '
                      'file, shards'),
    (dict(img2dataset={'input_format': 'tsv', 'url_col': 'url'}), '`img2dataset` has no caption_col (the names of '
                                                                   'the URL and caption columns)'),
    (dict(columns=['caption', 'link']), "`columns` ['caption', 'link'] lacks url, which `img2dataset` names"),
    (dict(expected=[1, 2]), '`expected` is [1, 2], not a mapping'),
])
def test_a_card_missing_a_key_or_with_a_wrong_one_is_named(tmp_path, change, problem):
    card = {k: v for k, v in {**CARD, **change}.items() if v is not None}
    (tmp_path / 'mine.yaml').write_text(yaml.safe_dump(card, sort_keys=False))
    (tmp_path / 'list.tsv').write_text('http://x/1.jpg\ta dog\n')
    result = call(data_main, ['download', 'mine.yaml', 'list.tsv', 'out'], cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith(f'error: dataset card mine.yaml: {problem}')
    assert result.stderr.rstrip().endswith('. Fix the card (data/cc3m.yaml is one to follow)')
    assert not (tmp_path / 'out').exists()


def test_a_card_that_is_not_a_mapping_or_not_there_is_named(tmp_path):
    (tmp_path / 'empty.yaml').write_text('')
    with pytest.raises(DataError, match='dataset card .*empty.yaml: holds nothing, not the keys of a card'):
        load_card(str(tmp_path / 'empty.yaml'))
    with pytest.raises(DataError, match='dataset card .*gone.yaml: No such file or directory'):
        load_card(str(tmp_path / 'gone.yaml'))


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
def test_the_list_is_handed_on_as_parquet_in_the_dataset_column_order(tmp_path, dataset, line):
    tsv = tmp_path / 'in.tsv'
    tsv.write_text(line + '\n')
    card = load_card(dataset)
    out = prepare_url_list(card, tsv, tmp_path / 'out')
    assert (out.input_format, out.rows, out.left_out) == ('parquet', 1, 0)
    table = pq.read_table(out.path)
    assert table.column_names == card.columns and table.to_pylist() == [dict(zip(card.columns, line.split('\t')))]
    written = out.path.stat().st_mtime_ns
    again = prepare_url_list(card, tsv, tmp_path / 'out')
    assert again == out and out.path.stat().st_mtime_ns == written  # reused, not rewritten


def test_a_file_with_its_own_header_keeps_its_column_order(tmp_path):
    tsv = tmp_path / 'failed.tsv'
    tsv.write_text('url\tcaption\nhttp://x/1.jpg\ta dog\n')
    out = prepare_url_list(load_card('cc3m'), tsv, tmp_path / 'out')
    assert pq.read_table(out.path).to_pylist() == [{'url': 'http://x/1.jpg', 'caption': 'a dog'}]
    assert (out.rows, out.left_out) == (1, 0)


QUOTED = ['"Best" photo of a dog', '"an open quote never closed', '"', '""', '"quoted" then "again"',
          '" ends with a quote"']


def test_captions_starting_with_a_quote_are_kept_as_they_are(tmp_path):
    """pyarrow's CSV reader, img2dataset's, strips such quotes or runs on to the next `"` over the rows between."""
    tsv = tmp_path / 'cc3m.tsv'
    rows = [(caption, f'http://x/{i}.jpg') for i, caption in enumerate(QUOTED + ['a plain "cat"'])]
    tsv.write_text(''.join(f'{c}\t{u}\n' for c, u in rows))
    out = prepare_url_list(load_card('cc3m'), tsv, tmp_path / 'out')
    assert pq.read_table(out.path).to_pylist() == [{'caption': c, 'url': u} for c, u in rows]


def test_every_row_that_cannot_be_downloaded_is_named_by_line_and_left_out(tmp_path):
    lines = [b'a dog\thttp://x/1.jpg', b'a caption and no url', b'three\thttp://x/3.jpg\tcolumns',
             b'ftp\tftp://x/4.jpg', b'', b'no url\t', b'latin-1 caf\xe9\thttp://x/7.jpg',
             b'carriage\rreturn\thttp://x/8.jpg', b'a cat\thttp://x/9.jpg\r']
    tsv = tmp_path / 'cc3m.tsv'
    tsv.write_bytes(b'\n'.join(lines) + b'\n')
    out = prepare_url_list(load_card('cc3m'), tsv, tmp_path / 'out')
    assert pq.read_table(out.path).to_pylist() == [{'caption': 'a dog', 'url': 'http://x/1.jpg'},
                                                   {'caption': 'a cat', 'url': 'http://x/9.jpg'}]
    reasons = {2: '1 tab-separated field, expected 2 (caption <TAB> url)',
               3: '3 tab-separated fields, expected 2 (caption <TAB> url)',
               4: "the URL 'ftp://x/4.jpg' does not start with http:// or https://",
               5: 'a blank line', 6: 'no URL', 7: 'not UTF-8 (byte 0xe9 at byte 12 of the line)',
               8: 'a carriage return (\\r) inside the line'}
    assert (out.rows, out.left_out, out.kept) == (9, 7, 2)
    assert out.examples == list(reasons.items())
    recorded = out.left_out_file.read_bytes().split(b'\n')
    assert recorded[0] == b'line\treason\ttext' and recorded[-1] == b''
    assert recorded[1:-1] == [f'{n}\t{r}\t'.encode() + lines[n - 1] for n, r in reasons.items()]
    assert prepare_url_list(load_card('cc3m'), tsv, tmp_path / 'out') == out  # reused: the same report
    assert describe(out, 'cc3m.tsv')[:3] == [
        f'cc3m.tsv: 9 rows; 2 handed to img2dataset ({out.path}), 7 left out (every one in {out.left_out_file})',
        '  left out: cc3m.tsv, line 2: 1 tab-separated field, expected 2 (caption <TAB> url)',
        '  left out: cc3m.tsv, line 3: 3 tab-separated fields, expected 2 (caption <TAB> url)']


def test_a_list_with_no_row_to_download_is_refused(tmp_path):
    tsv = tmp_path / 'cc3m.tsv'
    tsv.write_text('a dog\thttp://x/1.jpg\textra\n')
    with pytest.raises(DataError, match='line 1 has 3 tab-separated fields; cc3m expects 2'):
        prepare_url_list(load_card('cc3m'), tsv, tmp_path / 'out')
    tsv.write_text('url\tcaption\n\tno url\n')
    with pytest.raises(DataError, match=r'none of its 1 rows can be downloaded \(line 2: no URL\)'):
        prepare_url_list(load_card('cc3m'), tsv, tmp_path / 'out')
    tsv.write_text('a\rdog\thttp://x/1.jpg\n')
    with pytest.raises(DataError, match=r'line 1 holds a carriage return \(\\r\) inside the line; it must be a '
                                        r'header or a row of the list'):
        prepare_url_list(load_card('cc3m'), tsv, tmp_path / 'out')
    assert list((tmp_path / 'out' / '_url_list').iterdir()) == []


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


@pytest.mark.slow
def test_download_keeps_quoted_captions_and_names_the_rows_it_leaves_out(tmp_path):
    """`python -m diffzoo.data download cc3m` on a list with six captions that start with `"` and rows of 1 and 3
    columns, against a real HTTP server. img2dataset alone merged the quoted rows (six rows, four samples, one caption
    holding three rows) and stopped at the first row of 1 or 3 columns (`Expected 2 columns, got 1`)."""
    serve_dataset(tmp_path / 'www', 8, missing=1, corrupt=0)
    with http_server(tmp_path / 'www') as base:
        lines = [f'{QUOTED[0]}\t{base}/img_000.jpg', f'{QUOTED[1]}\t{base}/img_001.jpg',
                 f'a plain cat\t{base}/img_002.jpg', 'a caption and no url', f'{QUOTED[2]}\t{base}/img_003.jpg',
                 f'three\t{base}/img_004.jpg\tcolumns',
                 f'{QUOTED[3]}\t{base}/img_005.jpg', f'a picture that is gone\t{base}/gone_0.jpg',
                 f'{QUOTED[4]}\t{base}/img_006.jpg', f'{QUOTED[5]}\t{base}/img_007.jpg']
        (tmp_path / 'cc3m.tsv').write_text(''.join(line + '\n' for line in lines))
        result = run([sys.executable, '-m', 'diffzoo.data', 'download', 'cc3m', 'cc3m.tsv', 'out',
                      '--processes', '1', '--threads', '2'], cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    left_out = tmp_path / 'out' / '_url_list' / 'cc3m.left_out.tsv'
    assert result.stdout.splitlines()[:3] == [
        f'cc3m.tsv: 10 rows; 8 handed to img2dataset ({tmp_path / "out" / "_url_list" / "cc3m.parquet"}), '
        f'2 left out (every one in {left_out})',
        '  left out: cc3m.tsv, line 4: 1 tab-separated field, expected 2 (caption <TAB> url)',
        '  left out: cc3m.tsv, line 6: 3 tab-separated fields, expected 2 (caption <TAB> url)']
    assert '  img2dataset: 8 URLs in 1 shards, 7 downloaded, 1 failed' in result.stdout
    assert f'  cc3m.tsv: 10 rows, 2 left out ({left_out})' in result.stdout
    assert left_out.read_text().splitlines()[1:] == [
        '4\t1 tab-separated field, expected 2 (caption <TAB> url)\ta caption and no url',
        f'6\t3 tab-separated fields, expected 2 (caption <TAB> url)\t{lines[5]}']
    samples = {}
    for _, members in iter_samples(tmp_path / 'out' / '00000.tar'):
        meta = json.loads(members['json'])
        samples[meta['url']] = members['txt'].decode()
        assert meta['caption'] == samples[meta['url']]
    expected = dict(reversed(line.split('\t')) for line in lines if line.count('\t') == 1 and '/gone_' not in line)
    assert samples == expected and len(samples) == 7
    assert [samples[f'{base}/img_{i:03d}.jpg'] for i in (0, 1, 3, 5, 6, 7)] == QUOTED
    assert json.loads((tmp_path / 'out' / 'sizes.json').read_text()) == {'00000.tar': 7}
