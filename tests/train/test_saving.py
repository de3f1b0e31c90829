"""Checkpoints written whole or not at all, and a full disk named: `diffzoo.train.saving` on real files, and
`python -m diffzoo.train` on a small tmpfs (real processes, in a mount namespace of their own)."""
import io
import os
import shlex
import shutil
import subprocess
import sys
import zipfile

import pytest
import torch

from diffzoo.train.saving import MB, TorchForCheckpoints, checkpoint_bytes, save_whole, tensor_bytes
from tests.factory import write_shards

RECIPE = 'clip-tiny-baseline'


def test_a_checkpoint_is_written_whole_and_renamed_into_place(tmp_path):
    state = {'epoch': 1, 'state_dict': {'w': torch.randn(64, 64)}, 'optimizer': {'m': [torch.zeros(10)]}}
    path = tmp_path / 'epoch_1.pt'
    save_whole(state, path)
    assert zipfile.is_zipfile(path) and sorted(os.listdir(tmp_path)) == ['epoch_1.pt']  # no partial left beside it
    assert torch.equal(torch.load(path, weights_only=True)['state_dict']['w'], state['state_dict']['w'])
    assert tensor_bytes(state) == (64 * 64 + 10) * 4
    buffer = io.BytesIO()  # what is not a path goes to torch.save as it is
    TorchForCheckpoints(torch).save(state, buffer)
    assert torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)['epoch'] == 1
    assert TorchForCheckpoints(torch).nn is torch.nn


def _mount_namespaces() -> bool:
    try:
        return subprocess.run(['unshare', '-Urm', 'true'], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.slow  # three trainings' processes
@pytest.mark.skipif(shutil.which('unshare') is None or not _mount_namespaces(),
                    reason='needs unshare -Urm (a mount namespace) for a small tmpfs')
def test_a_full_disk_is_named_keeps_the_last_good_checkpoint_and_the_run_resumes_once_there_is_room(tmp_path):
    """Logs on a tmpfs that holds one checkpoint and not two: the save of epoch_latest (tmp.pt) stops the run with
    'no space left', epoch_1.pt is whole and nothing cut is left; a rerun on the still-full disk is refused before
    it builds or logs anything; with room again the run resumes from epoch_1.pt."""
    write_shards(tmp_path / 'shards', 2, 8)
    one = checkpoint_bytes(RECIPE) / MB
    disk = tmp_path / 'disk'
    disk.mkdir()
    train = shlex.join([sys.executable, '-m', 'diffzoo.train', '--recipe', RECIPE, '--train_data', 'shards',
                        '--epochs', '1', '--global_batch_size', '8', '--logs', str(disk / 'runs')])
    script = f'''
        set -u
        mount -t tmpfs -o size={int(one + 40)}m tmpfs {disk}
        {train} > out1 2> err1; echo $? > rc1
        cp -r {disk}/runs after1
        {train} > out2 2> err2; echo $? > rc2
        mount -o remount,size={int(3 * one + 40)}m {disk}
        {train} > out3 2> err3; echo $? > rc3
        cp -r {disk}/runs after3
    '''
    done = subprocess.run(['unshare', '-Urm', 'bash', '-c', script], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    err = {i: (tmp_path / f'err{i}').read_text() for i in (1, 2, 3)}
    rc = {i: int((tmp_path / f'rc{i}').read_text()) for i in (1, 2, 3)}

    checkpoints = disk / 'runs' / RECIPE / 'checkpoints'
    assert rc[1] == 2, err[1][-3000:]
    assert f'error: no space left on {checkpoints}: {one:,.0f} MB needed for tmp.pt, ' in err[1]
    assert 'iostream error' not in err[1] and 'Traceback' not in err[1]
    first = tmp_path / 'after1' / RECIPE / 'checkpoints'
    assert sorted(os.listdir(first)) == ['epoch_1.pt']  # whole; no tmp.pt, no partial file, no epoch_latest.pt
    assert torch.load(first / 'epoch_1.pt', weights_only=True)['epoch'] == 1

    assert rc[2] == 2, err[2][-3000:]
    assert (f'error: no space left on {disk / "runs" / RECIPE}: {one:,.0f} MB needed for one checkpoint of {RECIPE}'
            in err[2])
    assert 'Logging error' not in err[2] and 'Traceback' not in err[2] and not (tmp_path / 'out2').read_text()

    assert rc[3] == 0, err[3][-3000:]
    assert 'INFO:root:' not in err[1] + err[3]  # open_clip's log lines once each, in its own format
    assert (f'{checkpoints}/epoch_latest.pt is missing; resuming from epoch_1.pt, the newest epoch checkpoint beside '
            'it written whole') in err[3]
    last = tmp_path / 'after3' / RECIPE / 'checkpoints'
    assert torch.load(last / 'epoch_latest.pt', weights_only=True)['epoch'] == 1
