"""The recipe loader both kinds share: base chains, merging, ${VAR}, overrides, schemas."""
import pytest
import yaml

from diffzoo.recipes import (REQUIRED, Key, RecipeError, Section, Typed, apply_overrides, expand_env, load_recipe,
                             merge, parse_overrides, validate)

SCHEMA = Section({
    'lr': Key((float,), REQUIRED, 'learning rate'),
    'steps': Key((int,), None, 'optimizer steps'),
    'mode': Key((str,), 'fast', 'fast or slow', ('fast', 'slow')),
    'data': Section({'root': Key((str,), REQUIRED, 'data folder'), 'fraction': Key((float,), 1.0, 'subset')}),
    'extra': Section({'k': Key((int,), 1, 'k')}, optional=True),
    'model': Typed({'a': Section({'type': Key((str,), REQUIRED, 'a or b'), 'x': Key((int,), 0, 'x')}),
                    'b': Section({'type': Key((str,), REQUIRED, 'a or b'), 'y': Key((str,), REQUIRED, 'y')})},
                   doc='the model'),
})
GOOD = {'lr': 1e-3, 'data': {'root': 'd'}, 'model': {'type': 'a'}}


def test_defaults_fill_and_integers_pass_as_numbers():
    out = validate(dict(GOOD, lr=1), SCHEMA)
    assert out == {'lr': 1.0, 'steps': None, 'mode': 'fast', 'data': {'root': 'd', 'fraction': 1.0}, 'extra': None,
                   'model': {'type': 'a', 'x': 0}}
    assert isinstance(out['lr'], float)


@pytest.mark.parametrize('recipe, message', [
    (dict(GOOD, data={'root': 'd', 'fracton': 0.1}), r'data\.fracton \(did you mean data\.fraction\?\)'),
    (dict(GOOD, lrr=1), r'unknown recipe keys:\n  lrr \(did you mean lr\?\)\nvalid keys are:\n  lr '),
    ({'data': {'root': 'd'}, 'model': {'type': 'a'}}, 'recipe key lr is missing: learning rate'),
    (dict(GOOD, steps='many'), r"recipe key steps: 'many' is not an integer \(optimizer steps\)"),
    (dict(GOOD, steps=True), "recipe key steps: True is not an integer"),
    (dict(GOOD, lr='big'), "recipe key lr: 'big' is not a number"),
    (dict(GOOD, mode='medium'), "recipe key mode: 'medium' is not one of fast, slow"),
    (dict(GOOD, model={'type': 'c'}), r"model\.type: 'c'; choose one of a, b"),
    (dict(GOOD, model={'type': 'b'}), 'recipe key model.y is missing'),
    (dict(GOOD, model={'type': 'a', 'y': 'z'}), r'model\.y'),
    (dict(GOOD, data='d'), "recipe key data: 'd' is not a mapping"),
])
def test_bad_recipes_are_named_with_the_fix(recipe, message):
    with pytest.raises(RecipeError, match=message):
        validate(recipe, SCHEMA)


def test_a_mapping_merges_unless_its_type_changes():
    base = {'model': {'type': 'a', 'x': 3}, 'data': {'root': 'd', 'fraction': 0.5}}
    assert merge(base, {'data': {'fraction': 0.1}}) == {'model': {'type': 'a', 'x': 3},
                                                         'data': {'root': 'd', 'fraction': 0.1}}
    assert merge(base, {'model': {'x': 4}})['model'] == {'type': 'a', 'x': 4}
    assert merge(base, {'model': {'type': 'b', 'y': 'z'}})['model'] == {'type': 'b', 'y': 'z'}  # replaced


def test_base_chain_env_and_overrides(tmp_path, monkeypatch):
    (tmp_path / 'base.yaml').write_text(yaml.safe_dump({'lr': 1e-3, 'data': {'root': '${ROOT}', 'fraction': 0.5},
                                                        'model': {'type': 'a'}}))
    (tmp_path / 'run.yaml').write_text('base: base.yaml\ndata: {fraction: 0.25}\n')
    recipe = load_recipe(str(tmp_path / 'run.yaml'))
    assert recipe == {'lr': 1e-3, 'data': {'root': '${ROOT}', 'fraction': 0.25}, 'model': {'type': 'a'}}
    with pytest.raises(RecipeError, match=r'recipe key data\.root uses \$\{ROOT\}, which is not set'):
        expand_env(recipe)
    monkeypatch.setenv('ROOT', '/data')
    recipe = apply_overrides(expand_env(recipe), parse_overrides(['--data.fraction', '0.1', '--steps=3']))
    assert validate(recipe, SCHEMA)['data'] == {'root': '/data', 'fraction': 0.1} and recipe['steps'] == 3
    (tmp_path / 'loop.yaml').write_text('base: loop.yaml\n')
    with pytest.raises(RecipeError, match='extends itself'):
        load_recipe(str(tmp_path / 'loop.yaml'))
    (tmp_path / 'broken.yaml').write_text('lr: [1e-3\n')
    with pytest.raises(RecipeError, match=r'broken\.yaml is not valid YAML'):
        load_recipe(str(tmp_path / 'broken.yaml'))
    with pytest.raises(RecipeError, match="got 'lr'"):
        parse_overrides(['lr', '1'])
