import pytest
import torch
import transformers

from diffzoo.layers import capture_attention_maps
from diffzoo.vlm import build_vlm, differentialize
from diffzoo.bench.eramv import cost_report
from diffzoo.vlm.eramv import anchor_scores, default_inject_layers, module_indices
from tests.vlm.models import tiny_lm

VOCAB = 50
PATCHES = 64  # diffclip-tiny: 64 px images, 8 px patches


def _lm(implementation='sdpa', layers=4, seed=0):
    return tiny_lm('gemma', implementation, seed, vocab=VOCAB, layers=layers)


def _vlm(integration='eramv', implementation='sdpa', seed=0, **kw):
    lm = _lm(implementation, seed=seed)
    torch.manual_seed(seed)
    return build_vlm('diffclip-tiny', lm, integration=integration, **kw).eval()


def _inputs(batch=2, length=6):
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch, 3, 64, 64, generator=g), torch.randint(3, VOCAB, (batch, length), generator=g)


def test_default_injection_layers_count_from_1_and_take_every_second_layer_of_eramvs_span():
    assert default_inject_layers(32) == [8, 10, 12, 14, 16, 18, 20, 22]  # the paper's, counted from 1
    assert module_indices(default_inject_layers(32), 32) == [7, 9, 11, 13, 15, 17, 19, 21]
    assert default_inject_layers(16) == [4, 6, 8, 10]  # round(8/32·16) .. round(22/32·16) = 4 .. 11
    assert default_inject_layers(24) == [6, 8, 10, 12, 14, 16]  # 6 .. round(16.5) = 17
    assert default_inject_layers(4) == [1, 3]  # 1 .. round(2.75) = 3
    for depth in (4, 16, 24, 32, 40):
        layers = default_inject_layers(depth)
        assert all(b - a == 2 for a, b in zip(layers, layers[1:])) and 1 <= layers[0] and layers[-1] <= depth
    model = _vlm()  # 4 layers
    assert model.inject_layers == [1, 3] and model.inject_indices == [0, 2]
    assert _vlm(inject_layers=[1, 3], layer_base=0).inject_indices == [1, 3]  # module indices, the earlier form
    with pytest.raises(ValueError, match=r'inject_layers=\[0\]: the decoder has layers 1\.\.4'):
        _vlm(inject_layers=[0, 2])
    with pytest.raises(ValueError, match=r'inject_layers=\[4\]: the decoder has layers 0\.\.3'):
        _vlm(inject_layers=[4], layer_base=0)
    with pytest.raises(ValueError, match="injected_queries='anchors'"):
        _vlm(injected_queries='anchors')
    with pytest.raises(ValueError, match="integration='llava'"):
        _vlm(integration='llava')


def _hidden_states(trunk, pixels, tap=None):
    """LLaVA-1.5's `hidden_states` of a timm ViT, by running its parts by hand: [the embeddings, each
    block's output] (no final norm), each (B, 1 + P, D_v); with `tap` (a block index), also that
    block's attention map (B, h, N, N) read on its explicit path."""
    x = trunk.norm_pre(trunk.patch_drop(trunk._pos_embed(trunk.patch_embed(pixels))))
    states, attn = [x], None
    for i, block in enumerate(trunk.blocks):
        if i == tap:
            with capture_attention_maps(block) as maps:
                x = block(x)
            attn = maps[list(maps)[-1]]
        else:
            x = block(x)
        states.append(x)
    return states, attn


def _mlp2x_gelu(x, projector):
    """LLaVA-1.5's projector by hand in fp64 from `projector`'s weights: W2·GELU(W1·x + b1) + b2."""
    first, last = projector[0], projector[2]
    h = x.double() @ first.weight.double().T + first.bias.double()
    h = 0.5 * h * (1 + torch.erf(h / 2 ** 0.5))  # exact GELU
    return (h @ last.weight.double().T + last.bias.double()).float()


def _top_k(scores, k):
    return torch.stack([torch.tensor(sorted(torch.argsort(row, descending=True)[:k].tolist())) for row in scores])


