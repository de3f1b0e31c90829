"""The benchmark readers on the layouts their files come in: MME as its zip unpacks (the release folder inside the
task's folder, or once more in MME_Benchmark/ as the Hugging Face copy holds it), each subtask in its own
sub-layout; ScienceQA as LLaVA-1.5's evaluation ships it (llava_test_CQM-A.json and images/test/<pid>/image.png),
with or without ScienceQA's problems.json beside it; and the errors that name every place looked at. A question
its files give badly (a repeated id, a label not yes/no, a line that is not question<TAB>answer, an image name that
leaves the folder) is left out by `Task.questions`, counted by reason and named, and refused by a reader alone."""
import json

import pytest
from PIL import Image

from diffzoo.data.shards import DataError
from diffzoo.eval.lmm import scienceqa, tasks

LETTERS = "Answer with the option's letter from the given choices directly."
SHORT = 'Answer the question using a single word or phrase.'


def _image(path, colour='red', size=(40, 30)):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new('RGB', size, colour).save(path)


def _mme_release(release):
    """Three MME subtasks as the release holds them: artwork (images/ and questions_answers_YN/), existence
    (.jpg beside its .txt) and code_reasoning (.png beside its .txt)."""
    qa = release / 'artwork' / 'questions_answers_YN'
    qa.mkdir(parents=True)
    (qa / '10002.txt').write_text('Does this artwork exist in the form of painting? Please answer yes or no.\tYes\n'
                                  'Does this artwork exist in the form of glassware? Please answer yes or no.\tNo\n')
    _image(release / 'artwork' / 'images' / '10002.jpg', 'blue')
    (release / 'existence' / '000000006040.txt').parent.mkdir(parents=True)
    (release / 'existence' / '000000006040.txt').write_text(
        'Is there a train in this image? Please answer yes or no.\tYes\n'
        'Is there a bed in this image? Please answer yes or no.\tNo\n')
    _image(release / 'existence' / '000000006040.jpg')
    (release / 'code_reasoning' / '0020.txt').parent.mkdir(parents=True)
    (release / 'code_reasoning' / '0020.txt').write_text(
        'The image shows a python code. Is the output of the code \'11\'? Please answer yes or no.\tNo\n')
    _image(release / 'code_reasoning' / '0020.png', 'green')


@pytest.mark.parametrize('inside', tasks.MME_RELEASE[:3])  # the task folder, the release folder, Hugging Face's
def test_mme_is_read_in_the_task_folder_or_in_the_release_folder_its_zip_unpacks_to(tmp_path, inside):
    _mme_release(tmp_path / 'mme' / inside)
    samples = tasks.TASKS['mme'].read(tmp_path / 'mme')
    release = (tmp_path / 'mme' / inside).resolve()
    assert [(s.id, s.image.resolve(), s.prompt, s.meta['label']) for s in samples] == [
        ('existence/000000006040/0', release / 'existence' / '000000006040.jpg',
         f'Is there a train in this image?\n{SHORT}', 'Yes'),
        ('existence/000000006040/1', release / 'existence' / '000000006040.jpg',
         f'Is there a bed in this image?\n{SHORT}', 'No'),
        ('artwork/10002/0', release / 'artwork' / 'images' / '10002.jpg',
         f'Does this artwork exist in the form of painting?\n{SHORT}', 'Yes'),
        ('artwork/10002/1', release / 'artwork' / 'images' / '10002.jpg',
         f'Does this artwork exist in the form of glassware?\n{SHORT}', 'No'),
        ('code_reasoning/0020/0', release / 'code_reasoning' / '0020.png',
         f'The image shows a python code. Is the output of the code \'11\'?\n{SHORT}', 'No')]
    assert {s.meta['subtask'] for s in samples} == {'existence', 'artwork', 'code_reasoning'}
    assert samples[-1].load_image().size == (40, 30)


def test_a_folder_without_mme_names_every_place_looked_at(tmp_path):
    (tmp_path / 'mme' / 'MME_Benchmark_release_version' / 'unrelated').mkdir(parents=True)
    with pytest.raises(DataError) as error:
        tasks.read_mme(tmp_path / 'mme')
    message = str(error.value)
    for place in ('mme', 'mme/MME_Benchmark_release_version', 'mme/MME_Benchmark_release_version/MME_Benchmark'):
        assert f'{tmp_path / place},' in message or f'{tmp_path / place};' in message, place
    assert 'existence' in message and 'unzip MME_Benchmark_release_version.zip' in message


