"""VQA accuracy against values worked out by hand from the official vqaEval.py rules, with each reply processed
first as LLaVA's convert_vqav2_for_submission.py does (EvalAIAnswerProcessor) under the default scoring."""
import json
import re

import pytest

from diffzoo.eval.vqa import VQAInputError, evaluate, main, vqa_accuracy


@pytest.mark.parametrize('matches, expected', [
    (0, 0.0),
    (1, 0.3),  # leaving out the match: 0; leaving out any of the 9 others: 1/3 → 9·(1/3)/10
    (2, 0.6),  # (2·1/3 + 8·2/3) / 10
    (3, 0.9),  # (3·2/3 + 7·1) / 10: leaving out one of the 3 matches leaves only 2
    (4, 1.0),  # at least 3 matches whichever is left out
    (10, 1.0),
])
def test_leave_one_out_over_ten_humans(matches, expected):
    answers = ['cat'] * matches + ['dog'] * (10 - matches)
    assert vqa_accuracy('cat', answers) == pytest.approx(expected)


def test_other_answer_counts_leave_one_out_over_those_given():
    # cat, cat, dog: leaving out a cat leaves 1 match (1/3), leaving out the dog leaves 2 (2/3)
    assert vqa_accuracy('cat', ['cat', 'cat', 'dog']) == pytest.approx((1 / 3 + 1 / 3 + 2 / 3) / 3)
    assert vqa_accuracy('cat', ['cat'] * 4) == 1.0  # 3 others match whichever is left out
    assert vqa_accuracy('cat', ['cat'] * 3) == pytest.approx(2 / 3)  # only 2 others


@pytest.mark.parametrize('answers', [[], ['yes']])
def test_too_few_answers_is_a_clear_error(answers):
    with pytest.raises(ValueError, match=f'at least 2 human answers.*got {len(answers)}'):
        vqa_accuracy('yes', answers)


def test_a_string_is_not_a_list_of_answers():
    with pytest.raises(TypeError, match='list of the human answers'):
        vqa_accuracy('yes', 'yes')


def test_vqaeval_normalises_the_reply_only_when_the_humans_differ():
    agreeing = ["don't"] * 10
    assert vqa_accuracy("don't", agreeing, 'vqaeval') == 1.0
    assert vqa_accuracy('dont', agreeing, 'vqaeval') == 0.0  # all humans agree: exact comparison
    assert vqa_accuracy('Yes', ['yes'] * 10, 'vqaeval') == 0.0  # case included
    assert vqa_accuracy(' yes\n', ['yes'] * 10, 'vqaeval') == 1.0  # only whitespace is cleaned
    differing = ["don't"] * 4 + ['no'] * 6
    assert vqa_accuracy('dont', differing, 'vqaeval') == 1.0  # normalised: "dont" → "don't"
    assert vqa_accuracy('Yes.', ['yes'] * 9 + ['no'], 'vqaeval') == 1.0
    assert vqa_accuracy('two', ['2', '2'] + ['3'] * 8, 'vqaeval') == pytest.approx(0.6)
    assert vqa_accuracy('2', ['two', 'Two'] + ['3'] * 8, 'vqaeval') == pytest.approx(0.6)  # humans normalised too


def test_the_default_processes_every_reply_as_llava_submits_it():
    # EvalAI's processor on the reply, then vqaEval.py: agreeing humans still compare exactly, with the processed reply
    assert vqa_accuracy('Yes', ['yes'] * 10) == 1.0
    assert vqa_accuracy('Nokia.', ['nokia'] * 10) == 1.0
    assert vqa_accuracy('dont', ["don't"] * 10) == 1.0  # "dont" → "don't"
    assert vqa_accuracy('Two', ['2'] * 10) == 1.0
    assert vqa_accuracy('Two', ['two'] * 10) == 0.0  # "2" against the agreeing humans' raw "two"


def _annotation(qid, question_type, answer_type, answers):
    return {'question_id': qid, 'image_id': qid * 10, 'question_type': question_type, 'answer_type': answer_type,
            'multiple_choice_answer': answers[0],
            'answers': [{'answer': a, 'answer_confidence': 'yes', 'answer_id': i + 1} for i, a in enumerate(answers)]}


@pytest.fixture
def annotations():
    return {'annotations': [
        _annotation(1, 'is the', 'yes/no', ['yes'] * 10),  # "yes" → 100
        _annotation(2, 'is the', 'yes/no', ['yes'] * 2 + ['no'] * 8),  # "yes" → 60
        _annotation(3, 'how many', 'number', ['2'] + ['3'] * 9),  # "two" → 30
        _annotation(4, 'what color is the', 'other', ['red'] * 4 + ['blue'] * 6),  # "Red." → 100
        _annotation(5, 'what color is the', 'other', ['red'] * 4 + ['blue'] * 6),  # "green" → 0
    ]}


