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
