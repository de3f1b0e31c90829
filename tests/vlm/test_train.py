"""LoRA fine-tuning end to end on a generated VQAv2-format set, a tiny Gemma and DiffCLIP-tiny."""
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, Union

import pytest
import torch
import transformers
import yaml
from transformers.trainer_utils import get_last_checkpoint

from diffzoo.train.vlm import main as train_vlm
from diffzoo.train.vlm.resume import checkpoint_problem
from diffzoo.train.vlm.trainer import VLMTrainer
from diffzoo.vlm import build_vlm, differentialize, load_adapter, load_vlm
from diffzoo.vlm.data import PROMPT, VLMCollator, load_vqav2
from diffzoo.vlm.lora import add_lora, save_adapter
from diffzoo.vlm.parts import trainable_parameters
from tests.factory import call
from tests.vlm.models import write_vqav2_split

pytestmark = pytest.mark.slow  # fine-tunings, one under torchrun



@pytest.fixture(scope='module')
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp('vlm')
    write_vqav2_split(root / 'vqav2', 'train', 48, seed=0)
    write_vqav2_split(root / 'vqav2', 'val', 8, seed=1)
    return root


def _recipe(assets: Path, model: Union[Path, Dict], out: Path, **extra) -> Path:
    """A recipe training `model` (a language model directory under diffclip-tiny, or a recipe's model
    mapping) on assets/vqav2, written to OUT/tiny-vqa.yaml."""
    if not isinstance(model, dict):
        model = {'type': 'build_vlm', 'vision': 'diffclip-tiny', 'language_model': str(model)}
    recipe = {
        'model': model,
        'attention': {'type': 'differential', 'variant': 'split', 'lambda_init': 0.8},
        'lora': {'r': 8, 'alpha': 16},
        'train_projector': True,
        'data': {'root': str(assets / 'vqav2'), 'split': 'train', 'val_split': 'val'},
        'lr': 3.0e-3, 'batch_size': 4, 'max_steps': 160, 'log_every': 40, 'save_every': 80,
        'precision': 'fp32', 'device': 'cpu', 'workers': 0, 'eval_max_new_tokens': 3,
        'output': str(out), **extra,
    }
    path = out / 'tiny-vqa.yaml'
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(recipe))
    return path


def _train(recipe: Path, *args, torchrun: int = 0) -> subprocess.CompletedProcess:
    """`python -m diffzoo.train.vlm --recipe RECIPE ARGS` through its `main` in this process, or with
    `torchrun` processes under torchrun (the command's real-process test)."""
    if not torchrun:
        result = call(train_vlm, ['--recipe', recipe, *args], cwd=recipe.parent)
    else:
        cmd = [sys.executable, '-m', 'torch.distributed.run', '--standalone', f'--nproc-per-node={torchrun}',
               '-m', 'diffzoo.train.vlm', '--recipe', str(recipe), *args]
        result = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, 'OMP_NUM_THREADS': '1'},
                                timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def test_official_layout_loads_with_a_seeded_subset(assets):
    full = load_vqav2(assets / 'vqav2', 'train')
    assert len(full) == 96 and full[0].answers == [full[0].answer] * 10
    half = load_vqav2(assets / 'vqav2', 'train', fraction=0.5, seed=3)
    assert len(half) == 48 and [s.question_id for s in half] == [s.question_id for s in
                                                                 load_vqav2(assets / 'vqav2', 'train', 0.5, 3)]
    with pytest.raises(FileNotFoundError, match='official layout'):
        load_vqav2(assets, 'train')


