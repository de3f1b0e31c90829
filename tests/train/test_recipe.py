import argparse
import re

import open_clip
import pytest

from diffzoo.train.recipe import (
    RecipeError, load_recipe, parse_overrides, recipe_names, resolve, split_batch, steps_per_epoch,
)
from diffzoo.train.runner import run
from tests.factory import write_shards

PAPER_RUNS = [f'{m}-{d}' for m in ('diffclip-b16', 'diffclip-b16-vision', 'diffclip-b16-dynamic',
                                   'clip-b16-baseline') for d in ('cc3m', 'cc12m')]
TINY_RUNS = ['diffclip-tiny', 'diffclip-tiny-vision', 'diffclip-tiny-dynamic', 'clip-tiny-baseline']


@pytest.fixture
def shards(tmp_path):
    write_shards(tmp_path / 'shards', 16, 2)
    return tmp_path / 'shards'


def _value(argv, flag):
    i = argv.index(flag)
    return argv[i + 1]


def test_every_paper_run_and_tiny_recipe_ships():
    assert set(PAPER_RUNS + TINY_RUNS) <= set(recipe_names())


@pytest.mark.parametrize('name', PAPER_RUNS)
@pytest.mark.parametrize('world_size', [4, 8, 16])
def test_paper_recipes_expand_to_the_paper_settings(name, world_size, shards, monkeypatch):
    monkeypatch.setenv('CC3M_SHARDS', str(shards))
    monkeypatch.setenv('CC12M_SHARDS', str(shards))
    recipe = load_recipe(name)
    plan = resolve(dict(recipe, workers=1), name, world_size)
    argv = plan.argv
    assert _value(argv, '--model') in open_clip.list_models()
    assert _value(argv, '--epochs') == '40' and _value(argv, '--lr') == '0.0005' and _value(argv, '--wd') == '0.5'
    assert (_value(argv, '--beta1'), _value(argv, '--beta2'), _value(argv, '--eps')) == ('0.9', '0.98', '1e-08')
    assert _value(argv, '--precision') == 'amp_bf16'
    per_gpu, accum = int(_value(argv, '--batch-size')), int(_value(argv, '--accum-freq'))
    assert per_gpu * accum * world_size == 4096 and per_gpu <= 512
    assert '--local-loss' in argv and '--gather-with-grad' in argv
    assert _value(argv, '--resume') == 'latest' and '--save-most-recent' in argv
    assert _value(argv, '--save-frequency') == '1'
    assert int(_value(argv, '--warmup')) == plan.derived['steps_per_epoch']  # one warm-up epoch
    assert _value(argv, '--name') == name


def test_one_process_gets_no_distributed_loss(shards):
    plan = resolve(dict(load_recipe('diffclip-tiny'), train_data=str(shards)), 'diffclip-tiny', 1)
    assert '--local-loss' not in plan.argv and '--gather-with-grad' not in plan.argv


@pytest.mark.parametrize('global_batch, world, max_per_gpu, expected', [
    (4096, 4, 512, (512, 2)), (4096, 8, 512, (512, 1)), (4096, 1, 512, (512, 8)), (4096, 2, None, (2048, 1)),
    (96, 2, 20, (16, 3)),
])
def test_split_batch_keeps_the_global_batch(global_batch, world, max_per_gpu, expected):
    assert split_batch(global_batch, world, max_per_gpu) == expected


def test_split_batch_refuses_a_batch_that_does_not_divide():
    with pytest.raises(RecipeError, match='multiple of 3'):
        split_batch(4096, 3, 512)


@pytest.mark.parametrize('samples, per_gpu, world, workers, accum', [
    (2_300_000, 512, 4, 8, 2), (7_900_000, 512, 8, 8, 1), (150, 8, 2, 1, 1), (1000, 16, 2, 3, 2),
])
def test_steps_per_epoch_is_what_open_clip_trains(tmp_path, samples, per_gpu, world, workers, accum):
    from open_clip_train.data import get_wds_dataset
    shards = write_shards(tmp_path, max(2, workers * world), 1)
    args = argparse.Namespace(train_data=str(tmp_path / f'{{00000..{len(shards) - 1:05d}}}.tar'),
                              train_num_samples=samples, dataset_resampled=False, train_data_upsampling_factors=None,
                              seed=0, batch_size=per_gpu, world_size=world, workers=workers)
    loader = get_wds_dataset(args, lambda x: x, is_train=True, tokenizer=lambda t: [t]).dataloader
    assert steps_per_epoch(samples, per_gpu, world, workers, accum) == loader.num_batches // accum


def test_overrides_parse_like_yaml():
    assert parse_overrides(['--lr', '1e-3', '--epochs=2', '--grad-checkpointing', '--name', 'run a']) == {
        'lr': 1e-3, 'epochs': 2, 'grad_checkpointing': True, 'name': 'run a'}
    with pytest.raises(RecipeError, match='after a lone --'):
        parse_overrides(['lr', '1'])


