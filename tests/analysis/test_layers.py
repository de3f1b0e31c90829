import json
import math
import re

import open_clip
import pytest
import torch
import transformers
import yaml

from diffzoo import analysis
from diffzoo.analysis import SPECIAL, TEXT, VISUAL
from diffzoo.analysis.cli import main
from diffzoo.analysis.maps import attention_maps
from diffzoo.vlm import build_vlm, differentialize
from diffzoo.vlm.factory import BuiltVLM, PaliGemmaVLM
from diffzoo.vlm.lora import add_lora, save_adapter
from tests.factory import call, scenes

PROMPTS = ['answer en what color is the shape?', 'answer en what shape is it?']  # words of the tiny LM's vocabulary


def _scenes(n=2):
    return scenes(n, size=80)


def _image_folder(tmp_path, n=1):
    """tmp_path/images holding `n` scenes, the folder the CLI's --images takes."""
    images = tmp_path / 'images'
    images.mkdir()
    for i, im in enumerate(_scenes(n)):
        im.save(images / f'scene{i}.png')
    return images


def test_entropy_of_uniform_rows_is_log_n_and_of_one_hot_rows_zero():
    for n in (1, 2, 7, 64):
        torch.testing.assert_close(analysis.attention_entropy(torch.full((3, n), 1 / n)),
                                   torch.full((3,), math.log(n)))
    one_hot = torch.eye(5).reshape(1, 5, 5)  # (B, queries, keys): zeros count as 0·log 0 = 0
    assert analysis.attention_entropy(one_hot).shape == (1, 5)
    assert torch.equal(analysis.attention_entropy(one_hot), torch.zeros(1, 5))


def test_entropy_of_a_known_two_token_row_and_of_a_signed_row():
    expected = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert analysis.attention_entropy(torch.tensor([0.25, 0.75])).item() == pytest.approx(expected, abs=1e-6)
    # a differential row summing to 1 − λ = 0.6: the entropy of |a| / Σ|a| = (0.6, 0.2, 0.2)
    expected = -(0.6 * math.log(0.6) + 2 * 0.2 * math.log(0.2))
    assert analysis.attention_entropy(torch.tensor([0.6, -0.2, 0.2])).item() == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize('after, expected', [
    (lambda x: x.clone(), 1.0),  # identical
    (lambda x: 3 * x, 1.0),  # same directions, other lengths
    (lambda x: -x, -1.0),  # opposite
    (lambda x: torch.stack([-x[:, 1], x[:, 0]], 1), 0.0),  # each token rotated by 90°: orthogonal
])
def test_average_cosine_similarity_of_known_pairs(after, expected):
    before = torch.randn(6, 2)
    assert analysis.average_cosine_similarity(before, after(before)) == pytest.approx(expected, abs=1e-9)


def test_average_cosine_similarity_is_the_mean_over_tokens():
    before = torch.tensor([[1., 0.], [1., 0.]])
    after = torch.tensor([[2., 0.], [1., 1.]])  # cos 1 and cos 45°
    assert analysis.average_cosine_similarity(before, after) == pytest.approx((1 + 2 ** -0.5) / 2, abs=1e-9)
    with pytest.raises(ValueError, match=r'before \(2, 2\), after \(3, 2\)'):
        analysis.average_cosine_similarity(before, torch.zeros(3, 2))
    with pytest.raises(ValueError, match=r'expected two \(N, D\) matrices'):
        analysis.average_cosine_similarity(before[None], after[None])


def test_attention_mass_by_category_of_softmax_and_signed_rows():
    categories = torch.tensor([VISUAL, VISUAL, TEXT, SPECIAL])
    rows = torch.tensor([[0.5, 0.2, 0.2, 0.1],  # softmax row
                         [0.5, -0.1, 0.3, 0.1]])  # signed: |a| sums to 1.0
    mass = analysis.attention_mass(rows, categories)
    torch.testing.assert_close(mass, torch.tensor([[0.7, 0.2, 0.1], [0.6, 0.3, 0.1]]))
    torch.testing.assert_close(analysis.attention_mass(2 * rows, categories), mass)  # shares, whatever the row sum
    with pytest.raises(ValueError, match='do not label the 4 keys'):
        analysis.attention_mass(rows, categories[:3])


