import re

import open_clip
import open_clip.coca_model
import open_clip.factory
import open_clip.model
import pytest
import torch
from torch import nn

from diffzoo.clip import DiffTextTransformer, seams
from diffzoo.seam import Seam
from diffzoo.layers import DifferentialAttention


def test_install_is_idempotent():
    before = open_clip.model._build_text_tower
    n_paths = len(open_clip.factory._MODEL_CONFIG_PATHS)
    seams.install()
    seams.install()
    wrapper = open_clip.model._build_text_tower
    original = getattr(wrapper, '__diffzoo_original__')
    assert not hasattr(original, '__diffzoo_original__')  # never a wrapper of a wrapper
    assert getattr(before, '__diffzoo_original__') is original
    assert len(open_clip.factory._MODEL_CONFIG_PATHS) == n_paths
    assert open_clip.coca_model._build_text_tower is wrapper
    assert open_clip.list_pretrained_tags_by_model('diffclip-b16') == ['cc3m', 'cc12m']


def test_changed_open_clip_internals_fail_loudly(monkeypatch):
    def _build_text_tower(text_cfg, embed_dim):  # a future signature
        raise AssertionError('not reached')

    monkeypatch.setattr(open_clip.model, '_build_text_tower', _build_text_tower)
    with pytest.raises(seams.OpenClipChanged, match=r'_build_text_tower.*tested with open_clip_torch 3\.3'):
        seams.install()
    monkeypatch.delattr(open_clip.factory, 'load_state_dict')
    with pytest.raises(seams.OpenClipChanged, match='has no open_clip.factory.load_state_dict'):
        Seam(open_clip.factory, 'load_state_dict', None, '', ('checkpoint_path',)).original(seams.OpenClipChanged)


def test_plain_open_clip_models_are_untouched():
    model = open_clip.create_model('ViT-S-32-alt') if 'ViT-S-32-alt' in open_clip.list_models() else None
    model = model or open_clip.create_model('RN50')
    assert not any(type(m).__module__.startswith('diffzoo') for m in model.modules())


def test_unknown_diffzoo_keys_are_refused():
    cfg = open_clip.get_model_config('diffclip-tiny')
    cfg['text_cfg']['diffzoo']['lambda'] = 0.5
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['lambda'\]"):
        open_clip.model.CLIP(**cfg)


def _normalize(preprocess):
    norm = preprocess.transforms[-1]
    return tuple(norm.mean), tuple(norm.std), preprocess.transforms[0].interpolation.value


IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225), 'bilinear')


def test_a_run_checkpoint_loads_with_its_runs_preprocessing(tmp_path, recwarn):
    """open_clip_train's epoch_K.pt carries no preprocessing; its run directory's settings do."""
    import json
    import torch
    model = open_clip.create_model('diffclip-tiny')
    run = tmp_path / 'run'
    (run / 'checkpoints').mkdir(parents=True)
    torch.save({'epoch': 1, 'state_dict': model.state_dict()}, run / 'checkpoints' / 'epoch_1.pt')
    (run / 'params.txt').write_text("model: diffclip-tiny\nimage_mean: (0.485, 0.456, 0.406)\n"
                                    "image_std: (0.229, 0.224, 0.225)\nimage_interpolation: bilinear\n")
    checkpoint = str(run / 'checkpoints' / 'epoch_1.pt')
    _, _, preprocess = open_clip.create_model_and_transforms('diffclip-tiny', pretrained=checkpoint)
    assert _normalize(preprocess) == IMAGENET  # from open_clip_train's params.txt
    (run / 'diffzoo-run.json').write_text(json.dumps({'image_mean': [0.5, 0.5, 0.5], 'image_std': [0.25] * 3}))
    _, _, preprocess = open_clip.create_model_and_transforms('diffclip-tiny', pretrained=checkpoint)
    assert _normalize(preprocess)[:2] == ((0.5, 0.5, 0.5), (0.25, 0.25, 0.25))  # diffzoo's record first
    _, _, preprocess = open_clip.create_model_and_transforms('diffclip-tiny', pretrained=checkpoint,
                                                             image_mean=(0.1, 0.2, 0.3))
    assert _normalize(preprocess)[:2] == ((0.1, 0.2, 0.3), (0.25, 0.25, 0.25))  # what the caller forces wins
    assert not [w for w in recwarn if 'no record of the preprocessing' in str(w.message)]


def test_a_bare_weights_file_warns_once_naming_what_it_assumes(tmp_path):
    import torch
    torch.save(open_clip.create_model('diffclip-tiny').state_dict(), tmp_path / 'weights.pt')
    with pytest.warns(UserWarning, match=r"weights\.pt: no record of the preprocessing .* assuming \{'mean': "
                                         r"\(0\.4814"):
        open_clip.create_model_and_transforms('diffclip-tiny', pretrained=str(tmp_path / 'weights.pt'))
    import warnings
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter('always')
        open_clip.create_model_and_transforms('diffclip-tiny', pretrained=str(tmp_path / 'weights.pt'))
        open_clip.create_model_and_transforms('diffclip-tiny', pretrained=str(tmp_path / 'weights.pt'),
                                              image_mean=IMAGENET[0], image_std=IMAGENET[1],
                                              image_interpolation='bilinear')
    assert not [w for w in again if 'no record' in str(w.message)]  # once per file; nothing assumed when all given


def _built_from(text_fields, differential):
    """The text tower `_build_text_tower` builds from diffclip-tiny's text_cfg with `text_fields` set, differential
    (its diffzoo key) or open_clip's own (without it)."""
    cfg = open_clip.get_model_config('diffclip-tiny')
    text_cfg = {**cfg['text_cfg'], **text_fields}
    if not differential:
        text_cfg.pop('diffzoo')
    return open_clip.model._build_text_tower(cfg['embed_dim'], text_cfg, quick_gelu=True)


