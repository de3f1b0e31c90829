"""The counting pipeline stages on real shards, read by open_clip_train's pipeline order without training."""
import argparse
import json

import pytest
import torch
import webdataset as wds

from diffzoo.data.__main__ import main as data_main
from diffzoo.train import data_events, data_report, data_stages
from diffzoo.train.launch import main as train_main
from tests.factory import call, write_shards


def _pipeline(urls, batches: int, batch_size: int):
    """open_clip_train's training stages (no shuffles) as diffzoo.train.seams installs them; an epoch of `batches`."""
    counting = data_stages.CountingWebdataset(wds)
    return counting.DataPipeline(
        wds.SimpleShardList(urls), data_events.tarfile_to_samples_nothrow,
        wds.select(data_events.filter_no_caption_or_no_image), wds.decode('pilrgb', handler=data_events.log_and_continue),
        wds.rename(image='jpg', text='txt'), wds.map_dict(image=lambda image: image.size),
        counting.to_tuple('image', 'text'), counting.batched(batch_size, partial=False)).with_epoch(batches)


def _epoch(events, urls, epoch: int, batches: int, batch_size: int = 4) -> dict:
    data_report.start_epoch(events, epoch)
    trained = sum(len(images) for images, _ in _pipeline(urls, batches, batch_size))
    rank = data_report.collect(events, epoch)
    assert rank['trained'] == trained
    return rank


def test_a_wrapped_epoch_counts_distinct_samples_and_calls_the_rest_repeats(tmp_path, monkeypatch):
    """3 shards of 4 with 2 caption-less samples and a corrupt JPEG: 9 readable. Batches of 4 carry on across the
    ends of the worker's passes: 5 batches = 2 whole passes (2 × 9 trained) + 2 samples of a third (a third pass's
    sample read ahead, a bad one met on the way)."""
    write_shards(tmp_path / 'shards', 3, 4, no_caption={(0, 1), (2, 3)}, corrupt={(1, 0)})
    urls = [str(tmp_path / 'shards' / f'{i:05d}.tar') for i in range(3)]
    monkeypatch.setenv(data_events.ENV, str(tmp_path / 'events'))
    (tmp_path / 'events').mkdir()
    for epoch in range(2):  # the second epoch starts afresh: same counts, not twice them
        record = data_report.epoch_record(epoch + 1, [_epoch(tmp_path / 'events', urls, epoch, batches=5)])
        assert (record['samples_trained'], record['samples_distinct'], record['samples_repeated']) == (20, 9, 11)
        assert record['samples_readable'] == 9 and record['all_shards_read'] and record['samples_untrained'] == 0
        assert record['samples_read'] == 12 + 12 + 4
        assert record['skipped'] == {'no_caption': 2, 'undecodable_image': 1}
        assert record['skip_events'] == {'no_caption': 5, 'undecodable_image': 2}
        assert [(r, k) for r, _, k in record['examples']] == [
            ('no_caption', '000000001'), ('undecodable_image', '000010000'), ('no_caption', '000020003')]
    text = data_report.summary(record)
    assert text.startswith('epoch 2 data: 20 samples trained (9 distinct, 11 repeats: trained again in the same '
                           'epoch, to fill the whole batches open_clip_train makes of each data-loader worker\'s '
                           'share), from 3 shards read by 1 process(es)')
    assert '  skipped 2 without caption, met 5 times (3 repeats) (00000.tar/000000001, 00002.tar/000020003)' in text
    assert '  skipped 1 undecodable image, met 2 times (1 repeat) (00001.tar/000010000)' in text
    assert 'not trained' not in text
    args = argparse.Namespace(train_num_samples=20, dataset_resampled=False)
    assert data_report.repeat_warning(record, args) == (
        '--train-num-samples 20 asks for more samples than the shards hold (12 with an image, 9 readable): each '
        'sample is trained ~2.2× per epoch (11 repeats in epoch 2); pass --train-num-samples 9')
    assert data_report.repeat_warning(record, argparse.Namespace(train_num_samples=12, dataset_resampled=False)) is None
    assert data_report.repeat_warning(record, argparse.Namespace(train_num_samples=20, dataset_resampled=True)) is None


