"""A differentialized Llama against transformers' DiffLlama: equal logits for mapped weights, and the
conversions in both directions. Weights are N(0, 0.3) (sharp attention maps, logits of a few units),
v_proj's N(0, 0.003) (the sub-norm's inputs are small, so its eps shows: 1e-5 for 1e-6 moves the logits
by ~0.4) and λ vectors N(0, 0.5), so the pairing, λ and the sub-norm all show in the logits."""
import pytest
import torch
import transformers

from diffzoo.vlm.differential import SUB_NORM_EPS, differentialize, layer_lambdas
from diffzoo.vlm.diffllama import diffllama_to_llama, from_diffllama, llama_to_diffllama, to_diffllama

GEOMETRY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3, max_position_embeddings=64,
                head_dim=8, initializer_range=0.3)
LAYOUTS = {'gqa': (4, 2), 'gqa_groups_of_4': (8, 2), 'mha': (4, 4)}  # (query heads, KV heads)


def _ids():
    return torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))


def _diffllama(layout: str, implementation: str = 'sdpa', rms_norm_eps: float = 1e-6, seed: int = 0):
    heads, kv_heads = LAYOUTS[layout]
    torch.manual_seed(seed)
    config = transformers.DiffLlamaConfig(num_attention_heads=heads, num_key_value_heads=kv_heads,
                                          rms_norm_eps=rms_norm_eps, lambda_std_dev=0.5, **GEOMETRY)
    config._attn_implementation = implementation
    return _small_values(transformers.DiffLlamaForCausalLM(config)).eval()


def _small_values(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if 'v_proj' in name:
                p.mul_(0.01)
    return model


def _llama(layout: str, implementation: str = 'sdpa', rms_norm_eps: float = 1e-6, seed: int = 0, **settings):
    """A Llama of the layout made differential with `settings`, λ N(0, 0.5), sub-norm weights N(1, 0.3)."""
    heads, kv_heads = LAYOUTS[layout]
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(num_attention_heads=heads, num_key_value_heads=kv_heads,
                                      rms_norm_eps=rms_norm_eps, **GEOMETRY)
    config._attn_implementation = implementation
    model = differentialize(_small_values(transformers.LlamaForCausalLM(config)), **settings)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if 'lambda_' in name:
                p.normal_(0, 0.5)
            elif 'sub_norm' in name:
                p.normal_(1, 0.3)
    return model.eval()


def _assert_lambda_matters(model):
    """λ is far from λ_init in some layer: the λ vectors were drawn, not left near zero."""
    lambdas = layer_lambdas(model)
    depth = {i: 0.8 - 0.6 * torch.exp(torch.tensor(-0.3 * i)).item() for i in lambdas}
    assert max(abs(lambdas[i] - depth[i]) for i in lambdas) > 0.3


def _max_diff(a, b) -> float:
    return (a - b).abs().max().item()


def _assert_equal_to_fp32_rounding(logits, expected):
    """max |Δ| ≤ 1e-5 · max |expected| (logits of 5 to 10 here: ≤ 5e-5 to 1e-4; fp32 rounding through
    three layers measures 3e-6 to 1.5e-5)."""
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize('layout', list(LAYOUTS))
@pytest.mark.parametrize('implementation', ['sdpa', 'eager'])
def test_split_with_halves_pairing_computes_diffllama(layout, implementation):
    """DiffLlama's weights loaded by name (its norm eps set to the sub-norm's 1e-5 so nothing needs
    rescaling; the sub-norm weights stay 1, DiffLlama's norm has none) give DiffLlama's logits."""
    reference = _diffllama(layout, implementation, rms_norm_eps=SUB_NORM_EPS)
    model = _llama(layout, implementation, rms_norm_eps=SUB_NORM_EPS, seed=1, variant='split', lambda_init='depth',
                   head_pairing='halves')
    missing, unexpected = model.load_state_dict(reference.state_dict(), strict=False)
    assert unexpected == [] and missing and all(k.endswith('self_attn.sub_norm.weight') for k in missing)
    with torch.no_grad():
        for k in missing:
            model.get_parameter(k).fill_(1)
    _assert_lambda_matters(model)
    ids = _ids()
    expected = reference(ids).logits
    assert expected.abs().max() > 2
    _assert_equal_to_fp32_rounding(model(ids).logits, expected)


@pytest.mark.parametrize('layout', ['gqa', 'gqa_groups_of_4'])
def test_adjacent_pairs_under_gqa_are_not_diffllama(layout):
    """The earlier split pairing (query heads 2i, 2i + 1 on one KV head) with the same weights is
    another model: the logits move by several units."""
    reference = _diffllama(layout, rms_norm_eps=SUB_NORM_EPS)
    model = _llama(layout, rms_norm_eps=SUB_NORM_EPS, variant='split', lambda_init='depth', head_pairing='adjacent')
    model.load_state_dict(reference.state_dict(), strict=False)
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, 'differential'):
                m.sub_norm.weight.fill_(1)
    ids = _ids()
    assert _max_diff(model(ids).logits, reference(ids).logits) > 1