def _llava_scienceqa(root, gpt=('B', 'A', 'C')):
    """LLaVA-1.5's llava_test_CQM-A.json as its evaluation ships it, for three test questions: 4 without an image,
    5 with an image and a context, 7 with an image and three options; their images/test/<pid>/image.png."""
    questions = [
        {'id': '4', 'conversations': [
            {'from': 'human', 'value': 'Which figure of speech is used in this text?\nSing, O goddess.\nA. chiasmus\n'
                                       'B. apostrophe'},
            {'from': 'gpt', 'value': gpt[0]}]},
        {'id': '5', 'image': '5/image.png', 'conversations': [
            {'from': 'human', 'value': '<image>\nContext: Tea is hot.\nWhich is warmer?\nA. ice\nB. tea'},
            {'from': 'gpt', 'value': gpt[1]}]},
        {'id': '7', 'image': '7/image.png', 'conversations': [
            {'from': 'human', 'value': '<image>\nWhich animal is shown?\nA. cat\nB. dog\nC. fish'},
            {'from': 'gpt', 'value': gpt[2]}]}]
    (root / 'llava_test_CQM-A.json').parent.mkdir(parents=True, exist_ok=True)
    (root / 'llava_test_CQM-A.json').write_text(json.dumps(questions, indent=2))
    _image(root / 'images' / 'test' / '5' / 'image.png', 'orange')
    _image(root / 'images' / 'test' / '7' / 'image.png', 'gray', (32, 32))


def _scienceqa_files(root):
    """ScienceQA's own problems.json and pid_splits.json for the same three questions."""
    root.mkdir(parents=True, exist_ok=True)
    (root / 'problems.json').write_text(json.dumps({
        '4': {'question': 'Which figure of speech is used in this text?', 'choices': ['chiasmus', 'apostrophe'],
              'answer': 1, 'hint': 'Sing, O goddess.', 'image': None, 'split': 'test'},
        '5': {'question': 'Which is warmer?', 'choices': ['ice', 'tea'], 'answer': 1, 'hint': 'Tea is hot.',
              'image': 'image.png', 'split': 'test'},
        '7': {'question': 'Which animal is shown?', 'choices': ['cat', 'dog', 'fish'], 'answer': 2, 'hint': '',
              'image': 'image.png', 'split': 'test'}}))
    (root / 'pid_splits.json').write_text(json.dumps({'test': ['4', '5', '7'], 'train': []}))


EXPECTED_PROMPTS = [f'Context: Tea is hot.\nWhich is warmer?\nA. ice\nB. tea\n{LETTERS}',
                    f'Which animal is shown?\nA. cat\nB. dog\nC. fish\n{LETTERS}']


def test_llava_scienceqa_questions_are_asked_as_model_vqa_science_asks_them(tmp_path):
    """Without problems.json the answer is the gpt turn's letter and the options are those in the prompt."""
    _llava_scienceqa(tmp_path / 'scienceqa')
    samples = tasks.TASKS['scienceqa'].read(tmp_path / 'scienceqa')
    assert [s.id for s in samples] == ['5', '7']  # ScienceQA-IMG: 4 has no image
    assert [s.prompt for s in samples] == EXPECTED_PROMPTS
    assert [s.meta for s in samples] == [{'answer': 'A', 'options': 2}, {'answer': 'C', 'options': 3}]
    assert [s.image for s in samples] == [tmp_path / 'scienceqa' / 'images' / 'test' / pid / 'image.png'
                                          for pid in ('5', '7')]
    assert [s.load_image().size for s in samples] == [(40, 30), (32, 32)]


def test_beside_problems_json_the_answers_are_scienceqas_and_both_layouts_ask_the_same(tmp_path):
    """LLaVA's eval_science_qa.py scores against problems.json: its answer wins over the gpt turn (here 'A' for
    question 5, whose answer is B). ScienceQA's own layout gives the same prompts and answers."""
    _llava_scienceqa(tmp_path / 'llava')
    _scienceqa_files(tmp_path / 'llava')
    llava = tasks.read_scienceqa(tmp_path / 'llava')
    assert [(s.id, s.prompt, s.meta) for s in llava] == [('5', EXPECTED_PROMPTS[0], {'answer': 'B', 'options': 2}),
                                                         ('7', EXPECTED_PROMPTS[1], {'answer': 'C', 'options': 3})]
    _scienceqa_files(tmp_path / 'own')
    for pid in ('5', '7'):
        _image(tmp_path / 'own' / 'images' / 'test' / pid / 'image.png')
    own = tasks.read_scienceqa(tmp_path / 'own')
    assert [(s.id, s.prompt, s.meta) for s in own] == [(s.id, s.prompt, s.meta) for s in llava]


