"""`python -m diffzoo.data llava-qa`: each of eRAM-V's seven QA sets written in its published layout, converted
into one LLaVA-format JSON that the conversation loader reads whole; a missing image left out and counted, a
missing annotation file and a set outside the image root refused by name."""
import json

from PIL import Image

from diffzoo.data.__main__ import main
from diffzoo.vlm.conversations import load_conversations
from tests.factory import call

PROMPT = 'Answer the question using a single word or phrase.'


def _image(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new('RGB', (8, 8), 'red').save(path)


def _write(path, value):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value))


def _sets(root):
    """One or two samples of each set, as its files are published; VQAv2's second image is missing."""
    v = root / 'vqav2'
    _write(v / 'v2_OpenEnded_mscoco_train2014_questions.json', {'questions': [
        {'image_id': 1, 'question_id': 10, 'question': 'what color?'},
        {'image_id': 2, 'question_id': 20, 'question': 'how many?'}]})
    _write(v / 'v2_mscoco_train2014_annotations.json', {'annotations': [
        {'image_id': 1, 'question_id': 10, 'multiple_choice_answer': 'red', 'answers': [{'answer': 'red'}]},
        {'image_id': 2, 'question_id': 20, 'multiple_choice_answer': '2', 'answers': [{'answer': '2'}]}]})
    _image(v / 'train2014' / 'COCO_train2014_000000000001.jpg')
    o = root / 'okvqa'
    _write(o / 'OpenEnded_mscoco_train2014_questions.json', {'questions': [
        {'image_id': 3, 'question_id': 30, 'question': 'what sport?'}]})
    _write(o / 'mscoco_train2014_annotations.json', {'annotations': [{'image_id': 3, 'question_id': 30, 'answers': [
        {'answer': 'tennis'}, {'answer': 'golf'}, {'answer': 'golf'}]}]})
    _image(o / 'train2014' / 'COCO_train2014_000000000003.jpg')
    z = root / 'vizwiz'
    _write(z / 'Annotations' / 'train.json', [{'image': 'VizWiz_train_00000000.jpg', 'question': 'what is this?',
                                               'answers': [{'answer': 'soup'}, {'answer': 'soup'},
                                                           {'answer': 'can'}]}])
    _image(z / 'train' / 'VizWiz_train_00000000.jpg')
    g = root / 'gqa'
    _write(g / 'train_balanced_questions.json', {'07333408': {'imageId': '2375429', 'question': 'is it sunny?',
                                                              'answer': 'yes', 'fullAnswer': 'Yes, it is.'},
                                                 '07333409': {'imageId': '2375429', 'question': 'any car?',
                                                              'answer': '', 'fullAnswer': ''}})
    _image(g / 'images' / '2375429.jpg')
    r = root / 'ocrvqa'
    _write(r / 'dataset.json', {'465046462': {'imageURL': 'http://x/465046462.png', 'split': 1, 'title': 't',
                                              'questions': ['who wrote this?', 'is this a novel?'],
                                              'answers': ['Jane Doe', 'No']},
                                '111': {'imageURL': 'http://x/111.jpg', 'split': 3, 'questions': ['q'], 'answers': ['a']}})
    _image(r / 'images' / '465046462.png')
    d = root / 'docvqa'
    _write(d / 'train_v1.0_withQT.json', {'data': [{'questionId': 52212, 'question': 'what is the date?',
                                                     'image': 'documents/txpn0095_1.png', 'answers': ['1/8/93']}]})
    _image(d / 'documents' / 'txpn0095_1.png')
    c = root / 'chartqa'
    _write(c / 'train' / 'train_human.json', [{'imgname': '41699051005347.png', 'query': 'highest value?',
                                                'label': '47'}])
    _write(c / 'train' / 'train_augmented.json', [{'imgname': '41699051005347.png', 'query': 'lowest value?',
                                                    'label': 3}])
    _image(c / 'train' / 'png' / '41699051005347.png')


SETS = ('vqav2', 'okvqa', 'vizwiz', 'gqa', 'ocrvqa', 'docvqa', 'chartqa')


