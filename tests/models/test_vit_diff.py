import re
import warnings

import pytest
import timm
import torch
import torch.nn as nn

from diffzoo.layers import DifferentialAttention, diff_attn_layer

ATTN = {  # model family → its λ_init policy, None for ordinary attention
    'vit_diff': 0.8,
    'vit_diff_dynamic': 'depth',
    'vit_diff_baseline': None,
}
ARCHS = {  # size → (img_size, patch_size, embed_dim, depth, baseline heads, differential heads)
    'micro_patch8_64': (64, 8, 128, 4, 4, 2),
    'tiny_patch16_224': (224, 16, 192, 12, 3, 3),
    'small_patch16_224': (224, 16, 384, 12, 6, 3),
    'base_patch16_224': (224, 16, 768, 12, 12, 6),
    'base_patch32_224': (224, 32, 768, 12, 12, 6),
    'large_patch14_224': (224, 14, 1024, 24, 16, 8),
}
NAMES = [f'{family}_{arch}' for family in ATTN for arch in ARCHS] + ['diff_vit_base_patch16_224']  # + the alias
SMALL = ['vit_diff_micro_patch8_64', 'vit_diff_dynamic_micro_patch8_64', 'vit_diff_baseline_micro_patch8_64']


def _input(model, batch=1):
    return torch.randn(batch, *model.pretrained_cfg['input_size'])


def test_every_name_is_registered_with_timm():
    listed = set(timm.list_models('*diff*'))
    assert set(NAMES) - {'diff_vit_base_patch16_224'} == listed  # the alias is a timm deprecation, not listed
    assert timm.list_modules() and 'vit_diff' in timm.list_modules()
    assert timm.list_pretrained('vit_diff*') == [
        'vit_diff_base_patch16_224.diffclip_cc3m', 'vit_diff_base_patch16_224.diffclip_cc12m']
    with pytest.warns(UserWarning, match='diff_vit_base_patch16_224 to current vit_diff_base_patch16_224'):
        assert timm.create_model('diff_vit_base_patch16_224', num_classes=0).embed_dim == 768


def _device(name) -> torch.device:
    """Base and large models run on the meta device: shapes and gradient flow (their numerics are the small
    models' code at other sizes; B/16's are checked against the official model)."""
    return torch.device('meta' if '_base_' in name or '_large_' in name else 'cpu')


@pytest.mark.parametrize('name', NAMES)
def test_build_forward_backward(name):
    with _device(name):
        model = timm.create_model(name, num_classes=0)
    family = next(f for f in sorted(ATTN, key=len, reverse=True) if name.startswith(f + '_')) \
        if not name.startswith('diff_vit') else 'vit_diff'
    attns = [blk.attn for blk in model.blocks]
    if ATTN[family] is None:
        assert not any(isinstance(a, DifferentialAttention) for a in attns)
    else:
        assert all(isinstance(a, DifferentialAttention) for a in attns)
        expected = [0.8] * len(attns) if ATTN[family] == 0.8 else [0.8 - 0.6 * torch.exp(torch.tensor(-0.3 * i)).item() for i in range(len(attns))]
        assert [a.lambda_init for a in attns] == pytest.approx(expected)
    x = _input(model).to(_device(name))
    out = model(x)
    assert out.shape == (1, model.embed_dim)
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize('family', list(ATTN))
@pytest.mark.parametrize('arch', list(ARCHS))
def test_each_entrypoint_builds_its_geometry(family, arch):
    """Every entrypoint's model_args: image and patch size, width, depth, and half the baseline's heads in
    differential models (ViT-Ti keeps 3); the layout's LayerNorm eps 1e-5 and λ_init policy in every one."""
    img_size, patch_size, embed_dim, depth, baseline_heads, diff_heads = ARCHS[arch]
    with torch.device('meta'):
        model = timm.create_model(f'{family}_{arch}', num_classes=0)
    assert model.patch_embed.img_size == (img_size, img_size)
    assert model.patch_embed.patch_size == (patch_size, patch_size)
    assert model.embed_dim == embed_dim and len(model.blocks) == depth and model.norm.eps == 1e-5
    heads = {blk.attn.num_heads for blk in model.blocks}
    assert heads == {baseline_heads if ATTN[family] is None else diff_heads}
    assert {getattr(blk.attn, 'lambda_init_policy', None) for blk in model.blocks} == {ATTN[family]}
    assert model.pretrained_cfg['input_size'] == (3, img_size, img_size)


