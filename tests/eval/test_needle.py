import json
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw

from diffzoo.data.synthetic import COLOURS, SHAPES, SceneObject, draw_object

from diffzoo.eval.needle import (ABSENT, UNREADABLE, HaystackConfig, Location, NeedleError, build, caption_key,
                                 evaluate, parse_answer, parse_step, read_answers, read_captions, read_haystacks,
                                 score_answers, usable_captions, write, write_answers)
from diffzoo.eval.needle.cli import main

PLACES = {'left': 18, 'middle': 32, 'right': 46}  # x of the shape's centre in a 64 px wide picture
SIZE = 24  # px per sub-image in the tests


def _picture(colour, shape, place) -> Image.Image:
    """A 64×48 picture (not square, so stitching must resize) of one coloured shape on white, drawn
    as diffzoo.data.synthetic draws it."""
    image = Image.new('RGB', (64, 48), 'white')
    draw_object(ImageDraw.Draw(image), SceneObject(shape, colour, 'large', (PLACES[place], 24), 16))
    return image


def _corpus(root: Path, duplicates: int = 0):
    """40 PNGs with distinct captions (`duplicates` more re-use captions of the first ones), as a flat
    folder with captions.json, and as COCO val2014/ + annotations/captions_val2014.json."""
    images = root / 'val2014'
    images.mkdir(parents=True)
    captions = {}
    pictures = [(c, s, p) for p in PLACES for c in COLOURS for s in SHAPES][:40]  # 40 of 6 × 3 × 3
    for i, (colour, shape, place) in enumerate(pictures):
        name = f'COCO_val2014_{i:012d}.png'
        _picture(colour, shape, place).save(images / name)
        captions[name] = f'A {colour} {shape} in the {place} of a white background.'
    for i in range(duplicates):  # other pictures, same captions as images 0, 1, …
        name = f'dup_{i:03d}.png'
        picture = _picture(*pictures[i])
        picture.paste((128, 128, 128), (0, 0, 10, 10))  # other pixels
        picture.save(images / name)
        captions[name] = captions[f'COCO_val2014_{i:012d}.png'].lower()
    (root / 'captions.json').write_text(json.dumps(captions))
    names = sorted(captions)
    coco = {'images': [{'id': i, 'file_name': n} for i, n in enumerate(names)],
            'annotations': [a for i, n in enumerate(names)
                            for a in ({'image_id': i, 'id': 2 * i, 'caption': 'an earlier caption of ' + n},
                                      {'image_id': i, 'id': 2 * i + 1, 'caption': captions[n]})]}
    (root / 'annotations').mkdir()
    (root / 'annotations' / 'captions_val2014.json').write_text(json.dumps(coco))
    return images, captions


@pytest.fixture
def corpus(tmp_path):
    return _corpus(tmp_path)


def _subimage(path, size=SIZE) -> np.ndarray:
    """The test's own resize of a source image to a sub-image."""
    return np.asarray(Image.open(path).convert('RGB').resize((size, size), Image.Resampling.BICUBIC))


def _crop(image, row, column, size=SIZE) -> np.ndarray:
    """1-based (row, column) cell of a stitch."""
    return np.asarray(image.crop(((column - 1) * size, (row - 1) * size, column * size, (row - 1) * size + size)))


def _oracle(source: Path, captions, n: int, size=SIZE):
    """A perfect model: finds the caption's picture by its pixels and answers either protocol's prompts."""
    by_caption = {c: name for name, c in captions.items()}

    def answer(images, prompt):
        caption = prompt.rsplit('\nCaption: ', 1)[1]
        target = _subimage(source / by_caption[caption], size)
        hits = [(k, r, c) for k, image in enumerate(images, 1) for r in range(1, n + 1) for c in range(1, n + 1)
                if np.array_equal(_crop(image, r, c, size), target)]
        assert len(hits) <= 1
        if prompt.startswith('Given'):  # MMNeedle
            return '-1' if not hits else '{}, {}, {}'.format(*hits[0])
        if 'column' in prompt.split('\n')[0] or 'left or' in prompt:  # column step
            assert hits, 'a column question for a stitch without the needle'
            return {1: 'left', 2: 'right'}[hits[0][2]] if n == 2 else f'column {hits[0][2]}'
        if n == 1:
            return 'yes' if hits else 'no'
        if not hits:
            return 'none'
        return {1: 'top', 2: 'bottom'}[hits[0][1]] if n == 2 else f'row {hits[0][1]}.'
    return answer


