"""LLaVA-style stages end to end: a tiny DiffCLIP tower and a tiny random Qwen2-style LM, LLaVA-format JSON
over drawn scenes, stage 1 (projector, captions) → 2 (vision tower and projector, single-round QA) → 3
(projector and the differential language model in full, multi-turn with text-only samples), each a real
Trainer run of `python -m diffzoo.train.vlm` on real files, the loss falling in each, then a LoRA stage 4
whose adapters are merged into what it holds; what each stage holds and leaves frozen, a chain's mismatched
model refused, a chain's stages checked before the first trains, and a rerun resuming."""
import json
import re
import shutil

import pytest
import torch
import yaml
from safetensors.torch import load_file

from diffzoo.train.vlm import main
from diffzoo.vlm import load_vlm
from tests.factory import call
from tests.vlm.models import write_chat_language_model, write_llava_sets

STAGES = {
    'stage1': dict(data=dict(type='conversations', json='pretrain.json', format='plain'),
                   train=dict(projector=True), lr=3e-3),
    'stage2': dict(data=dict(type='conversations', json='qa.json', format='qwen2_instruct'),
                   train=dict(projector=True, vision=True), init_from='stage1', lr=1e-3),
    'stage3': dict(data=dict(type='conversations', json='instruct.json', format='qwen2_instruct'),
                   train=dict(projector=True, language_model='full', gradient_checkpointing=True),
                   init_from='stage2', lr=3e-3),
    'stage4': dict(data=dict(type='conversations', json='instruct.json', format='chat_template'),
                   train=dict(language_model='lora'), lora=dict(r=8, alpha=32), init_from='stage3', lr=1e-2),
}


INTEGRATIONS = {  # LLaVA-1.5's full-token model (penultimate features, MLP projector, causal) and eRAM-V's
    'full': dict(select_layer=-2, projector='mlp2x_gelu', sequence_mask='causal'),
    'eramv': dict(integration='eramv', anchors=4, inject_layers=[1, 2]),
}


@pytest.fixture(scope='module', params=sorted(INTEGRATIONS))
def chain(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f'stages-{request.param}')
    write_chat_language_model(root / 'lm')
    write_llava_sets(root, count=32)
    model = dict(type='build_vlm', vision='diffclip-tiny', language_model=str(root / 'lm'),
                 **INTEGRATIONS[request.param])
    runs = {}
    for name, stage in STAGES.items():
        data = dict(stage['data'], json=str(root / stage['data']['json']), image_folder=str(root / 'images'),
                    max_length=128)  # the tower's 64 patch positions (eRAM-V: 5 anchors) and the text
        recipe = dict(stage, model=model, attention=dict(type='differential', lambda_init=0.5), data=data,
                      global_batch_size=8, batch_size=4, max_steps=8, warmup_ratio=0.03, lr_scheduler='cosine',
                      log_every=1, save_every=4, report_to='none', device='cpu', output=str(root / 'runs'))
        (root / f'{name}.yaml').write_text(yaml.safe_dump(recipe))
        runs[name] = call(main, ['--recipe', root / f'{name}.yaml'], root)
    return root, runs


def _results(root, name):
    return json.loads((root / 'runs' / name / 'results.json').read_text())


def test_each_stage_trains_and_its_loss_falls(chain):
    root, runs = chain
    for name in STAGES:
        assert runs[name].returncode == 0, runs[name].stderr[-3000:]
        if name == 'stage4':  # a LoRA stage after the chain: there for its merge (the next test), 8 steps
            continue
        log = [json.loads(line) for line in (root / 'runs' / name / 'log.jsonl').read_text().splitlines()]
        assert [r['step'] for r in log] == list(range(1, 9))
        first, last = sum(r['loss'] for r in log[:2]) / 2, sum(r['loss'] for r in log[-2:]) / 2
        assert last < first, (name, [round(r['loss'], 3) for r in log])
    counts = {name: _results(root, name)['trainable_parameters'] for name in STAGES}
    assert counts['stage1']['other'] == 0 and counts['stage1']['differential'] == 0  # the projector alone
    assert counts['stage2']['other'] > 0  # + the vision tower (its own λ counted as differential)
    assert counts['stage3']['differential'] > 0 and 0 < counts['stage3']['other'] < counts['stage2']['other']  # the LM
    assert counts['stage4']['lora'] > 0 and counts['stage4']['other'] == counts['stage4']['projector'] == 0
    assert _results(root, 'stage3')['data_problems']['left_out'] == {}