@pytest.mark.parametrize('kwargs', [dict(lambda_init=0.5), dict(variant='v2'), dict(lambda_init=0.5, variant='v2')])
def test_baseline_refuses_differential_arguments_naming_the_model_and_its_twins(kwargs):
    """The baseline has ordinary attention: lambda_init and variant would have no effect, so they are refused."""
    names = ' or '.join(kwargs)
    with pytest.raises(ValueError) as error:
        timm.create_model('vit_diff_baseline_micro_patch8_64', **kwargs)
    assert str(error.value) == (
        f'vit_diff_baseline_micro_patch8_64 has ordinary attention and takes no {names}: leave '
        f'{"it" if len(kwargs) == 1 else "them"} out, or build a differential model (vit_diff_micro_patch8_64, '
        f'vit_diff_dynamic_micro_patch8_64)')


def test_base_patch16_is_diffclip_vision_tower():
    with torch.device('meta'):  # structure and parameter counts only
        model = timm.create_model('vit_diff_base_patch16_224', num_classes=0)
        baseline = timm.create_model('vit_diff_baseline_base_patch16_224', num_classes=0)
    assert model.has_class_token and model.global_pool == 'token'
    assert isinstance(model.norm_pre, nn.Identity) and isinstance(model.fc_norm, nn.Identity)
    assert model.patch_embed.proj.bias is not None
    blk = model.blocks[0]
    assert blk.attn.num_heads == 6 and blk.attn.head_dim == 64
    assert blk.attn.qkv.bias is not None and blk.attn.proj.bias is not None
    assert blk.attn.sub_norm.weight.shape == (128,) and blk.attn.sub_norm.eps == 1e-5
    assert isinstance(blk.mlp.act, nn.GELU) and blk.mlp.act.approximate == 'none'
    for norm in (blk.norm1, blk.norm2, model.norm):
        assert norm.eps == 1e-5
    assert all(b.attn.lambda_init == 0.8 for b in model.blocks)
    n = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert n(model) - n(baseline) == 12 * (4 * 64 + 128)  # λ vectors + sub-norm per block
    assert baseline.blocks[0].attn.num_heads == 12


@pytest.mark.parametrize('variant', ['split', 'duplicate', 'v2'])
@pytest.mark.parametrize('lambda_init', [0.5, 'depth'])
def test_kwargs_choose_variant_and_lambda(variant, lambda_init):
    model = timm.create_model('vit_diff_micro_patch8_64', variant=variant, lambda_init=lambda_init)
    assert {b.attn.variant for b in model.blocks} == {variant}
    if lambda_init == 0.5:
        assert {b.attn.lambda_init for b in model.blocks} == {0.5}
    else:
        assert model.blocks[0].attn.lambda_init == pytest.approx(0.2)
    assert model(_input(model, 2)).shape == (2, 1000)


@pytest.mark.parametrize('lambda_init', [1.0, 2.0, -0.5, float('nan'), True, 'layer'], ids=repr)
def test_lambda_init_outside_zero_one_is_refused_through_timm(lambda_init):
    with pytest.raises(ValueError, match=rf"lambda_init={re.escape(repr(lambda_init))}: expected a number in \[0, 1\)"):
        timm.create_model('vit_diff_micro_patch8_64', lambda_init=lambda_init)


@pytest.mark.parametrize('variant', ['split', 'duplicate', 'v2'])
def test_an_empty_batch_gives_empty_logits(variant):
    model = timm.create_model('vit_diff_micro_patch8_64', variant=variant)
    out = model(_input(model, 0))
    assert out.shape == (0, 1000)
    out.sum().backward()


@pytest.mark.parametrize('name', SMALL)
def test_timm_features_intermediates_and_checkpointing(name):
    model = timm.create_model(name, num_classes=0).eval()
    x = _input(model, 2)
    final, inter = model.forward_intermediates(x, indices=[1, 3])
    assert len(inter) == 2 and inter[0].shape == (2, model.embed_dim, 8, 8)
    torch.testing.assert_close(model.forward_head(final), model(x))
    model.set_grad_checkpointing(True)
    model.train()
    out = model(x)
    out.sum().backward()
    torch.testing.assert_close(out, model.eval()(x))
    feats = timm.create_model(name, features_only=True, out_indices=(1, 3))
    assert [f.shape for f in feats(x)] == [(2, model.embed_dim, 8, 8)] * 2


