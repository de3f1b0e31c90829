"""λ logging (diffzoo/train/metrics.py): the same `lambda/<layer>` scalars to lambda.jsonl, tensorboard and wandb."""
import json
import struct
import time

import pytest
import timm
import torch
import torch.nn as nn

from diffzoo.train.lambda_log import read_lambda_log
from diffzoo.train.metrics import LambdaLog, lambda_scalars

STEPS, EVERY = 5, 2


def _train(run_dir, tb_writer=None, wandb=False, upstream_log=None):
    """Two epochs of 5 optimizer steps on vit_diff_micro_patch8_64, driven as open_clip_train drives
    LambdaLog: the scheduler is called with the step in progress, the loss module's outputs are hooked,
    and `upstream_log(step)` runs where open_clip_train logs its own `train/…` scalars."""
    model = timm.create_model('vit_diff_micro_patch8_64', num_classes=3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    loss_fn = nn.CrossEntropyLoss()
    x, y = torch.randn(2, 3, 64, 64), torch.tensor([0, 2])
    for epoch in range(2):
        log = LambdaLog(str(run_dir), model, optimizer, epoch, STEPS, EVERY, tb_writer, wandb)
        hook = loss_fn.register_forward_hook(log.on_loss)
        scheduler = log.wrap_scheduler(None)
        for i in range(STEPS):
            step = STEPS * epoch + i
            scheduler(step)
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            optimizer.step()
            if upstream_log is not None and (i % EVERY == 0 or i == STEPS - 1):
                upstream_log(step)
        hook.remove()
        log.end_epoch()


def _wandb_records(data: bytes):
    """The records of an offline run's `.wandb` file (wandb's record log: a 7-byte header, then 32 KiB
    blocks of chunks, each `crc32c (4) | length (2) | type (1) | data`, type 1 full, 2–4 first/middle/last)."""
    from wandb.proto import wandb_internal_pb2
    assert data[:4] == b':W&B'
    records, pos, chunk = [], 7, b''
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack('<IHB', data[pos:pos + 7])
        if pos + 7 + length > len(data):
            break  # a chunk still being written
        chunk += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            records.append(record)
            chunk = b''
    return records


def _wandb_history(run_file, timeout=60.0):
    """The history rows of a finished offline run, once its `exit` record is on disk (wandb's service
    process may still be writing the file when wandb.finish() returns)."""
    deadline = time.monotonic() + timeout
    while True:
        records = _wandb_records(run_file.read_bytes())
        if any(r.WhichOneof('record_type') == 'exit' for r in records) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    return [{item.key or '/'.join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
            for r in records if r.WhichOneof('record_type') == 'history']


def test_lambda_scalars_are_named_by_layer():
    assert lambda_scalars({'visual.trunk.blocks.0.attn': 0.8, 'transformer.resblocks.1.attn': 0.7}) == {
        'lambda/visual.trunk.blocks.0.attn': 0.8, 'lambda/transformer.resblocks.1.attn': 0.7}
    assert lambda_scalars({}) == {}


def test_wandb_gets_the_lambda_scalars_tensorboard_gets(tmp_path, monkeypatch):
    wandb = pytest.importorskip('wandb')
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter
    for key in ('WANDB_DIR', 'WANDB_CONFIG_DIR', 'WANDB_CACHE_DIR', 'WANDB_DATA_DIR'):
        monkeypatch.setenv(key, str(tmp_path / 'wandb-home'))
    monkeypatch.setenv('WANDB_MODE', 'offline')
    monkeypatch.setenv('WANDB_SILENT', 'true')
    (tmp_path / 'wandb-home').mkdir()
    run_dir, tb_dir = tmp_path / 'run', tmp_path / 'run' / 'tensorboard'
    run_dir.mkdir()
    run = wandb.init(project='diffzoo-test', dir=str(tmp_path / 'wandb-home'))
    writer = SummaryWriter(str(tb_dir))
    try:
        _train(run_dir, writer, wandb=True, upstream_log=lambda step: wandb.log({'train/step': step}, step=step))
    finally:
        writer.close()
        wandb.finish()

    records = read_lambda_log(str(run_dir))
    # record 0, steps 2 and 4, the epoch's end at 5; then 6 and 8 (every 2 steps) and the end at 10
    assert [r['step'] for r in records] == [0, 2, 4, 5, 6, 8, 10]
    layers = [f'blocks.{i}.attn' for i in range(4)]
    assert all(list(r['lambda']) == layers for r in records)
    assert records[-1]['lambda'] != records[0]['lambda']  # λ is trained

    events = EventAccumulator(str(tb_dir)).Reload()
    tensorboard = {(s.step, tag): s.value for tag in events.Tags()['scalars'] for s in events.Scalars(tag)}
    rows = _wandb_history(next((tmp_path / 'wandb-home').rglob(f'run-{run.id}.wandb')))
    logged = {(row['_step'], name): value for row in rows for name, value in row.items()
              if name.startswith('lambda/')}
    expected = {(r['step'], name): value for r in records for name, value in lambda_scalars(r['lambda']).items()}
    assert len(expected) == 7 * 4
    assert logged == pytest.approx(expected)  # none dropped by wandb for a step that went back
    assert tensorboard == pytest.approx(expected, abs=1e-6)  # tensorboard keeps float32
    upstream = [row['_step'] for row in rows if 'train/step' in row]
    assert upstream == [0, 2, 4, 5, 7, 9]  # open_clip_train's own scalars are kept beside λ


def test_wandb_is_not_imported_without_report_to_wandb(tmp_path):
    model = timm.create_model('vit_diff_micro_patch8_64', num_classes=3)
    log = LambdaLog(str(tmp_path), model, torch.optim.SGD(model.parameters(), lr=0.1), 0, STEPS, EVERY)
    assert log.wandb is None
    off_rank = LambdaLog(None, model, torch.optim.SGD(model.parameters(), lr=0.1), 0, STEPS, EVERY, wandb=True)
    assert off_rank.wandb is None  # only the rank that writes lambda.jsonl logs λ


def test_a_resume_keeps_the_epochs_before_it_whatever_its_steps_per_epoch(tmp_path):
    """A run resumed at epoch 1 with fewer steps per epoch (other workers, another batch) keeps epoch 0's records
    whole and drops only those of the epochs it trains again; a restart at epoch 0 writes step 0 once."""
    _train(tmp_path)
    path = tmp_path / 'lambda.jsonl'
    records = [json.loads(line) for line in path.read_text().splitlines()]
    first = [r for r in records if r['epoch'] == 0]
    assert [r['step'] for r in first] == [0, 2, 4, 5]
    model = timm.create_model('vit_diff_micro_patch8_64', num_classes=3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    LambdaLog(str(tmp_path), model, optimizer, 1, STEPS - 1, EVERY)  # resumed at epoch 1, 4 steps an epoch
    assert [json.loads(line) for line in path.read_text().splitlines()] == first
    log = LambdaLog(str(tmp_path), model, optimizer, 0, STEPS, EVERY)  # stopped before its first checkpoint
    log.wrap_scheduler(None)(0)
    assert [json.loads(line)['step'] for line in path.read_text().splitlines()] == [0]


class _SlowItems(torch.utils.data.Dataset):
    """Each item takes `seconds` to make, in the loop's own process (no workers): the loop waits for every one."""

    def __init__(self, n, seconds):
        self.n, self.seconds = n, seconds

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        time.sleep(self.seconds)
        return torch.tensor([i])


def test_data_wait_times_the_loaders_batches_not_the_loops_own_work():
    """A real DataLoader whose batches take 40 ms each, a loop body of 20 ms: the waits are the 40 ms, the share
    about two thirds, and the loader's own attributes are reachable through the wrapper."""
    from diffzoo.train.metrics import DataWait
    loader = torch.utils.data.DataLoader(_SlowItems(6, 0.04), batch_size=1)
    loader.num_batches = 6  # as open_clip_train's loaders carry it
    waits = DataWait(loader)
    started = time.perf_counter()
    seen = []
    for batch in waits:
        time.sleep(0.02)
        seen.append(int(batch))
    summary = waits.summary(started, time.perf_counter())
    assert seen == list(range(6)) and waits.num_batches == 6 and summary['batches'] == 6
    assert all(0.035 < w < 0.2 for w in waits.waits)
    assert 0.5 < summary['share'] < 0.75 and 0.5 < summary['share_after_first'] < 0.75
    assert summary['wait_s'] <= summary['epoch_s'] and summary['wait_after_first_s'] < summary['wait_s']