def test_the_same_seed_gives_the_same_haystacks_another_seed_others(corpus):
    source, captions = corpus
    config = HaystackConfig(m=2, n=2, size=SIZE, samples=12, seed=0)
    a, b = build(source, captions, config), build(source, captions, config)
    assert a == b
    for x, y in zip(a[:3], b[:3]):
        assert all(np.array_equal(np.asarray(i), np.asarray(j)) for i, j in zip(x.images(), y.images()))
    other = build(source, captions, HaystackConfig(m=2, n=2, size=SIZE, samples=12, seed=1))
    assert [s.cells for s in other] != [s.cells for s in a]
    assert sum(s.positive for s in a) == 6 and [s.positive for s in a] == [True] * 6 + [False] * 6


@pytest.mark.parametrize('m,n', [(1, 1), (1, 2), (3, 2), (2, 3)])
def test_the_needle_is_at_the_recorded_index_row_and_column(corpus, tmp_path, m, n):
    source, captions = corpus
    samples = build(source, captions, HaystackConfig(m=m, n=n, size=SIZE, samples=10, seed=3))
    write(samples, tmp_path / 'set', {'n': n, 'size': SIZE, 'source': str(samples[0].root)}, log=None)
    written = read_haystacks(tmp_path / 'set')
    assert written == samples
    for sample, from_png in zip(samples, written):
        images, pngs = sample.images(), from_png.images()
        assert len(images) == m and all(im.size == (n * SIZE, n * SIZE) for im in images)
        assert all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(images, pngs))  # PNG is lossless
        for k, names in enumerate(sample.cells):  # every cell holds the source the record names
            for j, name in enumerate(names):
                row, column = divmod(j, n)
                assert np.array_equal(_crop(pngs[k], row + 1, column + 1), _subimage(source / name))
        if sample.positive:
            index, row, column = sample.truth
            assert 1 <= index <= m and 1 <= row <= n and 1 <= column <= n
            assert np.array_equal(_crop(pngs[index - 1], row, column), _subimage(source / sample.needle_source))
            assert sample.needle == captions[sample.needle_source]
        else:
            assert sample.truth == ABSENT == Location(-1, -1, -1)


def test_negatives_never_hold_the_needle_nor_its_caption(tmp_path):
    source, captions = _corpus(tmp_path, duplicates=10)  # 10 captions shared by two pictures
    samples = build(source, captions, HaystackConfig(m=3, n=3, size=8, samples=60, positives=20, seed=5))
    assert sum(s.positive for s in samples) == 20
    for sample in samples:
        names = [name for stitch in sample.cells for name in stitch]
        assert len(set(names)) == len(names)  # distinct sub-images
        same_caption = [name for name in names if caption_key(captions[name]) == caption_key(sample.needle)]
        if sample.positive:
            assert same_caption == [sample.needle_source]  # no look-alike caption elsewhere
        else:
            assert sample.needle_source not in names and same_caption == []


def test_coco_captions_take_the_last_annotation_and_skip_missing_files(corpus, tmp_path):
    source, captions = corpus
    coco = read_captions(tmp_path / 'annotations' / 'captions_val2014.json')
    assert coco == captions  # the last of two annotations per image, as MMNeedle's file_to_caption.py
    (source / 'COCO_val2014_000000000000.png').unlink()
    samples = build(source, coco, HaystackConfig(m=1, n=2, size=8, samples=30, seed=0))
    assert all('COCO_val2014_000000000000.png' not in s.cells[0] for s in samples)
    lines = tmp_path / 'captions.jsonl'
    lines.write_text(''.join(json.dumps({'file_name': k, 'caption': v}) + '\n' for k, v in captions.items()))
    assert read_captions(lines) == captions


