"""VLM recipes: every shipped one validates, typos and wrong types are refused by the fine-tuning command."""
import re

import pytest
import yaml

from diffzoo.recipes import RecipeError, recipe_names
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
    (['--attention.type', 'differential', '--attention.mlp', 'gelu'],
     "recipe key attention.mlp: 'gelu' is not one of original, swiglu"),
    (['--differential.variant', 'split'], 'recipe key differential .* is retired: write attention'),
    # a batch, steps or epochs of 0 or less trained nothing (a finished stage of 0 steps) or divided by zero
    (['--global_batch_size', '-8'], 'recipe key global_batch_size: -8; it must be above 0 or null'),
    (['--global_batch_size', '0'], 'recipe key global_batch_size: 0; it must be above 0 or null'),
    (['--batch_size', '0'], 'recipe key batch_size: 0; it must be above 0 '),
    (['--grad_accum', '0'], 'recipe key grad_accum: 0; it must be above 0 '),
    (['--max_steps', '-5'], 'recipe key max_steps: -5; it must be above 0 or null'),
    (['--max_steps', '0'], 'recipe key max_steps: 0; it must be above 0 or null'),
    (['--epochs', '0', '--max_steps', 'null'], 'recipe key epochs: 0; it must be above 0 '),
    (['--epochs', '-0.5'], r'recipe key epochs: -0\.5; it must be above 0 '),
    (['--save_every', '0'], 'recipe key save_every: 0; it must be above 0 '),
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


def test_the_attention_is_chosen_by_type_and_a_vanilla_recipe_drops_its_bases_settings():
    """The baseline extends the PaliGemma recipe, the -lr2e-5 one the differential recipe: each names
    its attention type, and the validated recipe holds differentialize's settings or None."""
    assert load_vlm_recipe('paligemma-3b-vqav2-baseline')['attention'] == {'type': 'vanilla'}
    settings = {'variant': 'duplicate', 'lambda_init': 'depth', 'layers': None, 'mlp': 'original'}
    assert check_model(load_vlm_recipe('paligemma-3b-vqav2-diff-lr2e-5'))['differential'] == settings
    assert check_model(load_vlm_recipe('paligemma-3b-vqav2-diff-split'))['differential']['variant'] == 'split'
    for name in ('paligemma-3b-vqav2-baseline', 'diffclip-b16-vqav2'):
        assert check_model(load_vlm_recipe(name))['differential'] is None
    model = {'type': 'paligemma', 'path': '/x'}
    assert check_model({'model': model})['differential'] is None  # no attention: the model as pretrained
    with pytest.raises(RecipeError, match=r'unknown recipe keys:\n  attention\.variant'):
        check_model({'model': model, 'attention': {'type': 'vanilla', 'variant': 'split'}})
    with pytest.raises(RecipeError, match=r"attention\.type: 'diff'; choose one of vanilla, differential"):
        check_model({'model': model, 'attention': {'type': 'diff'}})


@pytest.mark.parametrize('old', [{'variant': 'split'}, None])
def test_the_retired_differential_key_is_refused_naming_attention(old):
    model = {'type': 'paligemma', 'path': '/x'}
    with pytest.raises(RecipeError, match=r'recipe key differential .* is retired: write attention: '
                                          r'\{type: differential, variant: …\}.*attention: \{type: vanilla\}'):
        check_model({'model': model, 'differential': old})


def test_running_a_model_needs_only_its_model_part():
    spec = check_model({'model': {'type': 'paligemma', 'path': '/x'},
                        'attention': {'type': 'differential', 'variant': 'split'}})
    assert spec['differential'] == {'variant': 'split', 'lambda_init': 'depth', 'layers': None, 'mlp': 'original'}
    with pytest.raises(ValueError, match='unknown recipe keys'):
        check_model({'model': {'type': 'paligemma', 'path': '/x'}, 'modle': {}})


def test_recipes_are_listed(capsys):
    assert main(['recipes']) == 0  # as python -m diffzoo.train recipes
    out = capsys.readouterr().out
    assert all(name in out for name in recipe_names('vlm'))