def test_a_stage_holds_what_it_trained_and_started_from_and_frozen_parts_stay_bit_identical(chain):
    root, _ = chain
    held = {name: load_file(str(root / 'runs' / name / 'stage' / 'stage_model.safetensors')) for name in STAGES}
    # λ and the sub-norm, drawn at random by differentialize, are held from the first stage on, frozen or not
    lam = ('lambda_q1', 'lambda_k1', 'lambda_q2', 'lambda_k2', 'sub_norm.weight')
    assert all(k.endswith(lam) for k in held['stage1'] if k.startswith('language_model.'))
    assert any(k.startswith('language_model.') for k in held['stage1'])
    parts = {name: {k.split('.')[0] for k in tensors if not (k.startswith('language_model.') and k.endswith(lam))}
             - {'post_mlp'} for name, tensors in held.items()}
    assert parts == {'stage1': {'projector'}, 'stage2': {'projector', 'vision'},
                     'stage3': {'projector', 'vision', 'language_model'},
                     'stage4': {'projector', 'vision', 'language_model'}}  # eRAM-V's post-MLP with the projector
    vision = [k for k in held['stage2'] if k.startswith('vision.')]
    assert all(torch.equal(held['stage3'][k], held['stage2'][k]) for k in vision)  # frozen in stage 3
    assert not all(torch.equal(held['stage2'][k], held['stage1'][k]) for k in held['stage1'])  # trained on
    # LoRA merged: stage 4 holds stage 3's tensors under the same names, the adapted projections changed
    assert set(held['stage4']) == set(held['stage3'])
    adapted = [k for k in held['stage4'] if k.endswith(('q_proj.weight', 'v_proj.weight'))]
    assert adapted and not any(torch.equal(held['stage4'][k], held['stage3'][k]) for k in adapted)
    assert all(torch.equal(held['stage4'][k], held['stage3'][k]) for k in held['stage4'] if k.startswith('vision.'))
    config = json.loads((root / 'runs' / 'stage3' / 'stage' / 'stage.json').read_text())
    assert config['spec']['differential']['lambda_init'] == 0.5 and config['steps'] == 8


def test_a_stage_of_another_model_is_refused_and_a_rerun_resumes(chain):
    root, _ = chain
    recipe = yaml.safe_load((root / 'stage2.yaml').read_text())
    recipe['model'] = dict(recipe['model'], select_layer=-1)  # the last block's output: other features
    (root / 'other.yaml').write_text(yaml.safe_dump(recipe))
    refused = call(main, ['--recipe', root / 'other.yaml'], root)
    assert refused.returncode == 2 and 'model.select_layer' in refused.stderr
    resumed = call(main, ['--recipe', root / 'stage3.yaml', '--max_steps', '10'], root)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert 'resuming stage3 from step 8' in resumed.stdout
    log = [json.loads(line) for line in (root / 'runs' / 'stage3' / 'log.jsonl').read_text().splitlines()]
    assert [r['step'] for r in log] == list(range(1, 11))


CHAINS = {  # (recipe, what it trains, init_from, lr, global batch, per-GPU batch, format)
    'diffclip-b16-qwen2.5-0.5b-pretrain': ({'projector'}, None, 1e-3, 192, 48, 'plain'),
    'diffclip-b16-qwen2.5-0.5b-finetune': ({'projector', 'language_model'}, 'diffclip-b16-qwen2.5-0.5b-pretrain',
                                           2e-5, 192, 48, 'qwen2_instruct'),
    'clip-b16-baseline-qwen2.5-0.5b-pretrain': ({'projector'}, None, 1e-3, 192, 48, 'plain'),
    'clip-b16-baseline-qwen2.5-0.5b-finetune': ({'projector', 'language_model'},
                                                'clip-b16-baseline-qwen2.5-0.5b-pretrain', 2e-5, 192, 48, 'qwen2_instruct'),
    'llava-1.5-7b-pretrain': ({'projector'}, None, 1e-3, 256, 32, 'plain'),
    'llava-1.5-7b-finetune': ({'projector', 'language_model'}, 'llava-1.5-7b-pretrain', 2e-5, 128, 16, 'vicuna_v1'),
    'eramv-vicuna-7b-pretrain': ({'projector'}, None, 1e-3, 256, 32, 'plain'),
    'eramv-vicuna-7b-continue': ({'projector', 'vision'}, 'eramv-vicuna-7b-pretrain', 2e-5, 128, 16, 'vicuna_v1'),
    'eramv-vicuna-7b-finetune': ({'projector', 'language_model'}, 'eramv-vicuna-7b-continue', 2e-5, 128, 16,
                                 'vicuna_v1'),
}


