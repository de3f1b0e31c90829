"""λ of every differential layer, and the training loss, logged while open_clip_train trains.

`RUN_DIR/lambda.jsonl` holds one record per logged step:
    {"step": 120, "epoch": 0, "lr": 0.00049, "loss": 3.91, "lambda": {"visual.trunk.blocks.0.attn": 0.79, …}}
`step` counts optimizer updates done; λ is read after that update and `loss` is the loss the update
was computed from (record 0 is the initial λ, without loss). Records are written every
`--log-every-n-steps` steps and at the end of each epoch. λ also goes, as `lambda/<layer>` scalars at
that step, to tensorboard and to wandb when `--report-to` names them (the same scalars to both, beside
open_clip_train's own `train/…` ones). Layers whose λ depends on the input (variant v2) are not logged.

`DataWait` measures how long each epoch's loop waits for its batches (the host's time inside the loader's
`next`), which open_clip's `Data (t)` over-counts: it stops a step's clock before its log line waits for the GPU to
finish the step, and counts that wait as the next step's data time.
"""
import json
import logging
import os
import time
from typing import Dict, Iterator, List, Optional

import torch

from diffzoo.files import atomic_write_text
from diffzoo.layers import DifferentialAttention
from diffzoo.train.lambda_log import LAMBDA_FILE


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The model under DDP (`.module`) and torch.compile (`._orig_mod`) wrappers."""
    while True:
        inner = getattr(model, 'module', None) or getattr(model, '_orig_mod', None)
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


def _differential(m: torch.nn.Module) -> bool:
    """A `DifferentialAttention`, or one scripted (open_clip_train's --torchscript): a RecursiveScriptModule named
    after its class (`diff_attn_layer`'s classes are named DifferentialAttention_…)."""
    if isinstance(m, DifferentialAttention):
        return True
    return (isinstance(m, torch.jit.RecursiveScriptModule)
            and getattr(m, 'original_name', '').startswith(DifferentialAttention.__name__))


def lambda_layers(model: torch.nn.Module) -> Dict[str, DifferentialAttention]:
    """Differential layers with an input-independent λ, by module name (vision then text)."""
    return {name: m for name, m in unwrap(model).named_modules()
            if _differential(m) and m.variant != 'v2'}


def lambda_values(layers: Dict[str, DifferentialAttention]) -> Dict[str, float]:
    if not layers:
        return {}
    with torch.no_grad():
        values = torch.stack([m.compute_lambda(None).reshape(()) for m in layers.values()]).tolist()
    return dict(zip(layers, values))


def lambda_scalars(lam: Dict[str, float]) -> Dict[str, float]:
    """The scalars tensorboard and wandb receive for one record's λ: `lambda/<layer>` → value."""
    return {f'lambda/{name}': value for name, value in lam.items()}


def drop_records_after(path, step: int, key: str = 'step') -> int:
    """Remove the records whose `key` ('step'; 'epoch' in data.jsonl) is after `step` from a resumed run's JSON-lines
    log (lambda.jsonl, data.jsonl, the VLM's log.jsonl: the stopped run's steps or epochs past the checkpoint
    resumed from, which the run trains and logs again), so that each is in the file once; rewritten atomically.
    Returns how many were removed."""
    path = str(path)
    with open(path) as f:
        lines = f.read().splitlines()
    kept = [line for line in lines if json.loads(line)[key] <= step]
    if len(kept) < len(lines):
        atomic_write_text(path, ''.join(line + '\n' for line in kept))
    return len(lines) - len(kept)


class LambdaLog:
    """Follows one epoch of open_clip_train's loop through its scheduler calls and loss outputs."""

    def __init__(self, run_dir: Optional[str], model, optimizer, epoch: int, steps_per_epoch: int, every: int,
                 tb_writer=None, wandb: bool = False):
        self.path = os.path.join(run_dir, LAMBDA_FILE) if run_dir else None
        self.layers = lambda_layers(model) if run_dir else {}
        self.optimizer, self.epoch, self.every, self.tb_writer = optimizer, epoch, max(1, every), tb_writer
        # micro-batches left over when accum_freq does not divide the batches are scheduled with the
        # next epoch's first step, but no optimizer step follows them
        self.end_step = (epoch + 1) * steps_per_epoch
        self.step: Optional[int] = None  # the step in progress (0-based, as open_clip counts)
        self.loss_sum: Optional[torch.Tensor] = None
        self.loss_count = 0
        self.wandb = None
        if self.path is not None and os.path.exists(self.path):
            # by epoch, not by step: a resume may change the steps per epoch (other workers or batch), and the
            # epochs before this one are kept whole; this epoch's records (step 0's too) are written again
            drop_records_after(self.path, epoch - 1, key='epoch')
        if wandb and self.path is not None:
            import wandb as wandb_module  # heavy optional dependency, imported only when --report-to names it
            self.wandb = wandb_module

    def wrap_scheduler(self, scheduler):
        def scheduled(step):
            self.on_step(step)
            return scheduler(step) if scheduler is not None else None
        return scheduled

    def on_loss(self, module, inputs, output) -> None:
        if self.path is None or self.step is None:
            return
        total = sum(output.values()) if isinstance(output, dict) else output
        total = total.detach().float()
        self.loss_sum = total if self.loss_sum is None else self.loss_sum + total
        self.loss_count += 1

    def on_step(self, step: int) -> None:
        if self.path is None or step == self.step or step >= self.end_step:
            return  # gradient accumulation calls the scheduler once per micro-batch
        if self.step is None:
            if step == 0:
                self._write(0, loss=None)
        else:
            self._finish(final=False)
        self.step, self.loss_sum, self.loss_count = step, None, 0

    def end_epoch(self) -> None:
        if self.path is not None and self.step is not None:
            self._finish(final=True)
            self.step = None

    def _finish(self, final: bool) -> None:
        done = self.step + 1
        if final or done % self.every == 0:
            loss = (self.loss_sum / self.loss_count).item() if self.loss_count else None
            self._write(done, loss)

    def _write(self, step: int, loss: Optional[float]) -> None:
        lam = lambda_values(self.layers)
        record = {'step': step, 'epoch': self.epoch, 'lr': self.optimizer.param_groups[0]['lr'],
                  'loss': loss, 'lambda': lam}
        with open(self.path, 'a') as f:
            f.write(json.dumps(record) + '\n')
        scalars = lambda_scalars(lam)
        if self.tb_writer is not None:
            for name, value in scalars.items():
                self.tb_writer.add_scalar(name, value, step)
        if self.wandb is not None and scalars:
            # wandb drops a step that goes back; open_clip_train logs `train/…` at the step in progress, never ahead
            self.wandb.log(scalars, step=step)


DATA_WAIT_LINE = 'diffzoo data wait'


class DataWait:
    """The epoch's training loader, its batches timed: `waits` holds the host's seconds inside `next()` for each
    batch (where `for batch in dataloader` blocks), `first_at` the clock when the first batch came. Every other
    attribute is the loader's (open_clip reads num_batches, num_samples)."""

    def __init__(self, loader):
        self.loader = loader
        self.waits: List[float] = []
        self.first_at: Optional[float] = None

    def __getattr__(self, name):
        return getattr(self.loader, name)

    def __iter__(self) -> Iterator:
        batches = iter(self.loader)
        while True:
            start = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                return
            now = time.perf_counter()
            self.waits.append(now - start)
            if self.first_at is None:
                self.first_at = now
            yield batch

    def summary(self, started: float, ended: float) -> Dict:
        """Seconds waiting and seconds in all, over the epoch (`started` to `ended`, the loop's clock) and after
        its first batch (whose wait holds the workers' start), with the shares."""
        waited, total = sum(self.waits), ended - started
        later = sum(self.waits[1:])
        since_first = ended - self.first_at if self.first_at is not None else 0.0
        return {'batches': len(self.waits), 'wait_s': waited, 'epoch_s': total,
                'share': waited / total if total > 0 else None,
                'wait_after_first_s': later, 'after_first_s': since_first,
                'share_after_first': later / since_first if since_first > 0 else None}


def log_data_wait(epoch: int, summary: Dict) -> None:
    """One line in the run's log (out.log): the epoch's wait for data, all of it and after its first batch (the
    epoch counted from 1, as the data report counts it)."""
    def pct(x):
        return 'n/a' if x is None else f'{100 * x:.1f} %'
    logging.info(f'{DATA_WAIT_LINE}: epoch {epoch + 1}: {summary["batches"]} batches, {summary["wait_s"]:.3f} s of '
                 f'{summary["epoch_s"]:.3f} s waiting for them ({pct(summary["share"])}); after the first, '
                 f'{summary["wait_after_first_s"]:.3f} s of {summary["after_first_s"]:.3f} s '
                 f'({pct(summary["share_after_first"])})')
