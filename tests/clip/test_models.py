import json
import re
from importlib import resources

import open_clip
import pytest
import torch

from diffzoo.clip import DiffTextTransformer
from diffzoo.clip.text_tower import is_exactly_causal
from diffzoo.layers import DifferentialAttention

SIZES = ['tiny', 'b16', 'b32', 'l14']
NAMES = [n.format(s) for s in SIZES
         for n in ('diffclip-{}', 'diffclip-{}-vision', 'diffclip-{}-dynamic', 'clip-{}-baseline')]


def _n(module):
    return sum(p.numel() for p in module.parameters())


def _diff_layers(module):
    return [m for m in module.modules() if isinstance(m, DifferentialAttention)]


def test_configs_are_listed_and_ship_with_the_package():
    shipped = {p.name[:-5] for p in (resources.files('diffzoo') / 'model_configs').iterdir() if p.name.endswith('.json')}
    converted = {'ViT-B-16-diffzoo-duplicate'}  # open_clip's ViT-B-16 converted as built (tests/test_differential.py)
    assert shipped == set(NAMES) | converted
    assert set(NAMES) | converted <= set(open_clip.list_models())


def test_config_shows_where_variant_and_lambda_are_set():
    cfg = open_clip.get_model_config('diffclip-b16-dynamic')
    assert cfg['vision_cfg']['timm_model_name'] == 'vit_diff_dynamic_base_patch16_224'
    assert cfg['text_cfg']['diffzoo'] == {'variant': 'split', 'lambda_init': 'depth'}
    assert 'diffzoo' not in open_clip.get_model_config('diffclip-b16-vision')['text_cfg']


@pytest.mark.parametrize('name', NAMES)
def test_create_encode_backward(name):
    """Every model builds, encodes both towers and trains; all but the tiny ones on the meta device (shapes and
    gradient flow: their numerics are the tiny models' code at other sizes, and B/16's are checked against the
    official model in test_official_checkpoint.py)."""
    device = torch.device('cpu' if '-tiny' in name else 'meta')
    with device:
        model, preprocess_train, preprocess_val = open_clip.create_model_and_transforms(name, device=device)
    tokenizer = open_clip.get_tokenizer(name)
    size = model.visual.image_size
    images = torch.randn(2, 3, *size, device=device)
    text = tokenizer(['a small red circle left of a blue square', 'a photo of a dog']).to(device)
    image_features, text_features, logit_scale = model(images, text)
    assert image_features.shape == text_features.shape == (2, model.text_projection.shape[1])
    loss = open_clip.ClipLoss()(image_features, text_features, logit_scale)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)

    visual, text_tower = _diff_layers(model.visual), _diff_layers(model.transformer)
    if name.startswith('clip-'):
        assert not visual and not text_tower
    else:
        assert visual and all(a.variant == 'split' for a in visual)
        assert bool(text_tower) == (not name.endswith('-vision'))
        lams = [a.lambda_init for a in visual + text_tower]
        assert (lams[0] == pytest.approx(0.2)) if name.endswith('-dynamic') else set(lams) == {0.8}


def test_diffclip_b16_is_the_official_architecture():
    model = open_clip.create_model('diffclip-b16')
    assert _n(model) == 149_629_185
    blocks = model.transformer.resblocks
    assert len(blocks) == 12 and blocks[0].attn.num_heads == 4 and blocks[0].attn.head_dim == 64
    assert isinstance(blocks[0].mlp.gelu, open_clip.transformer.QuickGELU)
    assert model.text_projection.shape == (512, 512) and model.context_length == 77
    assert model.vocab_size == 49408 and model.text_pool_type == 'argmax'
    assert model.attn_mask.shape == (77, 77) and torch.isinf(model.attn_mask[0, 1])
    head = model.visual.head.proj
    assert head.weight.shape == (512, 768) and head.bias is None


