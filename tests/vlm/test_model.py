import pytest
import torch

from diffzoo.vlm import build_vlm, differentialize
from diffzoo.vlm.model import build_vision_tokens, prefix_lm_mask
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
