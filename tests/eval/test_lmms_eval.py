"""diffzoo's VLMs inside lmms-eval (the `lmms` extra): `--model diffzoo` resolves through the entry point, the
model answers lmms-eval's own requests (its POPE prompt, generation settings and documents) as
`python -m diffzoo.eval.lmm` answers the same questions, and lmms-eval's own POPE and MME scoring functions give
on the same replies what `diffzoo.eval.lmm.metrics` gives for them."""
import pytest
import yaml
from PIL import Image

lmms_eval = pytest.importorskip('lmms_eval')  # the lmms extra, which `make test` installs

from lmms_eval.api.instance import Instance  # noqa: E402
from lmms_eval.models import get_model  # noqa: E402
from lmms_eval.tasks.mme import utils as mme_utils  # noqa: E402
from lmms_eval.tasks.pope import utils as pope_utils  # noqa: E402

from diffzoo.eval.lmm import metrics  # noqa: E402
from diffzoo.eval.lmm.lmms_eval_model import DiffzooLMM  # noqa: E402
from tests.eval.test_lmm_metrics import _pope_rows  # noqa: E402
from tests.vlm.models import write_chat_language_model  # noqa: E402

POST = '\nAnswer the question using a single word or phrase.'  # pope.yaml's default post_prompt


def test_the_model_is_registered_with_lmms_eval():
    assert get_model('diffzoo') is DiffzooLMM


def test_it_answers_lmms_evals_requests_as_diffzoo_eval_lmm_does(tmp_path):
    write_chat_language_model(tmp_path / 'lm')
    recipe = {'model': {'type': 'build_vlm', 'vision': 'diffclip-tiny', 'language_model': str(tmp_path / 'lm'),
                        'select_layer': -2, 'projector': 'mlp2x_gelu', 'sequence_mask': 'causal'},
              'data': {'type': 'conversations', 'json': 'unused.json', 'format': 'chat_template'}}
    (tmp_path / 'model.yaml').write_text(yaml.safe_dump(recipe))
    model = DiffzooLMM.create_from_arg_string(f'recipe={tmp_path / "model.yaml"}', {'batch_size': 2})
    docs = [{'question_id': str(i), 'question': f'Is there a {c} circle in the image?', 'answer': 'yes' if i else 'no',
             'image': Image.new('RGB', (48, 32), c), 'category': 'random'} for i, c in enumerate(('red', 'blue', 'green'))]
    model.task_dict = {'pope': {'test': docs}}
    gen_kwargs = {'max_new_tokens': 3, 'temperature': 0, 'do_sample': False, 'until': ['\n\n']}
    requests = [Instance('generate_until', (pope_utils.pope_doc_to_text(doc, {'pre_prompt': '', 'post_prompt': POST}),
                                            gen_kwargs, pope_utils.pope_doc_to_visual, i, 'pope', 'test'), idx=0,
                         metadata={'task': 'pope', 'doc_id': i, 'repeats': 1}) for i, doc in enumerate(docs)]
    replies = model.generate_until(requests)
    assert replies == model.vlm.answer([d['image'] for d in docs], [d['question'] + POST for d in docs], 3)
    with pytest.raises(NotImplementedError, match='generate_until'):
        model.loglikelihood(requests)


def test_lmms_evals_pope_and_mme_scoring_agree_with_ours_on_the_same_replies():
    rows = _pope_rows()
    docs = [{'question_id': str(i), 'answer': r['label']} for i, r in enumerate(rows)]
    results = [pope_utils.pope_process_results(d, [r['prediction']]) for d, r in zip(docs, rows)]
    theirs = {name: aggregate([res[key] for res in results]) for name, key, aggregate in (
        ('accuracy', 'pope_accuracy', pope_utils.pope_aggregate_accuracy),
        ('precision', 'pope_precision', pope_utils.pope_aggregate_precision),
        ('recall', 'pope_recall', pope_utils.pope_aggregate_recall),
        ('f1', 'pope_f1_score', pope_utils.pope_aggregate_f1_score),
        ('yes_ratio', 'pope_yes_ratio', pope_utils.pope_aggregate_yes_ratio))}
    ours = metrics.lmms_eval_pope(rows)['random']
    assert theirs == pytest.approx({k: ours[k] for k in theirs})
    assert ours != metrics.pope(rows)['random']  # POPE's own reading of these replies differs (module docstring)

    mme = [('existence', 'a', 'Yes.', 'Yes'), ('existence', 'a', 'no, it is not', 'No'), ('existence', 'b', 'Yes', 'No'),
           ('existence', 'b', 'No', 'No'), ('code_reasoning', 'd', 'yes', 'Yes'), ('code_reasoning', 'd', 'nope', 'No')]
    scored = [mme_utils.mme_process_results({'question_id': image, 'answer': label, 'category': task}, [reply])
              for task, image, reply, label in mme]
    perception = mme_utils.mme_aggregate_results([s['mme_perception_score'] for s in scored if 'mme_perception_score' in s])
    cognition = mme_utils.mme_aggregate_results([s['mme_cognition_score'] for s in scored if 'mme_cognition_score' in s])
    ours = metrics.mme([dict(zip(('subtask', 'image', 'prediction', 'label'), r)) for r in mme])
    assert (ours['perception'], ours['cognition']) == pytest.approx((perception, cognition))