def test_a_letter_prompt_already_in_the_question_is_not_asked_twice(tmp_path):
    _llava_scienceqa(tmp_path)
    questions = json.loads((tmp_path / 'llava_test_CQM-A.json').read_text())
    questions[1]['conversations'][0]['value'] += f'\n{LETTERS}'
    (tmp_path / 'llava_test_CQM-A.json').write_text(json.dumps(questions))
    assert tasks.read_scienceqa(tmp_path)[0].prompt == EXPECTED_PROMPTS[0]


def test_scienceqa_errors_name_both_layouts_and_a_gpt_turn_without_a_letter(tmp_path):
    (tmp_path / 'empty').mkdir()
    with pytest.raises(DataError, match="neither ScienceQA's problems.json .* nor LLaVA-1.5's llava_test_CQM-A.json"):
        tasks.read_scienceqa(tmp_path / 'empty')
    _llava_scienceqa(tmp_path / 'free', gpt=('B', 'The answer is A.', 'C'))
    with pytest.raises(DataError, match=r"entry 1 \(id 5\) \(answer 'The answer is A.', 2 options\): answer not one of "
                                        r"its option letters \(problems.json beside the file gives the answers\)"):
        tasks.read_scienceqa(tmp_path / 'free')
    _llava_scienceqa(tmp_path / 'beyond', gpt=('B', 'C', 'C'))  # question 5 has options A and B
    questions, left_out = tasks.TASKS['scienceqa'].questions(tmp_path / 'beyond')
    assert [s.id for s in questions] == ['7']
    assert left_out.named == {'answer not one of its option letters (problems.json beside the file gives the '
                                'answers)': [f"{tmp_path / 'beyond' / 'llava_test_CQM-A.json'} entry 1 (id 5) "
                                             f"(answer 'C', 2 options)"]}