def test_unknown_keys_are_refused_with_the_valid_ones(shards):
    with pytest.raises(RecipeError) as err:
        resolve(dict(load_recipe('diffclip-tiny'), train_data=str(shards), learning_rate=1), 'x', 1)
    text = str(err.value)
    assert 'learning_rate' in text and 'global_batch_size' in text and 'open_clip_train flag' in text
    with pytest.raises(RecipeError, match='set global_batch_size instead'):
        resolve(dict(load_recipe('diffclip-tiny'), train_data=str(shards), batch_size=8), 'x', 1)


@pytest.mark.parametrize('key, value, message', [
    ('global_batch_size', 'big', "recipe key global_batch_size: 'big' is not an integer"),
    ('warmup_epochs', 'half', "recipe key warmup_epochs: 'half' is not an integer or a number"),
    ('workers', 'many', "recipe key workers: 'many' is refused by open_clip_train .*invalid int value"),
    ('precision', 'fp7', "recipe key precision: 'fp7' is refused by open_clip_train .*invalid choice"),
    ('lr', -1, 'recipe key lr: -1 must be positive'),
    ('global_batch_size', 0, 'recipe key global_batch_size: 0 must be positive'),
    ('distributed_loss', 'maybe', "recipe key distributed_loss: 'maybe' is not one of auto, True, False"),
    ('lr', float('nan'), 'recipe key lr: nan is not a finite number'),
    ('warmup_epochs', float('inf'), 'recipe key warmup_epochs: inf is not a finite number'),
    ('wd', float('-inf'), 'recipe key wd: -inf is not a finite number'),
    ('train_num_samples', 0, 'recipe key train_num_samples: 0 must be positive'),
    ('log_every_n_steps', 0, 'recipe key log_every_n_steps: 0 must be positive'),
    ('image_mean', [1, 2], r'recipe key image_mean: \[1, 2\]; give one number per RGB channel'),
    ('image_std', [0, 0, 0], r"recipe key image_std: \[0, 0, 0\]; each channel's std must be positive"),
    ('name', '../../escape', "recipe key name: '../../escape'; the run's folder under logs is named by it"),
    ('name', '', "recipe key name: ''; the run's folder"),
    ('logs', '/dev/null/runs', "recipe key logs: '/dev/null/runs': /dev/null is a file, so nothing can be written"),
])
def test_wrongly_typed_or_out_of_range_values_are_named(shards, key, value, message):
    with pytest.raises(RecipeError, match=message):
        resolve(dict(load_recipe('diffclip-tiny'), train_data=str(shards), **{key: value}), 'x', 1)


def test_a_folder_named_like_a_shard_is_named(tmp_path):
    write_shards(tmp_path, 2, 4)
    (tmp_path / '00002.tar').mkdir()
    with pytest.raises(RecipeError, match=r"1 of its \*\.tar are not files \(00002\.tar, …: folders named like shards\)"):
        resolve(dict(load_recipe('diffclip-tiny'), train_data=str(tmp_path)), 'x', 1)


def test_an_empty_train_data_and_a_batch_flag_after_the_separator_are_refused(shards):
    with pytest.raises(RecipeError, match="recipe key train_data: '' names no shards"):
        resolve(dict(load_recipe('diffclip-tiny'), train_data=''), 'x', 1)
    with pytest.raises(RecipeError, match='batch_size: diffzoo computes these; set global_batch_size instead'):
        run(['--recipe', 'diffclip-tiny', '--train_data', str(shards), '--', '--batch-size', '8'])


def test_unset_environment_variable_names_itself(monkeypatch):
    monkeypatch.delenv('CC3M_SHARDS', raising=False)
    with pytest.raises(RecipeError, match=r'\$\{CC3M_SHARDS\}, which is not set'):
        resolve(load_recipe('diffclip-b16-cc3m'), 'x', 4)


def test_data_errors_come_before_any_model(tmp_path, shards):
    base = load_recipe('diffclip-tiny')
    with pytest.raises(RecipeError, match='matches no shard'):
        resolve(dict(base, train_data=str(tmp_path / 'nowhere' / '{00000..00003}.tar')), 'x', 1)
    (shards / 'sizes.json').unlink()
    with pytest.raises(RecipeError, match='no sizes.json .* train_num_samples'):
        resolve(dict(base, train_data=str(shards)), 'x', 1)
    plan = resolve(dict(base, train_data=str(shards), train_num_samples=32), 'x', 1)
    assert plan.derived['samples'] == 32
    with pytest.raises(RecipeError, match='16 shards cannot feed 4 data workers on each of 8 processes.*pass --workers 2'):
        resolve(dict(base, train_data=str(shards), train_num_samples=32, workers=4, global_batch_size=64), 'x', 8)
    # fewer shards than processes: the fix is more shards or fewer processes, not fewer workers
    with pytest.raises(RecipeError) as refused:
        resolve(dict(base, train_data=str(shards), train_num_samples=64, workers=1, global_batch_size=64), 'x', 32)
    assert '--workers' not in str(refused.value)
    assert 'write at least 32 shards (one per process), or run 16 process(es), or pass --dataset-resampled' in str(
        refused.value)