def test_build_names_and_counts_the_images_it_leaves_out(corpus, tmp_path, capsys):
    source, captions = corpus
    gone = ['COCO_val2014_000000000005.png', 'COCO_val2014_000000000017.png', 'COCO_val2014_000000000031.png']
    for name in gone:
        (source / name).unlink()
    captions = dict(captions, **{'COCO_val2014_000000000002.png': ' . '})  # a blank caption
    (tmp_path / 'captions.json').write_text(json.dumps(captions))
    usable = usable_captions(source, captions)
    assert usable.missing == gone and usable.blank == ['COCO_val2014_000000000002.png']
    assert len(usable.captions) == 36
    out = tmp_path / 'set'
    assert main(['build', '--source', str(source), '--captions', str(tmp_path / 'captions.json'), '--out', str(out),
                 '--n', '2', '--size', '8', '--samples', '20']) == 0
    printed = capsys.readouterr().out
    assert 'build: 3 of 40 images missing (first: COCO_val2014_000000000005.png); left out' in printed
    assert 'build: 1 of 40 captions blank (first: COCO_val2014_000000000002.png); left out' in printed
    assert re.search(r'images used +36 of 40 captioned \(3 missing\) \(1 blank captions\)', printed)
    settings = json.loads((out / 'haystacks.json').read_text())['settings']
    assert (settings['images_missing'], settings['first_missing'], settings['blank_captions'],
            settings['captioned_images']) == (3, 'COCO_val2014_000000000005.png', 1, 36)
    used = {name for s in read_haystacks(out) for stitch in s.cells for name in stitch}
    assert not used & set(gone + ['COCO_val2014_000000000002.png'])


def test_errors_name_the_input_and_the_fix(corpus, tmp_path):
    source, captions = corpus
    with pytest.raises(NeedleError, match=r'no such file; pass the COCO captions_val2014.json'):
        read_captions(tmp_path / 'nope.json')
    bad = tmp_path / 'bad.jsonl'
    bad.write_text('{"file_name": "a.png", "caption": "x"}\n{"image": "b.png"}\n')
    with pytest.raises(NeedleError, match=r'entry 1: no caption field'):
        read_captions(bad)
    (tmp_path / 'coco.json').write_text(json.dumps({'annotations': []}))
    with pytest.raises(NeedleError, match=r'without a "images" list'):
        read_captions(tmp_path / 'coco.json')
    with pytest.raises(NeedleError, match=r'40 captioned images \(40 distinct captions\).*needs 50 sub-images.*'
                                          r'smaller --m or --n'):
        build(source, captions, HaystackConfig(m=2, n=5, samples=2))
    with pytest.raises(NeedleError, match=r'none of the 40 files the captions name is there'):
        build(tmp_path / 'annotations', captions, HaystackConfig())
    with pytest.raises(NeedleError, match=r'--positives 7: must be between 0 and --samples 5'):
        HaystackConfig(samples=5, positives=7)
    samples = build(source, captions, HaystackConfig(size=8, samples=2))
    write(samples, tmp_path / 'set', {'n': 2, 'size': 8, 'source': str(source)}, log=None)
    with pytest.raises(NeedleError, match=r'exists; pass another --out, or --overwrite'):
        write(samples, tmp_path / 'set', {}, log=None)


