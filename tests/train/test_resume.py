"""Resuming a CLIP run: the same weights as the uninterrupted run, a missing or unreadable latest checkpoint
giving way to an intact one (local, and on fsspec's file:// and memory:// filesystems standing in for object
stores), and a checkpoint that would run code refused, on real files (`python -m diffzoo.train`
through its `main` in this process; tests/train/test_end_to_end.py kills and resumes real processes)."""
import json
import logging
import os
import shutil

import fsspec
import open_clip_train.file_utils
import open_clip_train.main
import pytest
import torch

from diffzoo.checkpoint import CheckpointError, UnsafeCheckpointError
from diffzoo.train.resume import latest_checkpoint, load_resume_checkpoint
from diffzoo.train.launch import main
from tests.factory import call, write_shards

RECIPE = 'clip-tiny-baseline'
ARGV = ['--recipe', RECIPE, '--train_data', 'shards', '--epochs', '2', '--global_batch_size', '8']
CUT_ZIP = 'RuntimeError: PytorchStreamReader failed reading zip archive: failed finding central directory'


@pytest.fixture(scope='module')
def whole_run(tmp_path_factory):
    """Two uninterrupted epochs of 2 steps on 16 samples (one data-loader worker, as the tiny recipes)."""
    root = tmp_path_factory.mktemp('whole')
    write_shards(root / 'shards', 2, 8)
    result = call(main, ARGV, cwd=root)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return root


def _stopped_after_epoch_1(whole_run, tmp_path):
    """A copy of the run as a kill between epoch 1 and 2 leaves it; returns its checkpoints folder."""
    root = tmp_path / 'run'
    shutil.copytree(whole_run, root)
    checkpoints = root / 'runs' / RECIPE / 'checkpoints'
    (checkpoints / 'epoch_2.pt').unlink()
    shutil.copy(checkpoints / 'epoch_1.pt', checkpoints / 'epoch_latest.pt')
    return checkpoints


def _cut(path):
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])


def _weights(path):
    return torch.load(path, map_location='cpu', weights_only=True)['state_dict']


def _assert_same_weights(a, b):
    a, b = _weights(a), _weights(b)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f'{key}: max diff {(a[key] - b[key]).abs().max().item()}'


def test_a_run_resumed_at_an_epoch_boundary_trains_the_same_weights(whole_run, tmp_path):
    checkpoints = _stopped_after_epoch_1(whole_run, tmp_path)
    result = call(main, ARGV, cwd=checkpoints.parents[2])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert '(epoch 1)' in result.stderr  # open_clip's "=> resuming checkpoint … (epoch 1)"
    assert (f'\nrun directory: runs/{RECIPE}\nresuming {RECIPE} from epoch 1 of 2 (checkpoint '
            f'runs/{RECIPE}/checkpoints/epoch_latest.pt)\n') in result.stdout  # said before open_clip_train starts
    _assert_same_weights(checkpoints / 'epoch_2.pt', whole_run / 'runs' / RECIPE / 'checkpoints' / 'epoch_2.pt')
    # the stopped run had reported epoch 2 (then lost its checkpoint): data.jsonl counts it once, as lambda.jsonl
    epochs = [json.loads(line)['epoch'] for line in (checkpoints.parent / 'data.jsonl').read_text().splitlines()]
    assert epochs == [1, 2]
    steps = [json.loads(line)['step'] for line in (checkpoints.parent / 'lambda.jsonl').read_text().splitlines()]
    assert steps == sorted(set(steps))


