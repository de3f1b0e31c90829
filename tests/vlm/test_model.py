import pytest
import torch

from diffzoo.vlm import build_vlm, differentialize
from diffzoo.vlm.model import PROJECTORS, prefix_lm_mask
from diffzoo.vlm.towers import build_vision_tokens
from diffzoo.vlm.options import PROJECTOR_NAMES
from tests.vlm.models import tiny_lm

VOCAB = 50


def _lm(family='gemma', seed=0):
    return tiny_lm(family, seed=seed, vocab=VOCAB, layers=2)


def _vlm(family='gemma', vision='diffclip-tiny', seed=0):
    model = build_vlm(vision, _lm(family, seed)).eval()
    torch.manual_seed(seed)
    return model


def _pixels(model, batch=2, seed=0):
    h, w = model.vision.image_size
    return torch.randn(batch, 3, h, w, generator=torch.Generator().manual_seed(seed))


def _ids(batch, length, seed=1):
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_prefix_lm_mask_is_bidirectional_on_the_prefix_causal_after_and_hides_padding():
    valid = torch.tensor([[1, 1, 1, 1, 0]])
    prefix = torch.tensor([[1, 1, 0, 0, 0]])
    allowed = prefix_lm_mask(valid, prefix, torch.float32)[0, 0] == 0  # (L, L) query × key
    expected = torch.tensor([
        [1, 1, 0, 0, 0],  # prefix sees the whole prefix
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],  # answer tokens: causal
        [1, 1, 1, 1, 0],  # and nobody sees the padding
    ], dtype=torch.bool)
    assert torch.equal(allowed[:4], expected)
    assert allowed[4, 4]  # a padded query (output unused) sees at least itself: no all-masked row


@pytest.mark.parametrize('vision, patches', [('diffclip-tiny', 64), ('timm:vit_diff_tiny_patch16_224', 196),
                                             ('open_clip_native', 16)])
def test_vision_towers_give_patch_tokens(vision, patches):
    if vision == 'open_clip_native':
        from open_clip.transformer import VisionTransformer
        vision = VisionTransformer(image_size=32, patch_size=8, width=24, layers=1, heads=2, mlp_ratio=2.,
                                   output_dim=16)
    tokens = build_vision_tokens(vision)
    h, w = tokens.image_size
    out = tokens(torch.randn(2, 3, h, w))
    assert out.shape == (2, patches, tokens.dim)  # patch tokens only, no CLS
    with pytest.raises(ValueError, match='not an open_clip model name'):
        build_vision_tokens('no-such-model')


def _open_clip_hidden_states(visual, pixels):
    """open_clip's own ViT run by hand: [embeddings after ln_pre, each block's output], (B, 1 + P, D_v)."""
    x = visual.conv1(pixels).flatten(2).transpose(1, 2)  # (B, P, D_v)
    x = torch.cat([visual.class_embedding.expand(x.shape[0], 1, -1), x], 1) + visual.positional_embedding
    x = visual.ln_pre(x)
    states = [x]
    for block in visual.transformer.resblocks:
        x = block(x) if visual.transformer.batch_first else block(x.transpose(0, 1)).transpose(0, 1)
        states.append(x)
    return states


@pytest.mark.parametrize('select_layer', [-2, -1, 1, 'final_norm'])
def test_select_layer_takes_a_blocks_output_of_timm_and_open_clip_towers(select_layer):
    """select_layer indexes LLaVA-1.5's hidden_states ([embeddings, block 1, …, block L], no final
    norm); 'final_norm' is the last block through the tower's final norm, the earlier (and PaliGemma's)."""
    import open_clip.transformer
    torch.manual_seed(0)
    visual = open_clip.transformer.VisionTransformer(image_size=32, patch_size=8, width=24, layers=3, heads=2,
                                                     mlp_ratio=2., output_dim=16).eval()
    pixels = torch.randn(2, 3, 32, 32)
    states = _open_clip_hidden_states(visual, pixels)
    expected = visual.ln_post(states[-1]) if select_layer == 'final_norm' else states[select_layer]
    torch.testing.assert_close(build_vision_tokens(visual, select_layer)(pixels), expected[:, 1:])
    model = _vlm('llama')  # diffclip-tiny: a timm trunk of 4 blocks
    trunk = model.vision.tower
    x = trunk.norm_pre(trunk._pos_embed(trunk.patch_embed(pixels := _pixels(model))))
    states = [x]
    for block in trunk.blocks:
        states.append(x := block(x))
    expected = trunk.norm(states[-1]) if select_layer == 'final_norm' else states[select_layer]
    tokens = build_vision_tokens(model.vision, select_layer)
    torch.testing.assert_close(tokens(pixels), expected[:, 1:])
    torch.testing.assert_close(tokens(pixels, prefix=True), expected)
    assert tokens.tower is trunk and model.vision.select_layer == 'final_norm'  # the same tower; the model's unchanged


