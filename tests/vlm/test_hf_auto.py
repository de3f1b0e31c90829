"""Differential decoders saved with save_pretrained reload through transformers' Auto classes
(diffzoo.vlm.hf_config, diffzoo.vlm.hf_auto), and never as plain models."""
import json
import logging
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
import transformers

from diffzoo.vlm.attention import DIFF_EAGER, DIFF_SDPA
from diffzoo.vlm.differential import differentialize, load_differential
from diffzoo.vlm.hf_config import BASE_KEY, CODE_FILE, MODEL_TYPE, SETTINGS_KEY
from diffzoo.vlm.parts import differential_parameters
from tests.vlm.models import paligemma_config, tiny_lm

VOCAB = 64
FAMILIES = ['llama', 'qwen2', 'gemma']  # GQA, MHA with biases, MQA
HALVES = {'llama'}  # split pairs heads i, i + H/2 by default under GQA with an even KV-head count


def _trained(family: str, variant: str, **kw):
    """A differentialized tiny LM whose λ and sub-norm are away from their init."""
    model = differentialize(tiny_lm(family, vocab=VOCAB), variant=variant, **kw)
    with torch.no_grad():
        for p in differential_parameters(model):
            p.add_(torch.randn_like(p) * 0.3)
    return model


def _ids(batch=2, length=7):
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(1))


@pytest.fixture
def load_log():
    """What transformers logs while loading (its load report lists MISSING / UNEXPECTED keys)."""
    logger = transformers.utils.logging.get_logger('transformers')
    records = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: records.append(record.getMessage())
    verbosity = transformers.utils.logging.get_verbosity()
    transformers.utils.logging.set_verbosity_info()
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)
    transformers.utils.logging.set_verbosity(verbosity)


def _key_reports(records):
    return [r for r in records if 'LOAD REPORT' in r or 'UNEXPECTED' in r or 'MISSING' in r]


@pytest.mark.parametrize('family', FAMILIES)
@pytest.mark.parametrize('variant', ['duplicate', 'split'])
def test_auto_model_for_causal_lm_reloads_the_differential_model_without_key_reports(tmp_path, load_log, family,
                                                                                      variant):
    model = _trained(family, variant, layers=[0, 2], mlp='swiglu')
    ids = _ids()
    expected = model(ids).logits
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / 'config.json').read_text())
    assert saved['model_type'] == MODEL_TYPE and saved[BASE_KEY] == model.config.model_type
    pairing = None if variant == 'duplicate' else 'halves' if family in HALVES else 'adjacent'
    assert saved[SETTINGS_KEY] == {'variant': variant, 'lambda_init': 'depth', 'layers': [0, 2], 'mlp': 'swiglu',
                                   'head_pairing': pairing}
    assert (tmp_path / CODE_FILE).is_file()

    load_log.clear()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert _key_reports(load_log) == []
    assert isinstance(loaded, type(model)) and loaded.config.model_type == model.config.model_type
    assert loaded.config._attn_implementation == DIFF_SDPA
    assert [hasattr(layer.self_attn, 'differential') for layer in loaded.model.layers] == [True, False, True]
    for a, b in zip(differential_parameters(loaded), differential_parameters(model)):
        assert torch.equal(a, b)
    torch.testing.assert_close(loaded(ids).logits, expected, rtol=0, atol=0)


def test_the_load_report_is_captured_when_a_concrete_class_drops_the_differential_weights(tmp_path, load_log):
    """The positive control of `load_log`, and transformers' own path for a concrete class: it warns."""
    _trained('llama', 'split').save_pretrained(tmp_path)
    load_log.clear()
    plain = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    assert not any(hasattr(m, 'differential') for m in plain.modules())
    assert any('UNEXPECTED' in r and 'lambda_q1' in r for r in load_log)
    assert any(MODEL_TYPE in r and 'llama' in r for r in load_log)  # "a model of type … to instantiate … llama"