@pytest.mark.parametrize('name', sorted(CHAINS))
def test_the_shipped_stage_recipes_carry_the_published_settings(name):
    """DiffCLIP §5.1 (TinyLLaVA: 48 per GPU on 4 GPUs, lr 1e-3 then 2e-5, no weight decay, warm-up ratio 0.03,
    cosine), LLaVA-1.5's two stages and eRAM-V's three (section 4, Appendix H; LLaVA-1.5's rates and batches)."""
    from diffzoo.vlm.recipe import check, load_vlm_recipe
    parts, init_from, lr, total, per_gpu, fmt = CHAINS[name]
    recipe = check(load_vlm_recipe(name))
    train = recipe['train']
    trained = {k for k in ('projector', 'vision') if train[k]} | (
        {'language_model'} if train['language_model'] != 'frozen' else set())
    assert trained == parts and recipe['init_from'] == init_from and recipe['lr'] == lr
    assert (recipe['global_batch_size'], recipe['batch_size'], recipe['data']['format']) == (total, per_gpu, fmt)
    assert (recipe['weight_decay'], recipe['warmup_ratio'], recipe['lr_scheduler'], recipe['epochs']) == (
        0.0, 0.03, 'cosine', 1)
    assert recipe['model']['integration'] == ('eramv' if name.startswith('eramv') else 'full')
    assert (recipe['fsdp'] is not None) == ('7b' in name and name.endswith('finetune'))  # a 7B LM in full


def test_fsdp_is_refused_on_cpus_where_accelerate_would_train_unsharded(chain):
    """accelerate enables FSDP for GPUs only (a CPU run would silently hold the whole model in every process):
    said by name before anything trains. On a GPU, `python -m diffzoo.bench.gpu OUT stages` runs stage 3 under FSDP2."""
    root, _ = chain
    refused = call(main, ['--recipe', root / 'stage3.yaml', '--fsdp', '{version: 2}', '--output', root / 'fsdp'], root)
    assert refused.returncode == 2 and 'accelerate shards with FSDP on GPUs only' in refused.stderr
    assert not (root / 'fsdp').exists()


def test_lora_fine_tuning_from_a_stage_output_is_refused_naming_the_stage_that_does_it(chain):
    """`init_from` is a stage's start: a fine-tuning recipe (train: null) that names one would otherwise train the
    model as built and leave the stage's output out without a word."""
    root, _ = chain
    recipe = yaml.safe_load((root / 'stage1.yaml').read_text())
    recipe.update(train=None, data=dict(type='vqav2', root=str(root)), output=str(root / 'fine-tune'))
    (root / 'fine-tune.yaml').write_text(yaml.safe_dump(recipe))
    refused = call(main, ['--recipe', root / 'fine-tune.yaml', '--init_from', 'stage1'], root)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "init_from='stage1'" in refused.stderr and 'train.language_model: lora' in refused.stderr
    assert not (root / 'fine-tune').exists()


def test_one_command_runs_a_chain_and_stops_at_the_first_failing_stage(chain):
    root, _ = chain
    done = call(main, ['chain', root / 'stage1.yaml', root / 'stage2.yaml', '--output', root / 'chained',
                       '--max_steps', '2'], root)
    assert done.returncode == 0, done.stderr[-2000:]
    assert '=== stage 2 of 2' in done.stdout
    assert json.loads((root / 'chained' / 'stage2' / 'stage' / 'stage.json').read_text())['steps'] == 2
    stopped = call(main, ['chain', root / 'stage2.yaml', root / 'stage3.yaml', '--output', root / 'empty'], root)
    assert stopped.returncode == 2 and "init_from='stage1'" in stopped.stderr and '=== stage 1' not in stopped.stdout


