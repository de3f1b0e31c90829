"""VQA answer processing and per-reply accuracy under each reference, against values worked out by hand from
vqaEval.py (processPunctuation, processDigitArticle, evaluate), LLaVA's m4c_evaluator.py (EvalAIAnswerProcessor)
and lmms-eval's vqav2_process_results, and against lmms-eval's own functions on the same replies."""
import pytest

from diffzoo.eval.vqa_answers import evalai_accuracy, evalai_answer, normalize_answer, vqa_accuracy


@pytest.mark.parametrize('text, expected', [
    ('Two', '2'),
    ('none', '0'),
    ('ten', '10'),
    ('eleven', 'eleven'),
    ('the dog', 'dog'),
    ('An apple', 'apple'),
    ('a dog\'s', "dog's"),  # the apostrophe is not in the punctuation list
    ('dont', "don't"),
    ("don't", "don't"),
    ('Im', 'im'),  # the table's "Im" key has a capital and never meets a lower-cased word
    ('yes.', 'yes'),
    ('3.5', '3.5'),  # a period before a digit stays
    ('10.5.', '10.5'),
    ('e.g.', 'eg'),  # other periods are deleted, not spaced
    ('1,000', '1000'),  # a comma between digits: every mark is deleted
    ('1,000 (approx)', '1000 approx'),
    ('1,,000', '1 000'),  # vqaEval's commaStrip wants a single comma: these become spaces
    ('red,white', 'red white'),  # a mark with no space beside it becomes a space
    ('red, white', 'red white'),  # ... and beside a space it is deleted
    ('well-known, right?', 'well known right'),
    ('3:30', '3:30'),  # nor is the colon
    ('yes!', 'yes'),
    (' tab\tand\nnewline  ', 'tab and newline'),
    ('THE   Two  Dogs', '2 dogs'),
])
def test_normalize_answer_as_vqaevals_process_punctuation_and_digit_article(text, expected):
    assert normalize_answer(text) == expected


def test_more_than_32_periods_are_not_all_deleted():
    # vqaEval.py (and EvalAI's processor) pass re.UNICODE (32) as re.sub's count
    assert normalize_answer('.' * 40 + 'x') == '.' * 8 + 'x'
    assert evalai_answer('.' * 40 + 'x') == '.' * 8 + 'x'


@pytest.mark.parametrize('text, expected', [
    ('Nokia', 'nokia'),  # lower-cased whatever the humans said
    ('Two.', '2'),
    ('Yes', 'yes'),
    ("the dog's bowl", "dog 's bowl"),  # "'s" is written apart before anything else
    ("it's", "it 's"),  # ... so the contraction table never sees it
    ('red,white', 'redwhite'),  # commas are deleted first, not spaced as vqaEval would
    ('red, white', 'red white'),
    ('what?', 'what'),
    ('1,000 (approx)', '1000 approx'),
    ('1,,000', '1000'),
    ('x/y', 'x y'),
    ('U.S.A.', 'usa'),
    ('Twenty-one', 'twenty 1'),
    ('dont', "don't"),
    (' Tab\tand\nnewline ', 'tab and newline'),
    ('A', ''),  # an article alone
])
def test_evalai_answer_as_m4c_evaluators_evalai_answer_processor(text, expected):
    assert evalai_answer(text) == expected


REPLIES = ['Nokia', 'Two.', 'Yes', "the dog's bowl", "it's", 'red,white', 'red, white', 'what?', '1,000 (approx)',
           '1,,000', 'x/y', 'U.S.A.', 'Twenty-one', 'dont', ' Tab\tand\nnewline ', 'A', '', 'yes!', "Don't",
           '$1,000.50', 'It is 2.', 'e.g.', '3.5', '.' * 40 + 'x', 'well-known, right?', "rock 'n' roll"]


def test_evalai_answer_is_lmms_evals_evalai_answer_processor():
    """lmms-eval's _task_utils/vqa_eval_metric.py holds LLaVA's m4c_evaluator class with the same tables."""
    pytest.importorskip('lmms_eval')
    from lmms_eval.tasks._task_utils.vqa_eval_metric import EvalAIAnswerProcessor
    process = EvalAIAnswerProcessor()
    assert [evalai_answer(r) for r in REPLIES] == [process(r) for r in REPLIES]