def _layout(module):
    """Class (diffzoo's named as the open_clip class it mirrors), widths, eps, bias and layer-scale values of
    `module`: what the tower's config chooses outside the attention layer."""
    linear = (module.in_features, module.out_features, module.bias is not None) if isinstance(module, nn.Linear) else ()
    norm = (module.normalized_shape, module.eps) if isinstance(module, nn.LayerNorm) else ()
    scale = module.gamma.tolist() if isinstance(module, open_clip.transformer.LayerScale) else ()
    return type(module).__name__.removeprefix('Diff'), linear, norm, scale


TOWER_SETTINGS = ('context_length', 'num_pos', 'vocab_size', 'width', 'heads', 'output_dim', 'pad_id', 'eos_id',
                  'pool_type', 'output_tokens', 'use_pad_mask', 'correct_cls_mask')


@pytest.mark.parametrize('text_fields', [
    dict(mlp_ratio=2.0, ls_init_value=0.1, pad_id=1, eos_id=3, pool_type='eos', proj_bias=True, output_tokens=True,
         norm_kwargs=dict(eps=1e-6), embed_cls=True),
    dict(block_type='custom'),
    dict(qk_norm=True, scale_attn_inner=True, scale_attn=True, scale_fc=True, ls_init_value=0.5),
    dict(block_type='default', scale_fc=True, no_causal_mask=True),
], ids=['tower', 'block_type', 'custom_options', 'default_wins'])
def test_the_differential_text_tower_gets_every_text_cfg_field_open_clips_gets(text_fields):
    """open_clip's own builder maps the whole CLIPTextCfg onto the differential tower: its embeddings, mask,
    pooling and projection, and each block's norms, MLP, layer scales and block type (open_clip's rule: "custom"
    by name or by any custom option, "default" by name) are those of open_clip's tower from the same config;
    the attention layer holds the q/k norms and inner norm open_clip's custom attention has."""
    diff, plain = _built_from(text_fields, True), _built_from(text_fields, False)
    assert isinstance(diff, DiffTextTransformer) and type(plain) is open_clip.transformer.TextTransformer
    assert open_clip.model.TextTransformer is open_clip.transformer.TextTransformer  # bound for the one call only
    assert [getattr(diff, k) for k in TOWER_SETTINGS] == [getattr(plain, k) for k in TOWER_SETTINGS]
    assert (diff.attn_mask is None) == (plain.attn_mask is None)
    assert diff.attn_mask is None or torch.equal(diff.attn_mask, plain.attn_mask)
    assert {k: v.shape for k, v in diff.named_parameters(recurse=False)} == \
        {k: v.shape for k, v in plain.named_parameters(recurse=False)}  # embeddings, class token, projection
    outside = [(name, _layout(m)) for name, m in plain.named_modules() if not re.search(r'\.attn(\.|$)', name)]
    assert [(name, _layout(m)) for name, m in diff.named_modules() if not re.search(r'\.attn(\.|$)', name)] == outside
    for ours, theirs in zip(diff.transformer.resblocks, plain.transformer.resblocks, strict=True):
        assert isinstance(ours.attn, DifferentialAttention)
        for mine, open_clips in (('q_norm', 'ln_q'), ('k_norm', 'ln_k'), ('norm', 'ln_inner')):
            assert _layout(getattr(ours.attn, mine)) == _layout(getattr(theirs.attn, open_clips, nn.Identity()))


@pytest.mark.parametrize('field', ['scaled_cosine_attn', 'scale_heads'])
def test_text_cfg_options_without_a_differential_counterpart_are_refused(field):
    with pytest.raises(ValueError, match=rf"text_cfg\.{field}=true is an option of open_clip's one-map attention"):
        _built_from({field: True}, True)
    assert open_clip.model.TextTransformer is open_clip.transformer.TextTransformer  # restored after the error


def test_a_custom_differential_text_tower_trains_with_grad_checkpointing():
    """open_clip's own custom block takes no (x, None, None, mask) call, which its grad checkpointing makes;
    the differential custom block does, with the gradients of the plain run."""
    tower = _built_from(dict(block_type='custom', scale_attn=True, scale_fc=True), True)
    text = open_clip.get_tokenizer('diffclip-tiny')(['a red circle', 'two blue squares'])

    def grads(enable):
        tower.zero_grad()
        tower.set_grad_checkpointing(enable)
        tower(text).square().sum().backward()
        return [p.grad.clone() for p in tower.parameters()]

    for a, b in zip(grads(False), grads(True)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_text_transformer_not_open_clips_own_fails_loudly(monkeypatch):
    monkeypatch.setattr(open_clip.model, 'TextTransformer', type('TextTransformer', (torch.nn.Module,), {}))
    with pytest.raises(seams.OpenClipChanged, match='open_clip.model.TextTransformer is no longer'):
        _built_from({}, True)


def test_uninstall_puts_open_clip_s_own_back_and_install_applies_the_table_again():
    wrapper = open_clip.model._build_text_tower
    try:
        seams.uninstall()
        for row in seams.SEAMS:
            assert not hasattr(getattr(row.module, row.name), '__diffzoo_original__'), row.where
        assert open_clip.model._build_text_tower is getattr(wrapper, '__diffzoo_original__')
        assert open_clip.list_pretrained_tags_by_model('diffclip-b16') == []
    finally:
        seams.install()
    assert open_clip.coca_model._build_text_tower is open_clip.model._build_text_tower is not wrapper  # made again
    assert open_clip.list_pretrained_tags_by_model('diffclip-b16') == ['cc3m', 'cc12m']
