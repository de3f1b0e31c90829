import os

import open_clip_train.data
import open_clip_train.main
import pytest
import torch

from diffzoo.clip.seams import OpenClipChanged
from diffzoo.train import data_events, seams
from diffzoo.train.shuffle import SeededShuffle


def _current():
    return (open_clip_train.main.train_one_epoch, open_clip_train.main.pt_load,
            open_clip_train.data.get_wds_dataset, open_clip_train.data.tarfile_to_samples_nothrow,
            open_clip_train.data.filter_no_caption_or_no_image, open_clip_train.data.log_and_continue,
            torch.nn.parallel.DistributedDataParallel, open_clip_train.main.torch, open_clip_train.data.wds)


def test_seams_hold_for_one_run_and_are_undone_after_it():
    before = _current()
    with seams.installed():
        during = _current()
        assert all(a is not b for a, b in zip(before, during))
        assert torch.nn.parallel.DistributedDataParallel is seams.CpuAwareDistributedDataParallel
        assert isinstance(open_clip_train.data.wds.shuffle(10, 2), SeededShuffle)
        assert open_clip_train.main.pt_load is seams.load_resume_checkpoint
        assert open_clip_train.main.torch.save is seams.TorchForCheckpoints.save  # checkpoints whole or none
        assert open_clip_train.main.torch.optim is torch.optim  # the rest is torch's
        assert open_clip_train.data.wds.DataPipeline is before[-1].DataPipeline  # the rest is webdataset's
        assert os.path.isdir(os.environ[data_events.ENV])
        events = os.environ[data_events.ENV]
    assert _current() == before
    assert data_events.ENV not in os.environ and not os.path.exists(events)


def test_installing_twice_keeps_one_resume_loader_and_undoes_to_the_original():
    before = _current()
    with seams.installed():
        with seams.installed():
            assert open_clip_train.main.pt_load is seams.load_resume_checkpoint
        assert open_clip_train.main.pt_load is seams.load_resume_checkpoint
    assert _current() == before


def _future_train_one_epoch(model, data, epoch, optimizer, args):
    raise AssertionError('not reached')


def _future_pt_load(path, device=None):
    raise AssertionError('not reached')


@pytest.mark.parametrize('module, name, future', [
    (open_clip_train.main, 'train_one_epoch', _future_train_one_epoch),
    (open_clip_train.main, 'pt_load', _future_pt_load),
])
def test_a_changed_open_clip_train_fails_loudly_and_changes_nothing(monkeypatch, module, name, future):
    monkeypatch.setattr(module, name, future)
    before = _current()
    with pytest.raises(OpenClipChanged, match=rf'open_clip_train\.main\.{name}.*no longer takes'):
        with seams.installed():
            raise AssertionError('not reached')
    assert _current() == before