def test_a_damaged_set_or_answers_file_is_named(corpus, tmp_path):
    """A manifest cut short, without its samples, with a field missing or a needle outside the set, and answers with a
    query that is not a name or bytes that are not UTF-8: each named with the fix, none a traceback."""
    source, captions = corpus
    samples = build(source, captions, HaystackConfig(m=1, n=2, size=8, samples=2))
    manifest = write(samples, tmp_path / 'set', {'m': 1, 'n': 2, 'size': 8, 'source': str(source)}, log=None)
    whole = json.loads(manifest.read_text())
    positive = next(i for i, e in enumerate(whole['samples']) if e['row'] != -1)
    outside = json.loads(json.dumps(whole))
    outside['samples'][positive]['row'] = 5
    no_row = json.loads(json.dumps(whole))
    del no_row['samples'][0]['row']
    for text, message in ((manifest.read_text()[:40], 'not JSON'),
                          (json.dumps({k: v for k, v in whole.items() if k != 'samples'}), "no 'samples'"),
                          (json.dumps(no_row), "no 'row'"),
                          (json.dumps(outside), rf'sample {positive}: the needle at .* outside 1 images of 2×2')):
        manifest.write_text(text)
        with pytest.raises(NeedleError, match=rf'{re.escape(str(manifest))}: .*{message}.*rebuild the set'):
            read_haystacks(tmp_path / 'set')
    answers = tmp_path / 'answers.jsonl'
    for text in ('{"id": 0, "query": 3, "answer": "1, 1, 1"}', '{"id": true, "answer": "-1"}'):
        answers.write_text(text + '\n')
        with pytest.raises(NeedleError, match=r'line 1: expected \{"id": <sample id>, "query": ..., "answer"'):
            read_answers(answers)
    answers.write_bytes('{"id": 0, "answer": "caf\xe9"}\n'.encode('latin-1'))
    with pytest.raises(NeedleError, match=r'answers\.jsonl: not UTF-8 text'):
        read_answers(answers)


@pytest.mark.parametrize('text,expected', [
    ('2, 1, 2', (2, 1, 2)), ('(2,1,2)', (2, 1, 2)), ('2,1,2.', (2, 1, 2)), (' 1, 2, 1\n', (1, 2, 1)),
    ('Image 2, row 1, column 2.', (2, 1, 2)), ('1-2-1', (1, 2, 1)), ('-1', ABSENT), ('-1.', ABSENT),
    ("'-1'", ABSENT), ('2', (2, None, None)), ('2, 1', (2, 1, None)), ('garbage', UNREADABLE), ('', UNREADABLE),
    (None, UNREADABLE)])
def test_parse_answer(text, expected):
    assert parse_answer(text) == expected


@pytest.mark.parametrize('text,n,axis,expected', [
    ('Top.', 2, 'row', 1), ('the bottom half', 2, 'row', 2), ('Left', 2, 'column', 1), ('right', 2, 'column', 2),
    ('none', 2, 'row', -1), ('No.', 2, 'row', -1), ('-1', 3, 'row', -1), ('row 3', 3, 'row', 3),
    ('bottom', 4, 'row', 4), ('2', 2, 'column', 2), ('yes', 1, 'row', 1), ('no', 1, 'row', -1),
    ('7', 3, 'row', None), ('maybe', 2, 'row', None), ('top left', 2, 'column', 1)])
def test_parse_step(text, n, axis, expected):
    assert parse_step(text, n, axis) == expected


@pytest.mark.parametrize('protocol', ['mmneedle', 'two_step'])
@pytest.mark.parametrize('m,n', [(1, 2), (3, 2), (2, 3), (2, 1)])
def test_a_perfect_model_scores_one_everywhere(corpus, protocol, m, n):
    source, captions = corpus
    samples = build(source, captions, HaystackConfig(m=m, n=n, size=SIZE, samples=16, seed=1))
    result = evaluate(samples, _oracle(source, captions, n), protocol)
    assert result['metrics'] == dict.fromkeys(result['metrics'], 1.0)
    assert result['counts']['positives'] == result['counts']['negatives'] == 8
    assert result['counts']['unreadable_answers'] == 0 and result['empty_ids'] == []
    cells = [v for row in result['per_cell']['exact_accuracy'] for v in row]
    assert set(cells) <= {1.0, None} and sum(sum(row) for row in result['per_cell']['count']) == 8
    for record in result['records']:
        names = [q['query'] for q in record['queries']]
        if protocol == 'mmneedle':
            assert names == ['mmneedle']
        elif record['truth'][0] == -1:  # every stitch asked once, and said none
            assert names == [f'row/{k}' for k in range(1, m + 1)]
        else:  # asked up to the needle's stitch, then its column
            k = record['truth'][0]
            assert names == [f'row/{j}' for j in range(1, k + 1)] + ([f'column/{k}'] if n > 1 else [])


