"""The benchmarks' scoring on replies whose scores are worked out by hand from each reference script (named in each
test), and lmms-eval's own functions on the same replies where it has them."""
import pytest

from diffzoo.eval.lmm import metrics


def _pope_rows():
    # replies as POPE reads them: yes, no, no ("not"), yes, no (its first sentence holds "No")
    replies = ['Yes, there is a dog.', 'No.', 'There is not a cat.', 'yes', 'I see a No entry sign. Yes.']
    labels = ['yes', 'no', 'no', 'no', 'yes']
    return [{'split': 'random', 'prediction': p, 'label': g} for p, g in zip(replies, labels)]


def test_pope_reads_replies_and_scores_each_split_as_its_evaluate_script():
    assert [metrics.pope_answer(r['prediction']) for r in _pope_rows()] == ['yes', 'no', 'no', 'yes', 'no']
    # TP 1 (row 1), TN 2 (rows 2, 3), FP 1 (row 4), FN 1 (row 5)
    row = metrics.pope(_pope_rows())['random']
    assert row == pytest.approx({'accuracy': 3 / 5, 'precision': 1 / 2, 'recall': 1 / 2, 'f1': 1 / 2,
                                 'yes_ratio': 2 / 5, 'questions': 5})
    more = _pope_rows() + [{'split': 'adversarial', 'prediction': 'no', 'label': 'yes'}]
    assert metrics.pope(more)['adversarial'] == pytest.approx(
        {'accuracy': 0, 'precision': 0, 'recall': 0, 'f1': 0, 'yes_ratio': 0, 'questions': 1})


def test_lmms_evals_pope_counts_only_exact_replies_and_the_share_of_yes_labels():
    # lower-cased and stripped, only row 4 ("yes") is an exact yes/no: FP 1, no TP, no exact "no"
    row = metrics.lmms_eval_pope(_pope_rows())['random']
    assert row == pytest.approx({'accuracy': 0, 'precision': 0, 'recall': 0, 'f1': 0, 'yes_ratio': 2 / 5,
                                 'questions': 5})


@pytest.mark.parametrize('label', ['maybe', 1, None])
@pytest.mark.parametrize('scorer', [metrics.pope, metrics.lmms_eval_pope])
def test_a_pope_label_other_than_yes_or_no_is_refused_by_name(scorer, label):
    """Before: 'maybe' was counted in no cell (13 rows scored, the splits' counts adding to 12) and an integer
    label raised AttributeError; the runner leaves such questions out before asking them."""
    rows = _pope_rows() + [{'split': 'popular', 'prediction': 'yes', 'label': label}]
    with pytest.raises(ValueError, match=f"POPE row 5 \\(popular\\): label {label!r} is not yes or no"):
        scorer(rows)
    assert scorer(_pope_rows() + [{'split': 'popular', 'prediction': 'yes', 'label': ' Yes '}])['popular'][
        'accuracy'] == 1


def test_mme_scores_accuracy_and_accuracy_plus_per_subtask_and_sums_perception_and_cognition():
    rows = [  # (subtask, image, reply, label): MME reads yes, no | yes, no | other, no | yes, yes
        ('existence', 'a.jpg', 'Yes.', 'yes'), ('existence', 'a.jpg', 'no, it is not', 'no'),
        ('existence', 'b.jpg', 'Yes', 'no'), ('existence', 'b.jpg', 'No', 'no'),
        ('count', 'c.jpg', 'There are two', 'yes'), ('count', 'c.jpg', 'no', 'no'),
        ('code_reasoning', 'd.png', 'yes', 'yes'), ('code_reasoning', 'd.png', 'yes', 'no')]
    out = metrics.mme([dict(zip(('subtask', 'image', 'prediction', 'label'), r)) for r in rows])
    # existence: 3 of 4 right (75), image a both right, b not (50): 125; count: 50 + 0; code_reasoning: 50 + 0
    assert out['subtasks']['existence'] == pytest.approx({'accuracy': 75, 'accuracy_plus': 50, 'score': 125,
                                                          'questions': 4, 'images': 2})
    assert (out['subtasks']['count']['score'], out['subtasks']['code_reasoning']['score']) == (50, 50)
    assert (out['perception'], out['cognition']) == (175, 50)
    assert [metrics.mme_answer(t) for t in ('Yes.', 'No', 'nope', 'y', 'I think yes')] == [
        'yes', 'no', 'no', 'other', 'other']


