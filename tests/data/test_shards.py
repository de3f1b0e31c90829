import argparse
import contextlib
import json
import os
import re
import shutil
import tarfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import webdataset as wds

from diffzoo.data.__main__ import main as data_main
from diffzoo.data.check import check_dataset
from diffzoo.data.retry import write_retry
from diffzoo.data.shards import DataError, list_shards, write_sizes
from tests.data.tars import rename_samples
from tests.factory import write_shards


def test_sizes_from_img2dataset_stats(tmp_path):
    write_shards(tmp_path, 2, 5, sizes=False)
    (tmp_path / '00000_stats.json').write_text(json.dumps({'count': 9, 'successes': 5}))
    (tmp_path / '00001_stats.json').write_text(json.dumps({'count': 8, 'successes': 5}))
    report = write_sizes(tmp_path)
    assert report.sizes == {'00000.tar': 5, '00001.tar': 5} and report.counted == []
    assert json.loads((tmp_path / 'sizes.json').read_text()) == report.sizes


def test_sizes_of_shards_made_without_img2dataset_are_counted(tmp_path):
    write_shards(tmp_path, 3, 5, corrupt={(1, 0)}, no_caption={(2, 1)}, sizes=False)
    report = write_sizes(tmp_path)
    assert report.sizes == {'00000.tar': 5, '00001.tar': 5, '00002.tar': 5}
    assert report.counted == ['00000.tar', '00001.tar', '00002.tar']


def test_open_clip_reads_the_sizes_we_write(tmp_path):
    from open_clip_train.data import get_dataset_size
    write_shards(tmp_path, 4, 3, sizes=False)
    write_sizes(tmp_path)
    assert get_dataset_size(str(tmp_path / '{00000..00003}.tar')) == (12, 4)


def test_check_passes_a_clean_dataset(tmp_path, capsys):
    write_shards(tmp_path, 2, 4)
    assert data_main(['check', str(tmp_path), '--workers', '2']) == 0
    assert 'OK' in capsys.readouterr().out