def test_one_malformed_record_is_left_out_and_named_and_the_rest_are_asked(tmp_path):
    """Before: one record of another shape in ScienceQA's, LLaVA's TextVQA-OCR, GQA's or OK-VQA's files ended the
    whole task (a KeyError, or a DataError for the file)."""
    _llava_scienceqa(tmp_path / 'llava')
    _scienceqa_files(tmp_path / 'llava')
    entries = json.loads((tmp_path / 'llava' / 'llava_test_CQM-A.json').read_text())
    entries.insert(0, {'id': '9', 'image': '9/image.png', 'conversations': 'not a list'})
    entries.append({'id': '11', 'image': '7/image.png', 'conversations': entries[3]['conversations']})
    (tmp_path / 'llava' / 'llava_test_CQM-A.json').write_text(json.dumps(entries))
    _scienceqa_files(tmp_path / 'own')
    _image(tmp_path / 'own' / 'images' / 'test' / '7' / 'image.png')
    problems = json.loads((tmp_path / 'own' / 'problems.json').read_text())
    problems['5']['answer'] = 2  # beyond its two choices
    (tmp_path / 'own' / 'problems.json').write_text(json.dumps(problems))
    (tmp_path / 'own' / 'pid_splits.json').write_text(json.dumps({'test': ['4', '5', '7', '12']}))
    (tmp_path / 'textvqa').mkdir()
    (tmp_path / 'textvqa' / 'TextVQA_0.5.1_val.json').write_text(json.dumps({'data': [
        {'question_id': 1, 'question': 'what?', 'image_id': 'abc', 'answers': ['a'] * 10}, 'not a record']}))
    (tmp_path / 'textvqa' / 'llava_textvqa_val_v051_ocr.jsonl').write_text(''.join(
        json.dumps({'question_id': n, 'image': 'abc.jpg', 'text': 'q'}) + '\n' for n in (1, 2)))
    (tmp_path / 'gqa').mkdir()
    (tmp_path / 'gqa' / 'testdev_balanced_questions.json').write_text(json.dumps({
        '1': {'imageId': 'n1', 'question': 'q?', 'answer': 'no'}, '2': {'question': 'q?', 'answer': 'no'}}))
    (tmp_path / 'okvqa').mkdir()
    (tmp_path / 'okvqa' / 'OpenEnded_mscoco_val2014_questions.json').write_text(json.dumps({'questions': [
        {'question_id': n, 'image_id': 42, 'question': 'what?'} for n in (1, 2)]}))
    (tmp_path / 'okvqa' / 'mscoco_val2014_annotations.json').write_text(json.dumps({'annotations': [
        {'question_id': 1, 'image_id': 42, 'answers': [{'answer': 'cat'}] * 10},
        {'question_id': 2, 'image_id': 42, 'answers': 'cat'}]}))
    sqa_llava, sqa_own = tmp_path / 'llava' / 'llava_test_CQM-A.json', tmp_path / 'own' / 'problems.json'
    expected = {
        ('scienceqa', 'llava'): (['5', '7'], {
            "not {id, image, conversations: [human, gpt]} as LLaVA-1.5's llava_test_CQM-A.json": [f'{sqa_llava} entry 0'],
            scienceqa.NOT_A_PROBLEM: [f'{sqa_llava} entry 4 (id 11)']}),
        ('scienceqa', 'own'): (['7'], {scienceqa.NOT_A_PROBLEM: [f'{sqa_own} (pid 5)', f'{sqa_own} (pid 12)']}),
        ('textvqa', 'textvqa'): (['1'], {'not a JSON object': [f"{tmp_path / 'textvqa' / 'TextVQA_0.5.1_val.json'} "
                                                               f"entry 1"]}),
        ('textvqa_ocr', 'textvqa'): (['1'], {
            'question id not in TextVQA_0.5.1_val.json (both files must be TextVQA 0.5.1 val)': [
                f"{tmp_path / 'textvqa' / 'llava_textvqa_val_v051_ocr.jsonl'}:2 (question 2)"]}),
        ('gqa', 'gqa'): (['1'], {'no imageId': [f"{tmp_path / 'gqa' / 'testdev_balanced_questions.json'} question 2"]}),
        ('okvqa', 'okvqa'): (['1'], {'answers not a list of {answer: string}': [
            f"{tmp_path / 'okvqa' / 'mscoco_val2014_annotations.json'} entry 1 (question 2)"]}),
    }
    for (task, folder), (ids, named) in expected.items():
        questions, left_out = tasks.TASKS[task].questions(tmp_path / folder)
        assert ([s.id for s in questions], left_out.named) == (ids, named), (task, folder)
    with pytest.raises(DataError, match="testdev_balanced_questions.json question 2: no imageId"):
        tasks.read_gqa(tmp_path / 'gqa')  # a reader alone refuses the first