def test_jaccard_and_top_k_on_hand_made_sets():
    assert analysis.jaccard({1, 2, 3}, {2, 3, 4}) == 0.5
    assert analysis.jaccard([1, 2], [2, 1]) == 1.0
    assert analysis.jaccard({1}, {2}) == 0.0
    with pytest.raises(ValueError, match='both sets are empty'):
        analysis.jaccard(set(), set())
    scores = torch.tensor([0.1, 0.5, -0.3, 0.9, 0.2])
    assert analysis.top_k_tokens(scores, 2) == {3, 1}
    assert analysis.top_k_tokens(scores, 25) == {0, 1, 2, 3, 4}  # fewer tokens than k: all of them


def test_token_categories_mark_the_image_prefix_image_tokens_and_special_ids():
    cats = analysis.token_categories([1, 7, 8, 2, 0], special_ids=[0, 1, 2], image_tokens=3)
    assert cats.tolist() == [VISUAL] * 3 + [SPECIAL, TEXT, TEXT, SPECIAL, SPECIAL]
    paligemma = analysis.token_categories([4, 4, 1, 9], special_ids=[1, 4], image_token_id=4)
    assert paligemma.tolist() == [VISUAL, VISUAL, SPECIAL, TEXT]


def test_layer_metrics_on_hand_built_states_and_maps():
    categories = torch.tensor([VISUAL, VISUAL, TEXT, SPECIAL])
    h0 = torch.tensor([[1., 0.], [0., 1.], [1., 0.], [1., 1.]])
    h1 = h0.clone()  # layer 0 changes nothing
    h2 = torch.cat([-h1[:2], torch.tensor([[0., 1.], [1., 1.]])])  # layer 1: visual flipped, text turned 90°
    layer0 = torch.tensor([[0.25, 0.25, 0.25, 0.25],  # head 0 uniform: entropy log 4
                           [1.0, 0.0, 0.0, 0.0]])  # head 1 one-hot: entropy 0
    layer1 = torch.tensor([[0.6, -0.2, 0.1, 0.1]] * 2)  # differential heads, rows sum to 0.6
    m = analysis.layer_metrics([h0, h1, h2], [layer0, layer1], categories)
    assert m['cosine_visual'] == pytest.approx([1.0, -1.0])
    assert m['cosine_text'] == pytest.approx([1.0, 0.0])
    p = torch.tensor([0.6, 0.2, 0.1, 0.1])
    assert m['entropy'] == pytest.approx([math.log(4) / 2, -(p * p.log()).sum().item()], abs=1e-6)
    assert m['mass_visual'] == pytest.approx([0.75, 0.8])
    assert m['mass_text'] == pytest.approx([0.125, 0.1])
    assert m['mass_special'] == pytest.approx([0.125, 0.1])
    assert m['row_sum'] == pytest.approx([1.0, 0.6])
    # signed shares, mean over heads then layers: token 0 (0.625 + 0.6) / 2, token 1 (0.125 − 0.2) / 2
    torch.testing.assert_close(m['visual_scores'], torch.tensor([0.6125, -0.0375]))
    no_text = analysis.layer_metrics([h0, h1], [layer0], torch.tensor([VISUAL, VISUAL, SPECIAL, SPECIAL]))
    assert no_text['cosine_text'] == [None]
    with pytest.raises(ValueError, match='3 hidden states for 1 layers'):
        analysis.layer_metrics([h0, h1, h2], [layer0], categories)


def _tiny_vlm(language_model_dir, differential):
    lm = transformers.AutoModelForCausalLM.from_pretrained(language_model_dir)
    if differential:
        differentialize(lm, variant='split', lambda_init=0.5, layers=[1])  # layer 0 softmax, layer 1 differential
    torch.manual_seed(0)
    return build_vlm('diffclip-tiny', lm).eval()