def test_ctrl_c_ends_on_a_line_naming_what_the_same_command_resumes_from(whole_run, tmp_path, monkeypatch):
    """KeyboardInterrupt in open_clip_train's loop: one line, no traceback, exit 130 (scripts/train.sh's real
    Ctrl-C: tests/train/test_train_sh.py)."""
    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(open_clip_train.main, 'main', interrupted)
    checkpoints = _stopped_after_epoch_1(whole_run, tmp_path)
    result = call(main, ARGV, cwd=checkpoints.parents[2])
    assert result.returncode == 130 and 'Traceback' not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f'interrupted: run the same command again to resume from epoch 1 (checkpoint '
        f'runs/{RECIPE}/checkpoints/epoch_latest.pt)')
    write_shards(tmp_path / 'new' / 'shards', 2, 8)
    result = call(main, ARGV, cwd=tmp_path / 'new')
    assert result.returncode == 130
    assert result.stderr.strip().splitlines()[-1] == (
        'interrupted: no epoch was checkpointed yet; the same command starts the run over')


def test_a_cut_latest_checkpoint_gives_way_to_the_newest_intact_one(whole_run, tmp_path):
    checkpoints = _stopped_after_epoch_1(whole_run, tmp_path)
    _cut(checkpoints / 'epoch_latest.pt')
    result = call(main, ARGV, cwd=checkpoints.parents[2])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f'epoch_latest.pt is unreadable ({CUT_ZIP}); resuming from epoch_1.pt' in result.stderr
    _assert_same_weights(checkpoints / 'epoch_2.pt', whole_run / 'runs' / RECIPE / 'checkpoints' / 'epoch_2.pt')
    assert torch.load(checkpoints / 'epoch_latest.pt', weights_only=True)['epoch'] == 2  # written anew


def test_a_missing_latest_checkpoint_resumes_from_the_newest_epoch_instead_of_starting_over(whole_run, tmp_path):
    checkpoints = _stopped_after_epoch_1(whole_run, tmp_path)
    (checkpoints / 'epoch_latest.pt').unlink()  # open_clip_train alone would train epoch 1 again from scratch
    result = call(main, ARGV, cwd=checkpoints.parents[2])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (f'runs/{RECIPE}/checkpoints/epoch_latest.pt is missing; resuming from epoch_1.pt, the newest epoch '
            'checkpoint beside it') in result.stderr
    assert '(epoch 1)' in result.stderr
    _assert_same_weights(checkpoints / 'epoch_2.pt', whole_run / 'runs' / RECIPE / 'checkpoints' / 'epoch_2.pt')
    assert torch.load(checkpoints / 'epoch_1.pt', weights_only=True)['epoch'] == 1  # the link was not written through
    assert torch.load(checkpoints / 'epoch_latest.pt', weights_only=True)['epoch'] == 2


def test_a_missing_latest_checkpoint_with_no_intact_epoch_is_a_named_error(whole_run, tmp_path):
    checkpoints = _stopped_after_epoch_1(whole_run, tmp_path)
    (checkpoints / 'epoch_latest.pt').unlink()
    _cut(checkpoints / 'epoch_1.pt')
    result = call(main, ARGV, cwd=checkpoints.parents[2])
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    assert (f'error: cannot resume from runs/{RECIPE}/checkpoints: epoch_latest.pt is missing and epoch_1.pt was '
            'not written whole (saves cut short). Delete the checkpoints folder to start the run over') in result.stderr
    assert 'put in place' not in result.stderr  # nothing is claimed before it is known to be whole
    assert not (checkpoints / 'epoch_latest.pt').exists() and not (checkpoints / 'epoch_2.pt').exists()


def _record(checkpoints):
    return json.loads((checkpoints.parent / 'diffzoo-run.json').read_text())


def test_lambda_lr_added_to_a_run_trained_without_it_is_refused_and_the_record_left_as_it_was(whole_run, tmp_path):
    """The checkpoint's optimizer has no groups of λ's own, so the resume could not load it: refused by name
    before anything is built, the record unchanged."""
    checkpoints = _stopped_after_epoch_1(whole_run, tmp_path)
    before = _record(checkpoints)
    refused = call(main, ARGV + ['--lambda_lr', '1e-2'], cwd=checkpoints.parents[2])
    assert refused.returncode == 2, refused.stdout[-3000:] + refused.stderr[-3000:]
    assert (f'error: runs/{RECIPE} trained without lambda_lr: its checkpoint\'s optimizer has no groups of λ\'s own '
            'to resume; resume without lambda_lr') in refused.stderr
    assert _record(checkpoints) == before and 'lambda_lr' not in before