def test_an_epoch_rounded_up_to_whole_batches_trains_every_sample_without_a_warning(tmp_path, monkeypatch):
    """3 clean shards of 4, declared 12, batches of 5, one worker: open_clip's epoch is 3 batches (15 samples); the
    third batch is the pass's last 2 samples and the next pass's first 3: every sample trained, 3 repeats, whatever
    the shards (as the demo corpus's 400 samples in batches of 32). The summary counts them; no warning, which
    nothing but --train-num-samples 10 would answer."""
    write_shards(tmp_path / 'shards', 3, 4)
    urls = [str(tmp_path / 'shards' / f'{i:05d}.tar') for i in range(3)]
    monkeypatch.setenv(data_events.ENV, str(tmp_path / 'events'))
    (tmp_path / 'events').mkdir()
    record = data_report.epoch_record(1, [_epoch(tmp_path / 'events', urls, 0, batches=3, batch_size=5)])
    assert (record['samples_trained'], record['samples_distinct'], record['samples_repeated']) == (15, 12, 3)
    assert record['samples_readable'] == 12 and record['all_shards_read'] and record['samples_untrained'] == 0
    assert '15 samples trained (12 distinct, 3 repeats' in data_report.summary(record)
    args = argparse.Namespace(train_num_samples=12, dataset_resampled=False, workers=1, batch_size=5)
    assert data_report.repeat_warning(record, args) is None and data_report.untrained_warning(record, args) is None


def test_ranks_that_read_the_same_shard_count_its_samples_and_shards_once(tmp_path, monkeypatch):
    """As with --dataset-resampled: rank 0 reads shards 3 (empty), 0, 1 and rank 1 shards 3, 1, 2, a batch of 7 each;
    shard 1 holds a sample without caption. The union: 11 distinct samples, shard 1's 3 readable ones trained twice,
    one bad sample and one empty shard, each met twice."""
    write_shards(tmp_path / 'shards', 4, 4, no_caption={(1, 2)}, empty={3})
    urls = [str(tmp_path / 'shards' / f'{i:05d}.tar') for i in range(4)]
    ranks = []
    for rank, shards in enumerate(([urls[3], urls[0], urls[1]], [urls[3], urls[1], urls[2]])):
        monkeypatch.setenv(data_events.ENV, str(tmp_path / f'events{rank}'))
        (tmp_path / f'events{rank}').mkdir()
        ranks.append(_epoch(tmp_path / f'events{rank}', shards, 0, batches=1, batch_size=7))
    record = data_report.epoch_record(1, ranks)
    assert [r['samples_trained'] for r in record['ranks']] == [7, 7]
    assert (record['samples_trained'], record['samples_distinct'], record['samples_repeated']) == (14, 11, 3)
    assert record['skipped'] == {'empty_shard': 1, 'no_caption': 1}
    assert record['skip_events'] == {'empty_shard': 2, 'no_caption': 2}
    assert record['all_shards_read']  # each pass's end was read ahead of its batch
    assert data_report.repeat_warning(record, argparse.Namespace(train_num_samples=100, dataset_resampled=True)) is None
    assert 'skipped 1 empty shard, met 2 times (1 repeat) (00003.tar)' in data_report.summary(record)


def test_shards_split_unevenly_over_workers_leave_samples_untrained_and_the_warning_says_how_many(tmp_path,
                                                                                                 monkeypatch):
    """Two data-loader workers (processes of their own), 3 clean shards of 4, 2 batches of 3 per worker: worker 0
    reads shards 0 and 2 and the epoch ends before its pass does (shard 2's third sample read ahead, its fourth
    never reached); worker 1 trains shard 1 and 2 of its samples again. The record counts both exactly (the one not
    reached from sizes.json), and one warning says so and why."""
    write_shards(tmp_path / 'shards', 3, 4)
    urls = [str(tmp_path / 'shards' / f'{i:05d}.tar') for i in range(3)]
    events = tmp_path / 'events'
    events.mkdir()
    monkeypatch.setenv(data_events.ENV, str(events))
    data_report.start_epoch(events, 0)
    counting = data_stages.CountingWebdataset(wds)
    pipeline = counting.DataPipeline(
        wds.SimpleShardList(urls), wds.split_by_worker, data_events.tarfile_to_samples_nothrow,
        wds.select(data_events.filter_no_caption_or_no_image), wds.decode('pilrgb', handler=data_events.log_and_continue),
        wds.rename(image='jpg', text='txt'), wds.map_dict(image=lambda image: image.size),
        counting.to_tuple('image', 'text'), counting.batched(3, partial=False)).with_epoch(2)
    loader = torch.utils.data.DataLoader(pipeline, batch_size=None, num_workers=2, multiprocessing_context='fork')
    assert sum(len(images) for images, _ in loader) == 12
    rank = data_report.collect(events, 0)
    assert rank['processes'] == 2 and rank['trained'] == 12
    record = data_report.epoch_record(1, [rank], {f'{i:05d}.tar': 4 for i in range(3)}, urls)
    assert (record['samples_trained'], record['samples_distinct'], record['samples_repeated']) == (12, 10, 2)
    assert (record['samples_untrained'], record['samples_unreached']) == (1, 1)
    assert not record['all_shards_read']
    assert ('  2 readable samples not trained (1 read as a worker\'s share of the epoch ended, 1 in shards no '
            'data-loader worker read to their end, as sizes.json counts them)') in data_report.summary(record)
    args = argparse.Namespace(train_num_samples=None, train_data='::'.join(urls), dataset_resampled=False, workers=2)
    assert data_report.repeat_warning(record, args) is None
    assert data_report.untrained_warning(record, args) == (
        '2 readable samples not trained (1 read as a worker\'s share of the epoch ended, 1 in shards no data-loader '
        'worker read to their end, as sizes.json counts them) and 2 repeats in epoch 1: open_clip gives each of the '
        '2 data-loader worker(s): 2 per process × 1 process(es) an equal share of the epoch, and the shards of some '
        'hold more than their share (others less: they start theirs again), as shards of unequal sizes or a number '
        'of them that is not a multiple of 2 do; each epoch\'s shard order decides which samples are left out. Use '
        'shards of equal size, a multiple of 2 of them, or --dataset-resampled')


