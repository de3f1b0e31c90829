"""The table `make demo`, `make demo-vlm` and `python -m diffzoo.eval` share: Wilson intervals from the hits, the
chance level, and verdicts only where the intervals support them."""
import pytest

from diffzoo import confidence
from tests.factory import wilson

LABELS = ['dataset', 'task', 'metric']


def _row(metric, values, n, chance):
    return ('synthetic', 'zeroshot_classification', metric), values, n, chance


def test_one_model_gets_intervals_chance_and_the_accuracies_at_or_below_chance_named():
    """The quick start's first training (diffclip-tiny, 4 epochs of 1,000 scenes) on the 500 val scenes: shape 146
    hits (its interval under chance, 33.3), colour 337, and a shape accuracy of 168 (its interval holds chance)."""
    rows = [_row('zero_shot_shape', {'epoch 4': 29.2}, 500, 100 / 3),
            _row('zero_shot_colour', {'epoch 4': 67.4}, 500, 100 / 6),
            _row('image_to_text_R@1', {'epoch 4': 6.6}, 500, None),
            _row('shape_3way_1shot_acc', {'epoch 4': 41.3}, None, None)]  # a mean over episodes: no interval
    printed = confidence.table(LABELS, ['epoch 4'], rows, 'val scenes')
    lines = printed.splitlines()
    assert lines[0].split() == [*LABELS, 'epoch', '4', 'chance', 'n']  # one model: no difference column
    low, high = wilson(146, 500)
    assert f'29.2 ({low:.1f}–{high:.1f})    33.3  500' in lines[2] and high < 100 / 3
    assert lines[5].split()[-1] == '41.3'  # shown as measured
    words = ' '.join(printed.split())
    assert 'Wilson 95% interval of each accuracy over its n trials (val scenes).' in words
    assert 'Below chance (the whole interval under it, a systematic confusion): epoch 4 zero_shot_shape.' in words
    assert 'At chance' not in words and 'difference' not in words
    at = confidence.table(LABELS, ['epoch 4'], [_row('zero_shot_shape', {'epoch 4': 33.6}, 500, 100 / 3)], 'x')
    assert 'At chance (the interval holds the chance level): epoch 4 zero_shot_shape.' in ' '.join(at.split())


def test_two_models_get_a_difference_only_beyond_the_overlap_of_their_intervals():
    rows = [_row('zero_shot_shape', {'a': 33.2, 'b': 34.4}, 500, 100 / 3),
            _row('zero_shot_colour', {'a': 17.8, 'b': 60.0}, 500, 100 / 6),
            _row('image_to_text_R@1', {'a': 10.0, 'b': float('nan')}, 500, None)]  # b not measured: no verdict
    lines = confidence.table(LABELS, ['a', 'b'], rows, 'val scenes').splitlines()
    assert lines[0].split()[-5:] == ['a', 'b', 'chance', 'n', 'difference']
    assert lines[2].endswith('500   within chance') and lines[3].endswith('500   +42.2')
    assert lines[4].split()[-2:] == ['-', '500']
    no_trials = confidence.table(LABELS, ['a', 'b'], [_row('acc1', {'a': 1.0, 'b': 2.0}, None, None)], 'x')
    assert no_trials.splitlines()[0].split() == [*LABELS, 'a', 'b'] and '(a–b)' not in no_trials
    with pytest.raises(ValueError, match='no whole number of hits out of 7'):
        confidence.table(LABELS, ['a'], [_row('zero_shot_shape', {'a': 50.0}, 7, None)], 'x')