def test_a_field_of_another_type_is_left_out_named_by_its_record_and_the_rest_are_asked(tmp_path):
    """Before: an OK-VQA question without its id, or a TextVQA question that is not a string, ended the task before
    any inference (KeyError, AttributeError); TextVQA answers given as one string ended it after every question was
    answered (in scoring), a TextVQA-OCR text that is null at the first batch's tokenization; a GQA question that is
    null was asked as "None"; GQA and OK-VQA records were named by their file only."""
    (tmp_path / 'okvqa').mkdir()
    (tmp_path / 'okvqa' / 'OpenEnded_mscoco_val2014_questions.json').write_text(json.dumps({'questions': [
        {'question_id': 1, 'image_id': 42, 'question': 'what?'}, {'image_id': 42, 'question': 'no id?'},
        {'question_id': 3, 'image_id': 42, 'question': ['not', 'text']}]}))
    (tmp_path / 'okvqa' / 'mscoco_val2014_annotations.json').write_text(json.dumps({'annotations': [
        {'question_id': n, 'image_id': 42, 'answers': [{'answer': 'cat'}] * 10} for n in (1, 2, 3)]}))
    (tmp_path / 'textvqa').mkdir()
    (tmp_path / 'textvqa' / 'TextVQA_0.5.1_val.json').write_text(json.dumps({'data': [
        {'question_id': 1, 'question': 'what?', 'image_id': 'abc', 'answers': ['a'] * 10},
        {'question_id': 2, 'question': 7, 'image_id': 'abc', 'answers': ['a'] * 10},
        {'question_id': 3, 'question': 'what?', 'image_id': 'abc', 'answers': 'a'}]}))
    (tmp_path / 'textvqa' / 'llava_textvqa_val_v051_ocr.jsonl').write_text(''.join(
        json.dumps({'question_id': n, 'image': 'abc.jpg', 'text': text}) + '\n' for n, text in ((1, 'q'), (2, None))))
    (tmp_path / 'gqa').mkdir()
    (tmp_path / 'gqa' / 'testdev_balanced_questions.json').write_text(json.dumps({
        '1': {'imageId': 'n1', 'question': 'q?', 'answer': 'no'}, '2': {'imageId': 'n1', 'question': None,
                                                                        'answer': 'no'}}))
    okvqa, textvqa = tmp_path / 'okvqa', tmp_path / 'textvqa'
    expected = {
        ('okvqa', 'okvqa'): (['1'], {
            'no question_id': [f'{okvqa / "OpenEnded_mscoco_val2014_questions.json"} entry 1'],
            'question id not in OpenEnded_mscoco_val2014_questions.json': [
                f'{okvqa / "mscoco_val2014_annotations.json"} entry 1 (question 2)'],
            'question not a string': [f"{okvqa / 'OpenEnded_mscoco_val2014_questions.json'} entry 2 "
                                      f"(question ['not', 'text'])"]}),
        ('textvqa', 'textvqa'): (['1'], {
            'question not a string': [f'{textvqa / "TextVQA_0.5.1_val.json"} entry 1 (question 7)'],
            'answers not a list of strings': [f'{textvqa / "TextVQA_0.5.1_val.json"} entry 2']}),
        ('textvqa_ocr', 'textvqa'): (['1'], {
            'text not a string': [f'{textvqa / "llava_textvqa_val_v051_ocr.jsonl"}:2 (text None)']}),
        ('gqa', 'gqa'): (['1'], {
            'question not a string': [f'{tmp_path / "gqa" / "testdev_balanced_questions.json"} question 2 (question '
                                      f'None)']}),
    }
    for (task, folder), (ids, named) in expected.items():
        questions, left_out = tasks.TASKS[task].questions(tmp_path / folder)
        assert ([s.id for s in questions], left_out.named) == (ids, named), (task, folder)
        assert all(isinstance(s.prompt, str) for s in questions)
        tasks.TASKS[task].score(tasks.rows_for_scoring(questions, ['a'] * len(questions)))  # scored as they are


def test_an_mme_image_without_its_answer_file_is_named_and_counted(tmp_path):
    """Before: an image whose .txt was missing was passed over without a word (`mme: 5 questions`, nothing left
    out), in either sub-layout."""
    _mme_release(tmp_path / 'mme')
    _image(tmp_path / 'mme' / 'artwork' / 'images' / '10003.jpg')
    _image(tmp_path / 'mme' / 'existence' / '000000006041.png')
    (tmp_path / 'mme' / 'existence' / 'notes.md').write_text('not an image')
    questions, left_out = tasks.TASKS['mme'].questions(tmp_path / 'mme')
    assert len(questions) == 5
    assert left_out.named == {tasks.NO_ANSWER_FILE: [str(tmp_path / 'mme' / 'existence' / '000000006041.png'),
                                                     str(tmp_path / 'mme' / 'artwork' / 'images' / '10003.jpg')]}
    with pytest.raises(DataError, match=f'000000006041.png: image without its answer file'):
        tasks.read_mme(tmp_path / 'mme')  # a reader alone refuses the first


def test_a_repeated_question_id_keeps_the_first_question_and_leaves_out_every_repeat(tmp_path):
    """Before: replies were keyed by id, so the second question with an id was scored with the other's reply."""
    data = [{'question_id': 7, 'question': q, 'image_id': 'abc', 'answers': [a] * 10}
            for q, a in (('what brand?', 'nokia'), ('what year?', '1999'), ('what colour?', 'red'))]
    (tmp_path / 'TextVQA_0.5.1_val.json').write_text(json.dumps({'data': [*data, {**data[0], 'question_id': 8}]}))
    questions, left_out = tasks.TASKS['textvqa'].questions(tmp_path)
    assert [(s.id, s.meta['answers'][0]) for s in questions] == [('7', 'nokia'), ('8', 'nokia')]
    assert left_out.named == {tasks.REPEATED: [f'{tmp_path / "TextVQA_0.5.1_val.json"} entry {n} (question 7)'
                                               for n in (1, 2)]}