@pytest.mark.parametrize('reply, answers, llava, lmms_eval, vqaeval', [
    # vqaEval.py compares exactly when the ten humans agree; LLaVA submits EvalAI's processing of the reply
    ('Yes', ['yes'] * 10, 1.0, 1.0, 0.0),
    ('Nokia', ['nokia'] * 10, 1.0, 1.0, 0.0),
    ('Two.', ['2'] * 10, 1.0, 1.0, 0.0),
    ('Two.', ['two'] * 10, 0.0, 1.0, 0.0),  # the agreeing humans' "two" is compared raw with LLaVA's "2"
    ("dog's", ["dog's"] * 10, 0.0, 1.0, 1.0),  # EvalAI's "dog 's" against the raw "dog's"
    ('red,white', ['red white'] * 10, 0.0, 1.0, 0.0),  # EvalAI: "redwhite"; vqav2_process_results: "red white"
    ('1,,000', ['1000'] * 10, 1.0, 1.0, 0.0),  # lmms-eval's comma rule takes a run of commas between digits
    ('Yes.', ['yes'] * 9 + ['no'], 1.0, 1.0, 1.0),  # the humans differ: all normalise
    ('two', ['2', '2'] + ['3'] * 8, 0.6, 0.6, 0.6),
])
def test_vqav2_accuracy_under_each_scoring(reply, answers, llava, lmms_eval, vqaeval):
    assert vqa_accuracy(reply, answers) == pytest.approx(llava)  # the default
    for scoring, expected in (('llava', llava), ('lmms_eval', lmms_eval), ('vqaeval', vqaeval)):
        assert vqa_accuracy(reply, answers, scoring) == pytest.approx(expected), scoring


def test_an_unknown_scoring_is_named():
    with pytest.raises(ValueError, match="scoring='m4c': one of llava, lmms_eval, vqaeval"):
        vqa_accuracy('yes', ['yes'] * 10, 'm4c')


HUMANS = [['two', '2', '2', 'two', 'Two', '2 ', 'twenty', '2', 'two', '2'], ['nokia'] * 10, ["dog's bowl"] * 10,
          ['red white'] * 10, ['yes'] * 3 + ['no'] * 7, ['1000'] * 6 + ['1,000'] * 4]


def test_lmms_eval_scoring_is_lmms_evals_vqav2_process_results():
    pytest.importorskip('lmms_eval')
    from lmms_eval.tasks.vqav2 import utils as vqav2_utils
    for answers in HUMANS:
        for reply in REPLIES + ['2', 'yes', 'Nokia', "dog's bowl", '1,000']:
            doc = {'question_id': 1, 'answers': [{'answer': a, 'answer_id': i + 1} for i, a in enumerate(answers)]}
            theirs = vqav2_utils.vqav2_process_results(doc, [reply])['exact_match']
            assert vqa_accuracy(reply, answers, 'lmms_eval') == pytest.approx(theirs), (reply, answers)


def test_evalai_accuracy_is_textvqas_and_okvqas_in_llava_and_lmms_eval():
    """TextVQAAccuracyEvaluator: for each unique processed human answer, the mean over the ten leave-one-out
    subsets of min(1, matches / 3); the reply scores its processed form's value, 0 if none."""
    assert evalai_accuracy('Nokia', ['nokia'] * 10) == 1.0
    assert evalai_accuracy('Two.', ['two'] * 10) == 1.0  # both sides processed: "2" and "2"
    assert evalai_accuracy('THE 2', ['two'] * 3 + ['3'] * 7) == pytest.approx(0.9)
    assert evalai_accuracy("The dog's bowl.", ["dog's bowl"] * 2 + ['bowl'] * 8) == pytest.approx(0.6)
    assert evalai_accuracy('cat', ['dog'] * 10) == 0.0 and evalai_accuracy('cat', []) == 0.0
    pytest.importorskip('lmms_eval')
    from lmms_eval.tasks.ok_vqa import utils as okvqa_utils
    from lmms_eval.tasks.textvqa import utils as textvqa_utils
    for answers in HUMANS:
        for reply in REPLIES:
            ours = evalai_accuracy(reply, answers)
            for process in (textvqa_utils.textvqa_process_results, okvqa_utils.ok_vqa_process_results):
                theirs = process({'question_id': 1, 'answers': list(answers)}, [reply])['exact_match']
                assert ours == pytest.approx(theirs), (reply, answers, process.__name__)