@pytest.mark.parametrize('variant', ['split', 'duplicate', 'v2'])
@pytest.mark.parametrize('family', ['vit_diff', 'vit_diff_dynamic'])  # λ_init 0.8 and 'depth'
def test_scripting_and_fx_feature_extraction_as_timm_does(family, variant):
    """timm's tracing routes on each variant and λ_init form: torch.jit.script under
    set_scriptable, an fx feature extractor (timm's create_feature_extractor with its notrace
    lists) equal to eager bit for bit in eval, a backward through it in train reaching every
    parameter, and the fx graph scripted."""
    name = f'{family}_micro_patch8_64'
    with timm.layers.set_layer_config(scriptable=True):
        model = timm.create_model(name, variant=variant, num_classes=7).eval()
    x = _input(model, 2)
    with torch.no_grad():
        eager = model(x)
        torch.testing.assert_close(torch.jit.script(model)(x), eager, rtol=1e-5, atol=1e-5)
    nodes = {'blocks.1': 'block1', 'head': 'logits'}
    extractor = timm.models.create_feature_extractor(model, return_nodes=nodes)
    with torch.no_grad():
        features = extractor(x)
        assert torch.equal(features['logits'], eager)
        assert torch.equal(features['block1'], model.blocks[:2](model.norm_pre(model._pos_embed(model.patch_embed(x)))))
        torch.testing.assert_close(torch.jit.script(extractor)(x)['logits'], eager, rtol=1e-5, atol=1e-5)
    model.train()
    extractor = timm.models.create_feature_extractor(model, return_nodes=nodes)
    extractor(x)['logits'].square().mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in extractor.parameters())


def test_pretrained_without_weights_is_an_error_not_silence():
    with pytest.raises(ValueError, match='open_clip'):
        timm.create_model('vit_diff_small_patch16_224', pretrained=True)


def test_head_count_that_cannot_pair_names_the_model():
    with pytest.raises(ValueError, match=r'vit_diff_micro_patch8_64: num_heads=3'):
        timm.create_model('vit_diff_micro_patch8_64', num_heads=3)


def test_v2_lambda_projection_keeps_its_init_through_timm_init():
    """timm's ViT init (trunc-normal 0.02 on every Linear) does not overwrite W_λ: unilm's nn.Linear
    init by default, zero weight and bias with attn_layer=diff_attn_layer('v2', …, 'zeros')."""
    model = timm.create_model('vit_diff_micro_patch8_64', variant='v2')
    bound = model.embed_dim ** -0.5  # nn.Linear's kaiming_uniform(a=√5): U(−1/√fan_in, 1/√fan_in)
    for blk in model.blocks:
        w = blk.attn.lambda_proj.weight
        assert blk.attn.lambda_proj.bias is None
        assert w.abs().max() <= bound and w.std().item() == pytest.approx(bound / 3 ** 0.5, rel=0.2)
        assert blk.attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.2)
    zeros = timm.create_model('vit_diff_micro_patch8_64', attn_layer=diff_attn_layer('v2', 0.8, 'zeros'))
    for blk in zeros.blocks:
        assert blk.attn.lambda_proj.weight.abs().sum() == 0 and blk.attn.lambda_proj.bias.abs().sum() == 0


@pytest.mark.parametrize('name', timm.list_models('vit_diff*'))
def test_timm_model_cases_hold_for_every_registered_name(name):
    """What timm's own tests/test_models.py checks of a ViT (non-standard, token-output) model: the
    default cfg names real parameters, forward_features ends in num_features, a reset or absent
    classifier gives pooled (B, num_features); small models also train with every parameter reached."""
    with torch.device('cpu' if name in SMALL else 'meta'):  # the others: names of parameters only
        model = timm.create_model(name).eval()
    cfg, state = model.pretrained_cfg, model.state_dict()
    for key in ('input_size', 'crop_pct', 'interpolation', 'mean', 'std', 'first_conv', 'classifier', 'num_classes'):
        assert cfg.get(key) is not None, key
    assert cfg['first_conv'] + '.weight' in state and cfg['classifier'] + '.weight' in state
    if name not in SMALL:
        return  # the remaining checks build full-size forwards: covered by the micro geometry of each family
    x = _input(model, 1)
    assert model.forward_features(x).shape[-1] == model.num_features
    model.reset_classifier(0)
    assert model(x).shape == (1, model.num_features)
    assert timm.create_model(name, num_classes=0)(x).shape == (1, model.num_features)
    model = timm.create_model(name, num_classes=42).train()
    out = model(_input(model, 2))
    out.mean().backward()
    assert out.shape == (2, 42) and not torch.isnan(out).any()
    assert all(p.grad is not None for p in model.parameters())