def test_a_chain_checks_every_stage_before_the_first_trains(chain, tmp_path):
    """A later stage that cannot run is named before stage 1 trains (hours at scale), exit 2, nothing written:
    its JSON or image folder missing, a file that is no JSON list, a mistyped key, a batch of no step, a start
    from a stage of another model, or from a stage listed after it."""
    root, _ = chain
    stage2 = yaml.safe_load((root / 'stage2.yaml').read_text())
    (tmp_path / 'mapping.json').write_text('{"id": "q0"}')
    data = stage2['data']
    cases = {
        'no-json': (dict(data=dict(data, json=str(tmp_path / 'gone.json'))), f'{tmp_path / "gone.json"}: no such file'),
        'no-images': (dict(data=dict(data, image_folder=str(tmp_path / 'gone'))),
                      f'{tmp_path / "gone"}: no such folder'),
        'not-a-list': (dict(data=dict(data, json=str(tmp_path / 'mapping.json'))),
                       'mapping.json: starts with b\'{"id": "q0"}\', not a JSON list'),
        'typo': (dict(lr_schedulr='linear'), 'lr_schedulr (did you mean lr_scheduler?)'),
        'no-step': (dict(global_batch_size=-8), 'recipe key global_batch_size: -8; it must be above 0'),
        'other-model': (dict(model=dict(stage2['model'], select_layer=-1)),
                        "init_from='stage1': stage 1 of the chain trains another model (model.select_layer"),
    }
    for case, (change, message) in cases.items():
        path = tmp_path / f'{case}.yaml'
        path.write_text(yaml.safe_dump(dict(stage2, **change)))
        out = tmp_path / case
        refused = call(main, ['chain', root / 'stage1.yaml', path, '--output', out], root)
        assert refused.returncode == 2, (case, refused.stdout[-2000:])
        assert f'stage 2 of 2 ({path}), checked before any stage runs: ' in refused.stderr, (case, refused.stderr)
        assert message in refused.stderr, (case, refused.stderr)
        assert '=== stage 1' not in refused.stdout and not out.exists()
    order = call(main, ['chain', root / 'stage3.yaml', root / 'stage2.yaml', '--output', tmp_path / 'order'], root)
    assert order.returncode == 2 and not (tmp_path / 'order').exists()
    assert "init_from='stage2' is stage 2 of the chain, which runs after this one" in order.stderr