def test_adjacent_pairs_under_mha_are_diffllama_with_the_heads_reordered():
    """MHA: query, key and value heads 0, 2, 1, 3 of ours are DiffLlama's 0, 1, 2, 3."""
    reference = _diffllama('mha', rms_norm_eps=SUB_NORM_EPS)
    model = _llama('mha', rms_norm_eps=SUB_NORM_EPS, variant='split', lambda_init='depth', head_pairing='adjacent')
    assert model.model.layers[0].self_attn.differential.head_pairing == 'adjacent'
    ours_from_theirs = [0, 2, 1, 3]  # our head j is DiffLlama's head ours_from_theirs[j] (an involution here)
    state = {}
    for key, t in reference.state_dict().items():
        if key.endswith(('q_proj.weight', 'k_proj.weight', 'v_proj.weight')):
            t = t.reshape(4, 8, -1)[ours_from_theirs].reshape(t.shape)  # (heads, d, C) rows
        state[key] = t
    model.load_state_dict(state, strict=False)
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, 'differential'):
                m.sub_norm.weight.fill_(1)
    ids = _ids()
    _assert_equal_to_fp32_rounding(model(ids).logits, reference(ids).logits)


@pytest.mark.parametrize('layout,head_pairing', [('gqa', None), ('gqa_groups_of_4', None), ('mha', 'halves'),
                                                 ('mha', 'adjacent')])
def test_a_differential_llama_converts_to_diffllama_and_back(layout, head_pairing):
    """Sub-norm weights ≠ 1 and the decoder's eps 1e-6 ≠ the sub-norm's 1e-5: both are mapped, exactly."""
    model = _llama(layout, variant='split', lambda_init='depth', head_pairing=head_pairing)
    _assert_lambda_matters(model)
    ids = _ids()
    expected = model(ids).logits
    converted = to_diffllama(model)
    assert isinstance(converted, transformers.DiffLlamaForCausalLM) and not converted.training
    assert converted.config.rms_norm_eps == 1e-6
    _assert_equal_to_fp32_rounding(converted(ids).logits, expected)
    back = from_diffllama(converted)
    assert back.model.layers[0].self_attn.differential.head_pairing == 'halves'
    _assert_equal_to_fp32_rounding(back(ids).logits, expected)


@pytest.mark.parametrize('layout', list(LAYOUTS))
@pytest.mark.parametrize('implementation', ['sdpa', 'eager'])
def test_a_diffllama_converts_to_a_differential_llama_and_back(layout, implementation):
    reference = _diffllama(layout, implementation)
    ids = _ids()
    expected = reference(ids).logits
    model = from_diffllama(reference)
    assert model.config.diffzoo_differential['head_pairing'] == 'halves'
    assert model.config._attn_implementation == f'diffzoo_{implementation}'
    _assert_lambda_matters(model)
    _assert_equal_to_fp32_rounding(model(ids).logits, expected)
    back = to_diffllama(model)
    _assert_equal_to_fp32_rounding(back(ids).logits, expected)
    original = reference.state_dict()
    for key, t in back.state_dict().items():  # v_proj ÷ c then × c: equal to rounding, the rest exactly
        torch.testing.assert_close(t, original[key], rtol=1e-6, atol=1e-7, msg=key)


def test_state_dict_conversions_are_inverse_for_halves_models():
    model = _llama('gqa', variant='split', lambda_init='depth')
    dl_config = to_diffllama(model).config
    state = model.state_dict()
    round_trip = diffllama_to_llama(llama_to_diffllama(state, model.config), dl_config)
    assert round_trip.keys() == state.keys()
    # the sub-norm weight went into o_proj and comes back as 1; the function is the same (tested above)
    for key, t in round_trip.items():
        if not key.endswith(('sub_norm.weight', 'o_proj.weight')):
            torch.testing.assert_close(t, state[key], rtol=1e-6, atol=1e-7, msg=key)


@pytest.mark.parametrize('settings,layout,fix', [
    (dict(variant='duplicate'), 'gqa', 'differentialize with variant="split"'),
    (dict(variant='split', lambda_init=0.8), 'gqa', 'differentialize with lambda_init="depth"'),
    (dict(variant='split', lambda_init='depth', layers=[1, 2]), 'gqa', 'differentialize without layers='),
    (dict(variant='split', lambda_init='depth', head_pairing='adjacent'), 'gqa',
     'differentialize with head_pairing="halves"'),
])
def test_models_diffllama_cannot_express_are_refused_with_the_fix(settings, layout, fix):
    model = _llama(layout, **settings)
    with pytest.raises(ValueError, match=fix):
        to_diffllama(model)
    with pytest.raises(ValueError, match=fix):
        llama_to_diffllama(model.state_dict(), model.config)


def test_other_inputs_are_refused_with_the_fix():
    config = transformers.LlamaConfig(num_attention_heads=4, num_key_value_heads=1, **GEOMETRY)
    mqa = differentialize(transformers.LlamaForCausalLM(config), variant='split', lambda_init='depth',
                          head_pairing='halves')
    with pytest.raises(ValueError, match='num_key_value_heads=1: DiffLlama needs an even number'):
        to_diffllama(mqa)
    with pytest.raises(ValueError, match='not differential; call differentialize'):
        to_diffllama(transformers.LlamaForCausalLM(transformers.LlamaConfig(num_attention_heads=4, **GEOMETRY)))
    qwen = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(num_attention_heads=4, num_key_value_heads=2,
                                                                  **GEOMETRY))
    differentialize(qwen, variant='split', lambda_init='depth')
    with pytest.raises(ValueError, match='Qwen2ForCausalLM: to_diffllama converts a LlamaForCausalLM'):
        to_diffllama(qwen)
    with pytest.raises(ValueError, match="model_type='qwen2'.*DiffLlama is a Llama"):
        llama_to_diffllama(qwen.state_dict(), qwen.config)
    with pytest.raises(ValueError, match='from_diffllama converts a DiffLlamaForCausalLM'):
        from_diffllama(mqa)
