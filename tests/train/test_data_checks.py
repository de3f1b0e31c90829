"""What the training's data report says of a sizes.json that counts fewer samples than the shards hold and of
samples that repeat a key, on real shards: read by the counting pipeline alone, and in a tiny training."""
import json
import shutil

import pytest

from diffzoo.train import data_events, data_report
from diffzoo.train.launch import main as train_main
from tests.data.tars import rename_samples
from tests.factory import call, write_shards
from tests.train.test_data_events import _epoch


def _repeating_shards(directory, per_shard: int) -> list:
    """4 shards of `per_shard`: shard 1's sample 3 has sample 1's key, shard 3 is a copy of shard 0 (per_shard + 1
    key repeats); sizes.json says 2 for shard 2."""
    write_shards(directory, 4, per_shard)
    rename_samples(directory / '00001.tar', {'000010003': '000010001'})
    shutil.copy(directory / '00000.tar', directory / '00003.tar')
    sizes = json.loads((directory / 'sizes.json').read_text())
    (directory / 'sizes.json').write_text(json.dumps({**sizes, '00002.tar': 2}))
    return [str(directory / f'{i:05d}.tar') for i in range(4)]


def test_each_repeat_and_each_uncounted_sample_is_counted_once_however_often_it_is_read(tmp_path, monkeypatch):
    """Two ranks, each reading every shard twice in its epoch (9 batches of 3 from 16 samples): 5 key repeats and
    2 samples sizes.json leaves out, not 20 and 8."""
    urls = _repeating_shards(tmp_path / 'shards', 4)
    ranks = []
    for rank in range(2):
        events = tmp_path / f'events{rank}'
        events.mkdir()
        monkeypatch.setenv(data_events.ENV, str(events))
        ranks.append(_epoch(events, urls if rank == 0 else urls[::-1], 0, batches=9, batch_size=3))
    sizes = json.loads((tmp_path / 'shards' / 'sizes.json').read_text())
    record = data_report.epoch_record(1, ranks, sizes)
    assert record['shards_read_to_end'] == 4 and record['key_repeats'] == 5
    assert record['key_repeat_examples'][:2] == [['000010001', [urls[1]] * 2], ['000000000', [urls[0], urls[3]]]]
    assert record['sizes_json'] == {'shards_compared': 4, 'undercounted_shards': 1, 'uncounted_samples': 2,
                                    'overcounted_shards': 0, 'overcounted_samples': 0, 'examples': [[urls[2], 2, 4]]}
    text = data_report.summary(record)
    assert ('  5 key repeats (samples whose __key__ another sample of the 4 shards read to their end has; trained all '
            'the same): 000010001 in 00001.tar ×2; 000000000 in 00000.tar, 00003.tar; 000000001 in 00000.tar, '
            '00003.tar …') in text
    assert ('  sizes.json counts 2 samples fewer than 1 of the 4 shards read to their end hold (00002.tar: 2 in '
            'sizes.json, 4 in the tar)') in text
    assert data_report.undercount_warning(record, None) is None  # --train-num-samples sized the epoch


def test_a_shard_the_epoch_leaves_unfinished_is_not_compared(tmp_path, monkeypatch):
    """One batch of 2 from a shard of 4 (and a third sample read ahead): the shard is not read to its end, so nothing
    is said of it."""
    urls = _repeating_shards(tmp_path / 'shards', 4)
    monkeypatch.setenv(data_events.ENV, str(tmp_path / 'events'))
    (tmp_path / 'events').mkdir()
    record = data_report.epoch_record(1, [_epoch(tmp_path / 'events', urls[2:3], 0, batches=1, batch_size=2)],
                                      {'00002.tar': 2})
    assert record['shards_read_to_end'] == 0 and record['key_repeats'] == 0
    assert record['sizes_json']['shards_compared'] == 0


@pytest.mark.slow
def test_a_training_reports_an_undercounting_sizes_json_and_key_repeats_every_epoch_and_warns_once(tmp_path):
    """sizes.json says 26 samples of the 32 the shards hold, so an epoch is 7 batches of 4 (the sample shuffle reads
    every shard to its end before the first batch). Samples that repeat a key are trained."""
    _repeating_shards(tmp_path / 'shards', 8)
    result = call(train_main, ['--recipe', 'clip-tiny-baseline', '--train_data', 'shards', '--epochs', '2',
                               '--global_batch_size', '4'], cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run_dir = tmp_path / 'runs' / 'clip-tiny-baseline'
    records = [json.loads(line) for line in (run_dir / 'data.jsonl').read_text().splitlines()]
    assert [r['epoch'] for r in records] == [1, 2]
    for record in records:
        assert (record['samples_trained'], record['samples_distinct'], record['samples_repeated']) == (28, 28, 0)
        assert record['shards_read_to_end'] == 4 and record['key_repeats'] == 9
        assert (record['sizes_json']['undercounted_shards'], record['sizes_json']['uncounted_samples']) == (1, 6)
    log = (run_dir / 'out.log').read_text()
    assert log.count('9 key repeats (') == 3  # each epoch's summary, and the warning once
    assert ('shards/sizes.json counts 6 samples fewer than 1 of the 4 shards read to their end in epoch 1 hold '
            '(00002.tar: 2 in sizes.json, 8 in the tar): open_clip sizes each epoch from it, so each epoch ends that '
            'many samples short and part of the corpus goes untrained; fix it with '
            '`python -m diffzoo.data sizes shards --recount`') in log
    assert log.count('part of the corpus goes untrained') == 1
    assert ('…. `python -m diffzoo.data check shards` names every one; re-create the shards with a key of its own '
            'for every sample, or delete a shard that is a copy of another') in log