def test_anchors_are_the_top_k_by_cls_attention_of_the_penultimate_block_in_original_order():
    model = _vlm(anchors=8, include_cls=False)
    pixels, _ = _inputs()
    anchors, features, index = model.visual_inputs(pixels)
    assert anchors.shape == (2, 8, 32) and features.shape == (2, PATCHES, 32)
    assert torch.all(index[:, 1:] > index[:, :-1])  # original order
    states, attn = _hidden_states(model.vision.tower, pixels, tap=2)  # depth 4: block 2 is the penultimate
    assert torch.equal(index, _top_k(attn[:, :, 0, 1:].mean(1), 8))
    torch.testing.assert_close(features, _mlp2x_gelu(states[-2][:, 1:], model.projector))  # post-MLP: identity at init
    torch.testing.assert_close(anchors, features.gather(1, index[..., None].expand(-1, -1, 32)) * model.embed_scale)


@pytest.mark.parametrize('select_layer, block', [(-2, 2), (-1, 3), (1, 0), (3, 2)])
def test_features_and_cls_attention_come_from_the_selected_block_without_the_final_norm(select_layer, block):
    """select_layer indexes LLaVA-1.5's hidden_states ([embeddings, block 1, …, block L]); the anchor
    scores are that block's CLS attention."""
    model = _vlm(select_layer=select_layer)
    pixels, _ = _inputs()
    tokens, scores, cls = anchor_scores(model.vision, pixels, with_cls=True)
    states, attn = _hidden_states(model.vision.tower, pixels, tap=block)
    torch.testing.assert_close(tokens, states[select_layer][:, 1:], rtol=0, atol=1e-6)
    torch.testing.assert_close(cls, states[select_layer][:, 0], rtol=0, atol=1e-6)
    torch.testing.assert_close(scores, attn[:, :, 0, 1:].mean(1))
    assert model.vision.block_index == block


