"""`python -m diffzoo.eval.lmm`: every benchmark read from a local copy in its published layout, answered by a
real (untrained) build_vlm model in the recipe's conversation format, each task's rows scored by the official
scoring from the predictions file it writes; an unreadable image left out and counted; a missing copy named; a
benchmark file's bad questions (malformed lines, missing or non-yes/no labels, repeated ids, image names outside
the folder) left out, counted by reason and named while the rest are answered; --limit 0 and a missing --stage
refused before any model is built."""
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
    with pytest.raises(DataError, match='llava_textvqa_val_v051_ocr.jsonl:1: no image'):  # alone, a reader refuses
        tasks.read_textvqa_ocr(tmp_path / 'textvqa')


def tiny_recipe(root):
    """A build_vlm recipe (diffclip-tiny and a tiny random chat LM) in root/model.yaml."""
    write_chat_language_model(root / 'lm')
    recipe = {'model': {'type': 'build_vlm', 'vision': 'diffclip-tiny', 'language_model': str(root / 'lm'),
                        'select_layer': -2, 'projector': 'mlp2x_gelu', 'sequence_mask': 'causal'},
              'data': {'type': 'conversations', 'json': 'unused.json', 'format': 'chat_template'}}
    (root / 'model.yaml').write_text(yaml.safe_dump(recipe))
    return root / 'model.yaml'


def test_every_task_runs_on_a_model_and_its_rows_are_the_official_scores_of_its_predictions(tmp_path):
    _copies(tmp_path / 'data')
    args = ['--model', tiny_recipe(tmp_path), '--data', tmp_path / 'data', '--out', tmp_path / 'out',
            '--max-new-tokens', '3', '--batch-size', '2', '--scoring', 'gqa=lmms_eval', '--scoring', 'okvqa=vqaeval']
    for task in ('pope', 'mme', 'scienceqa', 'textvqa', 'textvqa_ocr', 'gqa', 'okvqa'):
        args += ['--task', task]
    done = call(main, args, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / 'out' / 'results.json').read_text())['results']
    assert f'predictions: {tmp_path / "out" / "pope_predictions.jsonl"}, {tmp_path / "out" / "mme_predictions.jsonl"}' \
        in done.stdout  # the files written, by name
    assert (results['pope']['questions'], results['pope']['answered']) == (6, 3)
    assert results['pope']['left_out'] == {'image does not open': 3}  # image 2
    assert results['pope']['left_out_examples']['image does not open'] == [
        str(tmp_path / 'data' / 'pope' / 'val2014' / 'COCO_val2014_000000000002.jpg')] * 3
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
    absent = call(main, ['--model', 'nothing.yaml', '--task', 'mme', '--task', 'pope', '--task', 'gqa', '--data',
                         tmp_path / 'nowhere', '--out', tmp_path / 'out'], tmp_path)
    assert absent.returncode == 2 and '3 of the tasks\' folders missing' in absent.stderr
    assert all(f'nowhere/{task}: no such folder' in absent.stderr for task in ('mme', 'pope', 'gqa'))  # all at once


def _pope_lines(root, lines):
    """POPE's three files under root/pope/coco, each holding `lines` (strings, as written), and images red.jpg
    and blue.jpg in val2014/."""
    for split in tasks.POPE_SPLITS:
        (root / 'pope' / 'coco').mkdir(parents=True, exist_ok=True)
        (root / 'pope' / 'coco' / f'coco_pope_{split}.json').write_text(''.join(line + '\n' for line in lines))
    _image(root / 'pope' / 'val2014' / 'red.jpg')
    _image(root / 'pope' / 'val2014' / 'blue.jpg', 'blue')


def _q(qid, image='red.jpg', **fields):
    return json.dumps({'question_id': qid, 'image': image, 'text': f'Is there a thing {qid}?', 'label': 'yes',
                       **fields})