@pytest.mark.slow  # real processes
def test_console_script_lists_the_recipes():
    import subprocess
    import sys
    from pathlib import Path
    done = subprocess.run([str(Path(sys.executable).parent / 'diffzoo-train-vlm'), 'recipes'], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    listed = [line.split()[0] for line in done.stdout.splitlines()]
    assert listed == recipe_names('vlm')


def test_every_build_vlm_keyword_is_a_recipe_key():
    import inspect
    from diffzoo.vlm.model import VisionLanguageModel
    from diffzoo.vlm.recipe import MODEL
    keywords = set(inspect.signature(VisionLanguageModel).parameters) - {'vision', 'language_model'}
    assert set(MODEL.sections['build_vlm'].keys) == keywords | {'type', 'vision', 'language_model'}


def test_a_recipe_sets_every_eramv_keyword(language_model_dir):
    from diffzoo.vlm.factory import vlm_from_recipe
    model = {'type': 'build_vlm', 'vision': 'diffclip-tiny', 'language_model': str(language_model_dir),
             'integration': 'eramv', 'select_layer': 1, 'projector': 'linear', 'anchors': 8, 'include_cls': False,
             'inject_layers': [0], 'layer_base': 0, 'injected_queries': 'text', 'post_mlp': False}
    built = vlm_from_recipe({'model': model}).model
    assert (built.select_layer, built.vision.select_layer, built.vision.block_index) == (1, 1, 0)
    assert built.projector_type == 'linear' and type(built.projector).__name__ == 'Linear'
    assert (built.anchors, built.include_cls, built.injected_queries) == (8, False, 'text')
    assert built.inject_indices == [0] and built.inject_layers == [1]
    assert type(built.post_mlp).__name__ == 'Identity'
    plain = {k: model[k] for k in ('type', 'vision', 'language_model', 'integration')}
    default = vlm_from_recipe({'model': plain}).model  # null or absent: eRAM-V's defaults
    assert (default.select_layer, default.projector_type, default.anchors, default.include_cls,
            default.injected_queries, default.inject_layers, type(default.post_mlp).__name__) == (
        -2, 'mlp2x_gelu', 64, True, 'all', [1], 'PostProjectionMLP')  # a 3-layer LM: layer 1
    full = vlm_from_recipe({'model': dict(model, integration='full', select_layer='final_norm', projector='mlp2x_gelu',
                                          **dict.fromkeys(('anchors', 'include_cls', 'inject_layers', 'layer_base',
                                                           'injected_queries', 'post_mlp')))}).model
    assert (full.select_layer, full.projector_type) == ('final_norm', 'mlp2x_gelu')
    with pytest.raises(ValueError, match=r'anchors=8, .*: eRAM-V settings, which apply to integration="eramv"'):
        vlm_from_recipe({'model': dict(model, integration='full')})


@pytest.mark.parametrize('change, message', [
    ({'anchor': 8}, r'unknown recipe keys:\n  model\.anchor \(did you mean model\.anchors'),
    ({'select_layer': 'last'}, r"recipe key model\.select_layer: select_layer='last': expected a block"),
    ({'select_layer': 0}, r'recipe key model\.select_layer: select_layer=0: expected a block'),
    ({'projector': 'mlp'}, r"recipe key model\.projector: 'mlp' is not one of linear, mlp2x_gelu"),
    ({'layer_base': 2}, r"recipe key model\.layer_base: 2 is not one of 0, 1"),
    ({'injected_queries': 'anchors'}, r"recipe key model\.injected_queries: 'anchors' is not one of all, text"),
    ({'include_cls': 'yes'}, r"recipe key model\.include_cls: 'yes' is not true or false"),
])
def test_bad_model_keys_are_refused_with_the_valid_ones(change, message):
    from diffzoo.vlm.factory import load_vlm
    model = dict({'type': 'build_vlm', 'vision': 'diffclip-tiny', 'language_model': '/x', 'integration': 'eramv'},
                 **change)
    with pytest.raises(RecipeError, match=message) as error:
        check_model({'model': model})
    if 'unknown' in message:
        assert 'valid keys are:' in str(error.value) and 'model.injected_queries' in str(error.value)
    with pytest.raises(RecipeError, match=message):  # the factory checks a spec given to it directly too
        load_vlm(model)


def test_the_eramv_recipe_spells_out_the_papers_settings(monkeypatch):
    for var in ('VQAV2_DIR', 'DIFFCLIP_CHECKPOINT', 'LM_DIR'):
        monkeypatch.setenv(var, f'/x/{var}')
    model = check(load_vlm_recipe('diffclip-b16-vqav2-eramv'))['model']
    assert model['vision'].startswith('diffclip-b16,') and model['integration'] == 'eramv'
    assert {k: model[k] for k in ('select_layer', 'projector', 'anchors', 'include_cls', 'injected_queries',
                                  'layer_base', 'post_mlp', 'inject_layers')} == {
        'select_layer': -2, 'projector': 'mlp2x_gelu', 'anchors': 64, 'include_cls': True,
        'injected_queries': 'all', 'layer_base': 1, 'post_mlp': True, 'inject_layers': None}


def test_a_key_given_without_its_value_on_the_command_line_says_it_takes_one(monkeypatch):
    """`--lr` alone parses as a flag (true): the error says the key takes a value, not only that true is no number."""
    from diffzoo.vlm.recipe import checked_recipe
    monkeypatch.setenv('PALIGEMMA_DIR', '/models/paligemma')
    monkeypatch.setenv('VQAV2_DIR', '/data/vqav2')
    with pytest.raises(RecipeError, match=r'recipe key lr: True is not a number \(.*\); on the command line --lr '
                                          r'takes a value: --lr VALUE'):
        checked_recipe('paligemma-3b-vqav2-diff', ['--lr', '--epochs', '1'])