@pytest.mark.parametrize('size', SIZES)
def test_twins_differ_only_by_attention_parameters(size):
    # counting needs shapes only: built on the meta device, without allocating or initialising weights
    with torch.device('meta'):
        models = {n: open_clip.create_model(n.format(size), device='meta')
                  for n in ('diffclip-{}', 'diffclip-{}-vision', 'diffclip-{}-dynamic', 'clip-{}-baseline')}
    counts = {n: _n(m) for n, m in models.items()}
    base = counts['clip-{}-baseline']
    diff = counts['diffclip-{}']
    assert counts['diffclip-{}-dynamic'] == diff
    assert base < counts['diffclip-{}-vision'] < diff
    model = models['diffclip-{}']
    assert next(model.parameters()).is_meta
    extra = sum(a.lambda_q1.numel() * 4 + a.sub_norm.weight.numel() for a in _diff_layers(model))
    assert diff - base == extra


def test_text_tower_is_open_clips_text_transformer():
    model = open_clip.create_model('diffclip-tiny', force_custom_text=True)
    assert isinstance(model.text, DiffTextTransformer)
    assert isinstance(model.text, open_clip.transformer.TextTransformer)
    text = open_clip.get_tokenizer('diffclip-tiny')(['a blue square'])
    out = model.text.forward_intermediates(text, indices=2, output_fmt='NLC')
    assert len(out['text_intermediates']) == 2
    torch.testing.assert_close(out['text_features'], model.encode_text(text))


def test_grad_checkpointing_in_both_towers():
    model = open_clip.create_model('diffclip-tiny')
    images = torch.randn(2, 3, 64, 64)
    text = open_clip.get_tokenizer('diffclip-tiny')(['a red circle', 'a green triangle'])

    def grads(enable):
        model.zero_grad()
        model.set_grad_checkpointing(enable)
        loss = open_clip.ClipLoss()(*model(images, text))
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    loss_a, grads_a = grads(False)
    loss_b, grads_b = grads(True)
    torch.testing.assert_close(loss_a, loss_b)
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_bf16_precision_runs():
    model = open_clip.create_model('diffclip-tiny', precision='bf16')
    text = open_clip.get_tokenizer('diffclip-tiny')(['a red circle'])
    with torch.autocast('cpu', dtype=torch.bfloat16):
        feats = model.encode_text(text), model.encode_image(torch.randn(1, 3, 64, 64))
    assert all(torch.isfinite(f).all() for f in feats)