def test_every_set_is_converted_into_llava_json_and_loads_whole(tmp_path):
    root = tmp_path / 'data'
    _sets(root)
    args = ['llava-qa', tmp_path / 'qa.json', '--image-root', root]
    for name in SETS:
        args += [f'--{name}', root / name]
    done = call(main, args, tmp_path)
    assert done.returncode == 0, done.stderr
    records = json.loads((tmp_path / 'qa.json').read_text())
    by_id = {r['id']: r for r in records}
    assert sorted(by_id) == ['chartqa-train_augmented-0', 'chartqa-train_human-0', 'docvqa-52212', 'gqa-07333408',
                             'ocrvqa-465046462-0', 'ocrvqa-465046462-1', 'okvqa-30', 'vizwiz-VizWiz_train_00000000.jpg',
                             'vqav2-10']
    assert by_id['vqav2-10'] == {'id': 'vqav2-10', 'image': 'vqav2/train2014/COCO_train2014_000000000001.jpg',
                                 'conversations': [{'from': 'human', 'value': f'<image>\nwhat color?\n{PROMPT}'},
                                                   {'from': 'gpt', 'value': 'red'}]}
    answers = {k: r['conversations'][1]['value'] for k, r in by_id.items()}
    assert (answers['okvqa-30'], answers['vizwiz-VizWiz_train_00000000.jpg'], answers['chartqa-train_augmented-0'],
            answers['ocrvqa-465046462-1'], answers['docvqa-52212']) == ('golf', 'soup', '3', 'No', '1/8/93')
    assert by_id['ocrvqa-465046462-0']['image'] == 'ocrvqa/images/465046462.png'
    table = {line.split()[0]: line.split()[1:] for line in done.stdout.splitlines()[1:8]}
    assert table['vqav2'] == ['1', '1', '0'] and table['gqa'] == ['1', '0', '1']  # kept, no image, no answer
    kept, problems = load_conversations(tmp_path / 'qa.json', root)
    assert len(kept) == len(records) and not problems.left_out and not problems.truncated


def test_a_missing_annotation_file_and_a_set_outside_the_image_root_are_named(tmp_path):
    root = tmp_path / 'data'
    _sets(root)
    (root / 'gqa' / 'train_balanced_questions.json').unlink()
    done = call(main, ['llava-qa', tmp_path / 'qa.json', '--image-root', root, '--gqa', root / 'gqa'], tmp_path)
    assert done.returncode == 2 and 'train_balanced_questions.json: no such file' in done.stderr
    elsewhere = call(main, ['llava-qa', tmp_path / 'qa.json', '--image-root', root / 'vqav2', '--okvqa',
                            root / 'okvqa'], tmp_path)
    assert elsewhere.returncode == 2 and 'is not inside --image-root' in elsewhere.stderr
    assert not (tmp_path / 'qa.json').exists()


def test_records_that_would_leave_the_image_root_or_are_not_in_the_layout_are_left_out_and_counted(tmp_path):
    """What the JSON could not hold safely is left out, counted per set under its reason: an image path with `..`
    or absolute outside --image-root (an absolute one inside it is written relative), an answer that is not a
    string, a record missing a field or with a field of another type; nothing written holds `..`."""
    from diffzoo.data.llava_qa import convert
    root = tmp_path / 'data'
    _image(tmp_path / 'outside.png')
    _image(root / 'docvqa' / 'documents' / 'a.png')
    doc = [{'questionId': 1, 'question': 'q', 'image': '../../outside.png', 'answers': ['a']},
           {'questionId': 2, 'question': 'q', 'image': 'documents/../documents/a.png', 'answers': ['a']},
           {'questionId': 3, 'question': 'q', 'image': str(tmp_path / 'outside.png'), 'answers': ['a']},
           {'questionId': 4, 'question': 'q', 'image': str(root / 'docvqa' / 'documents' / 'a.png'), 'answers': ['a']},
           {'questionId': 5, 'question': 'q', 'image': 7, 'answers': ['a']},
           {'questionId': 6, 'question': 'q', 'image': 'x' * 300 + '.png', 'answers': ['a']},
           {'questionId': 7, 'question': 'q', 'image': 'documents/a.png', 'answers': ['a']}]
    _write(root / 'docvqa' / 'train_v1.0.json', {'data': doc})
    _image(root / 'gqa' / 'images' / '1.jpg')
    _write(root / 'gqa' / 'train_balanced_questions.json', {
        '10': {'imageId': '1', 'question': 'how many?', 'answer': 2}, '11': {'imageId': '1', 'question': 'q'},
        '12': {'imageId': '1', 'question': 'any car?', 'answer': 'no'}, '13': ['not', 'a', 'record']})
    report = convert({'docvqa': root / 'docvqa', 'gqa': root / 'gqa'}, root, tmp_path / 'qa.json')
    records = json.loads((tmp_path / 'qa.json').read_text())
    assert {r['id']: r['image'] for r in records} == {'docvqa-4': 'docvqa/documents/a.png',
                                                       'docvqa-7': 'docvqa/documents/a.png',
                                                       'gqa-12': 'gqa/images/1.jpg'}
    assert report.left_out == {'docvqa': {'image path outside --image-root (a ../ component)': 2,
                                          'image path outside --image-root (an absolute path)': 1,
                                          "not in the set's layout (a field of another type)": 1,
                                          'image path refused by the system (File name too long)': 1},
                               'gqa': {'question or answer not a string': 1,
                                       "not in the set's layout (no 'answer' field)": 1,
                                       "not in the set's layout (a field of another type)": 1}}
    assert report.rows() == [('gqa', 1, 0, 0), ('docvqa', 2, 0, 0)]
    assert ('docvqa: 2 left out: image path outside --image-root (a ../ component) (e.g. docvqa-1)'
            in report.notes())
    done = call(main, ['llava-qa', tmp_path / 'cli.json', '--image-root', root, '--docvqa', root / 'docvqa'],
                tmp_path)
    assert done.returncode == 0, done.stderr
    assert '..' not in (tmp_path / 'cli.json').read_text()


