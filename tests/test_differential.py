"""`diffzoo.differentialize` on real timm and open_clip models with random weights: the converted weights and
heads against an independent fp64 computation from the source layer, every family forward/backward/
TorchScript/FX, the settings saved with the weights, the open_clip configuration and loader seams."""
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy
import open_clip
import pytest
import timm
import torch
import torch.nn.functional as F
from timm.models import create_feature_extractor, get_graph_node_names
from timm.models.eva import Eva

import diffzoo
from diffzoo.differential import NotConvertible, load_converted, settings_of
from diffzoo.layers import DifferentialAttention, capture_attention_maps
from diffzoo.layers.pretrained import PretrainedDifferentialAttention

ROOT = Path(__file__).resolve().parent.parent

VARIANTS = [('duplicate', None), ('split', 'adjacent'), ('split', 'halves'), ('v2', None)]
TINY = dict(img_size=32, depth=2, embed_dim=64, num_heads=4)
OPEN_CLIP_VISION = dict(image_size=32, patch_size=8, width=64, layers=2, head_width=16)
OPEN_CLIP_TEXT = dict(context_length=16, vocab_size=100, width=64, heads=4, layers=2)


def timm_family(family: str):
    torch.manual_seed(0)
    if family == 'eva':  # EVA-01 layout: fused qkv with q/v biases, no RoPE
        return Eva(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4, num_classes=5)
    name = {'vit': 'vit_tiny_patch16_224', 'deit': 'deit_tiny_distilled_patch16_224',
            'siglip': 'vit_base_patch16_siglip_224'}[family]
    return timm.create_model(name, pretrained=False, num_classes=5, **TINY)


def open_clip_model():
    torch.manual_seed(0)
    return open_clip.model.CLIP(embed_dim=32, vision_cfg=OPEN_CLIP_VISION, text_cfg=OPEN_CLIP_TEXT)


def source_weights(attn):
    """(qkv weight, qkv bias, proj weight, proj bias, H) of a timm Attention / EvaAttention / nn.MultiheadAttention."""
    if isinstance(attn, torch.nn.MultiheadAttention):
        return attn.in_proj_weight, attn.in_proj_bias, attn.out_proj.weight, attn.out_proj.bias, attn.num_heads
    bias = attn.qkv.bias if isinstance(attn, timm.layers.Attention) else torch.cat(
        [attn.q_bias, torch.zeros_like(attn.q_bias), attn.v_bias])
    return attn.qkv.weight, bias, attn.proj.weight, attn.proj.bias, attn.num_heads


