import math
import re

import numpy as np
import open_clip
import pytest
import torch
from scipy import stats as scipy_stats
import torch.nn.functional as F
from PIL import Image

from diffzoo.analysis import maps as attention
from diffzoo.analysis import plots, report
from diffzoo.analysis.metrics import attention_entropy
from diffzoo.analysis.overlays import main
from diffzoo.layers import DifferentialAttention, capture_attention_maps
from tests.factory import call, scenes

MODELS = ('diffclip-tiny', 'clip-tiny-baseline')
N_TOKENS = 1 + 8 * 8  # 64 px, patch 8: CLS + 8×8 patches


def _scenes(n=2):
    return scenes(n, size=96)


def _build(name):
    torch.manual_seed(0)
    model, _, preprocess = open_clip.create_model_and_transforms(name)
    return model.eval(), preprocess


@pytest.fixture(scope='module')
def built():
    return {name: _build(name) for name in MODELS}


def _images(preprocess, n=2):
    return torch.stack([preprocess(p) for p in _scenes(n)])


def _state(model):
    """Every attention layer's fused flag and every forward hook anywhere in the model."""
    attns = [m for m in model.modules() if hasattr(m, 'fused_attn')]
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    return [m.fused_attn for m in attns], hooks


def _attention_inputs(trunk, images):
    """Each block's attention input (after norm1), captured by the test itself."""
    inputs = {}
    handles = [block.attn.register_forward_pre_hook(lambda _m, args, i=i: inputs.__setitem__(i, args[0]))
               for i, block in enumerate(trunk.blocks)]
    with torch.no_grad():
        trunk.forward_features(images)
    for h in handles:
        h.remove()
    return inputs


def test_baseline_maps_are_softmax_of_q_k_written_out(built):
    model, preprocess = built['clip-tiny-baseline']
    images = _images(preprocess)
    trunk = model.visual.trunk
    maps = attention.attention_maps(model, images)
    assert list(maps) == [f'blocks.{i}.attn' for i in range(len(trunk.blocks))]
    inputs = _attention_inputs(trunk, images)
    for i, block in enumerate(trunk.blocks):
        attn = block.attn
        B, N, C = inputs[i].shape
        h, d = attn.num_heads, C // attn.num_heads
        q, k, _ = F.linear(inputs[i].double(), attn.qkv.weight.double(), attn.qkv.bias.double()).chunk(3, -1)
        q = q.view(B, N, h, d).transpose(1, 2)  # (B, h, N, d)
        k = k.view(B, N, h, d).transpose(1, 2)
        expected = (q @ k.transpose(-2, -1) / math.sqrt(d)).softmax(-1)  # (B, h, N, N)
        got = maps[f'blocks.{i}.attn']
        assert got.dtype == torch.float32 and got.shape == (B, h, N_TOKENS, N_TOKENS)
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got.sum(-1), torch.ones(B, h, N), rtol=0, atol=1e-5)


def test_differential_maps_match_capture_attention_maps(built):
    model, preprocess = built['diffclip-tiny']
    images = _images(preprocess)
    trunk = model.visual.trunk
    maps = attention.attention_maps(model, images)
    with torch.no_grad(), capture_attention_maps(trunk) as reference:
        trunk.forward_features(images)
    assert list(maps) == list(reference)
    for name, m in maps.items():
        torch.testing.assert_close(m, reference[name].float(), rtol=0, atol=0)
        layer = trunk.get_submodule(name)
        assert isinstance(layer, DifferentialAttention) and m.shape[1] == layer.num_heads
        lam = layer.compute_lambda(torch.zeros(1, 1, 1)).item()
        torch.testing.assert_close(m.sum(-1), torch.full(m.shape[:3], 1 - lam), rtol=0, atol=1e-5)  # rows: 1 − λ
    assert any((m < 0).any() for m in maps.values())  # signed, as documented


@pytest.mark.parametrize('name', MODELS)
def test_every_function_leaves_the_model_as_it_was(built, name):
    model, preprocess = built[name]
    images = _images(preprocess)
    before = _state(model)
    assert before[0] and all(before[0])  # the models attend with fused SDPA by default
    with torch.no_grad():
        embedding = model.encode_image(images)
    attention.attention_maps(model, images)
    attention.cls_attention(model, images)
    attention.query_attention(model, open_clip.get_tokenizer(name), images, ['circle'])
    attention.block_entropy(model, images)
    def fail(*_):
        raise KeyboardInterrupt

    handle = model.visual.trunk.blocks[2].register_forward_hook(fail)
    with pytest.raises(KeyboardInterrupt):  # a forward stopped half-way still restores everything
        attention.attention_maps(model, images)
    handle.remove()
    assert _state(model) == before
    assert all(p.grad is None for p in model.parameters())
    with torch.no_grad():
        torch.testing.assert_close(model.encode_image(images), embedding, rtol=0, atol=0)


