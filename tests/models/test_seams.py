import timm
import timm.models._factory
import pytest

from diffzoo.models import seams


def test_install_is_idempotent():
    before = timm.models._factory.load_checkpoint
    seams.install()
    seams.install()
    wrapper = timm.models._factory.load_checkpoint
    original = getattr(wrapper, '__diffzoo_original__')
    assert not hasattr(original, '__diffzoo_original__')  # never a wrapper of a wrapper
    assert wrapper is before
    assert original is timm.models.load_checkpoint  # the public function users call stays timm's own


def test_a_changed_load_checkpoint_fails_loudly(monkeypatch):
    def load_checkpoint(model, checkpoint_path, strict=True):  # a future signature
        raise AssertionError('not reached')

    monkeypatch.setattr(timm.models._factory, 'load_checkpoint', load_checkpoint)
    with pytest.raises(seams.TimmChanged, match=r"load_checkpoint\('model', 'checkpoint_path', 'strict'\) no longer "
                                                r"takes .*tested with timm"):
        seams.install()


def test_uninstall_puts_timm_s_own_load_checkpoint_back():
    wrapper = timm.models._factory.load_checkpoint
    try:
        seams.uninstall()
        assert timm.models._factory.load_checkpoint is timm.models.load_checkpoint
    finally:
        seams.install()
    assert getattr(timm.models._factory.load_checkpoint, '__diffzoo_original__') is timm.models.load_checkpoint
    assert timm.models._factory.load_checkpoint is not wrapper  # the table applied again, from timm's own