def test_a_resume_that_changes_the_schedule_is_refused_unless_accepted_and_then_recorded(whole_run, tmp_path):
    """Resumed after epoch 1 with another global batch: refused with the schedule before and after and the
    learning rate at the resumed step under each; with --accept-changed-settings it trains on, says so, and
    the run's record holds the new settings and the change."""
    checkpoints = _stopped_after_epoch_1(whole_run, tmp_path)
    changed = ARGV[:-1] + ['16']
    refused = call(main, changed, cwd=checkpoints.parents[2])
    assert refused.returncode == 2, refused.stdout[-3000:] + refused.stderr[-3000:]
    assert (f'error: runs/{RECIPE} was trained with other settings (batch_size: 8 -> 16; warmup: 1 -> 0), which '
            'change its learning-rate schedule: the schedule was global batch 8, 2 steps per epoch, warm-up 1 steps, '
            '2 epochs; now global batch 16, 1 steps per epoch, warm-up 0 steps, 2 epochs: resuming after epoch 1, '
            'the learning rate goes from 0.00075 (the old schedule there) to 0.0005') in refused.stderr
    assert 'pass --accept-changed-settings to train on with these' in refused.stderr
    assert not (checkpoints / 'epoch_2.pt').exists() and _record(checkpoints)['batch_size'] == 8

    accepted = call(main, ['--accept-changed-settings'] + changed, cwd=checkpoints.parents[2])
    assert accepted.returncode == 0, accepted.stdout[-3000:] + accepted.stderr[-3000:]
    assert 'warning: the learning-rate schedule changes (--accept-changed-settings): the schedule was' in accepted.stderr
    assert torch.load(checkpoints / 'epoch_2.pt', weights_only=True)['epoch'] == 2
    record = _record(checkpoints)
    assert record['batch_size'] == 16 and record['warmup'] == 0
    assert record['changes_on_resume'] == [{'epoch': 1, 'changed': {'batch_size': [8, 16], 'warmup': [1, 0]},
                                            'accepted': '--accept-changed-settings'}]


def test_a_resume_with_other_workers_keeps_the_schedule_says_it_is_no_replay_and_records_it(whole_run, tmp_path):
    checkpoints = _stopped_after_epoch_1(whole_run, tmp_path)
    result = call(main, ARGV + ['--workers', '2'], cwd=checkpoints.parents[2])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert ('warning: workers: 1 -> 2: the run goes on, but no longer replays the uninterrupted run bit for bit '
            '(another sample order or other numerics)') in result.stderr
    assert _record(checkpoints)['changes_on_resume'] == [
        {'epoch': 1, 'changed': {'workers': [1, 2]}, 'accepted': 'kept the schedule'}]


def test_a_finished_run_is_lengthened_by_more_epochs(whole_run, tmp_path):
    root = tmp_path / 'run'
    shutil.copytree(whole_run, root)
    result = call(main, ARGV[:5] + ['3'] + ARGV[6:], cwd=root)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert ('warning: epochs 2 -> 3: the run is lengthened; the schedule was global batch 8, 2 steps per epoch, '
            'warm-up 1 steps, 2 epochs; now global batch 8, 2 steps per epoch, warm-up 1 steps, 3 epochs: resuming '
            'after epoch 2, the learning rate goes from 0 (the old schedule there) to 0.000345') in result.stderr
    checkpoints = root / 'runs' / RECIPE / 'checkpoints'
    assert torch.load(checkpoints / 'epoch_3.pt', weights_only=True)['epoch'] == 3
    assert _record(checkpoints)['changes_on_resume'][0]['accepted'] == 'lengthened'