@pytest.mark.parametrize('name', MODELS)
def test_cls_attention_is_the_class_row_over_patches_averaged_over_heads(built, name):
    model, preprocess = built[name]
    images = _images(preprocess)
    maps = list(attention.attention_maps(model, images).values())
    for layer in (-1, 0):
        heat = attention.cls_attention(model, images, layer=layer)
        assert heat.shape == (2, 8, 8)
        expected = maps[layer][:, :, 0, 1:].mean(1)  # (B, 64), patches in row-major order
        torch.testing.assert_close(heat.flatten(1), expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match='--layer 4: the vision tower has 4 blocks'):
        attention.cls_attention(model, images, layer=4)


@pytest.mark.parametrize('name', MODELS)
def test_query_attention_depends_on_the_query_and_works_under_no_grad(built, name):
    model, preprocess = built[name]
    images = _images(preprocess)
    with torch.no_grad():
        relevance = attention.query_attention(model, open_clip.get_tokenizer(name), images, ['circle', 'blue square'])
    assert relevance.shape == (2, 2, 8, 8)
    assert torch.isfinite(relevance).all() and (relevance >= 0).all()  # R = I + Σ (∇A ⊙ A)⁺ R
    assert not torch.allclose(relevance[:, 0], relevance[:, 1])
    single = attention.query_attention(model, open_clip.get_tokenizer(name), images[:1], ['blue square'])
    torch.testing.assert_close(single[0, 0], relevance[0, 1], rtol=1e-4, atol=1e-6)  # images are independent


def test_row_entropy_of_known_distributions():
    n = 65
    uniform = torch.full((3, n), 1 / n)
    torch.testing.assert_close(attention_entropy(uniform), torch.full((3,), math.log(n)))
    assert attention_entropy(torch.eye(4)).tolist() == [0.0] * 4
    assert attention_entropy(torch.tensor([0.5, 0.25, 0.25])).item() == pytest.approx(1.5 * math.log(2), abs=1e-6)
    # a signed differential row counts by magnitude: |0.6| and |-0.2| → (0.75, 0.25)
    expected = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    assert attention_entropy(torch.tensor([0.6, -0.2])).item() == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize('name', MODELS)
def test_entropy_of_a_model_with_uniform_attention_is_log_n(name):
    model, preprocess = _build(name)
    with torch.no_grad():
        for block in model.visual.trunk.blocks:  # q = k = 0: every softmax is uniform, A1 − λA2 too
            block.attn.qkv.weight.zero_()
            block.attn.qkv.bias.zero_()
    entropy = attention.block_entropy(model, _images(preprocess, 3), batch_size=2)
    heads = 2 if name == 'diffclip-tiny' else 4
    torch.testing.assert_close(entropy, torch.full((4, heads), math.log(N_TOKENS)), rtol=0, atol=1e-5)


def test_entropy_table_and_plot(tmp_path, built):
    entropies = {name: attention.block_entropy(model, _images(pre)) for name, (model, pre) in built.items()}
    n_tokens = {name: N_TOKENS for name in entropies}
    table = report.entropy_table(entropies, n_tokens)
    lines = table.splitlines()
    assert lines[0].split() == ['block', *MODELS]
    assert [line.split()[0] for line in lines[2:6]] == ['0', '1', '2', '3']
    summary = _summary(table)
    means = {line.split()[0]: float(line.split()[1]) for line in summary[1:3]}
    assert means == {name: pytest.approx(e.mean().item(), abs=5e-4) for name, e in entropies.items()}
    assert f'log {N_TOKENS} = {math.log(N_TOKENS):.3f}' in summary[2]
    words = ' '.join(' '.join(summary).split())
    assert 'how spread each attention row\'s weight is over the tokens (lower: on fewer tokens)' in words
    assert 'differential attention: of |A1 − λ·A2| normalised, another map' in words
    assert 'not that a model is more accurate' in words and 'noise' not in words
    png = plots.plot_entropy(entropies, tmp_path / 'entropy.png', n_tokens)
    with Image.open(png) as img:
        assert img.size == (840, 480) and np.asarray(img.convert('L')).std() > 10


def test_image_entropy_is_per_image_and_block_entropy_its_mean(built):
    model, preprocess = built['diffclip-tiny']
    images = _images(preprocess, 3)
    per_image = attention.image_entropy(model, images, batch_size=2)
    assert per_image.shape == (3, 4, 2)  # images, blocks, differential heads
    torch.testing.assert_close(per_image.mean(0), attention.block_entropy(model, images), rtol=0, atol=1e-6)
    assert not torch.allclose(per_image[0], per_image[1])  # each image its own