def test_hugging_face_parquet_layout_loads_the_same_questions(assets, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    official = load_vqav2(assets / 'vqav2', 'val')
    rows = [{'question_id': s.question_id, 'question': s.question, 'question_type': s.question_type,
             'answer_type': s.answer_type, 'multiple_choice_answer': s.answer,
             'answers': [{'answer': a, 'answer_confidence': 'yes', 'answer_id': i + 1} for i, a in enumerate(s.answers)],
             'image': {'bytes': Path(s.image).read_bytes(), 'path': None}} for s in official]
    (tmp_path / 'data').mkdir()
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / 'data' / 'validation-00000-of-00001.parquet')
    pq.write_table(pa.Table.from_pylist(rows[:2]), tmp_path / 'data' / 'train-00000-of-00001.parquet')
    loaded = load_vqav2(tmp_path, 'validation')
    assert [(s.question_id, s.question, s.answer, s.answers) for s in loaded] == \
        [(s.question_id, s.question, s.answer, s.answers) for s in official]
    assert loaded[0].load_image().size == official[0].load_image().size
    pq.write_table(pa.Table.from_pylist([{'q': 'x'}]), tmp_path / 'data' / 'test-00000-of-00001.parquet')
    with pytest.raises(ValueError, match='no "question" column'):
        load_vqav2(tmp_path, 'test')


def test_collator_scores_only_the_answer_and_marks_the_prompt_as_prefix(assets, language_model_dir):
    tokenizer = transformers.AutoTokenizer.from_pretrained(language_model_dir)
    collate = VLMCollator(tokenizer, lambda im: torch.zeros(3, 64, 64))
    samples = load_vqav2(assets / 'vqav2', 'val')[:2]
    batch = collate(samples)
    for i, s in enumerate(samples):
        prompt_len = 1 + len(tokenizer(PROMPT.format(question=s.question), add_special_tokens=False)['input_ids'])
        assert batch['prefix_mask'][i].sum() == prompt_len
        scored = batch['labels'][i][batch['labels'][i] != -100].tolist()
        assert scored == tokenizer(s.answer, add_special_tokens=False)['input_ids'] + [tokenizer.eos_token_id]


def test_lora_trains_only_adapters_lambda_sub_norm_and_projector_and_round_trips(assets, language_model_dir, tmp_path):
    lm = transformers.AutoModelForCausalLM.from_pretrained(language_model_dir)
    torch.manual_seed(0)  # the vision tower: the same random weights as the fresh model below (not saved)
    model = build_vlm('diffclip-tiny', lm)
    differentialize(model.language_model, variant='duplicate')
    before = {n: p.detach().clone() for n, p in model.language_model.named_parameters()}
    model = add_lora(model, r=4, alpha=8, train_projector=True)
    counts = trainable_parameters(model)
    assert counts['other'] == 0 and counts['lora'] > 0 and counts['differential'] == 2 * (4 * 12 + 12)
    assert counts['projector'] == 128 * 48 + 48
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    tokenizer = transformers.AutoTokenizer.from_pretrained(language_model_dir)
    batch = VLMCollator(tokenizer, lambda im: torch.rand(3, 64, 64))(load_vqav2(assets / 'vqav2', 'val')[:4])
    for _ in range(3):
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    base = {n.replace('base_model.model.', '').replace('.base_layer', ''): p
            for n, p in model.language_model.named_parameters() if 'lora_' not in n}
    for name, value in before.items():
        if not name.endswith(('lambda_q1', 'lambda_k1', 'lambda_q2', 'lambda_k2', 'sub_norm.weight')):
            assert torch.equal(base[name], value), f'{name} changed'
    save_adapter(model, tmp_path / 'adapter')
    torch.manual_seed(1)  # a different random projector: the saved one must replace it
    fresh = build_vlm('diffclip-tiny', transformers.AutoModelForCausalLM.from_pretrained(language_model_dir))
    torch.manual_seed(0)
    fresh.vision = build_vlm('diffclip-tiny',
                             transformers.AutoModelForCausalLM.from_pretrained(language_model_dir)).vision
    loaded = load_adapter(fresh, tmp_path / 'adapter').eval()
    model.eval()
    torch.testing.assert_close(loaded(**batch).logits, model(**batch).logits)


