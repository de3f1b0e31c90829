"""`python -m diffzoo.eval.lmm`: every benchmark read from a local copy in its published layout, answered by a
real (untrained) build_vlm model in the recipe's conversation format, each task's rows scored by the official
scoring from the predictions file it writes; an unreadable image left out and counted; a missing copy named."""
import json

import pytest
import yaml
from PIL import Image

from diffzoo.data.shards import DataError
from diffzoo.eval.lmm import tasks
from diffzoo.eval.lmm.cli import chosen_scorers, main
from tests.factory import call
from tests.vlm.models import write_chat_language_model


def _image(path, colour='red'):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new('RGB', (40, 30), colour).save(path)


def _write(path, value, lines=False):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('\n'.join(json.dumps(v) for v in value) if lines else json.dumps(value))


def _copies(root):
    """Two or three questions of each benchmark, as its files are published."""
    for split in tasks.POPE_SPLITS:
        _write(root / 'pope' / 'coco' / f'coco_pope_{split}.json', [
            {'question_id': 1, 'image': 'COCO_val2014_000000000001.jpg', 'text': 'Is there a dog in the image?',
             'label': 'yes'},
            {'question_id': 2, 'image': 'COCO_val2014_000000000002.jpg', 'text': 'Is there a cat in the image?',
             'label': 'no'}], lines=True)
    _image(root / 'pope' / 'val2014' / 'COCO_val2014_000000000001.jpg')
    (root / 'pope' / 'val2014' / 'COCO_val2014_000000000002.jpg').write_bytes(b'not an image')
    (root / 'mme' / 'existence').mkdir(parents=True)
    (root / 'mme' / 'existence' / '000000006040.txt').write_text(
        'Is there a train in this image? Please answer yes or no.\tYes\n'
        'Is there a bed in this image? Please answer yes or no.\tNo\n')
    _image(root / 'mme' / 'existence' / '000000006040.jpg')
    (root / 'mme' / 'artwork' / 'questions_answers_YN').mkdir(parents=True)
    (root / 'mme' / 'artwork' / 'questions_answers_YN' / '10002.txt').write_text(
        'Is this artwork by Giotto? Please answer yes or no.\tYes\nIs this artwork by Monet? '
        'Please answer yes or no.\tNo\n')
    _image(root / 'mme' / 'artwork' / 'images' / '10002.jpg', 'blue')
    _write(root / 'scienceqa' / 'problems.json', {
        '5': {'question': 'Which is warmer?', 'choices': ['ice', 'tea'], 'answer': 1, 'hint': 'Tea is hot.',
              'image': 'image.png'},
        '6': {'question': 'Text only?', 'choices': ['a', 'b'], 'answer': 0, 'hint': '', 'image': None}})
    _write(root / 'scienceqa' / 'pid_splits.json', {'test': ['5', '6'], 'train': []})
    _image(root / 'scienceqa' / 'images' / 'test' / '5' / 'image.png')
    _write(root / 'textvqa' / 'TextVQA_0.5.1_val.json', {'data': [
        {'question_id': 34602, 'question': 'what is the brand of the TV?', 'image_id': '003a8ae2ef43b901',
         'answers': ['nokia'] * 10}]})
    _image(root / 'textvqa' / 'train_images' / '003a8ae2ef43b901.jpg')
    (root / 'textvqa' / 'llava_textvqa_val_v051_ocr.jsonl').write_text(json.dumps(
        {'question_id': 34602, 'image': '003a8ae2ef43b901.jpg', 'text': 'What is the brand of the tv?\nReference OCR '
         'token: NOKIA, 3310\nAnswer the question using a single word or phrase.'}) + '\n')
    _write(root / 'gqa' / 'testdev_balanced_questions.json', {
        '201307251': {'imageId': 'n161313', 'question': 'Is it overcast?', 'answer': 'no'}})
    _image(root / 'gqa' / 'images' / 'n161313.jpg')
    _write(root / 'okvqa' / 'OpenEnded_mscoco_val2014_questions.json', {'questions': [
        {'image_id': 7, 'question_id': 70, 'question': 'What sport is this?'}]})
    _write(root / 'okvqa' / 'mscoco_val2014_annotations.json', {'annotations': [
        {'image_id': 7, 'question_id': 70, 'answers': [{'answer': 'tennis'}] * 10}]})
    _image(root / 'okvqa' / 'val2014' / 'COCO_val2014_000000000007.jpg')


