"""python -m diffzoo.bench.data_profile at smoke sizes on the CPU: every part measured on a real corpus, real
workers and real training steps of a tiny model, written to the JSON and the table."""
import json

import pytest

from diffzoo.bench.data_profile import main
from tests.factory import call

pytestmark = pytest.mark.slow  # three tiny trainings with their data-loader workers


def test_the_data_profile_takes_each_backends_data_path_apart(tmp_path):
    result = call(main, ['--smoke', '--device', 'cpu', '--out', 'profile.json'], cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    profile = json.loads((tmp_path / 'profile.json').read_text())
    files = profile['files']
    assert files['images'] > 0 and 0 < files['header_ms'] < files['check_ms'] < files['full_decode_ms']
    workers = profile['workers']
    assert 0 < workers['device']['cpu_s_per_sample'] < workers['open_clip']['cpu_s_per_sample']
    making = profile['making']
    assert all(making[name] > 0 for name in ('decode_s', 'decode_cpu_s', 'resize_s', 'normalize_s'))
    assert not making['batched_resize'] and 'copy_s' not in making  # the CPU path: no copy, one image at a time
    rows = [(row['backend'], row['ahead']) for row in profile['training']]
    assert rows == [('open_clip', None), ('device', 1), ('device', 2)]
    for row in profile['training']:
        assert row['batches_timed'] == 3 and 0 <= row['wait_share'] < 1 and row['images_per_s'] > 0
        assert 0 < row['wait_s'] < row['iteration_s']
    assert 'the device backend\'s check' in result.stdout and '(2 ahead): wait' in result.stdout
    assert result.stdout.rstrip().endswith('results: profile.json')