def _summary(table):
    lines = table.splitlines()
    return lines[lines.index(f'  {report.SUMMARY}'):]


def test_entropy_table_gives_each_mean_its_interval_and_tests_the_difference_over_the_images():
    torch.manual_seed(0)
    a = 4.0 + 0.05 * torch.randn(40, 4, 4)  # (images, blocks, heads)
    noise = 0.05 * torch.randn(20, 4, 2)
    cases = {'beyond chance': a.mean(2, keepdim=True)[..., :2] - 0.1 + noise.repeat(2, 1, 1),
             'within chance': a.mean(2, keepdim=True)[..., :2] + 0.003 + torch.cat([noise, -noise])}
    for verdict, b in cases.items():
        per_image = {'clip': a, 'diffclip': b}
        summary = _summary(report.entropy_table({n: e.mean(0) for n, e in per_image.items()}, {'clip': 65,
                                                'diffclip': 65}, per_image))
        for line, e in zip(summary[1:3], per_image.values()):
            means = e.mean((1, 2)).double().numpy()
            half = scipy_stats.t.ppf(0.975, len(means) - 1) * means.std(ddof=1) / math.sqrt(len(means))
            assert line.split()[1] == f'{means.mean():.3f}'
            assert f'95 % interval {means.mean() - half:.3f}–{means.mean() + half:.3f} over 40 images' in line
        mean_a, mean_b = (e.mean((1, 2)).double().numpy() for e in (a, b))
        diff = mean_b - mean_a
        p = scipy_stats.ttest_rel(mean_b, mean_a).pvalue
        assert (p < 0.05) == (verdict == 'beyond chance')
        assert summary[3].startswith(f'  diffclip − clip: {diff.mean():+.3f} nats')
        assert (' within chance ' in summary[3]) == (verdict == 'within chance')
        assert (' a difference in spread beyond chance ' in summary[3]) == (verdict == 'beyond chance')
        assert 'paired t-test over the 40 images' in summary[3]
    flat = {'clip': torch.full((40, 4, 4), math.log(65)), 'diffclip': torch.full((40, 4, 2), 4.0)}
    summary = _summary(report.entropy_table({n: e.mean(0) for n, e in flat.items()}, None, flat))
    assert f'95 % interval {math.log(65):.3f}–{math.log(65):.3f} over 40 images' in summary[1]
    assert summary[3] == f'  diffclip − clip: {4.0 - math.log(65):+.3f} nats on every one of the 40 images'


def test_overlay_figure_puts_every_panel_on_one_colour_scale():
    pil = _scenes(2)
    flat = torch.full((2, 8, 8), 1 / 65)  # a uniform softmax CLS row: the baseline's map before it learns anything
    peaked = torch.zeros(2, 8, 8)
    peaked[:, 2:4, 5:7] = 0.05  # a differential row: 4 patches share it
    peaked[1, 0, 0] = -0.05  # cancelled by the differential map: shown as 0
    fig = plots.overlay_figure(pil, {'clip-tiny-baseline': flat, 'diffclip-tiny': peaked})
    overlays = [im for ax in fig.axes for im in ax.get_images() if im.get_array().ndim == 2]  # not the RGB crops
    assert len(overlays) == 4  # 2 images × 2 models
    vmax = max(im.get_array().max() for im in overlays)
    assert {im.get_clim() for im in overlays} == {(0, vmax)}
    assert 0.2 < vmax <= 0.25  # each peaked patch holds 1/4 of its map (bilinear upsampling lowers the peak a little)
    assert min(im.get_array().min() for im in overlays) == 0
    for im in overlays[0::2]:  # the flat map shows flat at 1/64, not filling its panel with the top colour
        assert im.get_array().min() == pytest.approx(1 / 64) and im.get_array().max() == pytest.approx(1 / 64)
    bar = next(ax for ax in fig.axes if 'one scale for every panel' in ax.get_ylabel())  # the colour bar says so
    assert [line.get_ydata()[0] for line in bar.get_lines()] == [pytest.approx(1 / 64)]  # the uniform share marked


def test_plot_overlays_grid_and_shape_checks(tmp_path):
    pil = _scenes(2)
    maps = {name: torch.rand(2, 2, 8, 8) - 0.2 for name in MODELS}  # (B, Q, gh, gw), some negative
    png = plots.plot_overlays(pil, maps, tmp_path / 'sub' / 'q.png', queries=['circle', 'square'])
    with Image.open(png) as img:
        assert img.size == (800, 990)  # 3 columns × 4 rows (2 images × 2 queries) of 240 px, + title, + colour bar
    with pytest.raises(ValueError, match=r"maps\['diffclip-tiny'\] covers 2 images .* expected 3 images"):
        plots.plot_overlays(pil + pil[:1], maps, tmp_path / 'x.png')
    with pytest.raises(ValueError, match=r"queries \['circle'\] do not label 2 queries per image for 2 images"):
        plots.plot_overlays(pil, maps, tmp_path / 'x.png', queries=['circle'])
    per_image = [['red circle', 'blue square'], ['green square', 'red triangle']]
    png = plots.plot_overlays(pil, maps, tmp_path / 'per_image.png', queries=per_image)
    with Image.open(png) as img:
        assert img.size == (800, 990)
    with pytest.raises(ValueError, match='do not label 2 queries per image'):
        plots.plot_overlays(pil, maps, tmp_path / 'x.png', queries=per_image[:1])


