"""VLM recipes: every shipped one validates, typos and wrong types are refused by the fine-tuning command."""
import re

import pytest
import yaml

from diffzoo.recipes import recipe_names
from diffzoo.train.vlm import main
from diffzoo.vlm.recipe import check, check_model, load_vlm_recipe


@pytest.mark.parametrize('name', recipe_names('vlm'))
def test_every_shipped_recipe_validates(name, monkeypatch):
    for var in ('PALIGEMMA_DIR', 'VQAV2_DIR', 'DIFFCLIP_CHECKPOINT', 'LM_DIR'):
        monkeypatch.setenv(var, f'/x/{var}')
    recipe = check(load_vlm_recipe(name))
    assert recipe['lr'] > 0 and recipe['model']['type'] in ('paligemma', 'build_vlm')


def test_a_recipe_chooses_its_model_by_type():
    """diffclip-b16-vqav2 extends the PaliGemma recipe and names another model type: the model
    mapping is replaced, not merged (no `path` left over from PaliGemma)."""
    recipe = load_vlm_recipe('diffclip-b16-vqav2')
    assert set(recipe['model']) == {'type', 'vision', 'language_model'}
    assert check(recipe)['model']['integration'] == 'full'


@pytest.fixture
def recipe(tmp_path):
    path = tmp_path / 'r.yaml'
    path.write_text(yaml.safe_dump({
        'model': {'type': 'build_vlm', 'vision': 'diffclip-tiny', 'language_model': str(tmp_path / 'lm')},
        'data': {'root': str(tmp_path / 'vqa')}, 'lr': 1e-3, 'output': str(tmp_path / 'runs')}))
    return path


@pytest.mark.parametrize('args, message', [
    (['--data.fracton', '0.01'], r'data\.fracton \(did you mean data\.fraction\b'),
    (['--lora.rank', '2'], r'lora\.rank'),
    (['--max_steps', 'many'], "recipe key max_steps: 'many' is not an integer"),
    (['--lr', 'fast'], "recipe key lr: 'fast' is not a number"),
    (['--precision', 'fp8'], "recipe key precision: 'fp8' is not one of fp32, bf16"),
    (['--model.type', 'llava'], "model.type: 'llava'; choose one of paligemma, build_vlm"),
])
def test_bad_overrides_are_refused_with_the_valid_keys(recipe, args, message, capsys):
    assert main(['--recipe', str(recipe), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith('error: ')
    assert re.search(message, err), err
    if 'unknown' in err:
        assert 'valid keys are:' in err


def test_bad_yaml_is_refused(recipe, capsys):
    data = yaml.safe_load(recipe.read_text())
    recipe.write_text(yaml.safe_dump(dict(data, lora={'rank': 2})))
    assert main(['--recipe', str(recipe)]) == 2
    assert 'lora.rank' in capsys.readouterr().err
    del data['lr']
    recipe.write_text(yaml.safe_dump(data))
    assert main(['--recipe', str(recipe)]) == 2
    assert 'recipe key lr is missing' in capsys.readouterr().err


def test_running_a_model_needs_only_its_model_part():
    spec = check_model({'model': {'type': 'paligemma', 'path': '/x'}, 'differential': {'variant': 'split'}})
    assert spec['differential'] == {'variant': 'split', 'lambda_init': 'depth', 'layers': None, 'mlp': 'original'}
    with pytest.raises(ValueError, match='unknown recipe keys'):
        check_model({'model': {'type': 'paligemma', 'path': '/x'}, 'modle': {}})


def test_recipes_are_listed(capsys):
    assert main(['--recipes']) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in recipe_names('vlm'))