@pytest.fixture(scope='module')
def official_clip(official):
    """open_clip's DiffCLIP ViT-B/16 with `official`'s weights, in eval mode: the reference of the tests below."""
    import open_clip
    return open_clip.create_model('diffclip-b16', pretrained=str(official.path)).eval()


@pytest.mark.slow
def test_diffclip_tags_load_the_official_vision_tower_through_the_hub_cache_offline(official, official_clip,
                                                                                    offline_hub):
    """timm's pretrained route (as its test_model_load_pretrained calls it) on an offline copy of the
    official repo: the tower with its projection as the head equals open_clip's DiffCLIP image encoder."""
    offline_hub('hammh0a/DiffCLIP_ViTB16_CC3M', official.path)
    tower = timm.create_model('vit_diff_base_patch16_224.diffclip_cc3m', pretrained=True).eval()
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        a, b = tower(x), official_clip.encode_image(x)
    assert a.shape == (2, 512) and ((a - b).norm() / b.norm()).item() < 1e-5
    assert tower.pretrained_cfg['mean'] == (0.485, 0.456, 0.406) and tower.pretrained_cfg['interpolation'] == 'bilinear'
    timm.create_model('vit_diff_base_patch16_224.diffclip_cc3m', pretrained=True, in_chans=1, num_classes=5)
    timm.create_model('vit_diff_base_patch16_224.diffclip_cc3m', pretrained=True, in_chans=1, num_classes=0)


@pytest.fixture(scope='module')
def converted(official, tmp_path_factory):
    """`official` as diffzoo.convert writes it, open_clip's layout in safetensors; read-only."""
    from diffzoo.clip.hub import official_diffclip
    path = tmp_path_factory.mktemp('converted') / 'diffclip.safetensors'
    official_diffclip(official.path, path)
    return path


@pytest.mark.slow
@pytest.mark.parametrize('route', ['pretrained_cfg_overlay', 'checkpoint_path'])
@pytest.mark.parametrize('layout', ['official', 'open_clip'])
def test_a_local_file_fine_tunes_with_a_new_head(request, official, official_clip, layout, route):
    """pretrained_cfg_overlay=dict(file=…) or checkpoint_path=: the official checkpoint or diffzoo.convert's
    safetensors; the trunk loads, the head is new (10 classes)."""
    path = official.path if layout == 'official' else request.getfixturevalue('converted')
    if route == 'checkpoint_path':
        with pytest.warns(UserWarning, match='has a 512-class head, this model num_classes=10'):
            model = timm.create_model('vit_diff_base_patch16_224', num_classes=10, checkpoint_path=str(path)).eval()
    else:
        model = timm.create_model('vit_diff_base_patch16_224', pretrained=True, num_classes=10,
                                  pretrained_cfg_overlay=dict(file=str(path))).eval()
    trunk = official_clip.visual.trunk
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        torch.testing.assert_close(model.forward_features(x), trunk.forward_features(x))
    assert model.head.weight.shape == (10, 768)


@pytest.fixture
def head_512(tmp_path):
    """vit_diff_micro_patch8_64 with a 512-class head, saved as timm saves weights (.pth) and as safetensors."""
    from safetensors.torch import save_file
    model = timm.create_model('vit_diff_micro_patch8_64', num_classes=512).eval()
    torch.save(model.state_dict(), tmp_path / 'model.pth')
    save_file(model.state_dict(), tmp_path / 'model.safetensors')
    return model, tmp_path


@pytest.mark.parametrize('suffix', ['pth', 'safetensors'])
def test_checkpoint_path_loads_the_same_model(head_512, suffix):
    saved, folder = head_512
    model = timm.create_model('vit_diff_micro_patch8_64', num_classes=512, checkpoint_path=str(folder / f'model.{suffix}'))
    x = _input(model, 2)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(x), saved(x), rtol=0, atol=0)