MME_REPLIES = ('Yes', 'yes.', 'No', 'no, it is not', 'nope', 'n.o.', '...No', 'N.', 'y', 'n', 'Y.', 'I think yes',
               'Noted', 'There is')


def test_mme_reads_replies_as_calculation_py_and_lmms_eval_as_its_parse_pred_ans():
    # calculation.py's parse_pred_ans on the lower-cased reply (nothing dropped): "yes"/"no", else the first four
    # characters; lmms-eval drops every period first and reads a lone "y"/"n"
    ours = ['yes', 'yes', 'no', 'no', 'no', 'other', 'other', 'other', 'other', 'other', 'other', 'other', 'no',
            'other']
    lmms = ['yes', 'yes', 'no', 'no', 'no', 'no', 'no', 'no', 'yes', 'no', 'yes', 'other', 'no', 'other']
    assert [metrics.mme_answer(t) for t in MME_REPLIES] == ours
    assert [metrics.lmms_eval_mme_answer(t) for t in MME_REPLIES] == lmms
    rows = [{'subtask': 'count', 'image': 'a', 'prediction': 'n.o.', 'label': 'No'},
            {'subtask': 'count', 'image': 'a', 'prediction': 'Yes', 'label': 'Yes'}]
    assert metrics.mme(rows)['perception'] == 50  # accuracy 50, accuracy+ 0
    assert metrics.lmms_eval_mme(rows)['perception'] == 200
    pytest.importorskip('lmms_eval')
    from lmms_eval.tasks.mme import utils as mme_utils
    assert [mme_utils.parse_pred_ans(t) for t in MME_REPLIES] == lmms


def test_scienceqa_reads_the_option_letter_as_llavas_script():
    # eval_science_qa.py's main loop parses a letter of its --options A–E whatever the choices; get_pred_idx then
    # gives -1 (wrong) to a letter beyond the question's options
    replies = ('B', 'C. the moon', 'The answer is A.', 'I think B', 'D', 'The answer is E.', 'E. five', 'F', 'b',
               'The answer is B and C.', 'The answer is B. The answer is C.')
    assert [metrics.scienceqa_letter(t) for t in replies] == ['B', 'C', 'A', 'FAILED', 'D', 'E', 'E', 'FAILED',
                                                              'FAILED', 'B', 'FAILED']
    rows = [{'prediction': p, 'answer': a, 'options': 3}
            for p, a in zip(('B', 'C. the moon', 'The answer is A.', 'I think B', 'D'), 'BCBBA')]
    assert metrics.scienceqa(rows) == pytest.approx({'accuracy': 2 / 5, 'questions': 5, 'failed': 2})
    beyond = [{'prediction': 'The answer is E.', 'answer': 'D', 'options': 4}]  # E of four options: -1
    assert metrics.scienceqa(beyond) == {'accuracy': 0.0, 'questions': 1, 'failed': 1}
    # LLaVA's first eval_science_qa.py (and ScienceQA's scripts) drew random.choice for such a reply instead
    guesses = metrics.scienceqa([{'prediction': '?', 'answer': 'A', 'options': 3}] * 3000, failed='random')
    assert guesses['failed'] == 3000 and abs(guesses['accuracy'] - 1 / 3) < 0.03
    guesses = metrics.scienceqa(beyond * 4000, failed='random')
    assert guesses['failed'] == 4000 and abs(guesses['accuracy'] - 1 / 4) < 0.03
    assert metrics.scienceqa(beyond * 50, failed='random') == metrics.scienceqa(beyond * 50, failed='random')