@pytest.mark.parametrize('differential', [False, True])
def test_tiny_vlm_end_to_end_matches_transformers_own_outputs(language_model_dir, differential):
    model = _tiny_vlm(language_model_dir, differential)
    tokenizer = transformers.AutoTokenizer.from_pretrained(language_model_dir)
    transform = model.vision.preprocess
    images = _scenes(2)
    kernel = model.language_model.config._attn_implementation
    report = analysis.analyse_vlm(BuiltVLM(model, tokenizer, transform), images, PROMPTS, top_k=25)

    assert model.language_model.config._attn_implementation == kernel  # sdpa / diffzoo_sdpa again
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert report['layers'] == 2 and len(report['samples']) == 4
    for name in analysis.VLM_METRICS:
        values = report['per_layer'][name]
        assert len(values) == 2 and all(math.isfinite(v) for v in values), name
    for sample in report['samples']:
        assert sample['tokens'] == {'visual': 64, 'text': len(sample['prompt'].split()), 'special': 1}  # BOS
        layers = sample['per_layer']
        for l in range(2):
            mass = layers['mass_visual'][l] + layers['mass_text'][l] + layers['mass_special'][l]
            assert mass == pytest.approx(1.0, abs=1e-5)
            assert 0 <= layers['entropy'][l] <= sample['max_entropy'] + 1e-6
        assert len(sample['top_visual_tokens']) == 25 and all(0 <= t < 64 for t in sample['top_visual_tokens'])
    assert report['per_layer']['row_sum'][0] == pytest.approx(1.0, abs=1e-5)  # softmax layer
    attn = model.language_model.model.layers[1].self_attn
    if differential:
        lam = (torch.exp(attn.lambda_q1 @ attn.lambda_k1) - torch.exp(attn.lambda_q2 @ attn.lambda_k2)).item() + 0.5
        assert report['per_layer']['row_sum'][1] == pytest.approx(1 - lam, abs=1e-5)
    else:
        assert report['per_layer']['row_sum'][1] == pytest.approx(1.0, abs=1e-5)
    pairs = report['jaccard']['pairs']
    assert len(pairs) == 2 and all(0 <= p['jaccard'] <= 1 for p in pairs)
    assert report['jaccard']['mean'] == pytest.approx(sum(p['jaccard'] for p in pairs) / 2)
    first = report['samples'][0]
    assert pairs[0]['jaccard'] == pytest.approx(analysis.jaccard(first['top_visual_tokens'],
                                                                 report['samples'][1]['top_visual_tokens']))

    # the same numbers from transformers' own eager outputs for image 0, prompt 0
    ids = torch.tensor([[tokenizer.bos_token_id] + tokenizer(PROMPTS[0], add_special_tokens=False)['input_ids']])
    model.language_model.config._attn_implementation = 'diffzoo_eager' if differential else 'eager'
    with torch.no_grad():
        out = model(transform(images[0])[None], ids, output_attentions=True, output_hidden_states=True)
    model.language_model.config._attn_implementation = kernel
    visual = slice(0, 64)
    assert first['per_layer']['cosine_visual'][0] == pytest.approx(analysis.average_cosine_similarity(
        out.hidden_states[0][0, visual], out.hidden_states[1][0, visual]), abs=1e-6)
    for l in range(2):
        row = out.attentions[l][0, :, -1]  # (heads, S)
        entropy = analysis.attention_entropy(row).mean().item()
        assert first['per_layer']['entropy'][l] == pytest.approx(entropy, abs=1e-5)
        assert first['per_layer']['mass_visual'][l] == pytest.approx(
            (row[:, visual].abs().sum(-1) / row.abs().sum(-1)).mean().item(), abs=1e-5)