def test_the_journal_is_a_few_bytes_per_sample(tmp_path, monkeypatch):
    """Append-only: each batch adds a line of its own samples, whatever was trained before it."""
    write_shards(tmp_path / 'shards', 2, 8)
    urls = [str(tmp_path / 'shards' / f'{i:05d}.tar') for i in range(2)]
    monkeypatch.setenv(data_events.ENV, str(tmp_path / 'events'))
    (tmp_path / 'events').mkdir()
    _epoch(tmp_path / 'events', urls, 0, batches=4)
    lines = next((tmp_path / 'events').glob('*-0.jsonl')).read_text().splitlines()
    assert len(lines) == 5  # a line per batch, and the pass's end (read ahead of the 4th)
    batch_lines = [json.loads(line) for line in lines]
    assert [sum(map(len, b.get('trained', {}).values())) for b in batch_lines] == [4, 4, 4, 0, 4]
    assert batch_lines[3]['passes'] == 1
    assert max(len(line) - sum(line.count(url) * len(url) for url in urls) for line in lines) < 80  # besides urls


def test_the_last_batch_of_a_clean_epoch_is_counted(tmp_path, monkeypatch):
    """Nothing skipped, one pass that ends with the epoch: every sample read and trained is in the file."""
    write_shards(tmp_path / 'shards', 2, 4)
    urls = [str(tmp_path / 'shards' / f'{i:05d}.tar') for i in range(2)]
    monkeypatch.setenv(data_events.ENV, str(tmp_path / 'events'))
    (tmp_path / 'events').mkdir()
    record = data_report.epoch_record(1, [_epoch(tmp_path / 'events', urls, 0, batches=2)])
    assert (record['samples_read'], record['samples_trained'], record['samples_distinct']) == (8, 8, 8)
    assert record['skipped'] == {} and 'nothing skipped' in data_report.summary(record)


def _records(run_dir) -> list:
    return [json.loads(line) for line in (run_dir / 'data.jsonl').read_text().splitlines()]


@pytest.mark.slow
def test_a_sizes_json_four_times_too_large_trains_each_sample_four_times_and_says_so_once(tmp_path):
    """2 clean shards of 4 whose sizes.json says 16 each: batches of 4, so an epoch is 4 whole passes. The fix the
    warning gives writes what the shards hold."""
    write_shards(tmp_path / 'shards', 2, 4)
    (tmp_path / 'shards' / 'sizes.json').write_text(json.dumps({'00000.tar': 16, '00001.tar': 16}))
    result = call(train_main, ['--recipe', 'clip-tiny-baseline', '--train_data', 'shards', '--epochs', '2',
                               '--global_batch_size', '4'], cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run_dir = tmp_path / 'runs' / 'clip-tiny-baseline'
    for epoch, record in enumerate(_records(run_dir), 1):
        assert record['epoch'] == epoch
        assert (record['samples_trained'], record['samples_distinct'], record['samples_repeated']) == (32, 8, 24)
        assert record['samples_read'] == 32 and record['samples_readable'] == 8  # the last batch's samples too
        assert record['skipped'] == {}
    log = (run_dir / 'out.log').read_text()
    assert ('epoch 2 data: 32 samples trained (8 distinct, 24 repeats: trained again in the same epoch, '
            'to fill the whole batches open_clip_train makes of each data-loader worker\'s share)' in log)
    warning = ('shards/sizes.json says 32 samples, the shards hold 8 (8 readable): each sample is trained ~4× per '
               'epoch (24 repeats in epoch 1); fix sizes.json with `python -m diffzoo.data sizes shards --recount` '
               'or pass --train-num-samples 8')
    assert log.count('the shards hold') == 1 and warning in log
    assert call(data_main, ['sizes', 'shards', '--recount'], cwd=tmp_path).returncode == 0
    assert json.loads((tmp_path / 'shards' / 'sizes.json').read_text()) == {'00000.tar': 4, '00001.tar': 4}