def test_bad_questions_are_left_out_counted_by_reason_and_named_and_the_others_answered_and_scored(tmp_path):
    """Before: a repeated question_id was scored with the other question's reply, a label 'maybe' vanished from
    every split's counts, an integer label crashed the scoring after all answers, a malformed line or a missing
    label ended the run with a traceback, and '../' or absolute image names were read outside the folder."""
    outside = tmp_path / 'elsewhere' / 'secret.jpg'
    _image(outside, 'white')
    (tmp_path / 'data' / 'pope' / 'val2014').mkdir(parents=True)
    (tmp_path / 'data' / 'pope' / 'val2014' / 'linked.jpg').symlink_to(outside)  # a symlink stays allowed
    lines = [_q(1), _q(1, 'blue.jpg', label='no'), _q(2, label='maybe'), _q(3, label=1), '{"question_id": 4, "ima',
             json.dumps({'question_id': 5, 'image': 'red.jpg', 'text': 'Is it red?'}), _q(6, '../../elsewhere/x.jpg'),
             _q(7, str(outside)), _q(8, 'linked.jpg', label='no'), _q(9, 'blue.jpg', label=' No ')]
    _pope_lines(tmp_path / 'data', lines)
    done = call(main, ['--model', tiny_recipe(tmp_path), '--task', 'pope', '--data', tmp_path / 'data', '--out',
                       tmp_path / 'out', '--max-new-tokens', '2'], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    pope = json.loads((tmp_path / 'out' / 'results.json').read_text())['results']['pope']
    assert pope['left_out'] == {'repeated question id (the first is kept)': 3, 'label not yes or no': 6,
                                'malformed line (not a JSON object)': 3, 'no label': 3,
                                'image name leaves the benchmark folder': 6}
    assert (pope['questions'], pope['answered'], pope['reused']) == (9, 9, 0)  # 1, 8, 9 of each split
    assert sum(split['questions'] for split in pope['scores'].values()) == 9
    rows = [json.loads(line) for line in (tmp_path / 'out' / 'pope_predictions.jsonl').read_text().splitlines()]
    assert [r['id'] for r in rows] == [f'{split}-{q}' for split in tasks.POPE_SPLITS for q in (1, 8, 9)]
    assert rows[0]['label'] == 'yes' and rows[0]['image'].endswith('red.jpg')  # the first of the repeated id
    random = tmp_path / 'data' / 'pope' / 'coco' / 'coco_pope_random.json'
    for named in (f'{random}:2 (question random-1)', f"{random}:3 (label 'maybe')", f'{random}:4 (label 1)',
                  f'{random}:5', f'{random}:6', f"{random}:7 ('../../elsewhere/x.jpg': a ../ component)",
                  f"{random}:8 ('{outside}': an absolute path)"):
        assert named in done.stdout, named
    assert 'pope (9 answered, 6 left out: label not yes or no, 3 left out: malformed line (not a JSON object), ' \
        '3 left out: no label, 6 left out: image name leaves the benchmark folder, 3 left out: repeated question id' \
        in done.stdout


def test_limit_0_a_stage_that_is_not_there_and_an_unknown_recipe_are_refused_before_any_model_is_built(tmp_path):
    """Before: --limit 0 answered every question (0 is falsy), and a --stage folder that does not exist ended the
    run with a FileNotFoundError traceback once the model was built; a stage that trained nothing, or whose weights
    are cut short, is refused as a chain refuses it."""
    _pope_lines(tmp_path / 'data', [_q(1)])
    base = ['--model', 'nothing.yaml', '--task', 'pope', '--data', tmp_path / 'data', '--out', tmp_path / 'out']
    zero = call(main, [*base, '--limit', '0'], tmp_path)
    assert zero.returncode == 2 and "argument --limit: '0': a whole number, 1 or more" in zero.stderr
    stage = call(main, [*base, '--stage', tmp_path / 'runs' / 'missing'], tmp_path)  # no recipe nothing.yaml either
    assert stage.returncode == 2, stage.stderr[-2000:]
    assert f'error: --stage {tmp_path / "runs" / "missing"}: no such folder (a finished stage writes ' \
           f'stage/stage.json and stage_model.safetensors)' in stage.stderr
    (tmp_path / 'runs' / 'unfinished' / 'stage').mkdir(parents=True)
    (tmp_path / 'runs' / 'unfinished' / 'stage' / 'stage.json').write_text('{}')
    half = call(main, [*base, '--stage', tmp_path / 'runs' / 'unfinished'], tmp_path)
    assert half.returncode == 2 and f'no stage_model.safetensors in {tmp_path / "runs" / "unfinished" / "stage"}' \
        in half.stderr
    (tmp_path / 'runs' / 'unfinished' / 'stage' / 'stage.json').write_text('{"steps": 0}')
    (tmp_path / 'runs' / 'unfinished' / 'stage' / 'stage_model.safetensors').write_bytes(b'')
    empty = call(main, [*base, '--stage', tmp_path / 'runs' / 'unfinished'], tmp_path)
    assert empty.returncode == 2 and 'stage.json records 0 steps: that stage trained nothing' in empty.stderr
    (tmp_path / 'runs' / 'unfinished' / 'stage' / 'stage.json').write_text('{"steps": 3}')
    cut = call(main, [*base, '--stage', tmp_path / 'runs' / 'unfinished'], tmp_path)
    assert cut.returncode == 2 and f'error: --stage {tmp_path / "runs" / "unfinished"}: ' in cut.stderr, cut.stderr
    recipe = call(main, base, tmp_path)  # before: a RecipeError traceback
    assert recipe.returncode == 2 and "error: no recipe 'nothing.yaml'" in recipe.stderr
    assert not (tmp_path / 'out').exists()


def test_a_line_or_file_that_is_not_utf8_is_left_out_and_counted(tmp_path):
    """A Latin-1 MME line, a folder named like an answer file and a POPE line that is not UTF-8 ended the run with a
    UnicodeDecodeError or IsADirectoryError; each is left out, counted and named, and the rest is read."""
    from diffzoo.eval.lmm.records import LeftOut, read_json
    _copies(tmp_path)
    txt = tmp_path / 'mme' / 'existence' / '000000006040.txt'
    txt.write_bytes(txt.read_bytes() + 'Is there a caf\xe9 in this image? Please answer yes or no.\tYes\n'.encode('latin-1'))
    (tmp_path / 'mme' / 'existence' / 'extra.txt').mkdir()
    left_out = LeftOut()
    assert len(tasks.read_mme(tmp_path / 'mme', left_out)) == 4
    assert left_out.named == {'line not UTF-8': [f'{txt}:3'],
                              'answer file not a file': [str(tmp_path / 'mme' / 'existence' / 'extra.txt')]}
    pope = tmp_path / 'pope' / 'coco' / 'coco_pope_random.json'
    pope.write_bytes(pope.read_bytes() + b'\n' + '{"question_id": 3, "text": "caf\xe9"}'.encode('latin-1'))
    left_out = LeftOut()
    assert len(tasks.read_pope(tmp_path / 'pope', left_out)) == 6
    assert left_out.named == {'malformed line (not a JSON object)': [f'{pope}:3']}
    (tmp_path / 'utf16.json').write_bytes(json.dumps({'a': 1}).encode('utf-16'))
    assert read_json(tmp_path / 'utf16.json') == {'a': 1}  # JSON's own encodings are read
    (tmp_path / 'latin1.json').write_bytes('{"a": "caf\xe9"}'.encode('latin-1'))
    with pytest.raises(DataError, match=r'latin1\.json: not JSON \(.utf-8. codec'):
        read_json(tmp_path / 'latin1.json')


def test_a_run_of_another_task_into_the_same_out_keeps_the_results_before_it(tmp_path):
    """results.json held only the last run's tasks: POPE's scores were gone once MME ran into the same --out."""
    _copies(tmp_path / 'data')
    common = ['--model', tiny_recipe(tmp_path), '--data', tmp_path / 'data', '--out', tmp_path / 'out',
              '--max-new-tokens', '2', '--batch-size', '2']
    assert call(main, [*common, '--task', 'pope'], tmp_path).returncode == 0
    pope = json.loads((tmp_path / 'out' / 'results.json').read_text())['results']['pope']
    assert call(main, [*common, '--task', 'mme'], tmp_path).returncode == 0
    results = json.loads((tmp_path / 'out' / 'results.json').read_text())['results']
    assert list(results) == ['pope', 'mme'] and results['pope'] == pope
    assert pope['answered_by']['max_new_tokens'] == 2 and results['mme']['answered_by']['model'] == str(common[1])


def test_a_recipe_without_a_conversation_format_over_a_tokenizer_without_bos_is_refused(tmp_path):
    """The VQA prompt layout starts with BOS, which a Qwen2-style tokenizer has none of: refused before any question
    is asked (it was a traceback mid-run), as its training refuses it."""
    from diffzoo.recipes import RecipeError
    from diffzoo.vlm.factory import vlm_from_recipe
    recipe = yaml.safe_load(tiny_recipe(tmp_path).read_text())
    del recipe['data']
    (tmp_path / 'vqa.yaml').write_text(yaml.safe_dump(recipe))
    with pytest.raises(RecipeError, match=r"tokenizer \(\w+\) has no BOS token, which the VQA prompt layout"):
        vlm_from_recipe(str(tmp_path / 'vqa.yaml'))
    from diffzoo.vlm.factory import load_vlm  # the model built directly: refused at its first question, named
    vlm = load_vlm(recipe['model'])
    with pytest.raises(ValueError, match=r'tokenizer \(\w+\) has no BOS token, .* set prompt_format to the '):
        vlm.answer([Image.new('RGB', (32, 32))], ['what is this?'])
