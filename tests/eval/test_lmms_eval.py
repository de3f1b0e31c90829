"""diffzoo's VLMs inside lmms-eval (the `lmms` extra): `--model diffzoo` resolves through the entry point, the
model answers lmms-eval's own requests (its POPE prompt, generation settings and documents) as
`python -m diffzoo.eval.lmm` answers the same questions, each reader's prompt is lmms-eval's, and lmms-eval's own
scoring functions (POPE, MME, ScienceQA, GQA, TextVQA, OK-VQA) give on the same replies what
`diffzoo.eval.lmm.metrics` gives for them. The real `lmms-eval` command, on a local POPE copy through its own
pope task file, scores what `python -m diffzoo.eval.lmm` answers on the same copy; a model it cannot build ends
that command with exit status 2 (lmms-eval itself logs a failed run and exits 0)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from PIL import Image, ImageDraw

lmms_eval = pytest.importorskip('lmms_eval')  # the lmms extra, which `make test` installs

from lmms_eval.api.instance import Instance  # noqa: E402
from lmms_eval.models import get_model  # noqa: E402
from lmms_eval.tasks.mme import utils as mme_utils  # noqa: E402
from lmms_eval.tasks.pope import utils as pope_utils  # noqa: E402

from diffzoo.eval.lmm import metrics  # noqa: E402
from diffzoo.eval.lmm.cli import main as lmm_main  # noqa: E402
from diffzoo.eval.lmm.lmms_eval_model import DiffzooLMM  # noqa: E402
from tests.eval.test_lmm_metrics import _pope_rows  # noqa: E402
from tests.factory import call, run  # noqa: E402
from tests.vlm.models import write_chat_language_model  # noqa: E402

POST = '\nAnswer the question using a single word or phrase.'  # pope.yaml's default post_prompt
LMMS_EVAL = Path(sys.executable).with_name('lmms-eval')  # the console script the lmms extra installs


def _tiny_recipe(tmp_path) -> Path:
    """A build_vlm recipe of the diffclip-tiny tower and a tiny random chat LM, written under tmp_path."""
    write_chat_language_model(tmp_path / 'lm')
    recipe = {'model': {'type': 'build_vlm', 'vision': 'diffclip-tiny', 'language_model': str(tmp_path / 'lm'),
                        'select_layer': -2, 'projector': 'mlp2x_gelu', 'sequence_mask': 'causal'},
              'data': {'type': 'conversations', 'json': 'unused.json', 'format': 'chat_template'}}
    (tmp_path / 'model.yaml').write_text(yaml.safe_dump(recipe))
    return tmp_path / 'model.yaml'


def _pope_requests(model, docs, max_new_tokens: int):
    """lmms-eval's generate_until requests for `docs` of its pope task (its prompt, greedy settings, visuals), the
    documents given to `model` as lmms-eval gives them."""
    model.task_dict = {'pope': {'test': docs}}
    gen_kwargs = {'max_new_tokens': max_new_tokens, 'temperature': 0, 'do_sample': False, 'until': ['\n\n']}
    return [Instance('generate_until', (pope_utils.pope_doc_to_text(doc, {'pre_prompt': '', 'post_prompt': POST}),
                                        gen_kwargs, pope_utils.pope_doc_to_visual, i, 'pope', 'test'), idx=0,
                     metadata={'task': 'pope', 'doc_id': i, 'repeats': 1}) for i, doc in enumerate(docs)]


def test_the_model_is_registered_with_lmms_eval():
    assert get_model('diffzoo') is DiffzooLMM


def test_it_answers_lmms_evals_requests_as_diffzoo_eval_lmm_does(tmp_path):
    # what lmms-eval passes beside --model_args (its --batch_size default 1): --model_args wins
    model = DiffzooLMM.create_from_arg_string(f'recipe={_tiny_recipe(tmp_path)},batch_size=2',
                                              {'batch_size': 1, 'max_batch_size': None, 'device': None})
    assert model.batch_size_per_gpu == 2
    docs = [{'question_id': str(i), 'question': f'Is there a {c} circle in the image?', 'answer': 'yes' if i else 'no',
             'image': Image.new('RGB', (48, 32), c), 'category': 'random'} for i, c in enumerate(('red', 'blue', 'green'))]
    requests = _pope_requests(model, docs, max_new_tokens=3)
    replies = model.generate_until(requests)
    assert replies == model.vlm.answer([d['image'] for d in docs], [d['question'] + POST for d in docs], 3)
    with pytest.raises(NotImplementedError, match='generate_until'):
        model.loglikelihood(requests)


def test_a_prompt_longer_than_the_model_is_cut_answered_and_counted_as_diffzoo_eval_lmm_counts_it(tmp_path, capsys):
    """A POPE question of a few thousand characters through lmms-eval's request path: cut to the model's
    max_length as LLaVA's model cuts it and answered (as before), now counted in `cut_documents` with its positions
    and named in the batch's closing line; the short questions are not."""
    model = DiffzooLMM.create_from_arg_string(f'recipe={_tiny_recipe(tmp_path)},batch_size=2', {})
    model.vlm.max_length = 256  # a recipe's data.max_length; the tiny LM states 2,048
    long_question = 'Is there a red circle in the image? ' + 'Look closely at every corner. ' * 200
    docs = [{'question_id': str(i), 'question': q, 'answer': 'yes', 'image': Image.new('RGB', (48, 32), 'red'),
             'category': 'random'} for i, q in enumerate(('Is there a red circle?', long_question, 'Any blue?'))]
    requests = _pope_requests(model, docs, max_new_tokens=2)
    replies = model.generate_until(requests)
    assert len(replies) == 3
    positions = model.vlm.prompt_positions(requests[1].args[0])  # lmms-eval's prompt for it
    assert positions > 256 and model.cut_documents == {'pope': [(1, positions)]}
    assert (f"diffzoo: 1 pope prompt(s) longer than the model's 256 positions, cut to them as LLaVA's model cuts a "
            f"prompt, then answered (the first: document 1, {positions:,} positions)") in capsys.readouterr().err


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