PREDICTIONS = [{'question_id': 1, 'answer': 'yes'}, {'question_id': 2, 'answer': 'yes'},
               {'question_id': 3, 'answer': 'two'}, {'question_id': 4, 'answer': 'Red.'},
               {'question_id': 5, 'answer': 'green'}]


def test_evaluate_overall_and_per_type(annotations):
    result = evaluate(PREDICTIONS, annotations)
    assert result['overall'] == 58.0  # (1 + .6 + .3 + 1 + 0) / 5
    assert result['perAnswerType'] == {'yes/no': 80.0, 'number': 30.0, 'other': 50.0}
    assert result['perQuestionType'] == {'is the': 80.0, 'how many': 30.0, 'what color is the': 50.0}
    assert result['perQuestion'] == {1: 100.0, 2: 60.0, 3: 30.0, 4: 100.0, 5: 0.0}
    assert (result['num_questions'], result['num_missing']) == (5, 0)
    assert result['scoring'] == 'llava'


def test_evaluate_scores_the_replies_as_the_scoring_names(annotations):
    # question 1's ten humans agree on "yes": "Yes" is 1 once processed (llava, lmms_eval), 0 as given (vqaeval)
    capitalised = [{'question_id': 1, 'answer': 'Yes'}] + PREDICTIONS[1:]
    assert evaluate(capitalised, annotations)['perQuestion'][1] == 100.0
    assert evaluate(capitalised, annotations, scoring='lmms_eval')['perQuestion'][1] == 100.0
    vqaeval = evaluate(capitalised, annotations, scoring='vqaeval')
    assert vqaeval['perQuestion'][1] == 0.0 and vqaeval['overall'] == 38.0 and vqaeval['scoring'] == 'vqaeval'
    with pytest.raises(VQAInputError, match="scoring 'm4c': one of llava, lmms_eval, vqaeval"):
        evaluate(PREDICTIONS, annotations, scoring='m4c')


def test_every_annotated_question_needs_a_prediction_unless_allowed(annotations):
    with pytest.raises(VQAInputError, match=r'no answer for 1 of 5 annotated questions \(e.g. question_id 5\)'):
        evaluate(PREDICTIONS[:4], annotations)
    result = evaluate(PREDICTIONS[:4], annotations, allow_missing=True)
    assert result['overall'] == 72.5 and result['num_missing'] == 1  # (1 + .6 + .3 + 1) / 4


def test_predictions_of_other_questions_or_twice_are_errors(annotations):
    with pytest.raises(VQAInputError, match=r'1 of 6 question ids are not among the 5 annotated.*e.g. 99'):
        evaluate(PREDICTIONS + [{'question_id': 99, 'answer': 'yes'}], annotations)
    with pytest.raises(VQAInputError, match='more than once.*e.g. 1'):
        evaluate(PREDICTIONS + [{'question_id': 1, 'answer': 'no'}], annotations)
    with pytest.raises(VQAInputError, match='"question_id" and "answer"'):
        evaluate([{'question_id': 1, 'text': 'yes'}], annotations)


@pytest.mark.parametrize('qid', [True, 1.0, [1]])
def test_an_id_that_is_not_an_int_or_a_string_is_named_wherever_it_is(annotations, qid):
    """true and 1.0 were scored as question 1, a list raised TypeError."""
    for where, call in (('predictions[0]', lambda: evaluate([{'question_id': qid, 'answer': 'yes'}] + PREDICTIONS[1:],
                                                          annotations, allow_missing=True)),
                        ('questions[0]', lambda: evaluate(PREDICTIONS, annotations, [{'question_id': qid}])),
                        ('annotations[0]', lambda: evaluate(PREDICTIONS, {'annotations': [
                            dict(annotations['annotations'][0], question_id=qid)]}))):
        with pytest.raises(VQAInputError, match=rf'^{re.escape(where)}: question_id .* is not an id'):
            call()


def test_malformed_questions_and_annotation_types_are_named(annotations):
    with pytest.raises(VQAInputError, match=r"questions\[0\] = \{'image_id': 10\}: expected a question dict"):
        evaluate(PREDICTIONS, annotations, [{'image_id': 10}])
    for key in ('question_type', 'answer_type'):
        bad = {'annotations': [dict(annotations['annotations'][0], **{key: None})]}
        with pytest.raises(VQAInputError, match=rf'annotations\[0\] \(question_id 1\): {key} None is not a string'):
            evaluate(PREDICTIONS[:1], bad)