def test_image_names_that_leave_the_folder_are_left_out_in_every_reader_that_takes_a_name(tmp_path):
    """Before: '../' or an absolute image name was read wherever it pointed (hostile_name is the shards' rule)."""
    (tmp_path / 'textvqa').mkdir()
    (tmp_path / 'textvqa' / 'TextVQA_0.5.1_val.json').write_text(json.dumps({'data': [
        {'question_id': n, 'question': 'what?', 'image_id': image, 'answers': ['a'] * 10}
        for n, image in ((1, 'abc'), (2, '../../../etc/passwd'), (3, '/etc/passwd'))]}))
    (tmp_path / 'textvqa' / 'llava_textvqa_val_v051_ocr.jsonl').write_text(''.join(
        json.dumps({'question_id': n, 'image': image, 'text': 'q'}) + '\n'
        for n, image in ((1, 'abc.jpg'), (2, '/etc/hosts'), (3, 'a/../../b.jpg'))))
    _llava_scienceqa(tmp_path / 'scienceqa')
    questions = json.loads((tmp_path / 'scienceqa' / 'llava_test_CQM-A.json').read_text())
    questions[2]['image'] = '../../../outside.png'
    (tmp_path / 'scienceqa' / 'llava_test_CQM-A.json').write_text(json.dumps(questions))
    (tmp_path / 'gqa').mkdir()
    (tmp_path / 'gqa' / 'testdev_balanced_questions.json').write_text(json.dumps({
        '1': {'imageId': 'n1', 'question': 'q?', 'answer': 'no'}, '2': {'imageId': '../n2', 'question': 'q?',
                                                                        'answer': 'no'}}))
    kept = {}
    for task, folder in (('textvqa', 'textvqa'), ('textvqa_ocr', 'textvqa'), ('scienceqa', 'scienceqa'),
                         ('gqa', 'gqa')):
        questions, left_out = tasks.TASKS[task].questions(tmp_path / folder)
        kept[task] = [s.id for s in questions]
        assert list(left_out.counts()) == [tasks.IMAGE_OUTSIDE], task
        assert all(tmp_path in s.image.parents for s in questions), task
    assert kept == {'textvqa': ['1'], 'textvqa_ocr': ['1'], 'scienceqa': ['5'], 'gqa': ['1']}
    ocr = tasks.TASKS['textvqa_ocr'].questions(tmp_path / 'textvqa')[1].named[tasks.IMAGE_OUTSIDE]
    path = tmp_path / 'textvqa' / 'llava_textvqa_val_v051_ocr.jsonl'
    assert ocr == [f"{path}:2 ('/etc/hosts': an absolute path)", f"{path}:3 ('a/../../b.jpg': a ../ component)"]
    with pytest.raises(DataError, match=f"{path}:2 \\('/etc/hosts': an absolute path\\): {tasks.IMAGE_OUTSIDE}"):
        tasks.read_textvqa_ocr(tmp_path / 'textvqa')  # a reader alone refuses the first


def test_mme_lines_without_a_yes_no_answer_are_left_out_and_the_ids_of_the_others_stay(tmp_path):
    """Before: a line without a tab ended the whole run, and a label other than Yes/No was scored as never right."""
    _mme_release(tmp_path / 'mme')
    txt = tmp_path / 'mme' / 'existence' / '000000006040.txt'
    txt.write_text('Is there a train?\tMaybe\nno tab on this line\n\nIs there a bed?\tNo\n')
    questions, left_out = tasks.TASKS['mme'].questions(tmp_path / 'mme')
    assert [s.id for s in questions if s.meta['subtask'] == 'existence'] == ['existence/000000006040/2']
    assert left_out.named == {'label not Yes or No': [f"{txt}:1 (label 'Maybe')"],
                              'line not "question<TAB>Yes|No" as MME\'s are': [f'{txt}:2']}


def test_a_benchmark_json_that_does_not_parse_is_named(tmp_path):
    (tmp_path / 'TextVQA_0.5.1_val.json').write_text('{"data": [')
    with pytest.raises(DataError, match='TextVQA_0.5.1_val.json: not JSON'):
        tasks.TASKS['textvqa'].questions(tmp_path)