def test_an_annotation_file_that_is_not_json_is_named_with_where(tmp_path):
    root = tmp_path / 'data'
    _sets(root)
    (root / 'gqa' / 'train_balanced_questions.json').write_text('{"07333408": {"imageId": "2375429",\n  "question"')
    done = call(main, ['llava-qa', tmp_path / 'qa.json', '--image-root', root, '--gqa', root / 'gqa'], tmp_path)
    assert done.returncode == 2
    assert "train_balanced_questions.json: not valid JSON (Expecting ':' delimiter at line 2 column 13" in done.stderr
    (root / 'gqa' / 'train_balanced_questions.json').write_bytes(b'{"q": "\xff"}')
    done = call(main, ['llava-qa', tmp_path / 'qa.json', '--image-root', root, '--gqa', root / 'gqa'], tmp_path)
    assert done.returncode == 2 and 'train_balanced_questions.json: not UTF-8 text (byte 7' in done.stderr
    assert not (tmp_path / 'qa.json').exists()


def test_coco_records_without_their_question_id_are_left_out_and_counted_and_a_file_of_another_layout_named(tmp_path):
    """OK-VQA and VQAv2 as hostile copies hold them: a question record without `question_id` (left out, counted once
    as a question), an annotation whose question_id names no question (left out, counted; it was skipped unnamed),
    an annotation without `question_id`; the other questions are converted. A questions file without its
    "questions" list, or a GQA file that is a list, stops the command naming the file (not a KeyError)."""
    root = tmp_path / 'data'
    o = root / 'okvqa'
    _write(o / 'OpenEnded_mscoco_train2014_questions.json', {'questions': [
        {'image_id': 3, 'question_id': 30, 'question': 'what sport?'},
        {'image_id': 3, 'question': 'an id lost?'}]})
    _write(o / 'mscoco_train2014_annotations.json', {'annotations': [
        {'image_id': 3, 'question_id': 30, 'answers': [{'answer': 'golf'}]},
        {'image_id': 3, 'question_id': 31, 'answers': [{'answer': 'tennis'}]},
        {'image_id': 3, 'answers': [{'answer': 'polo'}]}]})
    _image(o / 'train2014' / 'COCO_train2014_000000000003.jpg')
    done = call(main, ['llava-qa', tmp_path / 'qa.json', '--image-root', root, '--okvqa', o], tmp_path)
    assert done.returncode == 0, done.stderr
    assert [r['id'] for r in json.loads((tmp_path / 'qa.json').read_text())] == ['okvqa-30']
    out = done.stdout + done.stderr
    assert "okvqa: 1 left out: not in the set's layout (a question: no 'question_id' field)" in out
    assert "okvqa: 1 left out: not in the set's layout (no 'question_id' field)" in out
    assert 'okvqa: 1 left out: question_id not in OpenEnded_mscoco_train2014_questions.json' in out

    _write(o / 'OpenEnded_mscoco_train2014_questions.json', [{'image_id': 3, 'question_id': 30, 'question': 'q'}])
    done = call(main, ['llava-qa', tmp_path / 'qa2.json', '--image-root', root, '--okvqa', o], tmp_path)
    assert done.returncode == 2
    assert ('OpenEnded_mscoco_train2014_questions.json: not a JSON object with a "questions" list, as the set '
            'publishes it' in done.stderr), done.stderr
    assert 'Traceback' not in done.stderr and not (tmp_path / 'qa2.json').exists()
    _write(root / 'gqa' / 'train_balanced_questions.json', [{'imageId': '1', 'question': 'q', 'answer': 'a'}])
    done = call(main, ['llava-qa', tmp_path / 'qa3.json', '--image-root', root, '--gqa', root / 'gqa'], tmp_path)
    assert done.returncode == 2 and 'train_balanced_questions.json: not a JSON object, as the set' in done.stderr