def test_paligemma_visual_tokens_are_its_image_token_positions(paligemma_dir):
    model = transformers.PaliGemmaForConditionalGeneration.from_pretrained(paligemma_dir).eval()
    differentialize(model, variant='duplicate', lambda_init=0.8)
    processor = transformers.AutoProcessor.from_pretrained(paligemma_dir)
    report = analysis.analyse_vlm(PaliGemmaVLM(model, processor), _scenes(1), PROMPTS, top_k=5)
    sample = report['samples'][0]
    assert sample['tokens']['visual'] == 16 and sample['tokens']['special'] == 1  # 4×4 patches; BOS
    assert report['layers'] == 2 and len(sample['top_visual_tokens']) == 5
    masses = [report['per_layer'][f'mass_{c}'] for c in analysis.CATEGORIES]
    assert [sum(m) for m in zip(*masses)] == pytest.approx([1.0, 1.0], abs=1e-5)
    assert all(abs(s - 1) > 1e-3 for s in report['per_layer']['row_sum'])  # differential rows: 1 − λ
    assert model.config.text_config._attn_implementation == 'diffzoo_sdpa'


@pytest.mark.parametrize('name', ['diffclip-tiny', 'clip-tiny-baseline'])
def test_clip_tower_end_to_end_matches_the_maps_and_timm_intermediates(name):
    torch.manual_seed(0)
    model, _, preprocess = open_clip.create_model_and_transforms(name)
    model.eval()
    trunk = model.visual.trunk
    for block in trunk.blocks:  # peaked attention: random init attends almost uniformly, every row alike
        torch.nn.init.normal_(block.attn.qkv.weight, std=0.3)
    images = torch.stack([preprocess(im) for im in _scenes(3)])
    report = analysis.analyse_clip(model, images, batch_size=2)
    depth = len(trunk.blocks)
    assert report['layers'] == depth and len(report['samples']) == 3
    assert report['max_entropy'] == pytest.approx(math.log(65))  # CLS + 8×8 patches
    maps = list(attention_maps(model, images).values())
    cls_entropy = [analysis.attention_entropy(a[:, :, 0]).mean().item() for a in maps]
    assert report['per_layer']['entropy'] == pytest.approx(cls_entropy, abs=1e-5)
    assert max(cls_entropy) < math.log(65) - 0.1
    with torch.no_grad():
        blocks = trunk.forward_intermediates(images, indices=list(range(depth)), norm=False, output_fmt='NLC',
                                             intermediates_only=True)  # block outputs, patch tokens only
    for l in range(1, depth):
        expected = sum(analysis.average_cosine_similarity(blocks[l - 1][b], blocks[l][b]) for b in range(3)) / 3
        assert report['per_layer']['cosine_visual'][l] == pytest.approx(expected, abs=1e-6)
    assert all(-1 <= v <= 1 for v in report['per_layer']['cosine_visual'])


def _png(path):
    return path.is_file() and path.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'