def test_nan_from_yaml_is_refused(tmp_path, shards):
    (tmp_path / 'mine.yaml').write_text(f'base: diffclip-tiny\nlr: .nan\ntrain_data: {shards}\n')
    with pytest.raises(RecipeError, match='recipe key lr: nan is not a finite number'):
        resolve(load_recipe(str(tmp_path / 'mine.yaml')), 'mine', 1)


def test_unbalanced_braces_in_train_data_name_the_pattern(shards):
    pattern = f'{shards}/{{00000..00003.tar'
    with pytest.raises(RecipeError, match=re.escape(f"train_data '{pattern}': unbalanced braces; write a range as "
                                                    f"DIR/{{00000..00003}}.tar")):
        resolve(dict(load_recipe('diffclip-tiny'), train_data=pattern), 'x', 1)


@pytest.mark.parametrize('text, message', [
    ('{"00000.tar": 2,', 'is not JSON'),
    ('{"00000.tar": "two"}', "1 entries are not sample counts (first: '00000.tar': 'two')"),
    ('{"00000.tar": null}', "first: '00000.tar': None"),
])
def test_a_malformed_sizes_json_names_the_file_and_the_fix(shards, text, message):
    (shards / 'sizes.json').write_text(text)
    with pytest.raises(RecipeError) as err:
        resolve(dict(load_recipe('diffclip-tiny'), train_data=str(shards)), 'x', 1)
    text = str(err.value)
    assert str(shards / 'sizes.json') in text and message in text
    assert f'rewrite it with python -m diffzoo.data sizes {shards}' in text and '--train_num_samples N' in text


def test_a_recipe_file_can_extend_a_shipped_one(tmp_path, shards):
    (tmp_path / 'mine.yaml').write_text(f'base: diffclip-tiny\nlr: 2.0e-4\ntrain_data: {shards}\n')
    plan = resolve(load_recipe(str(tmp_path / 'mine.yaml')), 'mine', 1)
    assert _value(plan.argv, '--lr') == '0.0002' and _value(plan.argv, '--model') == 'diffclip-tiny'
    assert _value(plan.argv, '--train-data') == f'{shards}/{{00000..00015}}.tar'


def test_the_converted_clip_recipe_fine_tunes_from_a_local_pretrained_file(shards, monkeypatch, tmp_path):
    """vit-b16-laion2b-diff-duplicate-cc3m: the converting config, the local LAION file, λ at its own rate."""
    monkeypatch.setenv('CC3M_SHARDS', str(shards))
    monkeypatch.setenv('LAION_VIT_B16', str(tmp_path / 'open_clip_pytorch_model.bin'))
    plan = resolve(dict(load_recipe('vit-b16-laion2b-diff-duplicate-cc3m'), workers=1),
                   'vit-b16-laion2b-diff-duplicate-cc3m', 4)
    argv = plan.argv
    assert _value(argv, '--model') == 'ViT-B-16-diffzoo-duplicate' and 'ViT-B-16-diffzoo-duplicate' in open_clip.list_models()
    assert _value(argv, '--pretrained') == str(tmp_path / 'open_clip_pytorch_model.bin')
    assert _value(argv, '--lr') == '1e-05' and '--lambda-lr' not in argv and plan.recipe['lambda_lr'] == 1e-3
    config = open_clip.get_model_config('ViT-B-16-diffzoo-duplicate')
    assert config['vision_cfg']['diffzoo']['variant'] == config['text_cfg']['diffzoo']['variant'] == 'duplicate'
    assert {k: v for k, v in config['vision_cfg'].items() if k != 'diffzoo'} == \
        open_clip.get_model_config('ViT-B-16')['vision_cfg']


def test_a_misspelt_open_clip_flag_gets_a_suggestion_as_diffzoo_keys_do(shards):
    with pytest.raises(RecipeError, match=r'  epoch \(did you mean epochs\?\)'):
        resolve(dict(load_recipe('diffclip-tiny'), train_data=str(shards), epoch=2), 'x', 1)
    with pytest.raises(RecipeError, match=r'global_batch \(did you mean global_batch_size\?\)'):
        resolve(dict(load_recipe('diffclip-tiny'), train_data=str(shards), global_batch=8), 'x', 1)