def test_the_readers_take_the_published_layouts_with_the_default_prompts(tmp_path):
    _copies(tmp_path)
    pope = tasks.read_pope(tmp_path / 'pope')
    assert [s.meta['split'] for s in pope] == ['random'] * 2 + ['popular'] * 2 + ['adversarial'] * 2
    assert pope[0].prompt == f'Is there a dog in the image?\n{tasks.SHORT}'
    mme = tasks.read_mme(tmp_path / 'mme')
    assert [(s.meta['subtask'], s.meta['label']) for s in mme] == [('existence', 'Yes'), ('existence', 'No'),
                                                                    ('artwork', 'Yes'), ('artwork', 'No')]
    assert mme[0].prompt == f'Is there a train in this image?\n{tasks.SHORT}'  # "Please answer yes or no." replaced
    assert mme[2].image.name == '10002.jpg'
    sqa = tasks.read_scienceqa(tmp_path / 'scienceqa')
    assert [s.id for s in sqa] == ['5']  # ScienceQA-IMG: the question with an image
    assert sqa[0].prompt == f'Context: Tea is hot.\nWhich is warmer?\nA. ice\nB. tea\n{tasks.LETTER_PROMPT}'
    assert sqa[0].meta == {'answer': 'B', 'options': 2}
    assert tasks.read_okvqa(tmp_path / 'okvqa')[0].meta['answers'] == ['tennis'] * 10
    ocr = tasks.read_textvqa_ocr(tmp_path / 'textvqa')  # LLaVA-1.5's question file, asked as written
    assert [(s.id, s.image.name, s.meta) for s in ocr] == [('34602', '003a8ae2ef43b901.jpg', {'answers': ['nokia'] * 10})]
    assert ocr[0].prompt == f'What is the brand of the tv?\nReference OCR token: NOKIA, 3310\n{tasks.SHORT}'
    (tmp_path / 'textvqa' / 'llava_textvqa_val_v051_ocr.jsonl').write_text('{"question_id": 9, "text": "q"}\n')
    with pytest.raises(DataError, match='line 1 has no image'):
        tasks.read_textvqa_ocr(tmp_path / 'textvqa')


def test_every_task_runs_on_a_model_and_its_rows_are_the_official_scores_of_its_predictions(tmp_path):
    _copies(tmp_path / 'data')
    write_chat_language_model(tmp_path / 'lm')
    recipe = {'model': {'type': 'build_vlm', 'vision': 'diffclip-tiny', 'language_model': str(tmp_path / 'lm'),
                        'select_layer': -2, 'projector': 'mlp2x_gelu', 'sequence_mask': 'causal'},
              'data': {'type': 'conversations', 'json': 'unused.json', 'format': 'chat_template'}}
    (tmp_path / 'model.yaml').write_text(yaml.safe_dump(recipe))
    args = ['--model', tmp_path / 'model.yaml', '--data', tmp_path / 'data', '--out', tmp_path / 'out',
            '--max-new-tokens', '3', '--batch-size', '2', '--scoring', 'gqa=lmms_eval', '--scoring', 'okvqa=vqaeval']
    for task in ('pope', 'mme', 'scienceqa', 'textvqa', 'textvqa_ocr', 'gqa', 'okvqa'):
        args += ['--task', task]
    done = call(main, args, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / 'out' / 'results.json').read_text())['results']
    assert results['pope']['questions'] == 6 and results['pope']['left_out'] == 3  # image 2 does not open
    scoring = {'pope': 'pope', 'mme': 'mme', 'scienceqa': 'llava', 'textvqa': 'llava', 'textvqa_ocr': 'llava',
               'gqa': 'lmms_eval', 'okvqa': 'vqaeval'}  # the defaults, and the two named
    for task, scorer in scoring.items():
        rows = [json.loads(line) for line in (tmp_path / 'out' / f'{task}_predictions.jsonl').read_text().splitlines()]
        assert rows and all(isinstance(r['prediction'], str) for r in rows)
        assert results[task]['scoring'] == scorer, task
        assert results[task]['scores'] == tasks.TASKS[task].scorers[scorer](rows), task
    assert 'perception' in done.stdout and 'adversarial' in done.stdout
    assert 'gqa (1 answered; scored as lmms_eval)' in done.stdout


def test_scoring_names_a_scorer_per_task_or_one_for_every_task():
    asked = ['pope', 'gqa', 'textvqa_ocr']
    assert chosen_scorers(asked, []) == {'pope': 'pope', 'gqa': 'llava', 'textvqa_ocr': 'llava'}
    assert chosen_scorers(asked, ['lmms_eval', 'gqa=llava']) == {'pope': 'lmms_eval', 'gqa': 'llava',
                                                                  'textvqa_ocr': 'lmms_eval'}
    with pytest.raises(ValueError, match="pope has no scorer 'vqaeval' \\(its scorers: pope, lmms_eval\\); gqa has"):
        chosen_scorers(asked, ['vqaeval'])
    with pytest.raises(ValueError, match="no task 'gq'"):
        chosen_scorers(asked, ['gq=llava'])
    with pytest.raises(ValueError, match='mme is not among the tasks asked'):
        chosen_scorers(asked, ['mme=mme'])


def test_an_unknown_scorer_is_refused_before_any_data_is_read(tmp_path):
    done = call(main, ['--model', 'nothing.yaml', '--task', 'mme', '--data', tmp_path / 'nowhere', '--out',
                       tmp_path / 'out', '--scoring', 'mme=llava'], tmp_path)
    assert done.returncode == 2 and "mme has no scorer 'llava' (its scorers: mme, lmms_eval)" in done.stderr


def test_a_missing_copy_is_named_before_any_model_is_built(tmp_path):
    _copies(tmp_path / 'data')
    (tmp_path / 'data' / 'gqa' / 'testdev_balanced_questions.json').unlink()
    done = call(main, ['--model', 'nothing.yaml', '--task', 'gqa', '--data', tmp_path / 'data', '--out',
                       tmp_path / 'out'], tmp_path)
    assert done.returncode == 2 and 'testdev_balanced_questions.json: not found' in done.stderr
    absent = call(main, ['--model', 'nothing.yaml', '--task', 'mme', '--data', tmp_path / 'nowhere', '--out',
                         tmp_path / 'out'], tmp_path)
    assert absent.returncode == 2 and 'nowhere/mme: no such folder' in absent.stderr