def test_a_vision_tower_that_is_not_a_timm_vit_is_refused():
    clip = open_clip.model.CLIP(
        embed_dim=32, vision_cfg=dict(layers=1, width=64, head_width=32, patch_size=16, image_size=32),
        text_cfg=dict(context_length=8, vocab_size=100, width=32, heads=1, layers=1))
    with pytest.raises(ValueError, match='vision tower is VisionTransformer, not a timm VisionTransformer'):
        attention.attention_maps(clip, torch.zeros(1, 3, 32, 32))


@pytest.mark.slow
def test_cli_writes_overlay_and_entropy_pngs_and_prints_the_table(tmp_path):
    paths = []
    for i, img in enumerate(_scenes(2)):
        paths.append(str(tmp_path / f'scene{i}.png'))
        img.save(paths[-1])
    out = tmp_path / 'figs' / 'attention.png'
    proc = call(main, [*paths, '--model', 'diffclip-tiny', '--model', 'clip-tiny-baseline', '--entropy', '--out', out],
                tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[-2:] == [f'wrote {out}', f'wrote {out.with_name("attention_entropy.png")}']
    summary = lines.index(f'  {report.SUMMARY}')
    assert [line.split()[0] for line in lines[summary + 1:summary + 3]] == list(MODELS)
    assert all(0 < float(line.split()[1]) <= math.log(N_TOKENS) + 1e-3 for line in lines[summary + 1:summary + 3])
    with Image.open(out) as img:
        assert img.size == (800, 510)  # image + 2 model columns + colour bar, 2 image rows
        pixels = np.asarray(img.convert('RGB')).astype(float)
    panel = pixels[60:250, 260:470]  # the first overlay: heat map colours, not the plain scene
    assert pixels.std() > 20 and panel.std() > 20 and (panel[..., 2] - panel[..., 0]).std() > 10
    with Image.open(out.with_name('attention_entropy.png')) as img:
        assert img.size == (840, 480)


def test_cli_errors_name_the_bad_input_and_the_fix(tmp_path, capsys, monkeypatch):
    image = tmp_path / 'scene.png'
    _scenes(1)[0].save(image)

    def refused(argv, pattern):
        assert main(argv) == 2
        assert re.search(pattern, capsys.readouterr().err)

    refused([str(tmp_path / 'nope.jpg'), '--model', 'diffclip-tiny'],
            r'IMAGE .*nope\.jpg: no such file; pass the path of an existing image')
    (tmp_path / 'notes.txt').write_text('not an image')
    refused([str(tmp_path / 'notes.txt'), '--model', 'diffclip-tiny'], r'notes\.txt: not an image PIL can read')
    big = tmp_path / 'big.png'
    Image.new('RGB', (300, 300)).save(big)
    monkeypatch.setattr(Image, 'MAX_IMAGE_PIXELS', 200 * 200)  # a PNG over twice PIL's limit: refused at open
    refused([str(big), '--model', 'diffclip-tiny'], r'IMAGE .*big\.png: over PIL\'s pixel limit, '
                                                    r'Image\.MAX_IMAGE_PIXELS \(Image size \(90000 pixels\).*; pass a '
                                                    r'smaller copy of it')
    monkeypatch.undo()
    refused([str(image), '--model', 'diffclip-tinny'],
            "--model diffclip-tinny: 'diffclip-tinny' is not an open_clip model; did you mean diffclip-tiny")
    refused([str(image), '--model', 'diffclip-tiny,nonsense'],
            "--model diffclip-tiny,nonsense: 'nonsense' is neither a checkpoint file nor a pretrained tag")


def test_an_attention_layer_without_a_map_to_read_is_refused_before_anything_changes():
    import timm
    from timm.layers import DiffAttention

    vit = timm.create_model('vit_diff_micro_patch8_64', attn_layer=DiffAttention).eval()  # timm's own, no diff_map
    flags = [b.attn.fused_attn for b in vit.blocks]
    with pytest.raises(ValueError, match='DiffAttention has no explicit-path map to read'):
        attention.attention_maps(vit, torch.zeros(1, 3, 64, 64))
    assert [b.attn.fused_attn for b in vit.blocks] == flags