@pytest.mark.parametrize('suffix', ['pth', 'safetensors'])
@pytest.mark.parametrize('num_classes', [10, 0])
def test_checkpoint_path_with_another_head_loads_the_trunk_with_a_new_head(head_512, suffix, num_classes):
    """checkpoint_path= with another num_classes: the trunk loads, the head is new (one warning naming both
    counts), as pretrained_cfg_overlay=dict(file=…) gives; load_state_dict itself stays strict."""
    saved, folder = head_512
    path = str(folder / f'model.{suffix}')
    head = 'the head is new' if num_classes else 'the model has no head'
    torch.manual_seed(0)
    with pytest.warns(UserWarning) as caught:
        model = timm.create_model('vit_diff_micro_patch8_64', num_classes=num_classes, checkpoint_path=path).eval()
    assert [str(w.message) for w in caught] == [
        f'vit_diff_micro_patch8_64: checkpoint_path={path} has a 512-class head, this model num_classes={num_classes}: '
        f'the trunk is loaded and {head}. To resume or evaluate the saved model, pass num_classes=512']
    assert caught[0].filename == __file__  # points at the create_model call
    torch.manual_seed(0)
    fresh = timm.create_model('vit_diff_micro_patch8_64', num_classes=num_classes)  # the same initialisation
    overlay = timm.create_model('vit_diff_micro_patch8_64', pretrained=True, num_classes=num_classes,
                                pretrained_cfg_overlay=dict(file=path)).eval()
    x = _input(model, 2)
    with torch.no_grad():
        torch.testing.assert_close(model.forward_features(x), saved.forward_features(x), rtol=0, atol=0)
        torch.testing.assert_close(overlay.forward_features(x), saved.forward_features(x), rtol=0, atol=0)
        assert model(x).shape == ((2, num_classes) if num_classes else (2, 128))
    if num_classes:  # a new head: timm's initialisation, not the checkpoint's rows
        torch.testing.assert_close(model.head.weight, fresh.head.weight, rtol=0, atol=0)
    want = (f'to fine-tune the checkpoint with a new {num_classes}-class head' if num_classes else
            "to take the checkpoint's trunk without a head")
    with pytest.raises(RuntimeError) as error:
        fresh.load_state_dict(saved.state_dict())
    assert str(error.value) == (
        f"vit_diff_micro_patch8_64: the checkpoint's head has 512 classes (head.weight (512, 128)), this model "
        f"num_classes={num_classes}. load_state_dict loads the same model (to resume or evaluate it): build it "
        f"with num_classes=512; {want}, use timm.create_model('vit_diff_micro_patch8_64', "
        f"num_classes={num_classes}, checkpoint_path=CHECKPOINT) or pretrained=True, "
        f"pretrained_cfg_overlay=dict(file=CHECKPOINT)")


def test_checkpoint_path_in_the_open_clip_layout_loads_the_trunk(tmp_path):
    """diffclip-tiny's state dict (its vision trunk under visual.trunk.*, the image projection as the head):
    checkpoint_path= converts it as pretrained_cfg_overlay does; load_state_dict refuses it naming both."""
    import open_clip
    clip = open_clip.create_model('diffclip-tiny').eval()
    path = tmp_path / 'diffclip-tiny.pt'
    torch.save(clip.state_dict(), path)
    with warnings.catch_warnings():
        warnings.simplefilter('error')  # the projection fits num_classes=128: no new head, no warning
        model = timm.create_model('vit_diff_micro_patch8_64', num_classes=128, checkpoint_path=str(path)).eval()
    x = _input(model, 2)
    with torch.no_grad():
        torch.testing.assert_close(model(x), clip.encode_image(x), rtol=0, atol=1e-6)
    with pytest.raises(RuntimeError, match=re.escape(
            "vit_diff_micro_patch8_64: the checkpoint is in the open_clip ('visual.trunk.*') layout (keys ")) as error:
        timm.create_model('vit_diff_micro_patch8_64', num_classes=128).load_state_dict(clip.state_dict())
    assert ("Load it with timm.create_model('vit_diff_micro_patch8_64', num_classes=128, checkpoint_path=CHECKPOINT) "
            "or pretrained=True, pretrained_cfg_overlay=dict(file=CHECKPOINT)") in str(error.value)
    clip.load_state_dict(torch.load(path, weights_only=True))  # strict load of the whole CLIP: the trunk's hook stays out


def test_checkpoint_path_of_another_timm_model_keeps_timms_strict_load(head_512):
    """The filter is given to vit_diff_* models only: timm's own models load checkpoint_path= as timm does."""
    _, folder = head_512
    with pytest.raises(RuntimeError, match='Error.s. in loading state_dict for VisionTransformer'):
        timm.create_model('vit_tiny_patch16_224', num_classes=10, checkpoint_path=str(folder / 'model.pth'))