@pytest.mark.slow
def test_cli_compares_a_differential_vlm_with_its_adapter_to_a_vanilla_one(language_model_dir, tmp_path):
    images = _image_folder(tmp_path, 2)
    model = {'type': 'build_vlm', 'vision': 'diffclip-tiny', 'language_model': str(language_model_dir)}
    differential = {'variant': 'split', 'lambda_init': 0.8}
    (tmp_path / 'diff.yaml').write_text(yaml.safe_dump({'model': model,
                                                         'attention': {'type': 'differential', **differential}}))
    (tmp_path / 'vanilla.yaml').write_text(yaml.safe_dump({'model': model, 'attention': {'type': 'vanilla'}}))
    vlm = build_vlm('diffclip-tiny', transformers.AutoModelForCausalLM.from_pretrained(language_model_dir))
    differentialize(vlm.language_model, **differential)
    save_adapter(add_lora(vlm, r=4, alpha=8), tmp_path / 'adapter')

    out = tmp_path / 'out'
    result = call(main, ['--model', tmp_path / 'diff.yaml', '--adapter', tmp_path / 'adapter', '--model',
                         tmp_path / 'vanilla.yaml', '--images', images, '--prompts', *PROMPTS, '--out', out,
                         '--device', 'cpu'], tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads((out / 'analysis.json').read_text())
    assert list(data['models']) == ['diff + adapter', 'vanilla']
    assert data['images'] == [str(images / 'scene0.png'), str(images / 'scene1.png')] and data['top_k'] == 25
    diff, vanilla = data['models'].values()
    assert diff['adapter'] == str(tmp_path / 'adapter') and vanilla['adapter'] is None
    for r in (diff, vanilla):
        assert r['layers'] == 2 and len(r['samples']) == 4 and len(r['jaccard']['pairs']) == 2
    assert vanilla['per_layer']['row_sum'] == pytest.approx([1.0, 1.0], abs=1e-5)
    assert all(abs(s - 1) > 1e-3 for s in diff['per_layer']['row_sum'])  # differential in both layers
    for png in ('cosine_similarity', 'attention_entropy', 'attention_mass', 'jaccard'):
        assert _png(out / f'{png}.png'), png
    assert 'A = diff + adapter; B = vanilla' in result.stdout and 'visual-token Jaccard' in result.stdout
    assert f'wrote {out / "attention_mass.png"}' in result.stdout


def test_cli_on_clip_towers_and_its_input_errors(tmp_path, capsys):
    images = _image_folder(tmp_path)
    out = tmp_path / 'out'
    assert main(['--model', 'diffclip-tiny', '--model', 'clip-tiny-baseline', '--images', str(images),
                 '--out', str(out), '--device', 'cpu']) == 0
    data = json.loads((out / 'analysis.json').read_text())
    assert list(data['models']) == ['diffclip-tiny', 'clip-tiny-baseline']
    assert all(r['kind'] == 'clip' and r['layers'] == 4 for r in data['models'].values())
    assert _png(out / 'cosine_similarity.png') and _png(out / 'attention_entropy.png')
    assert not (out / 'attention_mass.png').exists()
    assert 'CLS ent' in capsys.readouterr().out

    (tmp_path / 'empty').mkdir()
    assert main(['--model', 'diffclip-tiny', '--images', str(tmp_path / 'empty'), '--out', str(out)]) == 2
    assert re.search(r'--images .*empty: no image files', capsys.readouterr().err)
    assert main(['--model', 'no-such-clip', '--images', str(images), '--out', str(tmp_path / 'bad')]) == 2
    assert re.search(r"no-such-clip \(no-such-clip\): .*not an open_clip model", capsys.readouterr().err)
    with pytest.raises(SystemExit) as exit_info:
        main(['--model', 'x.yaml', '--images', str(images)])  # no --prompts
    assert exit_info.value.code == 2 and '--model x.yaml is a VLM recipe: pass --prompts' in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(['--model', 'x.yaml', '--model', 'diffclip-tiny', '--images', str(images), '--prompts', 'p'])
    assert exit_info.value.code == 2 and 'one is a VLM recipe, the other an open_clip model' in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(['--model', 'a', '--model', 'b', '--model', 'c', '--images', str(images)])
    assert exit_info.value.code == 2 and '3 models given (a b c)' in capsys.readouterr().err
    for flag, value, why in (('--device', 'bogus', 'not a torch device'), ('--top-k', '0', 'a whole number, 1 or more')):
        with pytest.raises(SystemExit) as exit_info:
            main(['--model', 'diffclip-tiny', '--images', str(images), flag, value])
        assert exit_info.value.code == 2 and f"argument {flag}: '{value}': {why}" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit) as exit_info:
            main(['--model', 'diffclip-tiny', '--images', str(images), '--device', 'cuda'])
        assert exit_info.value.code == 2 and "'cuda': no CUDA device here" in capsys.readouterr().err


@pytest.mark.parametrize('flag', ['--clip', '--vlm-recipe', '--compare'])
def test_cli_takes_models_by_model_only(tmp_path, capsys, flag):
    """--model is the one spelling: the retired --clip / --vlm-recipe / --compare are unknown arguments."""
    with pytest.raises(SystemExit) as exit_info:
        main([flag, 'diffclip-tiny', '--images', str(_image_folder(tmp_path))])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and flag in err and ('unrecognized' in err or 'ambiguous' in err)


def test_cli_top_k_default_is_the_metrics_one():
    from diffzoo.analysis import cli, metrics
    assert cli.TOP_K == metrics.TOP_K