def test_questions_file_restricts_the_scored_set(annotations):
    questions = {'questions': [{'question_id': 1, 'image_id': 10, 'question': 'Is the sky blue?'},
                               {'question_id': 2, 'image_id': 20, 'question': 'Is the cat asleep?'}]}
    result = evaluate(PREDICTIONS[:2], annotations, questions)
    assert result['overall'] == 80.0 and result['perQuestion'] == {1: 100.0, 2: 60.0}
    with pytest.raises(VQAInputError, match='no annotation'):
        evaluate(PREDICTIONS, annotations, {'questions': [{'question_id': 7}]})


def test_percentages_round_halves_away_from_zero_as_python2():
    # one correct question of 800: 100 · 1 / 800 = 0.125 exactly; Python 2's round gives 0.13
    annotations = [_annotation(i, 'what', 'other', ['cat'] * 10) for i in range(800)]
    predictions = [{'question_id': i, 'answer': 'cat' if i == 0 else 'dog'} for i in range(800)]
    assert evaluate(predictions, annotations)['overall'] == 0.13


def test_cli_prints_a_table_and_writes_json(annotations, tmp_path, commands):
    (tmp_path / 'results.json').write_text(json.dumps(PREDICTIONS))
    (tmp_path / 'annotations.json').write_text(json.dumps(annotations))
    out = tmp_path / 'out' / 'accuracy.json'
    run = commands.run('diffzoo.eval.vqa', ['--predictions', tmp_path / 'results.json',
                                            '--annotations', tmp_path / 'annotations.json', '--output', out])
    assert run.returncode == 0, run.stderr
    written = json.loads(out.read_text())
    assert written['overall'] == 58.0 and written['perAnswerType']['number'] == 30.0
    assert written['perQuestion']['3'] == 30.0  # JSON keys are strings
    overall = next(line for line in run.stdout.splitlines() if line.strip().startswith('overall'))
    assert overall.split() == ['overall', '5', '58.00']
    assert 'what color is the' in run.stdout and f'results: {out}' in run.stdout


def test_cli_errors_name_the_input_and_the_fix(annotations, tmp_path, capsys):
    (tmp_path / 'results.json').write_text(json.dumps(PREDICTIONS[:4]))
    (tmp_path / 'annotations.json').write_text(json.dumps(annotations))
    args = ['--predictions', str(tmp_path / 'results.json'), '--annotations', str(tmp_path / 'annotations.json')]
    assert main(args) == 2
    assert '--allow-missing' in capsys.readouterr().err
    assert main(args + ['--allow-missing']) == 0
    assert json.loads((tmp_path / 'results_accuracy.json').read_text())['overall'] == 72.5
    assert main(['--predictions', str(tmp_path / 'nope.json')] + args[2:]) == 2
    assert f'--predictions {tmp_path / "nope.json"}: no such file' in capsys.readouterr().err
    kept = (tmp_path / 'results.json').read_text()
    assert main(args + ['--allow-missing', '--output', str(tmp_path / 'results.json')]) == 2  # its own predictions
    assert 'is one of the input files, which it would overwrite' in capsys.readouterr().err
    assert (tmp_path / 'results.json').read_text() == kept
    (tmp_path / 'latin1.json').write_bytes('[{"question_id": 1, "answer": "caf\xe9"}]'.encode('latin-1'))
    assert main(['--predictions', str(tmp_path / 'latin1.json')] + args[2:]) == 2
    assert f'--predictions {tmp_path / "latin1.json"}: not valid UTF-8 JSON' in capsys.readouterr().err


def test_cli_scoring_names_how_replies_are_prepared(annotations, tmp_path, capsys):
    (tmp_path / 'results.json').write_text(json.dumps([{'question_id': 1, 'answer': 'Yes'}] + PREDICTIONS[1:]))
    (tmp_path / 'annotations.json').write_text(json.dumps(annotations))
    args = ['--predictions', str(tmp_path / 'results.json'), '--annotations', str(tmp_path / 'annotations.json')]
    for scoring, overall in ((None, 58.0), ('vqaeval', 38.0)):
        assert main(args + (['--scoring', scoring] if scoring else [])) == 0
        written = json.loads((tmp_path / 'results_accuracy.json').read_text())
        assert (written['overall'], written['scoring']) == (overall, scoring or 'llava')
        assert f'scored as {scoring or "llava"}' in capsys.readouterr().out