def test_training_checkpoint_round_trip(tmp_path):
    """A checkpoint as open_clip_train writes it: {'epoch', 'name', 'state_dict' (DDP prefix), 'optimizer'}."""
    model = open_clip.create_model('diffclip-tiny-dynamic')
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = open_clip.ClipLoss()(*model(torch.randn(2, 3, 64, 64),
                                        open_clip.get_tokenizer('diffclip-tiny')(['a', 'b'])))
    loss.backward()
    opt.step()
    path = tmp_path / 'epoch_1.pt'
    torch.save({'epoch': 1, 'name': 'run', 'optimizer': opt.state_dict(),
                'state_dict': {f'module.{k}': v for k, v in model.state_dict().items()}}, path)
    loaded = open_clip.create_model('diffclip-tiny-dynamic', pretrained=str(path))
    for (k, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        torch.testing.assert_close(a, b, msg=k)


def test_checkpoint_for_another_architecture_lists_first_keys(tmp_path):
    path = tmp_path / 'baseline.pt'
    torch.save({'state_dict': open_clip.create_model('clip-tiny-baseline').state_dict()}, path)
    with pytest.raises(ValueError, match=r'missing keys \[.*lambda_k1.*unexpected keys \[.*in_proj'):
        open_clip.create_model('diffclip-tiny', pretrained=str(path))
    with pytest.raises(ValueError, match='not a checkpoint for this CLIP'):
        open_clip.create_model('diffclip-b32', pretrained=str(path))


def test_unknown_model_name_is_open_clips_error():
    with pytest.raises(RuntimeError, match='not found'):
        open_clip.create_model('diffclip-b17')


def test_odd_text_heads_are_refused_with_the_count(tmp_path):
    cfg = open_clip.get_model_config('diffclip-tiny')
    cfg['text_cfg']['heads'] = 5
    cfg['text_cfg']['width'] = 120
    (tmp_path / 'diffclip-odd.json').write_text(json.dumps(cfg))
    open_clip.add_model_config(tmp_path)
    with pytest.raises(ValueError, match='heads=5'):
        open_clip.create_model('diffclip-odd')


@pytest.mark.parametrize('lambda_init', [1.0, -0.2, float('inf'), True, 'layer'], ids=repr)
def test_text_cfg_lambda_init_outside_zero_one_is_refused(tmp_path, lambda_init):
    cfg = open_clip.get_model_config('diffclip-tiny')
    cfg['text_cfg']['diffzoo']['lambda_init'] = lambda_init
    name = f'diffclip-bad-lambda-{lambda_init}'.lower()
    (tmp_path / f'{name}.json').write_text(json.dumps(cfg))  # JSON's Infinity, as a user might write it
    open_clip.add_model_config(tmp_path)
    with pytest.raises(ValueError, match=rf"lambda_init={re.escape(repr(lambda_init))}: expected a number in \[0, 1\)"):
        open_clip.create_model(name)


@pytest.mark.parametrize('force_custom_text', [False, True])
def test_causal_text_tower_attends_with_is_causal(force_custom_text):
    """open_clip hands the text tower its (L, L) causal mask; the blocks attend with is_causal
    instead, and the features equal those computed with open_clip's additive mask."""
    model = open_clip.create_model('diffclip-tiny', force_custom_text=force_custom_text)
    tower = model.text.transformer if force_custom_text else model.transformer
    calls = []
    hooks = [a.register_forward_pre_hook(lambda m, args, kw: calls.append(kw), with_kwargs=True)
             for a in _diff_layers(tower)]
    text = open_clip.get_tokenizer('diffclip-tiny')(['a red circle', 'two blue squares left of a dog'])
    features = model.encode_text(text)
    assert len(calls) == 4 and all(kw['attn_mask'] is None and kw['is_causal'] for kw in calls)
    for h in hooks:
        h.remove()
    tower.is_causal = False  # open_clip's additive causal mask reaches every block
    for block in tower.resblocks:
        block.is_causal = False
    torch.testing.assert_close(features, model.encode_text(text), rtol=1e-5, atol=1e-6)


def test_a_mask_that_is_not_exactly_causal_reaches_the_blocks():
    """Only an exactly causal (L, L) mask becomes is_causal; a banded one is applied as given."""
    model = open_clip.create_model('diffclip-tiny')
    tower = model.transformer
    L, width = model.context_length, tower.width
    x = torch.randn(2, L, width)
    causal = torch.full((L, L), float('-inf')).triu_(1)
    banded = causal.clone()
    banded[torch.ones(L, L, dtype=torch.bool).tril_(-3)] = float('-inf')  # each token sees the last 3
    assert is_exactly_causal(causal) and not is_exactly_causal(banded)
    calls = []
    hooks = [a.register_forward_pre_hook(lambda m, args, kw: calls.append(kw), with_kwargs=True)
             for a in _diff_layers(tower)]
    out = tower(x, attn_mask=banded)
    for h in hooks:
        h.remove()
    assert all(kw['attn_mask'] is banded and not kw['is_causal'] for kw in calls)
    assert not torch.allclose(out, tower(x, attn_mask=causal), atol=1e-3)  # the band took effect
    # the verdict is kept per mask and version: the same mask changed in place is looked at again
    mask = causal.clone()
    calls.clear()
    hooks = [a.register_forward_pre_hook(lambda m, args, kw: calls.append(kw), with_kwargs=True)
             for a in _diff_layers(tower)]
    tower(x, attn_mask=mask)
    mask[torch.ones(L, L, dtype=torch.bool).tril_(-3)] = float('-inf')
    tower(x, attn_mask=mask)
    for h in hooks:
        h.remove()
    half = len(calls) // 2
    assert all(kw['attn_mask'] is None and kw['is_causal'] for kw in calls[:half])
    assert all(kw['attn_mask'] is mask and not kw['is_causal'] for kw in calls[half:])
