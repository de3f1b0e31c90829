import open_clip
import open_clip.coca_model
import open_clip.factory
import open_clip.model
import pytest

from diffzoo.clip import seams


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
        seams.wrap_function(open_clip.factory, 'load_state_dict', ('checkpoint_path',), lambda f: f)


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