def test_latest_is_never_a_save_cut_short(tmp_path):
    """open_clip_train's own choice without --save-most-recent is the last *.pt by name: tmp.pt."""
    for name in ('epoch_2.pt', 'epoch_10.pt', 'tmp.pt'):
        (tmp_path / name).write_bytes(b'')
    assert open_clip_train.main.get_latest_checkpoint(str(tmp_path), remote=False).endswith('tmp.pt')
    assert latest_checkpoint(str(tmp_path), remote=False) == str(tmp_path / 'epoch_10.pt')
    (tmp_path / 'epoch_latest.pt').write_bytes(b'')
    assert latest_checkpoint(str(tmp_path), remote=False) == str(tmp_path / 'epoch_latest.pt')
    assert latest_checkpoint(str(tmp_path / 'none'), remote=False) is None


@pytest.mark.parametrize('protocol', ['memory', 'file'])
def test_a_remote_resume_falls_back_to_the_newest_intact_epoch(whole_run, tmp_path, protocol, caplog):
    """The checkpoints on an fsspec filesystem, as `--remote-sync` leaves them in an object store."""
    fs = fsspec.filesystem(protocol)
    root = f'memory://{tmp_path.name}/run/checkpoints' if protocol == 'memory' else f'file://{tmp_path}/checkpoints'
    folder = root.split('://', 1)[1]
    fs.makedirs(folder, exist_ok=True)
    local = whole_run / 'runs' / RECIPE / 'checkpoints'
    for name in ('epoch_1.pt', 'epoch_2.pt', 'epoch_latest.pt'):
        fs.pipe_file(f'{folder}/{name}', (local / name).read_bytes())
    fs.pipe_file(f'{folder}/tmp.pt', b'cut')
    try:
        assert latest_checkpoint(root, remote=True) == f'{root}/epoch_latest.pt'
        assert load_resume_checkpoint(f'{root}/epoch_latest.pt', map_location='cpu')['epoch'] == 2
        fs.rm(f'{folder}/epoch_latest.pt')
        assert latest_checkpoint(root, remote=True) == f'{root}/epoch_2.pt'
        data = (local / 'epoch_2.pt').read_bytes()
        fs.pipe_file(f'{folder}/epoch_2.pt', data[:len(data) // 2])
        with caplog.at_level(logging.WARNING):  # (whatever level an earlier test left the root logger at)
            assert load_resume_checkpoint(f'{root}/epoch_2.pt', map_location='cpu')['epoch'] == 1
        assert f'epoch_2.pt is unreadable ({CUT_ZIP}); resuming from epoch_1.pt' in caplog.text
        fs.pipe_file(f'{folder}/epoch_1.pt', b'not a checkpoint')
        with pytest.raises(CheckpointError, match=rf'cannot resume from {root}: epoch_2\.pt is unreadable .*; '
                                                  r'epoch_1\.pt is unreadable .*--name NEW'):
            load_resume_checkpoint(f'{root}/epoch_2.pt', map_location='cpu')
    finally:
        if protocol == 'memory':
            fs.rm(folder, recursive=True)


def test_the_newest_intact_epoch_checkpoint_is_chosen(whole_run, tmp_path):
    checkpoints = tmp_path / 'checkpoints'
    shutil.copytree(whole_run / 'runs' / RECIPE / 'checkpoints', checkpoints)
    with pytest.raises(CheckpointError, match=r'^--resume .*epoch_9\.pt: no such checkpoint file \(beside it: '
                                              r'.*epoch_2\.pt.*\); give a checkpoint that is there'):
        load_resume_checkpoint(str(checkpoints / 'epoch_9.pt'), map_location='cpu')  # mistyped: no fall-back
    _cut(checkpoints / 'epoch_latest.pt')
    assert load_resume_checkpoint(str(checkpoints / 'epoch_latest.pt'), map_location='cpu')['epoch'] == 2
    _cut(checkpoints / 'epoch_2.pt')
    assert load_resume_checkpoint(str(checkpoints / 'epoch_latest.pt'), map_location='cpu')['epoch'] == 1
    assert load_resume_checkpoint(str(checkpoints / 'epoch_2.pt'), map_location='cpu')['epoch'] == 1
    _cut(checkpoints / 'epoch_1.pt')
    with pytest.raises(CheckpointError, match=r'epoch_latest\.pt is unreadable .*; epoch_2\.pt is unreadable .*; '
                                              r'epoch_1\.pt is unreadable .*--name NEW'):
        load_resume_checkpoint(str(checkpoints / 'epoch_latest.pt'), map_location='cpu')


def test_no_intact_checkpoint_is_a_named_error_not_a_traceback(whole_run, tmp_path):
    checkpoints = _stopped_after_epoch_1(whole_run, tmp_path)
    _cut(checkpoints / 'epoch_latest.pt')
    _cut(checkpoints / 'epoch_1.pt')
    result = call(main, ARGV, cwd=checkpoints.parents[2])
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    assert (f'error: cannot resume from runs/{RECIPE}/checkpoints: epoch_latest.pt is unreadable ({CUT_ZIP}); '
            f'epoch_1.pt is unreadable ({CUT_ZIP}).') in result.stderr
    assert 'Traceback' not in result.stderr
    assert not (checkpoints / 'epoch_2.pt').exists()


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f'touch {self.marker}',)


def test_a_planted_checkpoint_is_refused_even_when_torch_is_told_to_unpickle_anything(whole_run, tmp_path,
                                                                                     monkeypatch):
    checkpoints = _stopped_after_epoch_1(whole_run, tmp_path)
    marker = tmp_path / 'payload-ran'
    checkpoint = torch.load(checkpoints / 'epoch_1.pt', weights_only=True)
    torch.save({**checkpoint, 'name': _Payload(marker)}, checkpoints / 'epoch_latest.pt')

    monkeypatch.setenv('TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD', '1')
    result = call(main, ARGV, cwd=checkpoints.parents[2])
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    assert (f'error: runs/{RECIPE}/checkpoints/epoch_latest.pt: refused to unpickle global(s) posix.system'
            in result.stderr)
    assert not marker.exists()
    assert not (checkpoints / 'epoch_2.pt').exists()  # no fall-back past a planted file

    with pytest.raises(UnsafeCheckpointError, match='posix.system'):
        load_resume_checkpoint(str(checkpoints / 'epoch_latest.pt'), map_location='cpu')
    assert not marker.exists()
    open_clip_train.file_utils.pt_load(str(checkpoints / 'epoch_latest.pt'), map_location='cpu')
    assert marker.exists()  # what open_clip_train's own loader does with it


def test_the_same_paths_spelled_otherwise_resume_the_run(tmp_path, monkeypatch):
    """--logs and --train-data written relative or absolute, with or without ./, from the run's folder: the same run;
    other data is still another run."""
    from open_clip_train.params import parse_args

    from diffzoo.train.recipe import RecipeError
    from diffzoo.train.run_record import check_run_dir
    monkeypatch.chdir(tmp_path)

    def args(logs, data):
        return parse_args(['--model', 'diffclip-tiny', '--train-data', data, '--train-num-samples', '16', '--logs',
                           logs, '--name', 'run'])

    check_run_dir(args('runs', 'shards/{00000..00001}.tar'), 0, 1, None, False)
    (tmp_path / 'runs' / 'run' / 'checkpoints').mkdir()
    (tmp_path / 'runs' / 'run' / 'checkpoints' / 'epoch_1.pt').write_bytes(b'')
    again = args(str(tmp_path / 'runs'), './shards/{00000..00001}.tar')
    assert check_run_dir(again, 0, 1, None, False) == str(tmp_path / 'runs' / 'run')
    with pytest.raises(RecipeError, match=r'holds a run started with other settings \(train_data: '):
        check_run_dir(args('runs', 'other/{00000..00001}.tar'), 0, 1, None, False)