def test_always_absent_scores_the_negative_fraction(corpus):
    source, captions = corpus
    samples = build(source, captions, HaystackConfig(m=2, n=2, size=8, samples=20, positives=5, seed=2))
    result = evaluate(samples, lambda images, prompt: '-1', 'mmneedle')
    metrics = result['metrics']
    assert metrics['existence_accuracy'] == metrics['overall_accuracy'] == 15 / 20
    assert metrics['existence_accuracy_negatives'] == 1.0 and metrics['existence_accuracy_positives'] == 0.0
    assert metrics['index_accuracy'] == metrics['exact_accuracy'] == 0.0
    result = evaluate(samples, lambda images, prompt: 'none', 'two_step')
    assert result['metrics']['existence_accuracy'] == 15 / 20 and result['metrics']['index_accuracy'] == 0.0
    assert result['counts']['queries'] == 20 * 2  # one row question per stitch


def test_unreadable_answers_claim_the_needle_as_in_mmneedle(corpus):
    source, captions = corpus
    samples = build(source, captions, HaystackConfig(m=1, n=2, size=8, samples=10, positives=4, seed=2))
    result = evaluate(samples, lambda images, prompt: 'I cannot tell.', 'mmneedle')
    assert result['metrics']['existence_accuracy'] == 4 / 10 and result['metrics']['index_accuracy'] == 0.0
    assert result['counts']['unreadable_answers'] == 10
    result = evaluate(samples, lambda images, prompt: 'I cannot tell.', 'two_step')
    assert result['metrics']['existence_accuracy'] == 4 / 10
    assert result['metrics']['index_accuracy'] == 1.0 and result['metrics']['exact_accuracy'] == 0.0  # M = 1


def test_hand_made_answers_give_known_accuracies(corpus, tmp_path):
    source, captions = corpus
    samples = build(source, captions, HaystackConfig(m=2, n=2, size=8, samples=12, positives=8, seed=4))
    answers = {}
    positives = [s for s in samples if s.positive]
    for j, s in enumerate(positives):  # 8 positives: 4 exact, 2 right index only, 2 wrong index
        i, r, c = s.truth
        forms = [f'{i}, {r}, {c}', f'({i},{r},{c})', f'{i}, {3 - r}, {c}', f'{3 - i}, {r}, {c}']
        answers[(s.id, 'mmneedle')] = forms[j % 4]
    negatives = [s for s in samples if not s.positive]
    answers.update({(s.id, 'mmneedle'): a for s, a in zip(negatives, ['-1', '-1', '1, 1, 1', None])})
    result = score_answers(samples, answers)
    metrics, counts = result['metrics'], result['counts']
    assert result['empty_ids'] == [negatives[3].id] and counts['answered'] == 11
    assert metrics['index_accuracy'] == 6 / 8 and metrics['exact_accuracy'] == 4 / 8
    assert metrics['existence_accuracy_positives'] == 1.0 and metrics['existence_accuracy_negatives'] == 2 / 3
    assert metrics['existence_accuracy'] == 10 / 11 and metrics['overall_accuracy'] == 6 / 11
    assert sum(sum(row) for row in result['per_cell']['count']) == 8
    # answers written and read back score the same
    path = write_answers(result, tmp_path / 'answers.jsonl')
    assert score_answers(samples, read_answers(path))['metrics'] == metrics
    del answers[(positives[0].id, 'mmneedle')]
    with pytest.raises(NeedleError, match=rf"1 queries of the mmneedle protocol have no answer \(sample "
                                          rf"{positives[0].id} query 'mmneedle'\)"):
        score_answers(samples, answers)