def test_the_cls_attention_equals_softmax_qk_of_the_penultimate_block_of_a_plain_timm_vit():
    """An independent fp64 reference on timm's own ViT: its blocks run by hand, the penultimate
    block's attention written out as softmax(q·kᵀ/√d), its output taken before the final norm."""
    import copy
    import timm
    torch.manual_seed(0)
    tower = timm.create_model('vit_tiny_patch16_224', img_size=32, patch_size=8, depth=3, num_classes=0).eval()
    model = build_vlm(tower, _lm(), integration='eramv', anchors=5, include_cls=False).eval()
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    tokens, scores = anchor_scores(model.vision, pixels)
    ref = copy.deepcopy(tower).double()
    x = ref.norm_pre(ref._pos_embed(ref.patch_embed(pixels.double())))  # (B, 1 + 16, 192)
    x = ref.blocks[0](x)
    attn = ref.blocks[1].attn
    B, N, C = x.shape
    qkv = attn.qkv(ref.blocks[1].norm1(x)).reshape(B, N, 3, attn.num_heads, C // attn.num_heads).permute(2, 0, 3, 1, 4)
    q, k = qkv[0], qkv[1]  # (B, h, N, d)
    a = torch.softmax(q @ k.transpose(-1, -2) * (C // attn.num_heads) ** -0.5, dim=-1)  # (B, h, N, N)
    expected_scores = a[:, :, 0, 1:].mean(1)  # (B, 16)
    expected_tokens = ref.blocks[1](x)[:, 1:]
    print('max |scores - fp64|', (scores.double() - expected_scores).abs().max().item(),
          'max |tokens - fp64|', (tokens.double() - expected_tokens).abs().max().item())
    torch.testing.assert_close(scores.double(), expected_scores, rtol=0, atol=1e-6)
    torch.testing.assert_close(tokens.double(), expected_tokens, rtol=0, atol=1e-5)
    _, _, index = model.visual_inputs(pixels)
    assert torch.equal(index, _top_k(expected_scores, 5))


def test_final_norm_is_the_earlier_choice_the_last_block_through_the_final_norm():
    model = _vlm(anchors=8, include_cls=False, select_layer='final_norm')
    pixels, _ = _inputs()
    _, features, index = model.visual_inputs(pixels)
    trunk = model.vision.tower
    with capture_attention_maps(trunk) as maps:
        tokens = trunk.forward_features(pixels)  # the last block, then the final norm
    assert torch.equal(index, _top_k(maps[list(maps)[-1]][:, :, 0, 1:].mean(1), 8))
    torch.testing.assert_close(features, _mlp2x_gelu(tokens[:, 1:], model.projector))


def test_anchors_and_injected_features_share_one_llava_projector():
    model = _vlm(anchors=8)
    D_v, D = model.vision.dim, model.hidden_size
    projector = model.projector
    assert isinstance(projector, torch.nn.Sequential) and len(projector) == 3
    assert [type(m) for m in projector] == [torch.nn.Linear, torch.nn.GELU, torch.nn.Linear]
    assert (projector[0].in_features, projector[0].out_features) == (D_v, D)
    assert projector[1].approximate == 'none'  # exact GELU, as LLaVA-1.5
    assert (projector[2].in_features, projector[2].out_features) == (D, D)
    vision_to_text = [n for n, m in model.named_modules()
                      if isinstance(m, torch.nn.Linear) and m.in_features == D_v and not n.startswith('vision.')]
    assert vision_to_text == ['projector.0']  # one projector in the model
    pixels, _ = _inputs()
    anchors, features, index = model.visual_inputs(pixels)
    tokens, _, cls = anchor_scores(model.vision, pixels, with_cls=True)
    torch.testing.assert_close(anchors[:, 0], _mlp2x_gelu(cls, projector) * model.embed_scale)  # [CLS]
    picked = tokens.gather(1, index[..., None].expand(-1, -1, D_v))
    torch.testing.assert_close(anchors[:, 1:], _mlp2x_gelu(picked, projector) * model.embed_scale)  # V_A
    torch.testing.assert_close(features, _mlp2x_gelu(tokens, projector))  # V
    with torch.no_grad():
        projector[2].bias += 1.0  # one parameter moves the anchors and the injected features alike
    shifted, moved, _ = model.visual_inputs(pixels)
    torch.testing.assert_close(shifted, anchors + model.embed_scale)
    torch.testing.assert_close(moved, features + 1.0)
    assert type(_vlm('full').projector) is torch.nn.Linear  # the plain wrapper keeps PaliGemma's Linear
    linear = _vlm(projector='linear', anchors=8)
    assert type(linear.projector) is torch.nn.Linear  # the earlier eRAM-V projector, by name


def test_bad_select_layer_projector_and_eramv_settings_on_a_full_model_are_refused():
    for bad in (0, 5, -5, 'last', 1.5, True):
        with pytest.raises(ValueError, match=rf"select_layer={bad!r}: expected a block"):
            _vlm(select_layer=bad)
    with pytest.raises(ValueError, match=r"projector='mlp': expected one of linear, mlp2x_gelu"):
        _vlm(projector='mlp')
    with pytest.raises(ValueError, match=r'anchors=8, post_mlp=False: eRAM-V settings, which apply to '
                                         r'integration="eramv"'):
        _vlm('full', anchors=8, post_mlp=False)


def test_default_anchors_are_cls_then_the_top_64_patches():
    import timm
    torch.manual_seed(0)
    tower = timm.create_model('vit_diff_micro_patch8_64', img_size=96)  # 144 patches
    model = build_vlm(tower, _lm(), integration='eramv').eval()
    assert (model.select_layer, model.projector_type) == (-2, 'mlp2x_gelu')
    pixels = torch.randn(2, 3, 96, 96, generator=torch.Generator().manual_seed(0))
    anchors, features, index = model.visual_inputs(pixels)
    D = features.shape[-1]
    assert anchors.shape == (2, 65, D) and features.shape == (2, 144, D)  # [CLS] + the top 64 patches
    states, attn = _hidden_states(tower, pixels, tap=2)
    torch.testing.assert_close(anchors[:, 0], _mlp2x_gelu(states[-2][:, 0], model.projector) * model.embed_scale)
    expected = _top_k(attn[:, :, 0, 1:].mean(1), 64)
    assert torch.equal(index, expected)  # original order
    torch.testing.assert_close(anchors[:, 1:], features.gather(1, expected[..., None].expand(-1, -1, D)) * model.embed_scale)


@pytest.mark.parametrize('queries', ['all', 'text'])
def test_injected_features_are_read_exactly_at_the_chosen_layers(queries):
    model = _vlm(implementation='eager', anchors=8, inject_layers=[2, 4], injected_queries=queries)
    pixels, ids = _inputs(length=5)
    out = model(pixels, ids, output_attentions=True)
    seq = 9 + 5  # [CLS] + 8 anchors, 5 text tokens
    for layer, attn in enumerate(out.attentions):  # (B, heads, L, S [+ P])
        if layer in (1, 3):  # layers 2 and 4 counted from 1
            assert attn.shape[-1] == seq + PATCHES
            extra = attn[..., seq:]
            assert extra[:, :, 9:].sum() > 0.01 * 2 * 4 * 5  # text queries read the features
            if queries == 'all':  # Eq. 8: the anchors ([CLS] included) read them too
                assert (extra[:, :, :9].sum(-1) > 0.01).all()
            else:
                assert extra[:, :, :9].abs().max() == 0
            torch.testing.assert_close(attn.sum(-1), torch.ones(attn.shape[:-1]))
        else:
            assert attn.shape[-1] == seq


def test_all_anchors_and_no_injection_is_the_full_token_model_at_init():
    pixels, ids = _inputs()
    full = _vlm('full', select_layer=-2, projector='mlp2x_gelu', sequence_mask='causal')  # LLaVA-1.5's choices
    eramv = _vlm(anchors=PATCHES, inject_layers=[], include_cls=False)
    eramv.load_state_dict(full.state_dict(), strict=False)  # same tower, projector and LM; post-MLP is identity at init
    torch.testing.assert_close(eramv(pixels, ids).logits, full(pixels, ids).logits)


def _causal_reference(model, pixels, ids, mask):
    """eRAM-V's Eq. 4 by hand: [anchors | text] through the LM with a lower-triangular mask over the valid
    positions (the injected features appended by the model's layers as in its own forward); (logits, valid):
    logits at padded positions are not defined by it."""
    anchors, features, _ = model.visual_inputs(pixels)
    text = model.language_model.get_input_embeddings()(ids)
    embeds = torch.cat([anchors, text], 1)
    B, L = embeds.shape[:2]
    valid = torch.cat([torch.ones(B, anchors.shape[1], dtype=torch.bool), mask.bool()], 1)
    allowed = torch.ones(L, L, dtype=torch.bool).tril()[None] & valid[:, None, :]  # (B, L, L): k ≤ q, k valid
    additive = torch.zeros(B, 1, L, L).masked_fill(~allowed[:, None], torch.finfo(torch.float32).min)
    positions = (valid.long().cumsum(1) - 1).clamp(min=0)
    text_at = (torch.arange(L) >= anchors.shape[1])[None].expand(B, -1)  # (B, L): the text positions
    return model.language_model(inputs_embeds=embeds, attention_mask=additive, position_ids=positions,
                                 **model._injected(features, text_at)).logits, valid


def test_eramv_attends_causally_as_published_and_prefix_lm_by_name():
    """Eq. 4 (section 3.3): causal attention over [anchors | text], as LLaVA-1.5; PaliGemma's prefix-LM form
    differs in the anchors' block, where it lets anchors and prompt attend both ways."""
    pixels, ids = _inputs()
    mask = torch.tensor([[1] * 6, [1, 1, 1, 1, 0, 0]])
    model = _vlm(anchors=8, inject_layers=[2, 4])
    assert model.sequence_mask == 'causal' and _vlm('full').sequence_mask == 'prefix_lm'
    with torch.no_grad():
        causal = model(pixels, ids, mask).logits
        reference, valid = _causal_reference(model, pixels, ids, mask)
        torch.testing.assert_close(causal[valid], reference[valid])
        model.sequence_mask = 'prefix_lm'
        prefix_lm = model(pixels, ids, mask).logits
    assert (prefix_lm[:, :9] - causal[:, :9]).abs().max() > 1e-3  # the anchors see what follows them
    named = _vlm(anchors=8, inject_layers=[2, 4], sequence_mask='prefix_lm')
    with torch.no_grad():
        torch.testing.assert_close(named(pixels, ids, mask).logits, prefix_lm)
    with pytest.raises(ValueError, match="sequence_mask='bidirectional': expected causal"):
        _vlm(sequence_mask='bidirectional')


def test_generate_and_training_use_the_causal_mask():
    pixels, ids = _inputs()
    model = _vlm(anchors=8, inject_layers=[2, 4])
    mask = torch.ones_like(ids)
    answer = model.generate(pixels, ids, mask, max_new_tokens=3, use_cache=False)
    with torch.no_grad():
        first = _causal_reference(model, pixels, ids, mask)[0][:, -1].argmax(-1)
        assert torch.equal(answer[:, 0], first)
        full = torch.cat([ids, answer[:, :2]], 1)
        later = _causal_reference(model, pixels, full, torch.ones_like(full))[0][:, -1].argmax(-1)
    assert torch.equal(answer[:, 2], later)
    assert torch.equal(model.generate(pixels, ids, mask, max_new_tokens=3), answer)  # the KV cache agrees
    labels = ids.clone()
    loss = model(pixels, ids, mask, prefix_mask=torch.zeros_like(ids), labels=labels).loss
    with torch.no_grad():
        logits = _causal_reference(model, pixels, ids, mask)[0][:, 9:-1]
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
    torch.testing.assert_close(loss, expected)


def test_a_tower_without_a_class_token_is_refused_and_too_many_anchors_said_once():
    import timm
    lm = _lm()
    for kw, what in [(dict(class_token=False, global_pool='avg', reg_tokens=4), '4 register token'),
                     (dict(class_token=False, global_pool='avg'), 'no prefix token')]:
        tower = timm.create_model('vit_tiny_patch16_224', img_size=64, pretrained=False, **kw)
        with pytest.raises(ValueError, match=f'no class token .*{what}'):
            build_vlm(tower, lm, integration='eramv')
    with pytest.warns(UserWarning, match=r'anchors=64 ≥ the 16 patches') as warned:
        model = build_vlm(timm.create_model('vit_tiny_patch16_224', img_size=64, pretrained=False), _lm(),
                          integration='eramv')
        model.eval()(*_inputs())
        model(*_inputs())
    assert len([w for w in warned if 'anchors=' in str(w.message)]) == 1


@pytest.mark.parametrize('variant', [None, 'split'])
def test_eramv_composes_with_differential_decoders_and_the_kv_cache(variant):
    model = _vlm(anchors=8, inject_layers=[1, 3])
    if variant:
        differentialize(model.language_model, variant=variant)
    pixels, ids = _inputs()
    mask = torch.tensor([[1] * 6, [1, 1, 1, 1, 0, 0]])
    cached = model.generate(pixels, ids, mask, max_new_tokens=4)
    uncached = model.generate(pixels, ids, mask, max_new_tokens=4, use_cache=False)
    assert torch.equal(cached, uncached)
    model.train()
    loss = model(pixels, ids, labels=ids).loss
    loss.backward()
    assert model.post_mlp.fc2.weight.grad.abs().sum() > 0  # the injected path reaches the post-projection MLP
    assert model.projector[0].weight.grad.abs().sum() > 0


def test_cost_report_shows_fewer_flops_than_the_full_token_model():
    pixels, ids = _inputs(batch=1, length=8)
    full = _vlm('full', select_layer=-2, projector='mlp2x_gelu')  # the same parts
    report = cost_report({'full': full, 'eramv': _vlm(anchors=8)}, pixels, ids, reps=2)
    assert report['full']['sequence_length'] == PATCHES + 8 and report['eramv']['sequence_length'] == 9 + 8
    assert report['full']['flops_ratio'] == 1.0
    assert 0 < report['eramv']['language_model_flops_ratio'] < 0.5  # 17 positions instead of 72, plus injected K/V
    full, eramv = report['full']['flops_by_part'], report['eramv']['flops_by_part']
    assert abs(eramv['vision'] / full['vision'] - 1) < 0.05  # the CLS map: one block on its explicit path
    assert 'post_mlp' not in full and eramv['post_mlp'] > 0
    assert report['eramv']['latency_s'] > 0


@pytest.mark.parametrize('model_flags, parts, new_tokens', [
    (['--model', 'diffclip-tiny', '{lm}', '--select-layer', 'final_norm', '--projector', 'linear'],
     ('final_norm', 'linear'), 0),
    (['--model', 'diffclip-tiny', '{lm}', '--device', 'cpu'], (-2, 'mlp2x_gelu'), 3),  # eRAM-V's defaults
])
def test_cost_report_cli_prints_a_table_and_writes_json(tmp_path, model_flags, parts, new_tokens):
    import json

    from diffzoo.bench.eramv import main
    from tests.factory import call
    _lm().save_pretrained(tmp_path / 'lm')
    argv = [*[f.format(lm=tmp_path / 'lm') for f in model_flags], '--new-tokens', new_tokens,
            '--anchors', '16', '--prompt-tokens', '8', '--reps', '2', '--out', str(tmp_path / 'report.json')]
    done = call(main, argv, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert 'anchors 16 of 64 visual tokens, injected at layers [1, 3]' in done.stdout
    report = json.loads((tmp_path / 'report.json').read_text())
    assert report['eramv']['sequence_length'] == 1 + 16 + 8 and report['full']['sequence_length'] == 64 + 8
    assert report['config']['vision'] == 'diffclip-tiny' and report['config']['language_model'] == str(tmp_path / 'lm')
    assert (report['config']['select_layer'], report['config']['projector']) == parts
    if new_tokens:  # time to first token and tokens/s of 3 greedy tokens, each a median of 2 calls
        assert 'TTFT ms' in done.stdout
        for name in ('full', 'eramv'):
            r = report[name]
            assert r['new_tokens'] == 3 and r['ttft']['n'] == r['generate']['n'] == 2
            assert 0 < r['ttft_s'] and r['tokens_per_s'] == pytest.approx(3 / r['generate_s'])
    else:
        assert 'ttft_s' not in report['full'] and 'TTFT ms' not in done.stdout


def test_the_flop_counter_matches_a_hand_count_of_a_tiny_eramv_model():
    """2 FLOPs per multiply-accumulate of every matmul, convolution and attention (query-key pairs, causal or
    not), summed by hand for a 3-block ViT (features from block 2, LLaVA's -2) and a 4-layer GQA Llama."""
    from timm.models.vision_transformer import VisionTransformer
    from diffzoo.bench.eramv_paper import count
    Dv, P, N = 16, 4, 5  # 32 px, 16 px patches: 4 patches and [CLS]
    tower = VisionTransformer(img_size=32, patch_size=16, embed_dim=Dv, depth=3, num_heads=2, mlp_ratio=2,
                              num_classes=0)
    H, I, layers, heads, kv_heads, d, V = 32, 48, 4, 4, 2, 8, 50
    config = transformers.LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=layers,
                                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=d,
                                      max_position_embeddings=64)
    config._attn_implementation = 'sdpa'
    lm = transformers.AutoModelForCausalLM.from_config(config).eval()
    k, T = 2, 5
    model = build_vlm(tower, lm, 'eramv', anchors=k, inject_layers=[2, 4]).eval()
    block = 2 * N * Dv * 3 * Dv + 2 * N * Dv * Dv + 2 * 2 * N * N * Dv + 2 * 2 * N * Dv * 2 * Dv  # qkv, proj, attn, MLP
    vision = 2 * P * (3 * 16 * 16) * Dv + 2 * block  # patch embedding, then blocks 1 and 2 (block 3 never runs)
    projector = 2 * (P + 1) * (Dv * H + H * H)  # the patches and [CLS], Linear → GELU → Linear
    post_mlp = 2 * (P + 1) * 2 * H * H
    L = 1 + k + T  # [CLS], the anchors, the prompt
    def decoder_layer(keys):
        return (2 * L * H * heads * d * 2 + 2 * L * H * kv_heads * d * 2  # q, o; k, v
                + 2 * 2 * heads * L * keys * d + 2 * L * H * I * 3)  # attention; gate, up, down
    language_model = sum(decoder_layer(L + P if i in (1, 3) else L) for i in range(layers)) + 2 * L * H * V
    injected_kv = 2 * 2 * P * H * kv_heads * d * 2  # k, v of the P patches at layers 2 and 4 (made by the VLM)
    counted = count(model, T)
    assert counted['sequence_length'] == L
    assert counted['flops_by_part'] == {'vision': vision, 'projector': projector, 'language_model': language_model,
                                        'post_mlp': post_mlp}
    assert counted['flops'] == vision + projector + post_mlp + language_model + injected_kv


def test_the_papers_shapes_build_on_the_meta_device():
    from diffzoo.bench.eramv_paper import count, meta_models
    models = meta_models('7b', ['llava', 'eramv'])
    eramv = models['eramv']
    assert next(eramv.parameters()).is_meta and eramv.vision.image_size == (336, 336)
    assert sum(p.numel() for p in eramv.language_model.parameters()) == 6_738_415_616  # Vicuna-7B's (Llama 2 7B)
    assert eramv.inject_layers == [8, 10, 12, 14, 16, 18, 20, 22] and eramv.anchors == 64
    assert count(eramv, 8)['sequence_length'] == 65 + 8 and count(models['llava'], 8)['sequence_length'] == 576 + 8


def test_cost_report_cli_names_a_missing_model_and_an_unknown_flag(capsys):
    from diffzoo.bench.eramv import main
    for argv, message in ((['--anchors', '8'], '--anchors apply to a model pair: add --model VISION LM_DIR'),
                          (['--model', 'a', 'b', '--vision', 'c'], 'unrecognized arguments: --vision c'),
                          (['--model', 'a', 'b', '--select-layer', 'last'], '--select-layer last: expected a block')):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_analysis_counts_injected_keys_as_visual_attention(language_model_dir):
    from PIL import Image
    from diffzoo.analysis import analyse_vlm
    from diffzoo.vlm.factory import BuiltVLM
    tokenizer = transformers.AutoTokenizer.from_pretrained(language_model_dir)
    lm = transformers.AutoModelForCausalLM.from_pretrained(language_model_dir)
    model = build_vlm('diffclip-tiny', lm, integration='eramv', anchors=8, inject_layers=[2])
    images = [Image.new('RGB', (64, 64), (200, 20, 20))]
    result = analyse_vlm(BuiltVLM(model, tokenizer, model.vision.preprocess), images,
                         ['what color is the shape?', 'what shape is it?'])
    mass = result['per_layer']['mass_visual']
    assert len(mass) == 2 and mass[1] > 0  # layer 1 reads the injected features
    for layer in range(2):
        total = sum(result['per_layer'][f'mass_{c}'][layer] for c in ('visual', 'text', 'special'))
        assert abs(total - 1) < 1e-5
    assert result['samples'][0]['tokens']['visual'] == 9  # [CLS] and 8 anchors: the sequence's visual tokens


def test_an_eramv_recipe_fine_tunes_and_its_adapter_carries_the_post_projection_mlp(language_model_dir, tmp_path):
    from safetensors.torch import load_file
    from tests.vlm.models import write_vqav2_split
    from tests.vlm.test_train import _recipe, _train
    from diffzoo.vlm import load_adapter
    write_vqav2_split(tmp_path / 'vqav2', 'train', 8, seed=0)
    write_vqav2_split(tmp_path / 'vqav2', 'val', 2, seed=1)
    model = {'type': 'build_vlm', 'vision': 'diffclip-tiny', 'language_model': str(language_model_dir),
             'integration': 'eramv', 'anchors': 8, 'inject_layers': [2]}
    recipe = _recipe(tmp_path, model, tmp_path / 'runs', max_steps=4, log_every=2, save_every=4)
    _train(recipe)
    run = tmp_path / 'runs' / 'tiny-vqa'
    results = (run / 'results.json').read_text()
    assert '"other": 0' in results
    extra = load_file(str(run / 'adapter' / 'diffzoo_extra.safetensors'))
    assert {'post_mlp.fc1.weight', 'post_mlp.fc2.weight', 'projector.0.weight', 'projector.2.weight'} <= set(extra)
    assert extra['post_mlp.fc2.weight'].abs().sum() > 0  # trained away from its zero init
    torch.manual_seed(0)
    fresh = build_vlm('diffclip-tiny', transformers.AutoModelForCausalLM.from_pretrained(language_model_dir),
                      integration='eramv', anchors=8, inject_layers=[2])
    loaded = load_adapter(fresh, run / 'adapter')
    torch.testing.assert_close(loaded.post_mlp.fc2.weight, extra['post_mlp.fc2.weight'])