@pytest.mark.parametrize('family', ['llama', 'gemma'])
def test_auto_config_and_auto_model_give_the_differential_config_and_base_model(tmp_path, load_log, family):
    model = _trained(family, 'duplicate', lambda_init=0.5)
    ids = _ids()
    expected = model.model(ids).last_hidden_state
    model.save_pretrained(tmp_path)
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    assert type(config) is type(model.config) and config.model_type == model.config.model_type
    assert getattr(config, SETTINGS_KEY) == {'variant': 'duplicate', 'lambda_init': 0.5, 'layers': [0, 1, 2],
                                           'mlp': 'original', 'head_pairing': None}
    load_log.clear()
    base = transformers.AutoModel.from_pretrained(tmp_path).eval()
    reports = _key_reports(load_log)  # the head is unexpected in a base model, as for any causal LM checkpoint
    assert all('lm_head.weight' in r and 'lambda' not in r and 'sub_norm' not in r for r in reports)
    assert isinstance(base, type(model.model)) and hasattr(base.layers[0].self_attn, 'differential')
    torch.testing.assert_close(base(ids).last_hidden_state, expected, rtol=0, atol=0)


def test_eager_kernel_is_kept_on_reload_and_a_resaved_model_reloads_again(tmp_path, load_log):
    model = _trained('qwen2', 'split')
    ids = _ids()
    expected = model(ids).logits
    model.save_pretrained(tmp_path / 'a')
    eager = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / 'a', attn_implementation='eager').eval()
    assert eager.config._attn_implementation == DIFF_EAGER
    torch.testing.assert_close(eager(ids).logits, expected)  # explicit fp32 maps: rounding only
    eager.save_pretrained(tmp_path / 'b')
    assert json.loads((tmp_path / 'b' / 'config.json').read_text())['architectures'] == \
        ['DifferentialQwen2ForCausalLM']
    load_log.clear()
    for again in (transformers.AutoModelForCausalLM.from_pretrained(tmp_path / 'b'), load_differential(tmp_path / 'b'),
                  load_differential(tmp_path / 'a')):
        assert _key_reports(load_log) == []
        torch.testing.assert_close(again.eval()(ids).logits, expected, rtol=0, atol=0)


def test_checkpoints_saved_in_the_earlier_format_still_load_with_load_differential(tmp_path):
    """Before the model type, config.json was the base model's with a `diffzoo_differential` entry."""
    model = _trained('gemma', 'split')
    ids = _ids()
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / 'config.json').read_text())
    config['model_type'] = config.pop(BASE_KEY)
    del config['auto_map']
    (tmp_path / 'config.json').write_text(json.dumps(config))
    (tmp_path / CODE_FILE).unlink()
    loaded = load_differential(tmp_path).eval()
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_paligemma_reloads_through_auto_model_for_image_text_to_text(tmp_path, load_log):
    torch.manual_seed(0)
    config = paligemma_config()
    model = differentialize(transformers.PaliGemmaForConditionalGeneration(config).eval(), variant='split')
    with torch.no_grad():
        for p in differential_parameters(model):
            p.add_(torch.randn_like(p) * 0.3)
    ids = torch.cat([torch.full((1, 16), 79), torch.randint(0, 70, (1, 5))], 1)
    pixels = torch.randn(1, 3, 32, 32)
    expected = model(input_ids=ids, pixel_values=pixels).logits
    model.save_pretrained(tmp_path)
    load_log.clear()
    loaded = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path).eval()
    assert _key_reports(load_log) == []
    assert loaded.config.text_config._attn_implementation == DIFF_SDPA
    assert not any(hasattr(m, 'differential') for m in loaded.model.vision_tower.modules())
    torch.testing.assert_close(loaded(input_ids=ids, pixel_values=pixels).logits, expected, rtol=0, atol=0)