def _lmms_eval_defaults(path: str) -> dict:
    """A task YAML's default lmms_eval_specific_kwargs (its `!function` entries are not needed here)."""
    from pathlib import Path
    loader = type('Loader', (yaml.SafeLoader,), {})
    loader.add_constructor('!function', lambda loader_, node: None)
    root = Path(lmms_eval.__file__).parent / 'tasks'
    return yaml.load((root / path).read_text(), Loader=loader)['lmms_eval_specific_kwargs']['default']


def test_every_prompt_is_lmms_evals_default_for_the_same_question(tmp_path):
    """The readers' prompts equal what lmms-eval's own doc_to_text functions make, with each task YAML's
    default kwargs, of the same records (lmms-eval capitalizes TextVQA's question; MME drops its suffix)."""
    import json

    from lmms_eval.tasks.gqa import utils as gqa_utils
    from lmms_eval.tasks.ok_vqa import utils as okvqa_utils
    from lmms_eval.tasks.scienceqa import utils as sqa_utils
    from lmms_eval.tasks.textvqa import utils as textvqa_utils

    from diffzoo.eval.lmm import tasks
    from tests.eval.test_lmm import _copies
    _copies(tmp_path)
    pope = json.loads((tmp_path / 'pope' / 'coco' / 'coco_pope_random.json').read_text().splitlines()[0])
    mme = (tmp_path / 'mme' / 'existence' / '000000006040.txt').read_text().splitlines()[0].split('\t')[0]
    sqa = json.loads((tmp_path / 'scienceqa' / 'problems.json').read_text())['5']
    textvqa = json.loads((tmp_path / 'textvqa' / 'TextVQA_0.5.1_val.json').read_text())['data'][0]
    gqa = json.loads((tmp_path / 'gqa' / 'testdev_balanced_questions.json').read_text())['201307251']
    okvqa = json.loads((tmp_path / 'okvqa' / 'OpenEnded_mscoco_val2014_questions.json').read_text())['questions'][0]
    cases = [
        (tasks.read_pope, 'pope', pope_utils.pope_doc_to_text, {'question': pope['text']}, 'pope/pope.yaml'),
        (tasks.read_mme, 'mme', mme_utils.mme_doc_to_text, {'question': mme}, 'mme/mme.yaml'),
        (tasks.read_scienceqa, 'scienceqa', sqa_utils.sqa_doc_to_text, sqa, 'scienceqa/scienceqa_img.yaml'),
        (tasks.read_textvqa, 'textvqa', textvqa_utils.textvqa_doc_to_text, textvqa,
         'textvqa/_default_template_textvqa_yaml'),
        (tasks.read_gqa, 'gqa', gqa_utils.gqa_doc_to_text, gqa, 'gqa/gqa.yaml'),
        (tasks.read_okvqa, 'okvqa', okvqa_utils.ok_vqa_doc_to_text, okvqa, 'ok_vqa/_default_template_vqa_yaml'),
    ]
    for read, folder, doc_to_text, doc, yaml_path in cases:
        ours = read(tmp_path / folder)[0].prompt
        assert ours == doc_to_text(doc, _lmms_eval_defaults(yaml_path)), folder
    # textvqa_ocr asks LLaVA-1.5's question text as written: lmms-eval's TextVQA prompt with ocr on
    ocr = {**_lmms_eval_defaults('textvqa/_default_template_textvqa_yaml'), 'ocr': True}
    assert tasks.read_textvqa_ocr(tmp_path / 'textvqa')[0].prompt == textvqa_utils.textvqa_doc_to_text(
        {**textvqa, 'ocr_tokens': ['NOKIA', '3310']}, ocr)


