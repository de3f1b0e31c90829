"""The benchmarks' scoring on replies whose scores are worked out by hand (in each test's comments)."""
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


def test_scienceqa_reads_the_option_letter_as_llavas_script():
    letters = ['A', 'B', 'C']
    assert [metrics.scienceqa_letter(t, letters) for t in ('B', 'C. the moon', 'The answer is A.', 'I think B', 'D')] \
        == ['B', 'C', 'A', 'FAILED', 'FAILED']
    rows = [{'prediction': p, 'answer': a, 'options': 3}
            for p, a in zip(('B', 'C. the moon', 'The answer is A.', 'I think B', 'D'), 'BCBBA')]
    assert metrics.scienceqa(rows) == pytest.approx({'accuracy': 2 / 5, 'questions': 5, 'failed': 2})
    # ScienceQA's own scripts draw a random option for a failed reply: over many draws, a third are right
    guesses = metrics.scienceqa([{'prediction': '?', 'answer': 'A', 'options': 3}] * 3000, failed='random')
    assert guesses['failed'] == 3000 and abs(guesses['accuracy'] - 1 / 3) < 0.03


def test_gqa_exact_match_and_the_vqa_accuracy_of_textvqa_and_okvqa():
    rows = [{'prediction': 'Yes.', 'answer': 'yes'}, {'prediction': 'the table', 'answer': 'table'},
            {'prediction': 'Left', 'answer': 'left'}]
    assert metrics.gqa(rows) == pytest.approx({'accuracy': 2 / 3, 'questions': 3})
    # "two" → "2": 3 of 10 humans said 2; leaving out one of them 2/3, any other 1 → (3·2/3 + 7)/10
    assert metrics.vqa([{'prediction': 'two', 'answers': ['2'] * 3 + ['3'] * 7}]) == pytest.approx(
        {'accuracy': 0.9, 'questions': 1})