def test_a_stage_output_of_no_step_or_cut_short_is_refused_as_a_start_naming_the_fix(chain, tmp_path):
    """init_from a stage.json of 0 steps (the old code wrote one for --epochs 0) or a stage_model.safetensors cut
    short (a copy or save stopped) is refused by name, with its fix, by a stage, a chain and a model loaded from
    it; nothing is written (safetensors' own error named no file)."""
    from diffzoo.recipes import RecipeError
    from diffzoo.vlm.factory import vlm_from_recipe
    root, _ = chain
    zero, cut = tmp_path / 'zero', tmp_path / 'cut'
    for run in (zero, cut):
        shutil.copytree(root / 'runs' / 'stage1' / 'stage', run / 'stage')
    config = json.loads((zero / 'stage' / 'stage.json').read_text())
    (zero / 'stage' / 'stage.json').write_text(json.dumps(dict(config, steps=0)))
    weights = cut / 'stage' / 'stage_model.safetensors'
    weights.write_bytes(weights.read_bytes()[:weights.stat().st_size // 2])
    rerun = 'rerun that stage (its recipe, with its output): it resumes from its last complete checkpoint'
    for run, message in ((zero, 'stage.json records 0 steps: that stage trained nothing; rerun it with max_steps or '
                                'epochs above 0'),
                         (cut, f'stage_model.safetensors holds {weights.stat().st_size:,} bytes of the')):
        for command in (['--recipe'], ['chain']):
            refused = call(main, [*command, root / 'stage2.yaml', '--init_from', run, '--output', tmp_path / 'out'],
                           root)
            assert refused.returncode == 2 and f"init_from='{run}': {run / 'stage'}: {message}" in refused.stderr, \
                refused.stderr
    assert rerun in refused.stderr and not (tmp_path / 'out').exists()
    with pytest.raises(RecipeError, match=f'stage {cut / "stage"}: stage_model.safetensors holds .*; '
                                          f'{re.escape(rerun)}'):
        vlm_from_recipe(yaml.safe_load((root / 'stage2.yaml').read_text()), stage=cut)  # before any model is built


def test_a_finished_stage_loads_and_answers_in_its_format_with_the_image_at_its_place(chain):
    """vlm_from_recipe(recipe, stage=run dir): the stage's tensors in the model, prompts in the recipe's
    format (qwen2_instruct: up to 'ASSISTANT:'), the image padded to a square and
    spliced where <image> was; for the full-token model the first answer token is the argmax written out by
    hand."""
    from PIL import Image
    from diffzoo.vlm.conversations import pad_to_square, prompt, transform_mean
    from diffzoo.vlm.factory import vlm_from_recipe
    root, _ = chain
    recipe = yaml.safe_load((root / 'stage3.yaml').read_text())
    vlm = vlm_from_recipe(recipe, stage=root / 'runs' / 'stage3')
    held = load_file(str(root / 'runs' / 'stage3' / 'stage' / 'stage_model.safetensors'))
    params = dict(vlm.model.named_parameters())
    assert all(torch.equal(params[k], v) for k, v in held.items())
    assert vlm.prompt_format == 'qwen2_instruct' and vlm.image_aspect == 'pad'
    image = Image.open(root / 'images' / 'scenes' / '00000.jpg').crop((0, 0, 64, 40))  # not square
    batch = vlm.prompts([image], ['what color is the shape?'])
    answer = vlm.generate(batch, max_new_tokens=3)
    assert isinstance(answer[0], str)
    ids, at = prompt('what color is the shape?', vlm.tokenizer, 'qwen2_instruct')
    assert batch['input_ids'][0].tolist() == ids and batch['image_at'].tolist() == [at]
    if vlm.model.integration != 'full':
        return  # eRAM-V's anchors and injected features: the prompt and splice above are what this test checks
    colour = tuple(int(m * 255) for m in transform_mean(vlm.transform))
    pixels = vlm.transform(pad_to_square(image.convert('RGB'), colour))[None]
    with torch.no_grad():
        text = vlm.model.language_model.get_input_embeddings()(torch.tensor(ids))
        seq = torch.cat([text[:at], vlm.model.image_embeddings(pixels)[0], text[at:]])
        first = vlm.model.language_model(inputs_embeds=seq[None]).logits[0, -1].argmax()
        out = vlm.model.generate(batch['pixel_values'], batch['input_ids'], batch['attention_mask'], max_new_tokens=1,
                                 image_at=batch['image_at'])
    assert out[0, 0] == first


def test_each_epoch_ends_with_what_the_data_lost_each_conversation_counted_once(chain):
    root, runs = chain
    assert ('epoch 1: 0 conversation(s) cut to 128 positions (image and text), 0 left out after the cut'
            in runs['stage1'].stdout)
    # 8 steps of 8 over 32 captions: two epochs, the second's counts given once, by the stage's closing line
    assert 'epoch 2: ' not in runs['stage1'].stdout
    assert 'stage1: 8 steps, loss' in runs['stage1'].stdout
    limit = load_vlm(yaml.safe_load((root / 'stage1.yaml').read_text())['model']).model.image_positions() + 3
    cut = call(main, ['--recipe', root / 'stage1.yaml', '--data.max_length', limit, '--output', root / 'cut',
                      '--max_steps', '8'], root)
    assert cut.returncode == 0, cut.stderr[-2000:]
    # every caption is longer than 3 tokens beside the image: all 32 cut in epoch 1, still 32 (not 64) after epoch 2
    assert f'epoch 1: 32 conversation(s) cut to {limit} positions (image and text)' in cut.stdout
    # epoch 1, then the run (not epoch 2)
    assert cut.stdout.count(f'32 conversation(s) cut to {limit} positions (image and text)') == 2
    problems = json.loads((root / 'cut' / 'stage1' / 'data_problems.json').read_text())
    assert problems['cut_to_max_length'] == 32 and problems['left_out_after_cut'] == 0


def test_the_logged_loss_is_a_micro_batch_mean_whatever_the_accumulation(chain):
    """Trainer divides the loss by the accumulation steps itself (the model's loss takes no item count): one
    step of 8 captions logs the same loss as batch 8 and as 2 × 4 accumulated (at lr 0), not twice it."""
    root, _ = chain
    losses = {}
    for batch in (8, 4):
        out = root / f'accumulate-{batch}'
        done = call(main, ['--recipe', root / 'stage1.yaml', '--lr', '0', '--max_steps', '1', '--batch_size', batch,
                           '--global_batch_size', '8', '--output', out], root)
        assert done.returncode == 0, done.stderr[-2000:]
        losses[batch] = json.loads((out / 'stage1' / 'log.jsonl').read_text().splitlines()[0])['loss']
    assert 0.8 < losses[4] / losses[8] < 1.25, losses


def test_a_conversation_stage_refuses_the_prefix_lm_mask(chain):
    root, _ = chain
    recipe = yaml.safe_load((root / 'stage1.yaml').read_text())
    if recipe['model'].get('integration') == 'eramv':
        return  # eRAM-V attends causally by default; the full-token model's default is PaliGemma's prefix-LM
    recipe['model'] = dict(recipe['model'], sequence_mask='prefix_lm')
    (root / 'prefix.yaml').write_text(yaml.safe_dump(recipe))
    refused = call(main, ['--recipe', root / 'prefix.yaml', '--output', root / 'prefix'], root)
    assert refused.returncode == 2 and 'trains causally' in refused.stderr