def test_the_full_model_takes_llava_15s_features_and_projector_by_name():
    """integration="full" keeps PaliGemma's choices (final norm, one Linear); select_layer=-2 and
    projector='mlp2x_gelu' give LLaVA-1.5's, entering the decoder as projected."""
    model = _vlm('llama')
    assert (model.select_layer, model.projector_type) == ('final_norm', 'linear')
    assert type(model.projector) is torch.nn.Linear
    llava = build_vlm('diffclip-tiny', _lm('llama'), select_layer=-2, projector='mlp2x_gelu').eval()
    assert [type(m) for m in llava.projector] == [torch.nn.Linear, torch.nn.GELU, torch.nn.Linear]
    pixels, ids = _pixels(llava, 1), _ids(1, 4)
    trunk = llava.vision.tower
    x = trunk.norm_pre(trunk._pos_embed(trunk.patch_embed(pixels)))
    for block in trunk.blocks[:-1]:
        x = block(x)
    first, last = llava.projector[0], llava.projector[2]
    expected = last(torch.nn.functional.gelu(first(x[:, 1:])))  # (1, P, D): the penultimate block, projected
    seen = {}
    layer = llava.language_model.model.layers[0]
    handle = layer.register_forward_pre_hook(lambda m, args, kw: seen.update(h=kw.get('hidden_states', args[0] if args else None)),
                                             with_kwargs=True)
    llava(pixels, ids)
    handle.remove()
    torch.testing.assert_close(seen['h'][:, :expected.shape[1]], expected)


def test_a_tower_without_blocks_takes_only_its_final_features():
    import timm
    cnn = timm.create_model('resnet10t', num_classes=0)
    assert build_vision_tokens(cnn).select_layer == 'final_norm'
    with pytest.raises(ValueError, match=r"select_layer=-2: ResNet has no transformer blocks .*select_layer='final_norm'"):
        build_vision_tokens(cnn, -2)


@pytest.mark.parametrize('family', ['gemma', 'llama'])
def test_image_tokens_enter_the_decoder_as_projected_and_text_with_the_lms_own_scale(family):
    """PaliGemma's numerics: Gemma's √D multiplies text embeddings only, never the image tokens."""
    model = _vlm(family)
    pixels, ids = _pixels(model, 1), _ids(1, 4)
    seen = {}
    layer = model.language_model.model.layers[0]
    handle = layer.register_forward_pre_hook(lambda m, args, kw: seen.update(h=kw.get('hidden_states', args[0] if args else None)),
                                             with_kwargs=True)
    model(pixels, ids)
    handle.remove()
    P = seen['h'].shape[1] - ids.shape[1]
    torch.testing.assert_close(seen['h'][:, :P], model.projector(model.vision(pixels)))
    text = model.language_model.get_input_embeddings()(ids)
    torch.testing.assert_close(seen['h'][:, P:], text)
    if family == 'gemma':  # the embedding module carries √D
        plain = torch.nn.functional.embedding(ids, model.language_model.get_input_embeddings().weight)
        torch.testing.assert_close(text, plain * 32 ** 0.5)


def test_prompt_tokens_see_later_prompt_tokens_but_not_the_answer():
    model = _vlm('llama')
    pixels, ids = _pixels(model, 1), _ids(1, 6)
    prefix = torch.tensor([[1, 1, 1, 0, 0, 0]])
    base = model(pixels, ids, prefix_mask=prefix).logits
    later_prompt = ids.clone()
    later_prompt[0, 2] = (ids[0, 2] + 1) % VOCAB
    changed = model(pixels, later_prompt, prefix_mask=prefix).logits
    P = base.shape[1] - ids.shape[1]
    assert not torch.allclose(changed[:, P], base[:, P])  # prompt token 0 reads prompt token 2
    answer = ids.clone()
    answer[0, 4] = (ids[0, 4] + 1) % VOCAB
    changed = model(pixels, answer, prefix_mask=prefix).logits
    torch.testing.assert_close(changed[:, :P + 4], base[:, :P + 4])  # nothing before it reads answer token 4
    assert not torch.allclose(changed[:, P + 5], base[:, P + 5])


@pytest.mark.parametrize('family', ['gemma', 'llama'])
def test_training_loss_counts_answer_tokens_and_reaches_every_part(family):
    model = _vlm(family).train()
    differentialize(model.language_model, variant='duplicate')
    pixels, ids = _pixels(model), _ids(2, 6)
    labels = ids.clone()
    labels[:, :3] = -100  # prompt not scored
    out = model(pixels, ids, prefix_mask=(labels == -100).long(), labels=labels)
    assert out.loss.ndim == 0 and torch.isfinite(out.loss)
    out.loss.backward()
    assert model.projector.weight.grad.abs().sum() > 0
    assert model.language_model.model.layers[0].self_attn.lambda_q1.grad.abs().sum() > 0
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.vision.parameters())


@pytest.mark.parametrize('differential', [False, True])
def test_generation_with_cache_equals_without_and_padding_changes_nothing(differential):
    model = _vlm('gemma')
    if differential:
        differentialize(model.language_model, variant='split')
    pixels = _pixels(model)
    ids = _ids(2, 5)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])  # the second prompt is 3 tokens, right-padded
    cached = model.generate(pixels, ids, mask, max_new_tokens=5)
    uncached = model.generate(pixels, ids, mask, max_new_tokens=5, use_cache=False)
    assert torch.equal(cached, uncached)
    alone = model.generate(pixels[1:], ids[1:, :3], max_new_tokens=5)
    assert torch.equal(cached[1:], alone)


def test_recipes_offer_exactly_the_projectors_the_model_builds():
    """diffzoo.vlm.options (torch-free, what recipes check) names the projectors model.py builds."""
    assert tuple(PROJECTORS) == PROJECTOR_NAMES