def test_cpu_fine_tune_lowers_the_loss_scores_vqa_and_resumes(assets, language_model_dir, tmp_path):
    recipe = _recipe(assets, language_model_dir, tmp_path / 'runs', max_steps=80, log_every=20, save_every=40)
    out = _train(recipe).stdout
    run = tmp_path / 'runs' / 'tiny-vqa'
    log = [json.loads(line) for line in (run / 'log.jsonl').read_text().splitlines()]
    assert [r['step'] for r in log] == [20, 40, 60, 80]
    assert log[-1]['loss'] < log[0]['loss'] - 0.02, log  # the answers start to depend on the image
    results = json.loads((run / 'results.json').read_text())
    assert results['steps'] == 80 and results['questions'] == 16 and 0 <= results['vqa_accuracy'] <= 100
    assert results['trainable_parameters']['other'] == 0
    assert (run / 'loss.png').stat().st_size > 0 and (run / 'adapter' / 'diffzoo_extra.safetensors').is_file()
    assert 'VQA accuracy' in out
    assert {'lambda/layer_0', 'lambda/layer_1'} <= set(log[0])  # λ of each differential layer, every log line
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(next((run / 'tensorboard').rglob('events.out.tfevents*')).parent)).Reload()
    assert {'train/loss', 'train/lambda/layer_0', 'train/learning_rate'} <= set(events.Tags()['scalars'])
    resumed = _train(recipe, '--max_steps', '90').stdout
    assert 'resuming tiny-vqa from step 80' in resumed
    log = [json.loads(line) for line in (run / 'log.jsonl').read_text().splitlines()]
    assert log[-1]['step'] == 90
    assert (run / 'checkpoints' / 'checkpoint-90' / 'adapter_model.safetensors').is_file()
    refused = call(train_vlm, ['--recipe', recipe, '--max_steps', '100', '--lr', '1e-4'], cwd=tmp_path)
    assert refused.returncode == 2 and "other settings for ['lr']" in refused.stderr