def reference(source, x, layer, variant, pairing):
    """The converted layer's output from the source layer's weights, in fp64, written out head by head."""
    w, b, wo, bo, H = (t.detach().double() if isinstance(t, torch.Tensor) else t for t in source_weights(source))
    x = x.double()
    B, N, C = x.shape
    d = C // H
    q, k, v = (F.linear(x, w, b)).split(C, -1)
    q, k, v = (t.reshape(B, N, H, d).transpose(1, 2) for t in (q, k, v))  # (B, H, N, d)
    if not isinstance(source, torch.nn.MultiheadAttention):
        q, k = source.q_norm.double()(q), source.k_norm.double()(k)  # the source's own query/key norms
    P = torch.softmax(q @ k.transpose(-2, -1) / d ** 0.5, -1)  # (B, H, N, N): the source's maps
    lam = layer.compute_lambda(x.to(layer.qkv.weight.dtype)).double()
    Z = torch.zeros(B, N, C, dtype=torch.float64)
    if variant == 'split':
        pairs = [(2 * i, 2 * i + 1) if pairing == 'adjacent' else (i, i + H // 2) for i in range(H // 2)]
    else:
        pairs = [(i, i) for i in range(H)]
    for i, (a, c) in enumerate(pairs):
        diff = P[:, a] - (lam[:, i] if variant == 'v2' else lam) * P[:, c]  # (B, N, N)
        values = torch.cat([v[:, a], v[:, c]], -1) if variant == 'split' else v[:, a]
        o = diff @ values  # (B, N, width)
        if variant != 'v2':
            w_norm = layer.sub_norm.weight.double() * (1 - layer.lambda_init)
            o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + layer.sub_norm.eps) * w_norm
        Z[..., a * d:(a + 1) * d] = o[..., :d]
        if variant == 'split':
            Z[..., c * d:(c + 1) * d] = o[..., d:]
    if not isinstance(source, torch.nn.MultiheadAttention):
        Z = source.norm.double()(Z)  # the source's scale norm, on its own channel order
    return F.linear(Z, wo, bo)


@pytest.mark.parametrize('variant,pairing', VARIANTS)
@pytest.mark.parametrize('source', ['timm', 'timm_norms', 'eva', 'open_clip'])
@pytest.mark.parametrize('fused', [True, False])
def test_converted_layer_is_the_source_heads_as_the_docstring_lays_them_out(source, variant, pairing, fused):
    if source == 'open_clip':
        model = open_clip_model().visual.double()
        original = model.transformer.resblocks[0].attn
    else:
        if source == 'timm_norms':  # query/key norms and a scale norm (sub-LN) in the source layer
            torch.manual_seed(0)
            model = timm.create_model('vit_tiny_patch16_224', pretrained=False, qk_norm=True, scale_attn_norm=True,
                                      **TINY).double()
            with torch.no_grad():  # norms that are not the identity at init
                for name, p in model.named_parameters():
                    if 'norm' in name and '.attn.' in name:
                        p.normal_(1 if name.endswith('weight') else 0, 0.3)
        else:
            model = timm_family('vit' if source == 'timm' else 'eva').double()
        original = model.blocks[0].attn
    saved = {k: v.clone() for k, v in original.state_dict().items()}
    diffzoo.differentialize(model, variant=variant, head_pairing=pairing if variant == 'split' else None,
                            lambda_init=0.8)
    layer = (model.transformer.resblocks[0] if source == 'open_clip' else model.blocks[0]).attn
    assert isinstance(layer, PretrainedDifferentialAttention) and layer.num_heads == (2 if variant == 'split' else 4)
    with torch.no_grad():
        original.load_state_dict(saved)
        layer.fused_attn = fused
        x = torch.randn(2, 9, 64, dtype=torch.float64)
        torch.testing.assert_close(layer(x), reference(original, x, layer, variant, pairing), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize('family', ['vit', 'eva'])
def test_duplicate_keeps_every_pretrained_tensor(family):
    model = timm_family(family)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    diffzoo.differentialize(model, variant='duplicate')
    after = model.state_dict()
    for k, v in before.items():
        if family == 'eva' and k.endswith(('q_bias', 'v_bias')):  # EVA's q/v biases become qkv.bias (K's is 0)
            prefix = k.rsplit('.', 1)[0]
            q, kk, vv = after[f'{prefix}.qkv.bias'].split(64)
            assert torch.equal(q if k.endswith('q_bias') else vv, v) and not kk.any()
        else:
            assert torch.equal(after[k], v), k
    new = set(after) - set(before)
    assert all(k.split('.attn.')[1] in {'lambda_q1', 'lambda_k1', 'lambda_q2', 'lambda_k2', 'sub_norm.weight',
                                        '_extra_state', 'qkv.bias'} for k in new)


def _grads_everywhere(model, x, *args):
    model.train()
    out = model(x, *args)
    outs = out if isinstance(out, tuple) else (out,)  # CLIP: image features, text features, logit scale
    sum(o.float().pow(2).mean() for o in outs).backward()
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, missing


@pytest.mark.parametrize('family', ['vit', 'deit', 'siglip', 'eva'])
@pytest.mark.parametrize('variant', ['duplicate', 'split', 'v2'])
def test_timm_families_forward_backward_script_fx(family, variant):
    """timm's test_models.py checks on one converted model per family: forward, backward (every parameter
    gets a gradient), TorchScript, FX feature extraction (timm's own tracer)."""
    model = diffzoo.differentialize(timm_family(family), variant=variant)
    assert len(settings_of(model)) == 2
    x = torch.randn(2, 3, 32, 32)
    _grads_everywhere(model, x)
    model.eval()
    with torch.no_grad():
        expected = model(x)
        assert expected.shape == (2, 5) and torch.isfinite(expected).all()
        torch.testing.assert_close(torch.jit.script(model)(x), expected, rtol=1e-5, atol=1e-5)
        nodes = get_graph_node_names(model)[1]
        fx = create_feature_extractor(model, return_nodes=[nodes[-1]])
        torch.testing.assert_close(fx(x)[nodes[-1]], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('variant', ['duplicate', 'split', 'v2'])
def test_open_clip_towers_convert_causal_mask_kept(variant):
    plain = open_clip_model().eval()
    model = diffzoo.differentialize(open_clip_model(), variant=variant).eval()
    assert len(settings_of(model)) == 4  # both towers
    image, text = torch.randn(2, 3, 32, 32), torch.randint(1, 100, (2, 16))
    _grads_everywhere(model, image, text)
    model.eval()
    with torch.no_grad():
        # causal: changing a later token leaves the earlier positions' features as they were
        later = text.clone()
        later[:, 10:] = (later[:, 10:] + 1) % 100
        run = lambda t: model.transformer(model.token_embedding(t) + model.positional_embedding,  # noqa: E731
                                          attn_mask=model.attn_mask)
        torch.testing.assert_close(run(text)[:, :10], run(later)[:, :10])
        assert not torch.allclose(run(text)[:, 10:], run(later)[:, 10:])
        scripted = torch.jit.script(model)
        torch.testing.assert_close(scripted.encode_text(text), model.encode_text(text), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(model.encode_image(image), plain.encode_image(image))  # λ and the sub-norm act


def test_refuses_what_it_cannot_convert_by_name():
    with pytest.raises(NotConvertible, match='RoPE'):
        diffzoo.differentialize(Eva(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4,
                                    use_rot_pos_emb=True))
    with pytest.raises(NotConvertible, match='WindowAttention'):
        diffzoo.differentialize(timm.create_model('swin_tiny_patch4_window7_224', pretrained=False))
    with pytest.raises(NotConvertible, match='gated'):
        diffzoo.differentialize(timm.create_model('vit_tiny_patch16_224', pretrained=False, attn_layer='attn',
                                                  **TINY, block_fn=_gated_block()))
    with pytest.raises(NotConvertible, match='split.*3'):
        diffzoo.differentialize(timm.create_model('vit_tiny_patch16_224', pretrained=False, img_size=32, depth=1,
                                                  embed_dim=48, num_heads=3), variant='split')


def test_refuses_rope_inside_a_wrapper_a_sequence_first_stack_and_a_per_head_text_mask():
    class Wrapper(torch.nn.Module):  # EVA-02 style as a tower's trunk
        def __init__(self):
            super().__init__()
            self.trunk = Eva(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4, use_rot_pos_emb=True)
    with pytest.raises(NotConvertible, match='RoPE'):
        diffzoo.differentialize(Wrapper())
    with pytest.raises(NotConvertible, match='batch_first=False'):
        diffzoo.differentialize(open_clip.transformer.Transformer(64, 2, 4, batch_first=False))
    with pytest.raises(NotConvertible, match='class token or a padding'):
        diffzoo.differentialize(open_clip.model.CustomTextCLIP(embed_dim=32, vision_cfg=OPEN_CLIP_VISION,
                                                               text_cfg=dict(OPEN_CLIP_TEXT, embed_cls=True)))


def test_a_checkpoint_restores_the_lambda_init_it_was_trained_with():
    trained = diffzoo.differentialize(timm_family('vit'), lambda_init=0.2)
    other = diffzoo.differentialize(timm_family('vit'), lambda_init=0.8)
    other.load_state_dict(trained.state_dict())
    assert [m.lambda_init for m in other.modules() if isinstance(m, PretrainedDifferentialAttention)] == [0.2, 0.2]
    x = torch.randn(1, 3, 32, 32)
    torch.testing.assert_close(other.eval()(x), trained.eval()(x))


def _gated_block():
    from functools import partial

    from timm.models.vision_transformer import Block

    class GatedBlock(Block):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            dim = self.attn.proj.in_features
            self.attn = timm.layers.Attention(dim, num_heads=4, qkv_bias=True, gated=True)
    return partial(GatedBlock)


def test_blocks_and_depth_lambda_follow_the_stack_index():
    model = diffzoo.differentialize(timm.create_model('vit_tiny_patch16_224', pretrained=False, img_size=32,
                                                      depth=4, embed_dim=64, num_heads=4), blocks=[1, 3])
    kinds = [type(b.attn) for b in model.blocks]
    assert kinds == [timm.layers.Attention, PretrainedDifferentialAttention] * 2
    assert [round(model.blocks[i].attn.lambda_init, 6) for i in (1, 3)] == [
        round(0.8 - 0.6 * torch.exp(torch.tensor(-0.3 * i)).item(), 6) for i in (1, 3)]


BAD_BLOCKS = [([], 'converts nothing'), ([1.7], '1.7 is not a block index'), ('011', 'expected a list'),
              ([True], 'True is not a block index'), (3, 'expected a list'), ([0, 0], r'\[0\] given more than once'),
              ([-1], 'negative'), ([1, 2], '2 is not a block index'), (range(2), 'expected a list')]


@pytest.mark.parametrize('blocks,why', BAD_BLOCKS)
@pytest.mark.parametrize('family', ['vit', 'eva', 'open_clip'])
def test_blocks_refuses_each_bad_value_by_name_with_the_range(family, blocks, why):
    model = open_clip_model() if family == 'open_clip' else timm_family(family)
    stack = 'CLIP.visual.transformer.resblocks' if family == 'open_clip' else f'{type(model).__name__}.blocks'
    message = re.escape(f'blocks={blocks!r}') + f'.*{why}.*{re.escape(stack)} has blocks 0..1'
    with pytest.raises(ValueError, match=message):
        diffzoo.differentialize(model, blocks=blocks)
    assert not settings_of(model)  # nothing converted


def test_blocks_takes_a_list_or_tuple_of_distinct_ints_in_any_order():
    for blocks in ([1, 0], (1,), [numpy.int64(0)]):
        model = diffzoo.differentialize(timm_family('vit'), blocks=blocks)
        assert [r['depth'] for r in settings_of(model)] == sorted(int(i) for i in blocks)
    clip = diffzoo.differentialize(open_clip_model(), blocks=[1])  # index 1 of each tower's stack
    assert [r['depth'] for r in settings_of(clip)] == [1, 1]


def test_blocks_of_a_transformers_decoder_are_checked_before_they_become_its_layers():
    transformers = pytest.importorskip('transformers')
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    for blocks, why in BAD_BLOCKS:
        model = transformers.LlamaForCausalLM(config)
        with pytest.raises(ValueError, match=re.escape(f'blocks={blocks!r}') + f".*{why}.*decoder has blocks 0..1"):
            diffzoo.differentialize(model, blocks=blocks)
        assert not hasattr(model.model.layers[1].self_attn, 'differential')
    model = diffzoo.differentialize(transformers.LlamaForCausalLM(config), blocks=(1,))
    assert model.config.diffzoo_differential['layers'] == [1]


def test_an_already_differential_model_is_refused_saying_how_to_get_the_plain_one():
    converted = diffzoo.differentialize(timm_family('vit'), blocks=[0])
    for blocks in (None, [1]):  # another block of a partly converted model too
        with pytest.raises(NotConvertible, match='VisionTransformer is already differential .blocks.0.attn is '
                                                 'PretrainedDifferentialAttention.*load_converted'):
            diffzoo.differentialize(converted, blocks=blocks)
    clip = diffzoo.differentialize(open_clip_model())
    for model in (clip, clip.transformer):
        with pytest.raises(NotConvertible, match='already differential.*timm.create_model / open_clip.create_model'):
            diffzoo.differentialize(model)
    torch.manual_seed(0)
    native = timm.create_model('vit_diff_micro_patch8_64', pretrained=False, depth=2)
    with pytest.raises(NotConvertible, match='already differential.*DifferentialAttention.*vit_diff_baseline_<size>'):
        diffzoo.differentialize(native)
    timm_diff = timm.create_model('vit_tiny_patch16_224', pretrained=False, attn_layer='diff', **TINY)
    with pytest.raises(NotConvertible, match='already differential .blocks.0.attn is DiffAttention.*attn_layer out'):
        diffzoo.differentialize(timm_diff)
    plain = timm.create_model('vit_diff_baseline_micro_patch8_64', pretrained=False, depth=2)
    assert len(settings_of(diffzoo.differentialize(plain))) == 2  # the plain layout the message names converts


def test_a_converted_checkpoint_reloads_into_the_plain_model(tmp_path):
    model = diffzoo.differentialize(timm_family('siglip'), variant='split', head_pairing='halves', lambda_init=0.5)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, PretrainedDifferentialAttention):
                m.lambda_q1.add_(0.3)  # "trained": λ is not its initial value any more
    path = tmp_path / 'converted.safetensors'
    from safetensors.torch import save_file
    save_file(model.state_dict(), str(path))
    plain = timm_family('siglip')
    load_converted(plain, path)
    assert settings_of(plain) == settings_of(model)
    assert settings_of(plain)[1] == {'source': 'timm', 'pretrained_heads': 4, 'variant': 'split', 'lambda_init': 0.5,
                                     'head_pairing': 'halves', 'lambda_proj_init': 'unilm', 'depth': 1}
    x = torch.randn(1, 3, 32, 32)
    torch.testing.assert_close(plain.eval()(x), model.eval()(x))
    other = diffzoo.differentialize(timm_family('siglip'), variant='duplicate')
    with pytest.raises(ValueError, match="'variant': \\('split', 'duplicate'\\)"):
        other.load_state_dict(model.state_dict())


def test_analysis_reads_the_maps_of_a_converted_model():
    model = diffzoo.differentialize(timm_family('vit'), variant='split').eval()
    with capture_attention_maps(model) as maps, torch.no_grad():
        model(torch.randn(1, 3, 32, 32))
    assert sorted(maps) == ['blocks.0.attn', 'blocks.1.attn']
    assert maps['blocks.0.attn'].shape == (1, 2, 5, 5)  # 2 differential heads over the [CLS] + 4 patches
    assert all(isinstance(m, DifferentialAttention) for m in model.modules() if hasattr(m, 'diff_map'))


def _config(tmp_path, name, vision_diffzoo=None, text_diffzoo=None, timm_tower=False):
    vision = dict(OPEN_CLIP_VISION)
    if timm_tower:
        vision = {'image_size': 224, 'timm_model_name': 'vit_tiny_patch16_224', 'timm_model_pretrained': False,
                  'timm_pool': 'token', 'timm_proj': 'linear'}
    if vision_diffzoo:
        vision['diffzoo'] = vision_diffzoo
    text = dict(OPEN_CLIP_TEXT, vocab_size=49408, context_length=16)
    if text_diffzoo:
        text['diffzoo'] = text_diffzoo
    folder = tmp_path / 'configs'
    folder.mkdir(exist_ok=True)
    (folder / f'{name}.json').write_text(json.dumps({'embed_dim': 32, 'vision_cfg': vision, 'text_cfg': text}))
    open_clip.add_model_config(str(folder))
    return name


def test_open_clip_config_and_create_model_convert_pretrained_weights(tmp_path):
    """`vision_cfg.diffzoo` / `text_cfg.diffzoo` with convert, on a native and a timm tower, and
    create_model(…, diffzoo=…): the pretrained file's weights land converted; the fine-tuned checkpoint
    reloads under the plain name (open_clip's own loader, after import diffzoo)."""
    plain_name = _config(tmp_path, 'ViT-diffzoo-test-plain')
    timm_name = _config(tmp_path, 'ViT-diffzoo-test-timm', timm_tower=True)
    _config(tmp_path, 'ViT-diffzoo-test-converted', vision_diffzoo={'variant': 'duplicate'},
            text_diffzoo={'convert': True, 'variant': 'split', 'head_pairing': 'halves'})
    for name in (plain_name, timm_name):
        torch.manual_seed(0)
        plain = open_clip.create_model(name)
        pretrained = tmp_path / f'{name}.pt'
        torch.save(plain.state_dict(), pretrained)
        by_kwarg = open_clip.create_model(name, pretrained=str(pretrained), diffzoo={
            'vision': {'variant': 'v2'}, 'text': {'variant': 'duplicate', 'blocks': [1]}})
        sd = by_kwarg.state_dict()
        for k, v in plain.state_dict().items():
            if '.attn.' not in k:
                assert torch.equal(sd[k], v), k
        vision = by_kwarg.visual.trunk.blocks if name == timm_name else by_kwarg.visual.transformer.resblocks
        assert [r['variant'] for r in settings_of(by_kwarg)] == ['v2'] * len(vision) + ['duplicate']
        tuned = tmp_path / f'{name}-tuned.pt'
        torch.save({'epoch': 1, 'state_dict': {f'module.{k}': v for k, v in sd.items()}}, tuned)
        again = open_clip.create_model(name, pretrained=str(tuned))
        assert settings_of(again) == settings_of(by_kwarg)
        size = open_clip.get_model_preprocess_cfg(by_kwarg)['size']
        image = torch.randn(2, 3, *((size, size) if isinstance(size, int) else size))
        torch.testing.assert_close(again.eval().encode_image(image), by_kwarg.eval().encode_image(image))
    by_config = open_clip.create_model('ViT-diffzoo-test-converted', pretrained=str(tmp_path / f'{plain_name}.pt'))
    assert [r['variant'] for r in settings_of(by_config)] == ['duplicate'] * 2 + ['split'] * 2
    assert torch.equal(by_config.visual.transformer.resblocks[0].attn.qkv.weight,
                       torch.load(tmp_path / f'{plain_name}.pt')['visual.transformer.resblocks.0.attn.in_proj_weight'])
    with pytest.raises(ValueError, match='unknown key'):
        open_clip.create_model(plain_name, diffzoo={'vision': {'variant': 'split', 'lr': 1}})
    # open_clip's own overrides still apply beside diffzoo=
    forced = open_clip.create_model(plain_name, diffzoo={'vision': {}}, force_image_size=48, force_context_length=8)
    assert forced.visual.image_size == (48, 48) and forced.context_length == 8 and len(settings_of(forced)) == 2


@pytest.mark.slow
def test_the_converted_models_registered_for_timms_own_tests_build_converted(tmp_path):
    """scripts/timm_converted_models.py registers the names scripts/timm_model_tests.py runs timm's
    test_models.py on; in a child process, since its names match this suite's `*diff*` listing."""
    script = f'''
import sys
sys.path.insert(0, {str(ROOT / 'scripts')!r})
import timm, torch
import timm_converted_models as m
from diffzoo.differential import settings_of
assert set(m.NAMES) <= set(timm.list_models('*_diffzoo_*')) and len(m.NAMES) == 12
for name in ('vit_small_patch16_224_diffzoo_duplicate', 'deit_small_distilled_patch16_224_diffzoo_split',
             'eva_small_patch14_224_diffzoo_v2'):
    model = timm.create_model(name, num_classes=3, img_size=32, depth=2).eval()
    variant = name.rsplit('_', 1)[1]
    assert [r['variant'] for r in settings_of(model)] == [variant] * 2, (name, settings_of(model))
    assert timm.get_pretrained_cfg_value(name, 'input_size') == (3, 224, 224)
    out = model(torch.randn(1, 3, 32, 32))
    assert out.shape == (1, 3), out.shape
try:
    timm.create_model('vit_small_patch16_224_diffzoo_v2', pretrained=True)
except ValueError as e:
    assert 'diffzoo.differentialize(timm.create_model' in str(e), e
else:
    raise AssertionError('pretrained=True was accepted')
print('ok')
'''
    done = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.strip().endswith('ok'), done.stderr[-3000:]