GQA = [('Yes.', 'yes'), ('yes..', 'yes'), ('T-shirt', 'tshirt'), ('t-shirt', 't-shirt'), ('yes!', 'yes'),
       ('the table', 'table'), ('Left', 'left'), (' yes ', 'yes'), ("it's red", 'its red'), ('No', 'yes')]


def test_gqa_as_llavas_conversion_and_gqas_eval_py_or_as_lmms_evals_exact_match():
    # convert_gqa_for_eval.py: rstrip('.') and lower(); eval.py: the strings equal
    llava = [1, 1, 0, 1, 0, 0, 1, 1, 0, 0]
    # exact_match with ignore_case and ignore_punctuation on the (stripped) reply
    lmms = [1, 1, 1, 1, 1, 0, 1, 1, 1, 0]
    assert [metrics.gqa([{'prediction': p, 'answer': a}])['accuracy'] for p, a in GQA] == llava
    assert [metrics.lmms_eval_gqa([{'prediction': p, 'answer': a}])['accuracy'] for p, a in GQA] == lmms
    assert metrics.gqa([{'prediction': p, 'answer': a} for p, a in GQA]) == pytest.approx(
        {'accuracy': 5 / 10, 'questions': 10})
    pytest.importorskip('lmms_eval')
    from lmms_eval.api.metrics import exact_match_hf_evaluate
    # lmms-eval's generate_until strips each reply before its metrics
    assert [exact_match_hf_evaluate([p.strip()], [a], ignore_case=True, ignore_punctuation=True)['exact_match']
            for p, a in GQA] == lmms


TEXTVQA = [('Nokia', ['nokia'] * 10, 1.0, 0.0), ('Two.', ['two'] * 10, 1.0, 0.0), ('Yes', ['yes'] * 10, 1.0, 0.0),
           ('two', ['2'] * 3 + ['3'] * 7, 0.9, 0.9),  # 3 of 10 say 2: (3·2/3 + 7) / 10
           ("The dog's bowl", ["dog's bowl"] * 10, 1.0, 0.0), ('2', ['two', 'Two'] + ['3'] * 8, 0.6, 0.6)]


def test_textvqa_and_okvqa_process_every_reply_as_llavas_m4c_evaluator_and_lmms_eval():
    # TextVQAAccuracyEvaluator: reply and humans through EvalAIAnswerProcessor; vqaEval.py: raw when humans agree
    for reply, answers, processed, vqaeval in TEXTVQA:
        row = [{'prediction': reply, 'answers': answers}]
        assert metrics.vqa(row)['accuracy'] == pytest.approx(processed), reply
        assert metrics.vqaeval(row)['accuracy'] == pytest.approx(vqaeval), reply
    pytest.importorskip('lmms_eval')
    from lmms_eval.tasks.ok_vqa import utils as okvqa_utils
    from lmms_eval.tasks.textvqa import utils as textvqa_utils
    for process in (textvqa_utils.textvqa_process_results, okvqa_utils.ok_vqa_process_results):
        assert [process({'question_id': 1, 'answers': list(a)}, [r])['exact_match'] for r, a, _, _ in TEXTVQA] == \
            pytest.approx([p for _, _, p, _ in TEXTVQA])


def test_every_benchmark_has_named_scorers_and_defaults_to_the_papers():
    assert metrics.DEFAULT_SCORER == {'pope': 'pope', 'mme': 'mme', 'scienceqa': 'llava', 'textvqa': 'llava',
                                      'gqa': 'llava', 'okvqa': 'lmms_eval'}
    for benchmark, scorers in metrics.SCORERS.items():
        assert metrics.DEFAULT_SCORER[benchmark] in scorers and 'lmms_eval' in scorers, benchmark
    assert metrics.SCORERS['textvqa']['vqaeval'] is metrics.vqaeval and metrics.SCORERS['gqa']['llava'] is metrics.gqa