def test_check_reports_every_kind_of_damage_and_exits_nonzero(tmp_path, capsys):
    write_shards(tmp_path, 4, 6, corrupt={(0, 2)}, no_caption={(1, 0), (1, 3)}, empty={2})
    data = (tmp_path / '00003.tar').read_bytes()
    (tmp_path / '00003.tar').write_bytes(data[:len(data) // 2])  # truncated mid-sample
    report = check_dataset(tmp_path, workers=1, progress=None)
    by_name = {s.name: s for s in report.shards}
    assert by_name['00000.tar'].undecodable == ['000000002']
    assert by_name['00001.tar'].missing == {'caption': 2}
    assert by_name['00002.tar'].samples == 0
    assert by_name['00003.tar'].error is not None
    assert data_main(['check', str(tmp_path), '--workers', '1']) == 1
    out = capsys.readouterr().out
    assert '00000.tar: 1 undecodable images (000000002)' in out
    assert '00001.tar: no caption in 2 of 6 samples' in out
    assert '00002.tar: empty shard' in out
    assert '00003.tar: unreadable' in out


LATIN1_CAPTION = 'a red café sign'.encode('latin-1')  # b'caf\xe9': not UTF-8
BROKEN_JSON = b'{"caption": "a blue circle"'


def test_check_finds_captions_and_json_that_training_cannot_decode(tmp_path, capsys):
    write_shards(tmp_path, 2, 5, members={(0, 1): {'txt': LATIN1_CAPTION}, (1, 3): {'json': BROKEN_JSON}})
    report = check_dataset(tmp_path, workers=1, progress=None)
    by_name = {s.name: s for s in report.shards}
    assert by_name['00000.tar'].undecodable_text == [('000000001', '.txt is not UTF-8 (byte 0xe9 at offset 9)')]
    assert by_name['00001.tar'].undecodable_text == [
        ('000010003', ".json is not JSON (Expecting ',' delimiter: line 1 column 28)")]
    assert [(s.samples, s.usable) for s in report.shards] == [(5, 4), (5, 4)]
    assert data_main(['check', str(tmp_path), '--workers', '1', '--no-decode']) == 1
    out = capsys.readouterr().out
    assert '00000.tar: 1 undecodable captions or json, skipped in training (000000001: .txt is not UTF-8' in out
    assert '00001.tar: 1 undecodable captions or json, skipped in training (000010003: .json is not JSON' in out
    assert re.search(r'samples training uses +8\n', out) and re.search(r'samples +10\n', out)
    assert 'sizes.json counts' not in out  # sizes.json counts samples, as open_clip does


def test_check_skips_exactly_what_training_skips(tmp_path):
    from open_clip_train.data import get_wds_dataset
    from diffzoo.train import data_events, data_report, seams

    write_shards(tmp_path, 2, 6, corrupt={(0, 2)}, no_caption={(1, 0)},
                 members={(0, 4): {'txt': LATIN1_CAPTION}, (1, 2): {'json': BROKEN_JSON}, (1, 5): {'txt': b'  '}})
    report = check_dataset(tmp_path, workers=1, progress=None)
    checked = {('undecodable_image', k) for s in report.shards for k in s.undecodable}
    checked |= {('undecodable_text', k) for s in report.shards for k, _ in s.undecodable_text}
    args = argparse.Namespace(val_data=str(tmp_path / '{00000..00001}.tar'), val_num_samples=None, batch_size=4,
                              workers=0, world_size=1)
    with seams.installed():
        loader = get_wds_dataset(args, lambda image: image.size, is_train=False, tokenizer=lambda t: [t]).dataloader
        trained = sum(len(images) for images, _ in loader)
        skipped = data_report.collect(os.environ[data_events.ENV])['examples']
    assert checked | {('no_caption', '000010000'), ('no_caption', '000010005')} == {(r, k) for r, _, k in skipped}
    assert sum(s.usable for s in report.shards) == trained == 7
    assert sum(s.skipped for s in report.shards) == 5


@pytest.mark.parametrize('text, message', [
    ('{"00000.tar": 4, "00001.tar": ', 'is not JSON'),
    ('[4, 4]', 'holds a list'),
    ('{"00000.tar": 4, "00001.tar": 4.5}', "1 entries are not sample counts (first: '00001.tar': 4.5)"),
    ('{"00000.tar": "four", "00001.tar": 4}', "first: '00000.tar': 'four'"),
])
def test_check_refuses_a_malformed_sizes_json_before_reading_shards(tmp_path, capsys, text, message):
    write_shards(tmp_path, 2, 4)
    (tmp_path / 'sizes.json').write_text(text)
    (tmp_path / '00001.tar').write_bytes(b'not a tar')  # never read: sizes.json is refused first
    assert data_main(['check', str(tmp_path), '--workers', '1']) == 2
    captured = capsys.readouterr()
    assert 'checked' not in captured.out
    assert f'{tmp_path / "sizes.json"}' in captured.err and message in captured.err
    assert f'rewrite it with python -m diffzoo.data sizes {tmp_path}' in captured.err


def test_check_catches_stale_sizes_json(tmp_path, capsys):
    write_shards(tmp_path, 2, 4)
    (tmp_path / 'sizes.json').write_text(json.dumps({'00000.tar': 4, '00001.tar': 9}))
    assert data_main(['check', str(tmp_path), '--no-decode']) == 1
    assert (f'sizes.json counts 5 samples more than 1 shards hold (00001.tar: 9 in sizes.json, 4 in the tar): an epoch '
            f'asks for that many more samples and trains others twice to make them up; run python -m diffzoo.data '
            f'sizes {tmp_path} --recount') in capsys.readouterr().out


def test_check_counts_what_an_undercounting_sizes_json_leaves_out_and_recount_fixes_it(tmp_path, capsys):
    """3 shards of 6, a sample of shard 2 without its image (5 with one: what sizes.json counts); sizes.json says 2
    for shard 1 and 3 for shard 2, 6 samples fewer than they hold, and has no entry for shard 0."""
    write_shards(tmp_path, 3, 6)
    rename_samples(tmp_path / '00002.tar', {}, drop={'000020004.jpg'})
    (tmp_path / 'sizes.json').write_text(json.dumps({'00001.tar': 2, '00002.tar': 3}))
    assert data_main(['check', str(tmp_path), '--workers', '1', '--no-decode']) == 1
    out = capsys.readouterr().out
    assert re.search(r'samples in sizes.json +5\n', out)
    assert (f'sizes.json counts 6 samples fewer than 2 shards hold (00001.tar: 2 in sizes.json, 6 in the tar; '
            f'00002.tar: 3 in sizes.json, 5 in the tar): an epoch ends that many samples short, and part of the corpus '
            f'is never trained; run python -m diffzoo.data sizes {tmp_path} --recount') in out
    assert (f'sizes.json has no entry for 1 shards (00000.tar); run python -m diffzoo.data sizes {tmp_path} '
            f'--recount') in out
    assert data_main(['sizes', str(tmp_path), '--recount']) == 0
    assert data_main(['check', str(tmp_path), '--workers', '1', '--no-decode']) == 1  # the missing image remains
    out = capsys.readouterr().out
    assert 'sizes.json' not in out.split('problems')[-1] and 'no image in 1 of 6 samples' in out


def test_check_counts_each_sample_that_repeats_a_key_once(tmp_path, capsys):
    """Shard 1 holds key 000010001 three times (samples 1, 3 and 4), shard 3 is a copy of shard 0: 2 samples repeat
    a key of their own shard and 5 the keys of another; a key three times is two repeats, not three."""
    write_shards(tmp_path, 4, 5)
    rename_samples(tmp_path / '00001.tar', {'000010003': '000010001', '000010004': '000010001'})
    shutil.copy(tmp_path / '00000.tar', tmp_path / '00003.tar')
    report = check_dataset(tmp_path, workers=2, progress=None)
    by_name = {s.name: s for s in report.shards}
    assert by_name['00001.tar'].key_repeats == [(3, '000010001'), (4, '000010001')]
    assert (report.key_repeats_across, report.key_repeats) == (5, 7)
    assert report.key_repeat_examples[0] == ('000000000', ['00000.tar', '00003.tar'])
    assert data_main(['check', str(tmp_path), '--workers', '1', '--no-decode']) == 1
    out = capsys.readouterr().out
    assert re.search(r'samples repeating a key +7\n', out)
    assert ('00001.tar: 2 samples repeat the key of an earlier sample of the shard (000010001 at sample 3, 000010001 '
            'at sample 4); training trains each of them; re-create the shard with a key of its own for every '
            'sample') in out
    assert ('5 samples repeat the key of a sample of another shard (000000000 in 00000.tar and 00003.tar; 000000001 '
            'in 00000.tar and 00003.tar; 000000002 in 00000.tar and 00003.tar …); training trains each of them; '
            'delete a shard that is a copy of another, or re-create the shards with a key of their own for every '
            'sample') in out


def test_check_flags_members_named_to_leave_the_directory_and_nothing_extracts_them(tmp_path, commands):
    """A real `python -m diffzoo.data check` process, run two levels below the shards' parent, and webdataset's own
    reader (as training reads shards) over a shard whose members are named '../../escaped.*' and '<abs>/absolute.*':
    both read them in memory, nothing is written where the names point, and check names the shard and members."""
    write_shards(tmp_path / 'shards', 2, 3)
    absolute = tmp_path / 'absolute'
    rename_samples(tmp_path / 'shards' / '00001.tar', {'000010000': '../../escaped', '000010002': str(absolute)})
    cwd = tmp_path / 'a' / 'b'
    cwd.mkdir(parents=True)
    result = commands.run('diffzoo.data', ['check', tmp_path / 'shards', '--workers', '1'], cwd)
    assert result.returncode == 1, result.stdout + result.stderr
    assert re.search(r'members named to leave the dir +6\n', result.stdout)
    assert ("00001.tar: 6 members named to leave the directory they would be extracted into: '../../escaped.jpg' "
            "(a ../ component); '../../escaped.json' (a ../ component); '../../escaped.txt' (a ../ component) …; not "
            "written by img2dataset (nothing here extracts them: members are read in memory); re-create the shard"
            ) in result.stdout
    hostile = check_dataset(tmp_path / 'shards', workers=1, progress=None).shards[1].hostile
    assert [why for _, why in hostile] == ['a ../ component'] * 3 + ['an absolute path'] * 3
    assert hostile[3] == (f'{absolute}.jpg', 'an absolute path')
    with contextlib.chdir(cwd):
        keys = [s['__key__'] for s in wds.DataPipeline(wds.SimpleShardList(str(tmp_path / 'shards' / '00001.tar')),
                                                       wds.tarfile_to_samples())]
    assert keys == ['../../escaped', '000010001', str(absolute)]
    assert sorted(p.name for p in tmp_path.rglob('*') if p.is_file()) == [
        '00000.tar', '00001.tar', 'sizes.json']  # no escaped.* nor absolute.*


def test_check_finds_captions_holding_other_rows_of_either_layout(tmp_path):
    """A CC12M caption (url <TAB> caption) opening a quote runs on over a line break into the next row's URL; a CC3M
    one (caption <TAB> url) over a tab (tests/data/test_img2dataset_cli.py makes that one with img2dataset itself).
    A URL within a caption, or a line break before words, is no sign of it."""
    merged = {(0, 1): {'txt': b'a dog\nhttp://x/2.jpg\ta cat'}, (0, 2): {'txt': b'a dog\tHTTPS://x/2.jpg\na cat'},
              (1, 0): {'txt': b'see http://x/1.jpg for more'}, (1, 1): {'txt': b'two lines\nof caption'}}
    write_shards(tmp_path, 2, 3, members=merged)
    report = check_dataset(tmp_path, workers=1, progress=None)
    assert [s.merged for s in report.shards] == [['000000001', '000000002'], []]
    assert [p.split(' (')[0] for p in report.problems()] == [
        '00000.tar: 2 captions hold other rows of the URL list, a tab or line break and then a URL']


@pytest.mark.parametrize('make, message', [
    (lambda p: p / 'nope', 'does not exist'),
    (lambda p: p, 'no *.tar shards'),
])
def test_unusable_directories_name_the_fix(tmp_path, make, message, capsys):
    with pytest.raises(DataError, match='shard|does not exist'):
        list_shards(make(tmp_path))
    assert data_main(['sizes', str(make(tmp_path))]) == 2
    assert message in capsys.readouterr().err


def _parquet(path, rows, finished=True):
    pq.write_table(pa.Table.from_pylist(rows), path)
    if finished:  # img2dataset writes a shard's stats when it has finished it
        path.with_name(f'{path.stem}_stats.json').write_text(json.dumps({'count': len(rows)}))


def test_retry_lists_failures_once_and_skips_urls_that_succeeded_later(tmp_path, capsys):
    row = lambda url, status, err=None: {'url': url, 'caption': f'caption\tof {url}', 'status': status,
                                         'error_message': err}
    _parquet(tmp_path / '00000.parquet', [row('http://a/1', 'success'), row('http://a/2', 'failed_to_download',
                                          'HTTP Error 404: Not Found'), row('http://a/3', 'failed_to_download', 'timeout')])
    _parquet(tmp_path / '00001.parquet', [row('http://a/4', 'failed_to_resize', 'Image decoding error'),
                                          row('http://a/3', 'success')])
    out = tmp_path / 'failed.tsv'
    report = write_retry(tmp_path, out, exclude=['404'])
    lines = out.read_text().splitlines()
    assert lines[0] == 'url\tcaption'
    assert lines[1:] == ['http://a/4\tcaption of http://a/4']
    assert (report.failed, report.written, report.excluded) == (2, 1, 1)
    assert data_main(['retry', str(tmp_path), str(out)]) == 0
    assert '2 failed URLs' in capsys.readouterr().out
    assert len(out.read_text().splitlines()) == 3


def test_retry_leaves_unfinished_shards_to_the_download_script(tmp_path, capsys):
    row = {'url': 'http://a/1', 'caption': 'a', 'status': 'failed_to_download', 'error_message': 'timeout'}
    _parquet(tmp_path / '00000.parquet', [row])
    (tmp_path / '00001.parquet').write_bytes(b'PAR1 cut short')  # img2dataset was killed while writing it
    assert data_main(['retry', str(tmp_path), str(tmp_path / 'failed.tsv')]) == 0
    out = capsys.readouterr().out
    assert '1 failed URLs' in out and '1 shards are unfinished (no _stats.json; 00001.tar)' in out
    (tmp_path / '00001_stats.json').write_text('{}')  # finished, then damaged: named, not a pyarrow traceback
    assert data_main(['retry', str(tmp_path), str(tmp_path / 'failed.tsv')]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f'error: {tmp_path / "00001.parquet"}: not a readable parquet file (') and 'Traceback' not in err


def test_sizes_refuses_shards_img2dataset_did_not_finish(tmp_path, capsys):
    write_shards(tmp_path, 2, 4, sizes=False)
    (tmp_path / '00000_stats.json').write_text(json.dumps({'successes': 4}))
    assert data_main(['sizes', str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert 'no _stats.json, so img2dataset did not finish them (00001.tar)' in err and 're-run the download' in err
    assert not (tmp_path / 'sizes.json').exists()
    assert data_main(['sizes', str(tmp_path), '--recount']) == 0
    assert json.loads((tmp_path / 'sizes.json').read_text()) == {'00000.tar': 4, '00001.tar': 4}


def test_sizes_names_a_stats_file_cut_short(tmp_path, capsys):
    write_shards(tmp_path, 2, 4, sizes=False)
    (tmp_path / '00000_stats.json').write_text(json.dumps({'successes': 4}))
    (tmp_path / '00001_stats.json').write_text('{"count": 4, "succ')  # img2dataset was killed while writing it
    assert data_main(['sizes', str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f'{tmp_path / "00001_stats.json"} is not JSON (' in err and 'delete it and its shard, then re-run' in err
    for stats, why in (({'successes': -3}, 'successes -3 is not a sample count'),
                       ({'successes': None}, 'successes None is not a sample count'),
                       (5, 'holds a JSON int, not img2dataset\'s statistics')):
        (tmp_path / '00001_stats.json').write_text(json.dumps(stats))
        assert data_main(['sizes', str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f'error: {tmp_path / "00001_stats.json"}') and why in err and '--recount' in err
    assert not (tmp_path / 'sizes.json').exists()


def test_sizes_names_a_truncated_shard(tmp_path, capsys):
    write_shards(tmp_path, 2, 4, sizes=False)
    data = (tmp_path / '00001.tar').read_bytes()
    (tmp_path / '00001.tar').write_bytes(data[:len(data) // 2 + 100])
    assert data_main(['sizes', str(tmp_path)]) == 2
    assert '00001.tar: unreadable' in capsys.readouterr().err


def test_shards_of_img2dataset_layout_read_with_webdataset_keys(tmp_path):
    write_shards(tmp_path, 1, 3)
    with tarfile.open(tmp_path / '00000.tar') as tar:
        names = tar.getnames()
    assert names[:3] == ['000000000.jpg', '000000000.json', '000000000.txt']
