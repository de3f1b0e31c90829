import logging
import os
import types
import warnings

import open_clip_train.data
import open_clip_train.main
import open_clip_train.scheduler
import pytest
import torch

from diffzoo.clip.seams import OpenClipChanged
from diffzoo.train import data_events, data_stages, seams
from diffzoo.train.launch import main
from diffzoo.train.shuffle import SeededShuffle
from tests.factory import call, write_shards


def _current():
    return (open_clip_train.main.train_one_epoch, open_clip_train.main.pt_load,
            open_clip_train.data.get_wds_dataset, open_clip_train.data.tarfile_to_samples_nothrow,
            open_clip_train.data.filter_no_caption_or_no_image, open_clip_train.data.log_and_continue,
            open_clip_train.main.torch.nn.parallel.DistributedDataParallel, open_clip_train.main.torch,
            open_clip_train.data.wds)


def test_seams_hold_for_one_run_and_are_undone_after_it():
    before = _current()
    with seams.installed():
        during = _current()
        assert all(a is not b for a, b in zip(before, during))
        assert open_clip_train.main.torch.nn.parallel.DistributedDataParallel is seams.CpuAwareDistributedDataParallel
        assert torch.nn.parallel.DistributedDataParallel is seams.DistributedDataParallel  # torch's own: untouched
        assert isinstance(open_clip_train.data.wds.shuffle(10, 2), SeededShuffle)
        assert open_clip_train.main.pt_load is seams.load_resume_checkpoint
        assert open_clip_train.main.torch.save is seams.TorchForCheckpoints.save  # checkpoints whole or none
        assert open_clip_train.main.torch.optim is torch.optim  # the rest is torch's
        assert open_clip_train.data.wds.SimpleShardList is before[-1].SimpleShardList  # the rest is webdataset's
        assert open_clip_train.data.wds.DataPipeline.__func__ is data_stages.CountingWebdataset.DataPipeline
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


def _untouched(loggers=None):
    """Every name a run's table replaces (all its rows), torch's DDP, the warning filters, the environment variable,
    the root logger and the levels of `loggers` (the loggers there are now)."""
    names = {row.where: getattr(row.module, row.name) for row in seams.table('', 1.0, data_backend='device')}
    loggers = loggers or [n for n, x in logging.root.manager.loggerDict.items() if isinstance(x, logging.Logger)]
    return (names, torch.nn.parallel.DistributedDataParallel, list(warnings.filters), os.environ.get(data_events.ENV),
            list(logging.root.handlers), logging.root.level, {name: logging.getLogger(name).level for name in loggers})


def test_a_run_that_raises_leaves_open_clip_train_as_it_was_and_nothing_of_torch_is_changed():
    before = _untouched()
    with pytest.raises(KeyError):
        with seams.installed(lambda_lr_scale=1.0, data_backend='device'):
            assert torch.nn.parallel.DistributedDataParallel is before[1]
            assert open_clip_train.main.torch.nn.parallel is not torch.nn.parallel
            raise KeyError('the run fails')
    assert _untouched(before[-1]) == before


@pytest.mark.parametrize('module, name, future, message', [
    (open_clip_train.scheduler, 'assign_learning_rate', lambda optimizer, lr, warmup: None,
     r"open_clip_train\.scheduler\.assign_learning_rate\('optimizer', 'lr'\) no longer takes"),
    (open_clip_train.main, 'torch', types.SimpleNamespace(), r'open_clip_train\.main\.torch is no longer torch'),
])
def test_the_whole_table_is_checked_before_any_name_is_replaced(monkeypatch, module, name, future, message):
    """The table's last rows changed: the rows before them are not applied either."""
    monkeypatch.setattr(module, name, future)
    before = _untouched()
    with pytest.raises(OpenClipChanged, match=message):
        with seams.installed(lambda_lr_scale=1.0):
            raise AssertionError('not reached')
    assert _untouched(before[-1]) == before


@pytest.mark.slow  # two trainings, in this process
def test_after_a_training_and_after_one_that_failed_open_clip_train_torch_and_the_filters_are_as_before(tmp_path):
    write_shards(tmp_path / 'shards', 2, 8)
    argv = ['--train_data', 'shards', '--epochs', '1', '--global_batch_size', '8', '--lambda_lr', '1e-2']
    before = _untouched()
    result = call(main, ['--recipe', 'diffclip-tiny', '--data_backend', 'device'] + argv, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (tmp_path / 'runs' / 'diffclip-tiny' / 'checkpoints' / 'epoch_1.pt').is_file()
    assert _untouched(before[-1]) == before
    with pytest.raises(ValueError, match='lambda_lr: the model has no differential parameters'):  # in main's AdamW
        call(main, ['--recipe', 'clip-tiny-baseline'] + argv, cwd=tmp_path)
    assert _untouched(before[-1]) == before


def test_lambda_lr_puts_lambda_and_sub_norm_in_their_own_groups_under_the_schedule():
    """With a recipe's lambda_lr, open_clip_train's own AdamW call and cosine schedule (as main makes them)
    give λ and the sub-norm lambda_lr × the schedule's factor and every other parameter lr × that factor."""
    import open_clip_train.main as main_mod
    from open_clip_train.scheduler import cosine_lr

    from diffzoo.train import seams
    with seams.installed(lambda_lr_scale=100.0):
        model = main_mod.create_model_and_transforms('diffclip-tiny')[0]
        named = list(model.named_parameters())
        decay = [p for n, p in named if p.ndim >= 2]
        no_decay = [p for n, p in named if p.ndim < 2]
        optimizer = main_mod.optim.AdamW([{'params': no_decay, 'weight_decay': 0.}, {'params': decay, 'weight_decay': 0.2}],
                                         lr=1e-4)
        schedule = cosine_lr(optimizer, 1e-4, 10, 100)
        schedule(4)  # in warm-up: 5/10 of the base rate
    by_id = {id(p): g for g in optimizer.param_groups for p in g['params']}
    differential = {n for n, _ in named if '.lambda_' in n or '.sub_norm.' in n}
    assert differential and all(by_id[id(p)]['lr'] == pytest.approx(5e-3) for n, p in named if n in differential)
    assert all(by_id[id(p)]['lr'] == pytest.approx(5e-5) for n, p in named if n not in differential)
    assert sum(len(g['params']) for g in optimizer.param_groups) == len(named)
    assert main_mod.optim is torch.optim  # restored after the run


def test_a_resume_keeps_the_lambda_lr_given_now_and_names_a_checkpoint_grouped_otherwise():
    import open_clip_train.main as main_mod

    def optimizer_of(scale):
        with seams.installed(lambda_lr_scale=scale):
            model = main_mod.create_model_and_transforms('diffclip-tiny')[0]
            return main_mod.optim.AdamW([{'params': [p for p in model.parameters()]}], lr=1e-4)
    saved = optimizer_of(100.0).state_dict()
    resumed = optimizer_of(10.0)
    resumed.load_state_dict(saved)
    assert sorted(g.get('lr_scale', 1.0) for g in resumed.param_groups) == [1.0, 10.0]
    with pytest.raises(ValueError, match='lambda_lr: the checkpoint.s optimizer has 1 parameter groups'):
        resumed.load_state_dict(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))]).state_dict())