def test_lmms_evals_gqa_textvqa_okvqa_and_scienceqa_scoring_agree_with_ours_on_the_same_replies():
    """TextVQA and OK-VQA through lmms-eval's own process_results, GQA through its exact_match with the task's
    options, on replies with numbers as words, articles, punctuation and spaces: the same score as `metrics`
    for each (GQA: `metrics.lmms_eval_gqa`). ScienceQA: `metrics.lmms_eval_scienceqa` equals lmms-eval's reading on every reply, and LLaVA's
    (`metrics.scienceqa`) differs from it on exactly the replies the module docstring names."""
    from lmms_eval.api.metrics import exact_match_hf_evaluate
    from lmms_eval.tasks.ok_vqa import utils as okvqa_utils
    from lmms_eval.tasks.scienceqa import utils as sqa_utils
    from lmms_eval.tasks.textvqa import utils as textvqa_utils

    answers = ['two', '2', '2', 'two', 'Two', '2 ', 'twenty', '2', 'two', '2']
    for reply in ('2', 'Two.', 'a two', 'the 2', '2 people', "don't", 'Twenty', ' 2 ', 'It is 2.'):
        ours = metrics.vqa([{'prediction': reply, 'answers': list(answers)}])['accuracy']
        for process in (textvqa_utils.textvqa_process_results, okvqa_utils.ok_vqa_process_results):
            assert process({'answers': list(answers), 'question_id': 1}, [reply])['exact_match'] == \
                pytest.approx(ours), (reply, process.__name__)
    for reply, answer in (('Yes', 'yes'), ('yes.', 'yes'), (' yes ', 'yes'), ('left side', 'left'),
                          ("it's red", 'its red'), ('No', 'yes')):
        theirs = exact_match_hf_evaluate([reply.strip()], [answer], ignore_case=True, ignore_punctuation=True)
        assert metrics.lmms_eval_gqa([{'prediction': reply, 'answer': answer}])['accuracy'] == theirs['exact_match'], \
            reply
    differ = set()
    for reply in ('A', 'B', 'b', 'B.', 'A. ice', 'B. tea', 'The answer is B.', 'tea', 'C', ' B '):
        row = [{'prediction': reply, 'answer': 'B', 'options': 2}]
        theirs = sqa_utils.sqa_process_results({'choices': ['ice', 'tea'], 'answer': 1}, [reply])['exact_match']
        assert metrics.lmms_eval_scienceqa(row)['accuracy'] == theirs, reply
        if metrics.scienceqa(row)['accuracy'] != theirs:
            differ.add(reply)
    assert differ == {'b', 'B.', 'The answer is B.'}



POPE_QUESTIONS = (  # split, question_id, what is asked about, the colour of the picture's disc, label
    ('random', 1, 'dog', 'red', 'yes'), ('random', 2, 'cat', 'blue', 'no'),
    ('popular', 1, 'car', 'green', 'yes'), ('popular', 2, 'chair', 'yellow', 'no'),
    ('adversarial', 1, 'person', 'white', 'no'), ('adversarial', 2, 'cup', 'black', 'yes'))


