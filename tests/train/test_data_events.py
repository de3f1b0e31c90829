from diffzoo.train import data_events


def test_each_epoch_reports_the_bad_samples_it_met_again(tmp_path, monkeypatch):
    monkeypatch.setenv(data_events.ENV, str(tmp_path))
    no_caption = {'__url__': 'shards/00000.tar', '__key__': '000000007', 'jpg': b'...', 'txt': '  '}
    good = {'__url__': 'shards/00000.tar', '__key__': '000000008', 'jpg': b'...', 'txt': 'a red circle'}
    epochs, before = [], data_events.collect(tmp_path)
    for _ in range(2):
        assert data_events.filter_no_caption_or_no_image(good)
        assert not data_events.filter_no_caption_or_no_image(no_caption)  # blank counts as none
        after = data_events.collect(tmp_path)
        epochs.append(data_events.delta(before, after))
        before = after
    for epoch in epochs:
        assert epoch['skipped'] == {'no_caption': 1}
        assert epoch['examples'] == [['no_caption', 'shards/00000.tar', '000000007']]
    assert 'skipped 1 without caption (00000.tar/000000007)' in data_events.summary(2, 8, epochs[1:])