def test_cli_builds_a_coco_set_and_scores_answers(corpus, tmp_path, commands):
    source, captions = corpus
    out = tmp_path / 'set'
    # a real `python -m diffzoo.eval.needle` process; the captions found in ../annotations/captions_val2014.json
    done = commands.run('diffzoo.eval.needle', ['build', '--source', source, '--out', out, '--m', 2, '--n', 2,
                                                '--size', SIZE, '--samples', 10, '--seed', 7])
    assert done.returncode == 0, done.stderr
    assert 'build: 10/10 samples stitched' in done.stdout and str(out / 'haystacks.json') in done.stdout
    manifest = json.loads((out / 'haystacks.json').read_text())
    assert len(list((out / 'stitches').glob('*.png'))) == 20
    assert manifest['samples'][0]['prompt'].startswith('Given 2 images indexed from 1 to 2, each divided into 2*2 '
                                                       'subimages, identify the subimage')
    with open(tmp_path / 'answers.jsonl', 'w') as f:  # the ground truth as a model would write it
        for s in manifest['samples']:
            truth = '-1' if s['index'] == -1 else f"{s['index']}, {s['row']}, {s['column']}"
            f.write(json.dumps({'id': s['id'], 'answer': truth}) + '\n')
    done = commands.run('diffzoo.eval.needle', ['score', '--haystacks', out, '--answers', tmp_path / 'answers.jsonl',
                                                '--out', tmp_path / 'scores'])
    assert done.returncode == 0, done.stderr
    result = json.loads((tmp_path / 'scores' / 'needle_results.json').read_text())
    assert result['metrics'] == dict.fromkeys(result['metrics'], 1.0) and result['counts']['samples'] == 10
    heatmap = tmp_path / 'scores' / 'needle_heatmap.png'
    assert Image.open(heatmap).format == 'PNG' and Image.open(heatmap).size[0] > 200
    assert re.search(r'index \(needle present\) +100.00% +5 / 5', done.stdout)
    assert f'heatmap: {heatmap}' in done.stdout


def test_cli_scores_two_step_answers_and_reports_missing_ones(corpus, tmp_path, capsys):
    source, captions = corpus
    out = tmp_path / 'set'
    assert main(['build', '--source', source.as_posix(), '--captions', str(tmp_path / 'captions.json'),
                 '--out', str(out), '--n', '2', '--size', str(SIZE), '--samples', '6']) == 0
    samples = read_haystacks(out)
    result = evaluate(samples, _oracle(source, captions, 2), 'two_step')
    write_answers(result, tmp_path / 'two_step.jsonl')
    assert main(['score', '--haystacks', str(out), '--answers', str(tmp_path / 'two_step.jsonl'),
                 '--out', str(tmp_path / 'scores')]) == 0
    saved = json.loads((tmp_path / 'scores' / 'needle_results.json').read_text())
    assert saved['protocol'] == 'two_step' and saved['metrics']['exact_accuracy'] == 1.0
    assert 'two_step protocol' in capsys.readouterr().out
    lines = (tmp_path / 'two_step.jsonl').read_text().splitlines()
    (tmp_path / 'partial.jsonl').write_text('\n'.join(line for line in lines if '"column/1"' not in line))
    assert main(['score', '--haystacks', str(out), '--answers', str(tmp_path / 'partial.jsonl'),
                 '--out', str(tmp_path / 'scores2')]) == 2
    assert "3 queries of the two_step protocol have no answer" in capsys.readouterr().err
    assert main(['build', '--source', str(tmp_path / 'missing'), '--out', str(out)]) == 2
    assert 'missing: no such folder; pass the folder of images' in capsys.readouterr().err
    (tmp_path / 'a' / 'b').mkdir(parents=True)
    assert main(['build', '--source', str(tmp_path / 'a' / 'b'), '--out', str(out)]) == 2
    assert 'b/captions_val2014.json' in capsys.readouterr().err.replace('\\', '/')