def _pope_copies(root: Path) -> list:
    """Six POPE questions, two per split, as diffzoo reads them (root/data/pope: coco/coco_pope_<split>.json,
    val2014/) and as lmms-eval's POPE rows ({question_id, question, answer, image_source, image, category}, the same
    JPEG bytes) in root/tasks/pope_local.parquet, with root/tasks/pope_local.yaml: lmms-eval's own pope.yaml (its
    prompt, scoring and aggregation) on that file, one new token. Returns the (image, question) pairs."""
    import datasets
    pope, rows, pairs = root / 'data' / 'pope', [], []
    (pope / 'val2014').mkdir(parents=True)
    (pope / 'coco').mkdir()
    (root / 'tasks').mkdir()
    for n, (split, qid, thing, colour, label) in enumerate(POPE_QUESTIONS, 1):
        image = pope / 'val2014' / f'COCO_val2014_{n:012d}.jpg'
        picture = Image.new('RGB', (64, 48), 'gray')
        ImageDraw.Draw(picture).ellipse((8 * (n % 3), 6, 40 + 4 * n, 42), fill=colour)
        picture.save(image)
        record = {'question_id': qid, 'image': image.name, 'text': f'Is there a {thing} in the image?', 'label': label}
        with open(pope / 'coco' / f'coco_pope_{split}.json', 'a') as f:
            f.write(json.dumps(record) + '\n')
        rows.append({'question_id': str(qid), 'question': record['text'], 'answer': label,
                     'image_source': image.stem, 'image': {'bytes': image.read_bytes(), 'path': None},
                     'category': split})
        pairs.append((image, record['text']))
    features = datasets.Features({**{k: datasets.Value('string') for k in rows[0] if k != 'image'},
                                  'image': datasets.Image()})
    datasets.Dataset.from_list(rows, features=features).to_parquet(root / 'tasks' / 'pope_local.parquet')
    task = {'include': str(Path(lmms_eval.__file__).parent / 'tasks' / 'pope' / 'pope.yaml'), 'task': 'pope_local',
            'dataset_path': 'parquet', 'dataset_kwargs': {'data_files': {'test': 'pope_local.parquet'}},
            'generation_kwargs': {'max_new_tokens': 1, 'temperature': 0, 'top_p': 1.0, 'num_beams': 1,
                                  'do_sample': False}}
    (root / 'tasks' / 'pope_local.yaml').write_text(yaml.safe_dump(task, sort_keys=False))
    return pairs


def _yes_no_stage(recipe: Path, pairs, directory: Path) -> Path:
    """A stage (`diffzoo.vlm.stages`' files) that holds every tensor of the recipe's model, so that any process
    builds the same model from it; the (tied) embeddings of " Yes" and " No" are set so that the first new token is
    one of them: "Yes" where the hidden state that predicts it lies on one side of the pairs' mean, "No" on the
    other (both happen: the offsets from a mean sum to zero)."""
    import torch
    from safetensors.torch import save_file

    from diffzoo.recipes import expand_env
    from diffzoo.vlm.factory import vlm_from_recipe
    from diffzoo.vlm.recipe import check_model
    from diffzoo.vlm.stages import STAGE_CONFIG, STAGE_WEIGHTS, model_spec
    torch.manual_seed(0)
    vlm = vlm_from_recipe(str(recipe))
    head, states = vlm.decoder_model().get_output_embeddings(), []
    hook = head.register_forward_pre_hook(lambda module, args: states.append(args[0][:, -1]))
    for image, question in pairs:
        vlm.answer([Image.open(image).convert('RGB')], [question + POST], 1)
    hook.remove()
    hidden = torch.cat(states)  # (questions, hidden)
    mean = hidden.mean(0) / hidden.mean(0).norm()
    spread = torch.linalg.svd(hidden - hidden.mean(0))[2][0]  # the offsets' main direction
    spread = spread - (spread @ mean) * mean  # orthogonal to the mean: Yes − No is the offset along it
    (yes,), (no,) = (vlm.tokenizer(word, add_special_tokens=False)['input_ids'] for word in (' Yes', ' No'))
    with torch.no_grad():
        head.weight[yes], head.weight[no] = 50 * (mean + spread / spread.norm()), 50 * (mean - spread / spread.norm())
    directory.mkdir()
    save_file({n: p.detach().contiguous() for n, p in vlm.model.named_parameters()}, str(directory / STAGE_WEIGHTS))
    spec = model_spec(expand_env(check_model(yaml.safe_load(recipe.read_text()))))
    (directory / STAGE_CONFIG).write_text(json.dumps({'stage': 'yes-no', 'steps': 1, 'spec': spec}))
    return directory


