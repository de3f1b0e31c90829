import json
import math
import re

import pytest
import torch
import transformers

from diffzoo.vlm.attention import DIFF_EAGER, DIFF_SDPA, diffzoo_eager_attention, diffzoo_sdpa_attention
from diffzoo.vlm.differential import differentialize, load_differential
from diffzoo.vlm.hf_config import SETTINGS_KEY
from diffzoo.vlm.parts import differential_parameters
from tests.vlm.models import paligemma_config, tiny_lm

VOCAB = 64


def _model(family: str, implementation: str = 'sdpa', seed: int = 0):
    return tiny_lm(family, implementation, seed, vocab=VOCAB)


FAMILIES = ['llama', 'llama_odd_groups', 'gemma', 'qwen2']
# (variant, head_pairing): duplicate, and split with each pairing
SETTINGS = [('duplicate', None), ('split', 'halves'), ('split', 'adjacent')]


def _ids(batch=2, length=7, seed=1):
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _reference_heads(attn, query, key, value, variant, mask=None):
    """The module docstring's formulas, one head at a time, in fp64; split pairs the query heads
    (a, b) of the layer's head_pairing, each reading its own KV head."""
    lq1, lk1, lq2, lk2 = (p.detach().double() for p in (attn.lambda_q1, attn.lambda_k1, attn.lambda_q2, attn.lambda_k2))
    lam = math.exp(lq1 @ lk1) - math.exp(lq2 @ lk2) + attn.differential.lambda_init
    B, H, L, d = query.shape
    groups = H // key.shape[1]
    s = attn.scaling
    q, k, v = query.double(), key.double(), value.double()
    bias = 0 if mask is None else torch.zeros(mask.shape, dtype=torch.float64).masked_fill(~mask, -math.inf)

    def softmax(j):
        return ((q[:, j] @ k[:, j // groups].transpose(-2, -1)) * s + bias).softmax(-1)  # (B, L, S)

    weight = attn.sub_norm.weight.detach().double() * (1 - attn.differential.lambda_init)
    heads = []
    if variant == 'duplicate':
        for j in range(H):
            o = (softmax(j) - lam * softmax(j)) @ v[:, j // groups]  # (B, L, d)
            heads.append(o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-5) * weight)
    else:
        if attn.differential.head_pairing == 'halves':
            pairs = zip(range(H // 2), range(H // 2, H))
        else:
            pairs = zip(range(0, H, 2), range(1, H, 2))
        for a, b in pairs:
            vp = torch.cat([v[:, a // groups], v[:, b // groups]], -1)  # (B, S, 2d)
            o = (softmax(a) - lam * softmax(b)) @ vp  # (B, L, 2d)
            heads.append(o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-5) * weight)
    return torch.cat(heads, -1).reshape(B, L, H, d)


@pytest.mark.parametrize('family', FAMILIES)
@pytest.mark.parametrize('variant,head_pairing', SETTINGS)
@pytest.mark.parametrize('kernel', [diffzoo_sdpa_attention, diffzoo_eager_attention])
def test_attention_kernels_compute_the_formula(family, variant, head_pairing, kernel):
    model = differentialize(_model(family), variant=variant, lambda_init=0.8, head_pairing=head_pairing)
    attn = model.model.layers[1].self_attn
    with torch.no_grad():
        attn.sub_norm.weight.normal_(1, 0.2)
    H, Hkv, d = attn.config.num_attention_heads, attn.config.num_key_value_heads, attn.head_dim
    g = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(2, n, 5, d, generator=g) for n in (H, Hkv, Hkv))
    mask = torch.ones(5, 5, dtype=torch.bool).tril().expand(2, 1, 5, 5)
    out, _ = kernel(attn, query, key, value, mask, scaling=attn.scaling)
    expected = _reference_heads(attn, query, key, value, variant, mask[:, 0])
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize('family', FAMILIES)
@pytest.mark.parametrize('variant,head_pairing', SETTINGS)
@pytest.mark.parametrize('kernel', [diffzoo_sdpa_attention, diffzoo_eager_attention])
@pytest.mark.parametrize('lambda_init', [0.8, 'depth'])
def test_fp64_models_compute_the_formula_without_rounding_to_fp32(family, variant, head_pairing, kernel, lambda_init):
    """An fp64 model keeps fp64 throughout (λ, the folded sub-norm weight, the eager maps): its heads
    equal the formula written out in fp64 to 1e-12 (λ_init 0.8 and λ are not exact in fp32)."""
    model = differentialize(_model(family), variant=variant, lambda_init=lambda_init,
                            head_pairing=head_pairing).double()
    attn = model.model.layers[1].self_attn
    with torch.no_grad():
        attn.sub_norm.weight.normal_(1, 0.2)
        for p in (attn.lambda_q1, attn.lambda_k1, attn.lambda_q2, attn.lambda_k2):
            p.normal_(0, 0.3)
    H, Hkv, d = attn.config.num_attention_heads, attn.config.num_key_value_heads, attn.head_dim
    g = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(2, n, 5, d, generator=g, dtype=torch.float64) for n in (H, Hkv, Hkv))
    mask = torch.ones(5, 5, dtype=torch.bool).tril().expand(2, 1, 5, 5)
    out, _ = kernel(attn, query, key, value, mask, scaling=attn.scaling)
    assert out.dtype == torch.float64
    expected = _reference_heads(attn, query, key, value, variant, mask[:, 0])
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize('family', FAMILIES)
@pytest.mark.parametrize('variant,head_pairing', SETTINGS)
def test_sdpa_and_eager_models_agree_in_outputs_and_gradients(family, variant, head_pairing):
    ids = _ids()
    results = []
    for implementation in ('sdpa', 'eager'):
        model = differentialize(_model(family, implementation), variant=variant, head_pairing=head_pairing)
        assert model.config._attn_implementation == {'sdpa': DIFF_SDPA, 'eager': DIFF_EAGER}[implementation]
        model.train()
        loss = model(ids, labels=ids).loss
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((loss.detach(), grads))
    (loss_s, grads_s), (loss_e, grads_e) = results
    torch.testing.assert_close(loss_s, loss_e, rtol=1e-5, atol=1e-5)
    assert grads_s.keys() == grads_e.keys()
    assert any('lambda_q1' in n for n in grads_s) and any('sub_norm' in n for n in grads_s)
    for name in grads_s:
        atol = 1e-5 * max(1., grads_e[name].abs().max().item())
        torch.testing.assert_close(grads_s[name], grads_e[name], rtol=1e-4, atol=atol, msg=name)


def test_eager_returns_the_differential_maps_as_attention_weights():
    model = differentialize(_model('gemma', 'eager'), variant='split', lambda_init=0.5)
    out = model(_ids(), output_attentions=True)
    maps = out.attentions[0]  # (B, H/2, L, L)
    assert maps.shape == (2, 2, 7, 7)
    attn = model.model.layers[0].self_attn
    lam = (torch.exp(attn.lambda_q1 @ attn.lambda_k1) - torch.exp(attn.lambda_q2 @ attn.lambda_k2) + 0.5).item()
    torch.testing.assert_close(maps.sum(-1), torch.full((2, 2, 7), 1 - lam), rtol=1e-5, atol=1e-5)
    assert maps.triu(1).abs().max() == 0  # causal


@pytest.mark.parametrize('family', ['llama', 'gemma'])
@pytest.mark.parametrize('variant', ['duplicate', 'split'])
def test_generation_with_the_kv_cache_equals_generation_without(family, variant):
    model = differentialize(_model(family), variant=variant)
    ids = _ids(batch=1, length=5)
    kw = dict(max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True,
              pad_token_id=0)
    cached = model.generate(ids, use_cache=True, **kw)
    uncached = model.generate(ids, use_cache=False, **kw)
    assert torch.equal(cached.sequences, uncached.sequences)
    for a, b in zip(cached.scores, uncached.scores):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


class _Logits(torch.nn.Module):
    """The causal LM as ids → logits without a cache: the form the tracers take."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids, use_cache=False).logits


@pytest.mark.slow
@pytest.mark.parametrize('family,variant,head_pairing', [
    ('gemma', 'duplicate', None),  # MQA as PaliGemma's Gemma: Differential PaliGemma's variant
    ('gemma', 'split', 'adjacent'),  # both maps of a pair on the one KV head
    ('llama', 'split', 'halves'),  # GQA, DiffLlama's pairing across KV heads
])
def test_compile_fullgraph_and_export_trace_the_differential_decoder(family, variant, head_pairing):
    """No graph break (fullgraph=True, AOTAutograd tracing the backward), gradients equal to eager;
    an exported program equal to eager. Adjacent pairs on one KV head reuse each map's product for
    both value halves: one tensor in two places of the saved-outputs op, which dynamo takes."""
    model = tiny_lm(family, vocab=VOCAB, layers=1)  # the tracers inline each layer alike: one is enough
    model = differentialize(model, variant=variant, head_pairing=head_pairing).train()
    module, ids = _Logits(model), _ids()
    params = [p for p in model.parameters() if p.requires_grad]
    grads = []
    for run in (module, torch.compile(module, fullgraph=True, backend='aot_eager')):
        run(ids).square().mean().backward()
        grads.append([p.grad.clone() for p in params])
        model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    for eager, compiled in zip(*grads):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
    model.eval()
    program = torch.export.export(module, (ids,))
    with torch.no_grad():
        assert torch.equal(program.module()(ids), module(ids))


@pytest.mark.parametrize('family,expected', [('llama', 'halves'), ('llama_odd_groups', 'halves'),
                                             ('gemma', 'adjacent'), ('qwen2', 'adjacent')])
def test_split_pairs_across_kv_heads_by_default_under_gqa_with_an_even_kv_head_count(family, expected):
    """GQA with 2 KV heads (groups of 2 and of 3) pairs heads i and i + H/2 (DiffLlama's); MQA and MHA
    keep adjacent heads. The resolved pairing is what the config records."""
    model = differentialize(_model(family), variant='split')
    assert {m.differential.head_pairing for m in model.modules() if hasattr(m, 'differential')} == {expected}
    assert model.config.diffzoo_differential['head_pairing'] == expected
    assert differentialize(_model(family)).config.diffzoo_differential['head_pairing'] is None  # duplicate


def test_the_two_pairings_differ_under_gqa():
    """Under GQA the pairing changes the model (same weights, same λ), so the choice is not cosmetic."""
    ids = _ids()
    logits = {}
    for head_pairing in ('halves', 'adjacent'):
        model = differentialize(_model('llama'), variant='split', head_pairing=head_pairing)
        torch.manual_seed(2)
        with torch.no_grad():  # weights N(0, 0.3): maps far from uniform, so the pairing shows
            for p in model.parameters():
                if p.ndim == 2:
                    p.normal_(0, 0.3)
        logits[head_pairing] = model(ids).logits
    assert (logits['halves'] - logits['adjacent']).abs().max() > 0.1


def test_bad_head_pairings_are_named():
    with pytest.raises(ValueError, match="head_pairing='pairs': expected one of"):
        differentialize(_model('llama'), variant='split', head_pairing='pairs')
    with pytest.raises(ValueError, match="head_pairing='halves'.*leave head_pairing out"):
        differentialize(_model('llama'), variant='duplicate', head_pairing='halves')


@pytest.mark.parametrize('config_format', ['llama model type', 'diffzoo_differential model type'])
def test_split_settings_saved_before_head_pairing_reload_with_adjacent_pairs(tmp_path, config_format):
    model = differentialize(_model('llama'), variant='split', head_pairing='adjacent')
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / 'config.json').read_text())
    del config['diffzoo_differential']['head_pairing']  # as written before the option existed
    if config_format == 'llama model type':  # the earlier save format: the base model type, no auto_map
        config['model_type'] = config.pop('diffzoo_base_model_type')
        config.pop('auto_map')
    (tmp_path / 'config.json').write_text(json.dumps(config))
    loaded = load_differential(tmp_path).eval()
    assert loaded.model.layers[0].self_attn.differential.head_pairing == 'adjacent'
    ids = _ids()
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits)


def test_layers_lambda_policy_and_parameters():
    model = differentialize(_model('llama'), variant='duplicate', lambda_init='depth', layers=[0, 2])
    layers = model.model.layers
    assert not hasattr(layers[1].self_attn, 'differential')
    assert layers[0].self_attn.differential.lambda_init == pytest.approx(0.2)
    assert layers[2].self_attn.differential.lambda_init == pytest.approx(0.8 - 0.6 * math.exp(-0.6))
    assert len(differential_parameters(model)) == 2 * 5
    assert layers[0].self_attn.sub_norm.weight.shape == (8,)  # duplicate: one head wide
    split = differentialize(_model('llama'), variant='split', lambda_init=0.8)
    assert split.model.layers[0].self_attn.sub_norm.weight.shape == (16,)  # split: a pair of heads
    assert all(m.differential.lambda_init == 0.8 for m in split.modules() if hasattr(m, 'differential'))


@pytest.mark.parametrize('variant', ['duplicate', 'split'])
@pytest.mark.parametrize('lambda_init', [1.0, 1.2, -0.1, float('nan'), True], ids=repr)
def test_lambda_init_outside_zero_one_is_refused_and_the_model_left_as_it_was(variant, lambda_init):
    model = _model('llama')
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=rf"lambda_init={re.escape(repr(lambda_init))}: expected a number in \[0, 1\)"):
        differentialize(model, variant=variant, lambda_init=lambda_init)
    assert not any(hasattr(m, 'differential') for m in model.modules())
    assert model.config._attn_implementation == 'sdpa'
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


def test_a_model_differential_in_some_layers_still_runs_the_others_unchanged():
    ids = _ids()
    plain = _model('gemma2', 'eager')
    ref = plain(ids).logits
    partial = differentialize(_model('gemma2', 'eager'), layers=[1])
    out = partial(ids).logits
    assert not torch.allclose(out, ref)  # layer 1 changed
    # layer 0 (soft-capped, not differential) runs Gemma 2's own eager attention: same hidden states
    h_plain = plain(ids, output_hidden_states=True).hidden_states[1]
    h_partial = partial(ids, output_hidden_states=True).hidden_states[1]
    torch.testing.assert_close(h_partial, h_plain)


def test_soft_capped_models_need_the_eager_kernel():
    model = differentialize(_model('gemma2', 'eager'))
    assert model.config._attn_implementation == DIFF_EAGER
    model(_ids())
    model.config._attn_implementation = DIFF_SDPA  # SDPA cannot soft-cap: refused, not silently dropped
    with pytest.raises(ValueError, match='attn_implementation="eager"'):
        model(_ids())


@pytest.mark.parametrize('layers,why', [([], 'converts nothing'), ([True], 'not an int'), ([1.0], 'not an int'),
                                        (['1'], 'not an int'), (3, 'expected a list'), ([0, 0], 'more than once'),
                                        ([-1], 'negative'), ([3], 'past the last block')])
def test_layers_are_refused_by_name_and_nothing_converts(layers, why):
    model = _model('llama')
    with pytest.raises(ValueError, match=why) as refused:
        differentialize(model, layers=layers)
    assert f'layers={layers!r}' in str(refused.value) and 'blocks 0..2' in str(refused.value)
    assert not differential_parameters(model) and SETTINGS_KEY not in model.config.to_dict()


def test_an_attention_module_without_what_it_needs_is_refused_by_layer_and_nothing_converts():
    """A decoder layer whose attention lacks `layer_idx` (λ_init by depth reads it) is named before any layer
    changes."""
    model = _model('llama')
    del model.model.layers[1].self_attn.layer_idx
    with pytest.raises(ValueError, match=r"layer 1: LlamaAttention lacks \['layer_idx'\]; differentialize needs"):
        differentialize(model)
    assert not differential_parameters(model) and SETTINGS_KEY not in model.config.to_dict()


def test_a_second_call_is_refused_so_the_saved_settings_cover_every_differential_layer():
    """Layers of two settings in memory, and a config recording only the last call's, would reload otherwise."""
    model = differentialize(_model('llama'), layers=[0])
    with pytest.raises(ValueError, match=r'already differential \(decoder layers \[0\]\).*from_pretrained'):
        differentialize(model, layers=[1], variant='split')
    assert getattr(model.config, SETTINGS_KEY)['layers'] == [0] and not hasattr(model.model.layers[1].self_attn,
                                                                                 'differential')


def test_swiglu_option_and_bad_arguments_are_named():
    model = differentialize(_model('gemma'), mlp='swiglu')
    assert isinstance(model.model.layers[0].mlp.act_fn, torch.nn.SiLU)
    with pytest.raises(ValueError, match="variant='diff'"):
        differentialize(_model('llama'), variant='diff')
    with pytest.raises(ValueError, match=r'layers=\[7\]'):
        differentialize(_model('llama'), layers=[7])
    with pytest.raises(ValueError, match='already differential'):
        differentialize(differentialize(_model('llama')))
    with pytest.raises(ValueError, match='lambda_init'):
        differentialize(_model('llama'), lambda_init='layer')
    odd = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=24, intermediate_size=48, num_hidden_layers=1,
                                   num_attention_heads=3, num_key_value_heads=1)
    with pytest.raises(ValueError, match='use variant="duplicate"'):
        differentialize(transformers.LlamaForCausalLM(odd), variant='split')
    with pytest.raises(ValueError, match='no decoder'):
        differentialize(torch.nn.Linear(2, 2))


@pytest.mark.parametrize('variant', ['duplicate', 'split'])
def test_save_pretrained_and_load_differential_round_trip(tmp_path, variant):
    model = differentialize(_model('qwen2'), variant=variant, lambda_init='depth', layers=[1, 2], mlp='swiglu')
    with torch.no_grad():
        for p in differential_parameters(model):
            p.add_(torch.randn_like(p) * 0.3)  # trained values, not the init
    model.save_pretrained(tmp_path)
    loaded = load_differential(tmp_path).eval()
    ids = _ids()
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits)
    for a, b in zip(differential_parameters(loaded), differential_parameters(model)):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match='diffzoo_differential'):
        plain_dir = tmp_path / 'plain'
        _model('qwen2').save_pretrained(plain_dir)
        load_differential(plain_dir)


def test_bf16_model_runs_close_to_fp32():
    model = differentialize(_model('gemma'), variant='split')
    ids = _ids()
    ref = model(ids).logits
    out = model.to(torch.bfloat16)(ids).logits
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=0.05, atol=0.05)


def test_paligemma_decoder_only_is_differential_and_round_trips(tmp_path):
    torch.manual_seed(0)
    config = paligemma_config()
    model = transformers.PaliGemmaForConditionalGeneration(config).eval()
    differentialize(model, variant='duplicate')
    assert model.config.text_config._attn_implementation == DIFF_SDPA
    assert model.config.vision_config._attn_implementation != DIFF_SDPA  # SigLIP untouched
    assert not any(hasattr(m, 'differential') for m in model.model.vision_tower.modules())
    image_tokens = (32 // 8) ** 2
    ids = torch.cat([torch.full((1, image_tokens), 79), torch.randint(0, 70, (1, 5))], 1)
    pixels = torch.randn(1, 3, 32, 32)
    logits = model(input_ids=ids, pixel_values=pixels).logits
    model.save_pretrained(tmp_path)
    loaded = load_differential(tmp_path).eval()
    torch.testing.assert_close(loaded(input_ids=ids, pixel_values=pixels).logits, logits)