def test_a_checkpoint_cut_short_is_set_aside_and_the_run_resumes_from_the_one_before(assets, language_model_dir,
                                                                                     tmp_path):
    recipe = _recipe(assets, language_model_dir, tmp_path / 'runs', max_steps=8, log_every=4, save_every=4, data={
        'root': str(assets / 'vqav2'), 'split': 'train', 'val_split': None})
    _train(recipe)
    checkpoints = tmp_path / 'runs' / 'tiny-vqa' / 'checkpoints'
    assert sorted(p.name for p in checkpoints.iterdir()) == ['checkpoint-4', 'checkpoint-8']
    assert checkpoint_problem(checkpoints / 'checkpoint-8') is None
    for name, damage, problem in [('trainer_state.json', 'remove', 'no trainer_state.json'),
                                  ('trainer_state.json', 'truncate', 'trainer_state.json does not load'),
                                  ('optimizer.pt', 'truncate', 'optimizer.pt does not load'),
                                  ('diffzoo_extra.safetensors', 'remove', 'no diffzoo_extra.safetensors'),
                                  ('rng_state.pth', 'remove', 'no rng_state')]:
        copy = tmp_path / 'damaged' / f'{damage}-{name}'
        shutil.copytree(checkpoints / 'checkpoint-8', copy)
        path = copy / name
        path.unlink() if damage == 'remove' else path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])
        assert checkpoint_problem(copy).startswith(problem), (name, damage)
    weights = checkpoints / 'checkpoint-8' / 'adapter_model.safetensors'  # a run killed while writing it
    weights.write_bytes(weights.read_bytes()[:weights.stat().st_size // 2])
    assert get_last_checkpoint(checkpoints).endswith('checkpoint-8')  # transformers would resume from it
    out = _train(recipe, '--max_steps', '12').stdout
    assert f'skipping {checkpoints / "checkpoint-8"}: incomplete (adapter_model.safetensors does not load' in out
    assert 'set aside as incomplete-checkpoint-8' in out and 'resuming tiny-vqa from step 4' in out
    assert sorted(p.name for p in checkpoints.iterdir()) == ['checkpoint-12', 'checkpoint-8', 'incomplete-checkpoint-8']
    assert checkpoint_problem(checkpoints / 'checkpoint-8') is None
    run = tmp_path / 'runs' / 'tiny-vqa'
    assert json.loads((run / 'results.json').read_text())['steps'] == 12
    assert [json.loads(line)['step'] for line in (run / 'log.jsonl').read_text().splitlines()] == [4, 8, 12]
    assert 'log.jsonl: 1 record(s) after step 4 removed' in out  # step 8's, logged again by the resumed run
    # the counts go on from checkpoint-4's (steps 1-4), so they cover the whole run
    assert json.loads((run / 'skipped_images.json').read_text()) == {
        'count': 0, 'files': [], 'samples_skipped': 0, 'samples_trained': 12 * 4}


def test_unreadable_images_are_skipped_named_once_and_the_rest_trains(assets, language_model_dir, tmp_path):
    root = tmp_path / 'vqav2'
    write_vqav2_split(root, 'train', 16, seed=0)  # 32 questions: one epoch of 8 steps of 4
    truncated, not_jpeg = root / 'train2014' / 'COCO_train2014_000000001003.jpg', \
        root / 'train2014' / 'COCO_train2014_000000001011.jpg'
    truncated.write_bytes(truncated.read_bytes()[:300])  # cut off mid-scan: PIL opens it, decoding fails
    not_jpeg.write_bytes(b'<html>404 Not Found</html>\n' * 8)  # UnidentifiedImageError
    write_vqav2_split(root, 'val', 4, seed=1)  # 8 validation questions, 2 per image
    val_image = sorted((root / 'val2014').glob('*.jpg'))[1]
    val_image.write_bytes(val_image.read_bytes()[:300])
    recipe = _recipe(assets, language_model_dir, tmp_path / 'runs', max_steps=8, log_every=4, save_every=8, data={
        'root': str(root), 'split': 'train', 'val_split': 'val'})
    out = _train(recipe).stdout
    for path in (truncated, not_jpeg):
        assert out.count(f'skipped an unreadable image (its questions are left out): {path}') == 1
    # the evaluation at the end answers the 6 readable questions; the run's results and adapter are kept
    assert out.count(f'skipped an unreadable image (its questions are not answered): {val_image}') == 1
    assert 'VQA accuracy over the 6 answered questions: 2 validation questions left out' in out
    results = json.loads((tmp_path / 'runs' / 'tiny-vqa' / 'results.json').read_text())
    assert results['questions'] == 6 and results['questions_left_out'] == 2
    assert (tmp_path / 'runs' / 'tiny-vqa' / 'adapter' / 'adapter_model.safetensors').is_file()
    run = tmp_path / 'runs' / 'tiny-vqa'
    assert json.loads((run / 'skipped_images.json').read_text()) == {
        'count': 2, 'files': sorted([str(truncated), str(not_jpeg)], key=out.index),
        'samples_skipped': 4, 'samples_trained': 32 - 4}
    assert 'tiny-vqa: 28 samples trained; 2 unreadable image file(s) left out (4 samples)' in out
    assert json.loads((run / 'results.json').read_text())['steps'] == 8


def test_fine_tuning_trains_the_last_partial_batch_of_an_epoch(assets, language_model_dir, tmp_path):
    """10 VQAv2 questions at batch 4, one epoch (no max_steps): 3 steps of 4, 4 and 2, every question trained, as
    LLaVA's and TinyLLaVA's trainers keep the last batch (before: 2 steps, 8 trained, 2 dropped uncounted)."""
    root = tmp_path / 'vqav2'
    write_vqav2_split(root, 'train', 5, seed=0)  # 10 questions, 2 per image
    write_vqav2_split(root, 'val', 1, seed=1)
    recipe = _recipe(assets, language_model_dir, tmp_path / 'runs', max_steps=None, epochs=1, log_every=1,
                     save_every=8, data={'root': str(root), 'split': 'train', 'val_split': 'val'})
    out = _train(recipe).stdout
    run = tmp_path / 'runs' / 'tiny-vqa'
    assert json.loads((run / 'results.json').read_text())['steps'] == 3
    assert json.loads((run / 'skipped_images.json').read_text())['samples_trained'] == 10
    assert 'tiny-vqa: 10 samples trained' in out


def test_a_batch_without_a_readable_image_takes_a_step_with_no_gradient(assets, language_model_dir, tmp_path):
    vlm = load_vlm({'type': 'build_vlm', 'vision': 'diffclip-tiny', 'language_model': str(language_model_dir)},
                   differential={'variant': 'split', 'lambda_init': 0.8})
    vlm.add_lora(r=4, alpha=8, train_projector=True)
    samples = load_vqav2(assets / 'vqav2', 'val')[:2]
    bad = [dataclasses.replace(s, image=b'not an image') for s in samples]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=1,
                                          save_strategy='no', use_cpu=True, report_to='none')
    trainer = VLMTrainer(model=vlm.model, args=args, train_dataset=bad, data_collator=vlm.collator())
    before = {n: p.detach().clone() for n, p in vlm.model.named_parameters() if p.requires_grad}
    assert trainer.train().training_loss == 0 and trainer.state.global_step == 1
    for name, p in vlm.model.named_parameters():
        if p.requires_grad:
            assert torch.equal(p, before[name]), f'{name} moved'  # zero gradient: AdamW (no decay) stays put
    assert trainer.skipped_images.record() == {'count': 2, 'files': [f'question {s.question_id}' for s in samples],
                                               'samples_skipped': 2, 'samples_trained': 0}


def test_torchrun_two_processes_train_one_model(assets, language_model_dir, tmp_path):
    recipe = _recipe(assets, language_model_dir, tmp_path / 'runs', max_steps=4, log_every=2, save_every=4, data={
        'root': str(assets / 'vqav2'), 'split': 'train', 'val_split': None})
    out = _train(recipe, torchrun=2).stdout
    assert '4 steps of 4 × 1 × 2' in out
    run = tmp_path / 'runs' / 'tiny-vqa'
    assert (run / 'adapter' / 'adapter_model.safetensors').is_file()
    assert [json.loads(line)['step'] for line in (run / 'log.jsonl').read_text().splitlines()] == [2, 4]


def _paligemma_3b():
    """PaliGemma-3B's geometry (pt-224), built on the meta device: no weights allocated or downloaded."""
    config = transformers.PaliGemmaConfig(
        text_config=dict(model_type='gemma', vocab_size=257216, hidden_size=2048, intermediate_size=16384,
                         num_hidden_layers=18, num_attention_heads=8, num_key_value_heads=1, head_dim=256),
        vision_config=dict(model_type='siglip_vision_model', image_size=224, patch_size=14, hidden_size=1152,
                           intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16),
        projection_dim=2048)
    with torch.device('meta'):
        return transformers.PaliGemmaForConditionalGeneration(config)


@pytest.mark.parametrize('variant, mlp', [(None, False), ('duplicate', False), ('split', False), ('duplicate', True)])
def test_paligemma_3b_trainable_parameters(variant, mlp):
    model = _paligemma_3b()
    assert 2.9e9 < sum(p.numel() for p in model.parameters()) < 3.0e9
    if variant:
        differentialize(model, variant=variant)
    counts = trainable_parameters(add_lora(model, r=32, alpha=64, mlp=mlp))
    r, layers, hidden, kv, ffn, d = 32, 18, 2048, 256, 16384, 256
    lora = layers * r * ((hidden + hidden) * 2 + (hidden + kv) * 2)  # q, o: 2048→2048; k, v: 2048→256
    if mlp:
        lora += layers * r * 3 * (hidden + ffn)
    differential = 0 if variant is None else layers * (4 * d + (2 * d if variant == 'split' else d))
    assert counts == {'lora': lora, 'differential': differential, 'projector': 0, 'other': 0,
                      'total': lora + differential}




def test_paligemma_checkpoint_fine_tunes_differential_and_loads_its_adapter(assets, paligemma_dir, tmp_path):
    recipe = _recipe(assets, {'type': 'paligemma', 'path': str(paligemma_dir)}, tmp_path / 'runs',
                     attention={'type': 'differential', 'variant': 'duplicate', 'lambda_init': 'depth'},
                     train_projector=False,
                     max_steps=8, log_every=4, save_every=8)
    _train(recipe)
    run = tmp_path / 'runs' / 'tiny-vqa'
    results = json.loads((run / 'results.json').read_text())
    assert results['questions'] == 16 and results['trainable_parameters']['differential'] == 2 * (4 * 8 + 8)
    base = transformers.PaliGemmaForConditionalGeneration.from_pretrained(paligemma_dir)
    model = load_adapter(base, run / 'adapter')
    assert model.base_model.model.model.language_model.layers[1].self_attn.differential.variant == 'duplicate'
