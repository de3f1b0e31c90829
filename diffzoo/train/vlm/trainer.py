"""transformers' `Trainer` as `python -m diffzoo.train.vlm` trains with it: `VLMTrainer`, with what both kinds of
run add (`diffzoo.train.vlm.cli`'s docstring lists them), and `RunLog`, its log and progress lines. What a checkpoint
holds is each kind's: `finetune.FineTuneTrainer` (the adapter), `stage.StageTrainer` (what the stage holds). A run's
setup and its end are `diffzoo.train.vlm.run`; the choice of checkpoint to resume from, and what a stopped run left,
`diffzoo.train.vlm.resume`."""
import json
import time
from pathlib import Path
from typing import Dict, Optional

import torch
import torch.distributed as dist
from transformers import PrinterCallback, Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from diffzoo.files import repair_json_lines
from diffzoo.train.metrics import drop_records_after
from diffzoo.vlm.data import SkippedImages
from diffzoo.vlm.differential import layer_lambdas
from diffzoo.vlm.parts import PARAMETER_NAMES

from .resume import DATA_COUNTS, writing

PROGRESS_EVERY = 10  # seconds between a run's progress lines on the console; log.jsonl keeps every logged step


class VLMTrainer(Trainer):
    """`Trainer` with λ/sub-norm at their own learning rate, λ in the logs, the data's losses counted and kept in
    each checkpoint, and no step past `max_steps` on a rerun."""

    def __init__(self, *args, lambda_lr: Optional[float] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.remove_callback(PrinterCallback)  # a dict per logged step; RunLog prints the progress (no tqdm bar)
        self.lambda_lr = lambda_lr
        self.skipped_images = SkippedImages()

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.skipped_images.update(inputs)  # pops what the collator dropped before the forward pass
        return super().training_step(model, inputs, num_items_in_batch)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.get('labels')
        if labels is None or bool((labels != -100).any()):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        # Nothing scored (a batch of unreadable images became a placeholder row): a zero loss through the
        # forward pass, so every parameter still takes part (DDP) and the step adds no gradient.
        outputs = model(**{k: v for k, v in inputs.items() if k != 'labels'})
        loss = outputs.logits.float().sum() * 0.0
        return (loss, outputs) if return_outputs else loss

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            trainable = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
            groups = [{'params': [p for n, p in trainable if not n.endswith(PARAMETER_NAMES)]},
                      {'params': [p for n, p in trainable if n.endswith(PARAMETER_NAMES)],
                       'lr': self.lambda_lr or self.args.learning_rate}]
            args = self.args
            self.optimizer = torch.optim.AdamW([g for g in groups if g['params']], lr=args.learning_rate,
                                               betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
                                               weight_decay=args.weight_decay)
        return self.optimizer

    def _run_epoch(self, *args, **kwargs) -> None:
        """Trainer's epoch, none once `max_steps` are done: a finished run rerun from a checkpoint in mid-epoch
        would otherwise take one more step (Trainer checks the count only after a step) and rewrite its output."""
        if self.state.global_step >= self.state.max_steps:
            self.control.should_training_stop = True
            return
        super()._run_epoch(*args, **kwargs)

    def _save_checkpoint(self, model, trial) -> None:
        """Trainer's checkpoint with the data's counts so far (`data_counts`, before trainer_state.json, which
        Trainer writes last); a write that fails ends the run naming the disk (`resume.writing`)."""
        counts = self.data_counts()  # every process saves: the collective is met by all
        folder = Path(self._get_output_dir(trial=trial)) / f'{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}'
        with writing(folder, 'a checkpoint', folder.parent):
            if self.args.should_save:
                folder.mkdir(parents=True, exist_ok=True)
                (folder / DATA_COUNTS).write_text(json.dumps(counts) + '\n')
            super()._save_checkpoint(model, trial)

    def gathered_skipped_images(self) -> SkippedImages:
        """The unreadable images over every process (a collective under DDP: every rank calls it)."""
        parts = all_gathered(self.skipped_images, self.args.world_size)
        return parts[0].merge(parts[1:])

    def data_counts(self) -> Dict:
        """What the data lost so far over every process, as a checkpoint keeps it (a collective under DDP)."""
        return {'skipped_images': self.gathered_skipped_images().record()}

    def restore_data_counts(self, checkpoint: Optional[Path]) -> Dict:
        """Take up the counts `checkpoint` kept, so a resumed run's records cover the whole run (a rerun of a
        finished one writes them unchanged): the files on every process (each named once), the sample counts
        on the first (the processes' counts add up). Returns them ({} for a new run or an older checkpoint)."""
        path = None if checkpoint is None else Path(checkpoint) / DATA_COUNTS
        if path is None or not path.is_file():
            return {}
        counts = json.loads(path.read_text())
        record = counts['skipped_images']
        self.skipped_images = SkippedImages(record['files'])
        if self.args.process_index == 0:
            self.skipped_images.samples_skipped = record['samples_skipped']
            self.skipped_images.samples_trained = record['samples_trained']
        return counts

    def log(self, logs: Dict[str, float], start_time: Optional[float] = None) -> None:
        if 'loss' in logs:
            logs.update({f'lambda/layer_{i}': lam for i, lam in layer_lambdas(self.model).items()})
        super().log(logs, start_time)


class RunLog(TrainerCallback):
    """log.jsonl, a record per logged step, and on the console (rank 0) one progress line every `every` seconds
    and at the last step: steps done out of the run's, loss, elapsed, eta. A log and a checkpoint at the last step.
    A run resumed from step S drops the records after S that the stopped run wrote (it logs those steps again),
    so the file holds each optimizer step once; a last line the stop cut short is dropped
    (`diffzoo.files.repair_json_lines`)."""

    def __init__(self, path: Path, samples_per_step: int, every: float = PROGRESS_EVERY):
        self.path, self.samples_per_step, self.every = path, samples_per_step, every
        self.last_step, self.last_time = 0, time.time()
        self.first_step, self.started = 0, self.last_time  # this process's start: elapsed and eta count from it
        self.shown = self.started  # when the last progress line was printed

    def on_train_begin(self, args, state, control, **kwargs):
        self.last_step, self.last_time = state.global_step, time.time()
        self.first_step, self.started, self.shown = self.last_step, self.last_time, self.last_time
        if state.is_world_process_zero and self.path.exists():  # state.global_step: the checkpoint's, on resume
            cut = repair_json_lines(self.path)
            if cut is not None:
                print(f'{self.path}: its last line was cut short ({cut[:60]!r}…), most likely by a run stopped while '
                      f'writing it; dropped (the steps after {state.global_step}, where this run resumes, are trained '
                      f'and logged again)', flush=True)
            removed = drop_records_after(self.path, state.global_step)
            if removed:
                print(f'{self.path}: {removed} record(s) after step {state.global_step} removed (the stopped run '
                      f'trained past its last complete checkpoint); they are trained and logged again', flush=True)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= state.max_steps:
            control.should_log = control.should_save = True

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or 'loss' not in (logs or {}):
            return
        now = time.time()
        record = {'step': state.global_step, 'epoch': state.epoch, 'loss': logs['loss'],
                  'samples_per_s': ((state.global_step - self.last_step) * self.samples_per_step
                                    / (now - self.last_time)),
                  **{k: v for k, v in logs.items() if k.startswith('lambda/')}}
        self.last_step, self.last_time = state.global_step, now
        with open(self.path, 'a') as f:
            f.write(json.dumps(record) + '\n')
        if now - self.shown >= self.every or state.global_step >= state.max_steps:
            self.shown = now
            print(self.progress(record, state.max_steps, now), flush=True)

    def progress(self, record: Dict, max_steps: int, now: float) -> str:
        """The console's line for a log record: `RUN: step S/MAX  loss L  elapsed Ts  eta Ts  (N samples/s)`."""
        elapsed, done = now - self.started, record['step'] - self.first_step
        eta = elapsed / done * (max_steps - record['step']) if done > 0 else float('nan')
        return (f'  {self.path.parent.name}: step {record["step"]}/{max_steps}  loss {record["loss"]:.4f}  '
                f'elapsed {elapsed:.0f}s  eta {eta:.0f}s  ({record["samples_per_s"]:.1f} samples/s)')


def all_gathered(obj, world: int) -> list:
    """`obj` from every process, rank order (a collective under DDP: every rank calls it); [obj] alone."""
    if world == 1:
        return [obj]
    parts = [None] * world
    dist.all_gather_object(parts, obj)
    return parts
