import csv

import pytest
import torch

from diffzoo.eval.__main__ import main
from diffzoo.eval.mmvp import IMAGES, QUESTIONS, pair_correct, read_pairs, score
from diffzoo.eval.models import EvalError, ModelSpec, load
from diffzoo.eval.results import read_json
from tests.factory import picture

PATTERNS = ('Orientation and Direction', 'Color and Appearance')


def write_mmvp(root, pairs_per_pattern=2, same_images=True):
    """The official layout: Questions.csv (id, type, statement) and MLLM_VLM Images/<type>/<id>.jpg."""
    rows, qid = [], 1
    for p, pattern in enumerate(PATTERNS):
        (root / IMAGES / pattern).mkdir(parents=True)
        for n in range(pairs_per_pattern):
            first = picture('red', 'circle', size=(64, 64), seed=10 * p + n)
            second = first if same_images else picture('blue', 'square', size=(64, 64), seed=10 * p + n)
            for image, statement in ((first, 'the circle is red'), (second, 'the square is blue')):
                image.save(root / IMAGES / pattern / f'{qid}.jpg')
                rows.append([qid, pattern, statement])
                qid += 1
    with open(root / QUESTIONS, 'w', newline='') as f:
        csv.writer(f).writerows([['Question ID', 'Type', 'Statement']] + rows)
    return root


def test_a_pair_counts_only_if_both_statements_pick_their_own_image():
    assert pair_correct(torch.tensor([[0.9, 0.1], [0.2, 0.8]]))
    assert not pair_correct(torch.tensor([[0.9, 0.1], [0.9, 0.8]]))  # both statements pick the first image
    assert not pair_correct(torch.tensor([[0.1, 0.9], [0.8, 0.2]]))  # swapped
    assert not pair_correct(torch.tensor([[0.5, 0.5], [0.1, 0.9]]))  # a tie picks the second image


def test_score_is_per_pattern_then_their_mean():
    scores = score(['a', 'a', 'a', 'b'], [True, False, False, True])
    assert scores == {'a': pytest.approx(100 / 3), 'b': 100.0, 'average': pytest.approx((100 / 3 + 100) / 2)}


def test_official_layout_is_read_in_pairs(tmp_path):
    pairs = read_pairs(write_mmvp(tmp_path))
    assert [p.pattern for p in pairs] == [PATTERNS[0]] * 2 + [PATTERNS[1]] * 2
    assert pairs[0].statements == ('the circle is red', 'the square is blue')
    assert [i.name for i in pairs[1].images] == ['3.jpg', '4.jpg']


def test_missing_files_are_named(tmp_path):
    with pytest.raises(EvalError, match=f'no {tmp_path / QUESTIONS}.*MMVP_VLM'):
        read_pairs(tmp_path)
    write_mmvp(tmp_path)
    (tmp_path / IMAGES / PATTERNS[1] / '8.jpg').unlink()
    with pytest.raises(EvalError, match=f'no image {tmp_path / IMAGES / PATTERNS[1] / "8.jpg"}'):
        read_pairs(tmp_path)


def test_identical_images_score_zero_with_a_real_model(tmp_path):
    # both images of every pair are the same picture: every statement ties and picks the second image
    from diffzoo.eval import mmvp
    loaded = load(ModelSpec('diffclip-tiny'))
    scores = mmvp.evaluate(loaded, write_mmvp(tmp_path, same_images=True))
    assert scores == {PATTERNS[0]: 0.0, PATTERNS[1]: 0.0, 'average': 0.0}


def test_cli_scores_mmvp_for_each_model(tmp_path):
    root = write_mmvp(tmp_path / 'mmvp', same_images=False)
    out = tmp_path / 'results.json'
    assert main(['--model', 'diffclip-tiny', '--model', 'clip-tiny-baseline', '--dataset', 'mmvp',
                 '--dataset-root', str(root), '--output', str(out), '--workers', '0']) == 0
    rows = read_json(out)
    assert {(r.model, r.metric) for r in rows} == {(m, p) for m in ('diffclip-tiny', 'clip-tiny-baseline')
                                                   for p in PATTERNS + ('average',)}
    assert all(r.task == 'mmvp' and r.checkpoint_sha256 is None for r in rows)
    assert all(r.value in (0.0, 50.0, 100.0) for r in rows if r.metric != 'average')  # 2 pairs per pattern
