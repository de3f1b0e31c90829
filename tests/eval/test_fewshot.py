import numpy as np
import pytest
import torch

from diffzoo.eval.fewshot import FewShotConfig, episodes, evaluate
from diffzoo.eval.models import EvalError


def test_episodes_are_disjoint_balanced_and_fixed_by_the_seed():
    labels = np.repeat(np.arange(7), 10)
    config = FewShotConfig(way=5, shot=2, query=3, episodes=4, seed=1)
    first = list(episodes(labels, config))
    for s, sy, q, qy in first:
        assert len(s) == 10 and len(q) == 15 and not set(s) & set(q)
        assert list(np.bincount(sy)) == [2] * 5 and list(np.bincount(qy)) == [3] * 5
        for episode_label in range(5):  # one dataset class behind each episode label, support and query alike
            assert len(set(labels[s[sy == episode_label]]) | set(labels[q[qy == episode_label]])) == 1
    again = list(episodes(labels, config))
    assert all((a[0] == b[0]).all() and (a[2] == b[2]).all() for a, b in zip(first, again))
    other = list(episodes(labels, FewShotConfig(way=5, shot=2, query=3, episodes=4, seed=2)))
    assert any((a[0] != b[0]).any() for a, b in zip(first, other))


@pytest.mark.parametrize('classifier', ['logistic', 'prototype'])
def test_separable_classes_are_always_right(classifier):
    labels = torch.arange(4).repeat_interleave(8)
    features = torch.nn.functional.one_hot(labels, 16).float() + 0.01 * torch.randn(32, 16)
    metrics = evaluate(features, labels, FewShotConfig(way=4, shot=2, query=3, episodes=10, classifier=classifier))
    assert metrics == {'4way_2shot_acc': 100.0, '4way_2shot_ci95': 0.0}


def test_identical_features_leave_the_prototype_at_its_first_class():
    # every similarity ties, so every query is given episode label 0: exactly 1 in `way` right
    labels = torch.arange(6).repeat_interleave(5)
    metrics = evaluate(torch.ones(30, 8), labels, FewShotConfig(way=3, shot=1, query=4, episodes=5,
                                                                classifier='prototype'))
    assert metrics['3way_1shot_acc'] == pytest.approx(100 / 3)


def test_fewer_classes_than_way_use_all_and_say_so():
    labels = torch.arange(3).repeat_interleave(6)
    metrics = evaluate(torch.randn(18, 8), labels, FewShotConfig(way=5, shot=1, query=2, episodes=3))
    assert set(metrics) == {'3way_1shot_acc', '3way_1shot_ci95'}


def test_too_few_images_name_the_flags():
    with pytest.raises(EvalError, match='--fewshot-shot/--fewshot-query'):
        evaluate(torch.randn(6, 4), torch.tensor([0, 0, 1, 1, 2, 2]), FewShotConfig(shot=2, query=1))
    with pytest.raises(EvalError, match='--fewshot-classifier'):
        FewShotConfig(classifier='svm')