def _lmms_eval(tmp_path, *args) -> subprocess.CompletedProcess:
    """The lmms-eval command with tmp_path/tasks' task files, offline (a fresh Hugging Face home, no hub)."""
    return run([str(LMMS_EVAL), '--include_path', str(tmp_path / 'tasks'), *map(str, args)], tmp_path, timeout=600,
               HF_DATASETS_OFFLINE='1', HF_HOME=tmp_path / 'hf')


@pytest.mark.slow
def test_the_lmms_eval_command_scores_a_local_pope_copy_as_diffzoo_scores_the_same_replies(tmp_path):
    recipe = _tiny_recipe(tmp_path)
    stage = _yes_no_stage(recipe, _pope_copies(tmp_path), tmp_path / 'stage')
    done = _lmms_eval(tmp_path, '--model', 'diffzoo', '--model_args', f'recipe={recipe},stage={stage}', '--tasks',
                      'pope_local', '--batch_size', '1', '--output_path', tmp_path / 'lmms', '--log_samples')
    # lmms-eval exits 0 after a failed run too: its results file is what says that the run was done
    results = sorted((tmp_path / 'lmms').rglob('*_results.json'))
    assert done.returncode == 0 and len(results) == 1, done.stdout[-4000:] + done.stderr[-4000:]
    theirs = json.loads(results[0].read_text())['results']['pope_local']
    (samples,) = (tmp_path / 'lmms').rglob('*_samples_pope_local.jsonl')
    samples = sorted((json.loads(line) for line in samples.read_text().splitlines()), key=lambda s: s['doc_id'])

    ours = call(lmm_main, ['--model', recipe, '--stage', stage, '--task', 'pope', '--data', tmp_path / 'data',
                           '--out', tmp_path / 'out', '--max-new-tokens', '1', '--batch-size', '1'], tmp_path)
    assert ours.returncode == 0, ours.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / 'out' / 'pope_predictions.jsonl').read_text().splitlines()]
    assert [(r['prompt'], r['prediction']) for r in rows] == [(s['input'], s['filtered_resps']) for s in samples]
    assert {r['prediction'] for r in rows} == {'Yes', 'No'}
    scores = metrics.lmms_eval_pope([{**r, 'split': 'all'} for r in rows])['all']  # lmms-eval's pope: one table
    assert {m: theirs[f'pope_{m},none'] for m in ('accuracy', 'precision', 'recall', 'f1_score', 'yes_ratio')} == \
        pytest.approx({m: scores['f1' if m == 'f1_score' else m] for m in ('accuracy', 'precision', 'recall',
                                                                          'f1_score', 'yes_ratio')})


@pytest.mark.slow
def test_a_model_lmms_eval_cannot_build_ends_the_command_with_status_2(tmp_path):
    (tmp_path / 'tasks').mkdir()
    done = _lmms_eval(tmp_path, '--model', 'diffzoo', '--model_args', f'recipe={tmp_path / "missing.yaml"}',
                      '--tasks', 'pope', '--output_path', tmp_path / 'lmms')
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"error: lmms-eval --model diffzoo: RecipeError: no recipe '{tmp_path / 'missing.yaml'}'" in done.stderr


def test_a_stage_that_trained_no_step_is_refused_before_the_model_is_built(tmp_path, capsys):
    """`python -m diffzoo.eval.lmm --stage` refuses such a stage before any model is built; the model lmms-eval
    builds now refuses it by the same rule (`stage_problem`), before reading the recipe (before: only once the model
    was built, and only where its weights did not load)."""
    stage = tmp_path / 'run' / 'stage'
    stage.mkdir(parents=True)
    (stage / 'stage.json').write_text('{"steps": 0}')
    (stage / 'stage_model.safetensors').write_bytes(b'')
    with pytest.raises(SystemExit) as exited:
        DiffzooLMM(recipe=str(tmp_path / 'missing.yaml'), stage=str(tmp_path / 'run'))
    assert exited.value.code == 2
    assert f'RecipeError: stage {stage}: stage.json records 0 steps: that stage trained nothing' \
        in capsys.readouterr().err
