import json

import numpy as np
import pytest

from diffzoo.data.keys import decode, encode, key_text, repeats_across, shard_keys


def _img2dataset_keys(shard: int, n: int, failed_every: int = 3):
    """img2dataset's keys SSSSSIIII, with the URLs that failed to download left out."""
    return [f'{shard:05d}{i:04d}' for i in range(n) if i % failed_every]


def _keys(groups):
    return sorted(key_text(g[0], v) for g in groups for v in decode(g))


@pytest.mark.parametrize('keys', [
    _img2dataset_keys(12, 10_000),
    [str(k).zfill(12) for k in np.random.default_rng(0).integers(0, 10**12, 500)],  # sparse: listed as numbers
    ['0001', '001', '1', 'a/b', 'caf\u00e9', '\u0663', '9' * 19],  # widths apart, not digits, too wide for int64
])
def test_keys_come_back_as_they_were_and_travel_as_json(keys):
    groups = json.loads(json.dumps(encode(keys)))
    assert _keys(groups) == sorted(set(keys))


def test_img2dataset_keys_cost_a_few_bits_each():
    keys = _img2dataset_keys(7, 10_000)  # a bit per key number (in base64), a third of them failed downloads
    assert len(json.dumps(encode(keys))) < len(keys) / 3


def test_a_key_three_times_in_a_shard_is_two_repeats():
    groups, repeats = shard_keys(['000000000', '000000001', '000000001', '000000002', '000000001'])
    assert repeats == [(2, '000000001'), (4, '000000001')] and _keys(groups) == ['000000000', '000000001', '000000002']


def test_repeats_across_shards_count_each_extra_sample_once():
    """Shard c is a copy of a; d shares one key with a (and c) and none with b, whose keys lie between a's."""
    a, b = encode(_img2dataset_keys(0, 100)), encode(['000000050x', '000000051x'])
    d = encode(['000000001', '000500000'])
    count, examples = repeats_across({'a': a, 'b': b, 'c': a, 'd': d})
    assert count == len(decode(a[0])) + 1  # c's every key, and d's 000000001 (held by a and c: 2 repeats of 3)
    assert examples[0] == ('000000001', ['a', 'c', 'd']) and examples[1] == ('000000002', ['a', 'c'])
    assert repeats_across({'a': a, 'b': encode(_img2dataset_keys(1, 100))}) == (0, [])