def test_a_differentialized_model_still_runs_as_its_own_model_type():
    model = differentialize(tiny_lm('llama', vocab=VOCAB), variant='duplicate')
    assert model.config.model_type == 'llama' and isinstance(model.config, transformers.LlamaConfig)
    assert model.config.to_dict()['model_type'] == 'llama'  # peft's and transformers' per-model tables
    assert json.loads(model.config.to_json_string())['model_type'] == MODEL_TYPE  # what save_pretrained writes


# Loading in a fresh process, where diffzoo was not imported or is not installed.
LOAD = textwrap.dedent('''
    import sys, torch, transformers
    ids, expected = torch.load(sys.argv[2])
    for kwargs in ({}, {'trust_remote_code': True}):
        try:
            model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], **kwargs).eval()
        except Exception as exc:
            print('REFUSED', kwargs, type(exc).__name__, ' '.join(str(exc).split()))
        else:
            same = torch.equal(model(ids).logits, expected)
            print('LOADED', kwargs, type(model).__name__, 'diffzoo' in sys.modules, 'same' if same else 'different')
''')
NOT_INSTALLED = textwrap.dedent('''
    import sys
    sys.meta_path = [f for f in sys.meta_path if 'editable' not in getattr(f, '__module__', '')]  # pip install -e
    try:
        import diffzoo
    except ImportError:
        pass
    else:
        raise SystemExit('diffzoo still importable')
''')


def _run(code: str, *args, cwd):
    env = {**os.environ, 'HF_MODULES_CACHE': str(cwd / 'modules'), 'HF_HUB_OFFLINE': '1'}
    env.pop('PYTHONPATH', None)
    done = subprocess.run([sys.executable, '-c', code, *map(str, args)], capture_output=True, text=True,
                          timeout=300, cwd=cwd, env=env, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-3000:]
    return re.findall(r'(?:REFUSED|LOADED) .*', done.stdout)  # transformers' [y/N] prompt may lead the line


@pytest.fixture
def saved(tmp_path):
    model = _trained('llama', 'split')
    ids = _ids()
    model.save_pretrained(tmp_path / 'model')
    torch.save((ids, model(ids).logits.detach()), tmp_path / 'expected.pt')
    (tmp_path / 'run').mkdir()
    return tmp_path


@pytest.mark.slow
def test_without_import_diffzoo_it_asks_for_trust_remote_code_which_imports_diffzoo(saved):
    refused, loaded = _run(LOAD, saved / 'model', saved / 'expected.pt', cwd=saved / 'run')
    assert refused.startswith("REFUSED {} ValueError") and 'trust_remote_code=True' in refused
    assert loaded == "LOADED {'trust_remote_code': True} DifferentialLlamaForCausalLM True same"


@pytest.mark.slow
def test_without_diffzoo_installed_loading_fails_naming_diffzoo(saved):
    refused, refused_remote = _run(NOT_INSTALLED + LOAD, saved / 'model', saved / 'expected.pt', cwd=saved / 'run')
    assert refused.startswith("REFUSED {} ValueError") and 'trust_remote_code=True' in refused
    assert refused_remote.startswith("REFUSED {'trust_remote_code': True} ImportError")
    assert 'pip install diffzoo' in refused_remote


@pytest.mark.slow
@pytest.mark.parametrize('imports', ['import diffzoo\nimport transformers', 'import transformers\nimport diffzoo'])
def test_import_diffzoo_registers_the_model_type_in_either_order(tmp_path, imports):
    code = (f'{imports}\nfrom transformers.models.auto.configuration_auto import CONFIG_MAPPING\n'
            f'import sys\nprint("LOADED", "{MODEL_TYPE}" in CONFIG_MAPPING, "timm" in sys.modules, '
            f'"peft" in sys.modules)\n')
    # import diffzoo imports timm (its models' registry), not peft: that waits for a checkpoint to be read
    assert _run(code, cwd=tmp_path) == ['LOADED True True False']
