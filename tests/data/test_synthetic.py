import json
from collections import Counter

import numpy as np
import pytest

from diffzoo.data.__main__ import main as data_main
from diffzoo.data.check import check_dataset
from diffzoo.data.shards import iter_samples, read_sizes
from diffzoo.data.synthetic import COLOURS, RELATIONS, SHAPES, CorpusConfig, make_scene, write_corpus


def test_a_scene_depends_only_on_seed_split_and_index():
    a_image, a = make_scene(0, 'train', 7)
    b_image, b = make_scene(0, 'train', 7)
    assert a == b and np.array_equal(np.asarray(a_image), np.asarray(b_image))
    for other in (make_scene(1, 'train', 7), make_scene(0, 'val', 7), make_scene(0, 'train', 8)):
        assert not np.array_equal(np.asarray(a_image), np.asarray(other[0]))


@pytest.mark.parametrize('index', range(40))
def test_the_picture_shows_what_the_caption_says(index):
    image, scene = make_scene(3, 'train', index)
    pixels = np.asarray(image).astype(int)
    objects = scene['objects']
    subject = objects[0]
    assert scene['caption'].startswith(f"a {subject['size']} {subject['colour']} {subject['shape']}")
    assert (scene['shape'], scene['colour']) == (subject['shape'], subject['colour'])
    for obj in objects:
        x, y = (int(round(c)) for c in obj['centre'])
        assert np.abs(pixels[y, x] - COLOURS[obj['colour']]).max() <= 30, obj  # drawn last, nothing covers it
    if scene['relation'] is None:
        assert len(objects) == 1 and scene['caption'] == f"a {subject['size']} {subject['colour']} {subject['shape']}"
    else:
        other = objects[1]
        assert scene['caption'].endswith(f"{scene['relation']} a {other['size']} {other['colour']} {other['shape']}")
        dx, dy = RELATIONS[scene['relation']]
        gap = np.subtract(subject['centre'], other['centre'])
        assert (gap[0] * dx > 0 if dx else gap[1] * dy > 0)  # "left of": the subject's x is smaller …


def test_classes_are_all_used():
    scenes = [make_scene(0, 'train', i)[1] for i in range(300)]
    assert set(Counter(s['shape'] for s in scenes)) == set(SHAPES)
    assert set(Counter(s['colour'] for s in scenes)) == set(COLOURS)
    assert 0.45 < sum(s['relation'] is not None for s in scenes) / len(scenes) < 0.75


def test_corpus_is_written_as_checked_shards_and_reused(tmp_path, capsys):
    config = CorpusConfig(train=50, val=20, per_shard=20, image_size=64)
    manifest = write_corpus(tmp_path, config, progress=None)
    assert manifest['samples'] == {'train': 50, 'val': 20}
    assert read_sizes(tmp_path / 'train') == {'00000.tar': 20, '00001.tar': 20, '00002.tar': 10}
    for split in ('train', 'val'):
        report = check_dataset(tmp_path / split, workers=1, progress=None)
        assert report.problems() == [] and report.samples == manifest['samples'][split]
    key, members = next(iter_samples(tmp_path / 'val' / '00000.tar'))
    assert json.loads(members['json'])['caption'] == members['txt'].decode()
    stamp = (tmp_path / 'train' / '00000.tar').stat().st_mtime_ns
    assert data_main(['synthetic', str(tmp_path), '--train', '50', '--val', '20', '--per-shard', '20',
                      '--image-size', '64']) == 0
    assert 'reusing it (train 50, val 20 scenes)' in capsys.readouterr().out
    assert (tmp_path / 'train' / '00000.tar').stat().st_mtime_ns == stamp
    write_corpus(tmp_path, CorpusConfig(train=30, val=20, per_shard=20, image_size=64), progress=None)
    assert read_sizes(tmp_path / 'train') == {'00000.tar': 20, '00001.tar': 10}  # other settings: written anew


def test_shards_not_of_a_corpus_are_kept_and_an_interrupted_corpus_is_rewritten(tmp_path, capsys):
    """A folder holding shards but no corpus.json is not written over (it would delete them) unless --fresh; a
    corpus stopped before its manifest was completed is rewritten without it; a damaged manifest is named."""
    args = ['synthetic', str(tmp_path), '--train', '2', '--val', '2', '--per-shard', '2', '--image-size', '32']
    (tmp_path / 'train').mkdir()
    for name in ('00000.tar', '00001.tar'):
        (tmp_path / 'train' / name).write_bytes(b'someone else\'s shard')
    assert data_main(args) == 2
    err = capsys.readouterr().err
    assert f'{tmp_path / "train"} holds 2 shard(s) (00000.tar, …) and {tmp_path} has no corpus.json' in err
    assert 'pass --fresh to replace them' in err
    assert sorted(p.read_bytes() for p in (tmp_path / 'train').iterdir()) == [b'someone else\'s shard'] * 2
    assert data_main([*args, '--fresh']) == 0
    assert read_sizes(tmp_path / 'train') == {'00000.tar': 2}
    manifest = json.loads((tmp_path / 'corpus.json').read_text())
    (tmp_path / 'corpus.json').write_text(json.dumps(dict(manifest, samples=None)))  # as a stop leaves it
    capsys.readouterr()
    assert data_main(args) == 0
    assert 'reusing' not in capsys.readouterr().out and json.loads((tmp_path / 'corpus.json').read_text()) == manifest
    for damaged in ('{bad', '[1]'):
        (tmp_path / 'corpus.json').write_text(damaged)
        assert data_main(args) == 2
        assert f'{tmp_path / "corpus.json"}: ' in capsys.readouterr().err
        assert data_main([*args, '--fresh']) == 0


def test_an_empty_split_or_a_tiny_image_is_refused(tmp_path, capsys):
    assert data_main(['synthetic', str(tmp_path), '--val', '0']) == 2
    assert '--val 0: the corpus needs at least 1' in capsys.readouterr().err
    assert data_main(['synthetic', str(tmp_path), '--image-size', '16']) == 2
    assert not (tmp_path / 'train').exists()


def test_pope_negatives_are_absent_classes_chosen_as_each_split_says():
    import random
    from diffzoo.data.synthetic import (POPE_SPLITS, class_frequency, make_scene, object_classes, pope_negatives,
                                        scene_objects)
    descriptions = [make_scene(0, 'train', i)[1] for i in range(200)]
    frequency = class_frequency(descriptions)
    assert sum(frequency.values()) == sum(len(scene_objects(d)) for d in descriptions) and len(frequency) == 18
    rng = random.Random(0)
    for d in descriptions[:50]:
        present = scene_objects(d)
        negatives = {split: pope_negatives(d, split, rng, frequency) for split in POPE_SPLITS}
        for split, names in negatives.items():
            assert len(names) == len(present) == len(set(names)) and not set(names) & set(present), split
            assert set(names) <= set(object_classes())
        absent = sorted((c for c in object_classes() if c not in present), key=lambda c: (-frequency[c], c))
        assert negatives['popular'] == absent[:len(present)]  # the most frequent absent classes
        assert all(any(n.split()[0] == p.split()[0] or n.split()[1] == p.split()[1] for p in present)
                   for n in negatives['adversarial'])  # sharing a colour or a shape with a present object
