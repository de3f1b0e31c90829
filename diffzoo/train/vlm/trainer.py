"""The fine-tuning `python -m diffzoo.train.vlm` runs (`diffzoo.train.vlm.cli` parses the command): `VLMTrainer`,
transformers' `Trainer` with diffzoo's additions, its log callback, and `run`, which takes a checked recipe from
data to results.json. The choice of checkpoint to resume from, and what a stopped run left, are
`diffzoo.train.vlm.resume`."""
import contextlib
import json
import math
import os
import time
from pathlib import Path
from typing import Dict, List, Optional

import matplotlib
import torch
import torch.distributed as dist
from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from diffzoo.eval.vqa import accuracy, answer_questions, gather_answers, left_out
from diffzoo.recipes import RecipeError
from diffzoo.train.metrics import drop_records_after
from diffzoo.vlm.data import SkippedImages, load_vqav2
from diffzoo.vlm.differential import PARAMETER_NAMES, layer_lambdas
from diffzoo.vlm.factory import load_vlm
from diffzoo.vlm.lora import load_adapter_weights, save_adapter, trainable_parameters
from diffzoo.vlm.plan import training_plan

from .inputs import check_settings
from .resume import DATA_COUNTS, RUN_RECIPE, repair_log, resume_point, writing

SKIPPED_IMAGES = 'skipped_images.json'
PROGRESS_EVERY = 10  # seconds between a run's progress lines on the console; log.jsonl keeps every logged step


class VLMTrainer(Trainer):
    """`Trainer` with λ/sub-norm at their own learning rate, adapter-only checkpoints and λ in the logs."""

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
            a = self.args
            self.optimizer = torch.optim.AdamW([g for g in groups if g['params']], lr=a.learning_rate,
                                               betas=(a.adam_beta1, a.adam_beta2), eps=a.adam_epsilon,
                                               weight_decay=a.weight_decay)
        return self.optimizer

    def _save(self, output_dir: Optional[str] = None, state_dict=None) -> None:
        if self.args.should_save:
            save_adapter(self.model, output_dir or self.args.output_dir)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        load_adapter_weights(self.model, resume_from_checkpoint)

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

    def data_counts(self) -> Dict:
        """What the data lost so far over every process, as a checkpoint keeps it (a collective under DDP)."""
        parts = all_gathered(self.skipped_images, self.args.world_size)
        return {'skipped_images': parts[0].merge(parts[1:]).record()}

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
    (`resume.repair_log`)."""

    def __init__(self, path: Path, samples_per_step: int, every: float = PROGRESS_EVERY):
        self.path, self.samples_per_step, self.every = path, samples_per_step, every
        self.last_step, self.last_time = 0, time.time()
        self.first_step, self.started = 0, self.last_time  # this process's start: elapsed and eta count from it
        self.shown = self.started  # when the last progress line was printed

    def on_train_begin(self, args, state, control, **kwargs):
        self.last_step, self.last_time = state.global_step, time.time()
        self.first_step, self.started, self.shown = self.last_step, self.last_time, self.last_time
        if state.is_world_process_zero and self.path.exists():  # state.global_step: the checkpoint's, on resume
            cut = repair_log(self.path)
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
                  'samples_per_s': (state.global_step - self.last_step) * self.samples_per_step / (now - self.last_time),
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


def plot_loss(log: List[Dict], path: Path) -> None:
    matplotlib.use('Agg')
    from matplotlib.figure import Figure
    fig = Figure(figsize=(5, 3.2))
    ax = fig.subplots()
    ax.plot([r['step'] for r in log], [r['loss'] for r in log])
    ax.set_xlabel('optimizer step')
    ax.set_ylabel('answer-token loss')
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def accumulation(recipe: Dict, world: int) -> int:
    """Micro-batches per optimizer step: `grad_accum`, or what `global_batch_size` makes of batch_size × world."""
    total = recipe.get('global_batch_size')
    if total is None:
        return recipe['grad_accum']
    per_pass = recipe['batch_size'] * world
    if total % per_pass:
        raise RecipeError(f'global_batch_size {total} is not a multiple of batch_size {recipe["batch_size"]} × {world} '
                          f'process(es) = {per_pass}; choose a batch_size (and process count) that divides it')
    return total // per_pass


def warmup(recipe: Dict) -> float:
    """Trainer's warmup_steps: steps, or below 1 a fraction of the steps (`warmup_ratio`)."""
    ratio = recipe.get('warmup_ratio')
    if ratio is None:
        return recipe['warmup_steps']
    if recipe['warmup_steps']:
        raise RecipeError(f'warmup_ratio {ratio} and warmup_steps {recipe["warmup_steps"]} both given; keep one')
    if not 0 <= ratio < 1:
        raise RecipeError(f'warmup_ratio {ratio}: a fraction of the steps in [0, 1)')
    return ratio


def training_arguments(recipe: Dict, run_dir: Path, cuda: bool) -> TrainingArguments:
    precision = recipe['precision'] or ('bf16' if cuda else 'fp32')
    report = [r for r in recipe['report_to'].split(',') if r and r != 'none']
    world = int(os.environ.get('WORLD_SIZE', '1'))  # torchrun's; Trainer's world_size once it has started
    fsdp = recipe.get('fsdp')
    # a full state dict: Trainer then saves through `_save`, which writes what a stage holds (accelerate's default
    # for FSDP2, a sharded one, would bypass it)
    sharding = {} if fsdp is None else dict(fsdp='full_shard auto_wrap',
                                            fsdp_config=dict(fsdp, state_dict_type='FULL_STATE_DICT'))
    return TrainingArguments(**sharding,
        output_dir=str(run_dir / 'checkpoints'), per_device_train_batch_size=recipe['batch_size'],
        gradient_accumulation_steps=accumulation(recipe, world), learning_rate=recipe['lr'],
        weight_decay=recipe['weight_decay'], num_train_epochs=recipe['epochs'],
        max_steps=recipe['max_steps'] or -1, lr_scheduler_type=recipe['lr_scheduler'],
        warmup_steps=warmup(recipe), max_grad_norm=recipe['max_grad_norm'], bf16=precision == 'bf16',
        logging_steps=recipe['log_every'], save_steps=recipe['save_every'], save_total_limit=2,
        seed=recipe['seed'], use_cpu=not cuda, dataloader_drop_last=True,
        dataloader_num_workers=recipe['workers'], remove_unused_columns=False, report_to=report or 'none',
        log_level='warning', disable_tqdm=True)  # RunLog prints the progress


@contextlib.contextmanager
def _tensorboard_dir(run_dir: Path):
    """transformers' TensorBoard callback writes to $TENSORBOARD_LOGGING_DIR: RUN_DIR/tensorboard for this run
    (unless the user set it), put back afterwards so the next run in the same process writes to its own."""
    given = os.environ.get('TENSORBOARD_LOGGING_DIR')
    os.environ['TENSORBOARD_LOGGING_DIR'] = given or str(run_dir / 'tensorboard')
    try:
        yield
    finally:
        if given is None:
            os.environ.pop('TENSORBOARD_LOGGING_DIR', None)


def all_gathered(obj, world: int) -> list:
    """`obj` from every process, rank order (a collective under DDP: every rank calls it); [obj] alone."""
    if world == 1:
        return [obj]
    parts = [None] * world
    dist.all_gather_object(parts, obj)
    return parts


def start_run(run_dir: Path, recipe: Dict, name: str, checkpoint: Optional[Path], line: str) -> None:
    """Rank 0's start of a run: its recipe in RUN_DIR, `line` printed, and the step it resumes from."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / RUN_RECIPE).write_text(json.dumps(recipe, indent=1) + '\n')
    print(line, flush=True)
    if checkpoint is not None:
        step = json.loads((checkpoint / TRAINER_STATE_NAME).read_text())['global_step']
        print(f'resuming {name} from step {step} ({checkpoint})', flush=True)


def run_log(run_dir: Path) -> List[Dict]:
    """The run's loss log (RunLog's log.jsonl)."""
    return [json.loads(line) for line in (run_dir / 'log.jsonl').read_text().splitlines()]


def write_results(run_dir: Path, results: Dict, log: List[Dict]) -> None:
    """results.json and, with a log, the loss curve (loss.png)."""
    (run_dir / 'results.json').write_text(json.dumps(results, indent=1) + '\n')
    if log:
        plot_loss(log, run_dir / 'loss.png')


def run(recipe: Dict, name: str) -> Dict:
    """Fine-tune as the (validated) recipe says; returns what results.json holds."""
    with _tensorboard_dir(Path(recipe['output']) / name):
        return _run(recipe, name)


def _run(recipe: Dict, name: str) -> Dict:
    check_settings(recipe)
    run_dir = Path(recipe['output']) / name
    cuda = torch.cuda.is_available() and recipe['device'] != 'cpu'
    args = training_arguments(recipe, run_dir, cuda)
    rank, world = args.process_index, args.world_size
    data = recipe['data']
    seed = recipe['seed'] if data['seed'] is None else data['seed']
    train_set = load_vqav2(data['root'], data['split'], data['fraction'], seed)
    val_set = load_vqav2(data['root'], data['val_split'], data['val_fraction'], seed) if data['val_split'] else []
    steps_per_epoch = len(train_set) // (recipe['batch_size'] * world) // args.gradient_accumulation_steps
    if steps_per_epoch == 0:
        raise RecipeError(f'{len(train_set)} training samples make no optimizer step at batch {recipe["batch_size"]} × '
                          f'accumulation {args.gradient_accumulation_steps} × {world} processes; lower batch_size or '
                          f'raise data.fraction')
    max_steps = recipe['max_steps'] or math.ceil(steps_per_epoch * recipe['epochs'])  # as Trainer counts them
    checkpoint = resume_point(recipe, run_dir, args)

    torch.manual_seed(recipe['seed'])  # a build_vlm projector (and eRAM-V post-MLP) starts from this seed
    vlm = load_vlm(recipe['model'], differential=recipe['differential'])
    vlm.apply_plan(training_plan(recipe))
    counts = trainable_parameters(vlm.model)
    if rank == 0:
        start_run(run_dir, recipe, name, checkpoint,
                  f'{name}: {len(train_set)} training questions, {max_steps} steps of {recipe["batch_size"]} × '
                  f'{args.gradient_accumulation_steps} × {world}; trainable {counts}')
    samples_per_step = recipe['batch_size'] * args.gradient_accumulation_steps * world
    trainer = VLMTrainer(model=vlm.model, args=args, train_dataset=train_set,
                         data_collator=vlm.collator(train=True, max_length=data['max_length']),
                         callbacks=[RunLog(run_dir / 'log.jsonl', samples_per_step)], lambda_lr=recipe['lambda_lr'])
    trainer.restore_data_counts(checkpoint)
    trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)
    parts = all_gathered(trainer.skipped_images, world)
    skipped = parts[0].merge(parts[1:])

    results = {'recipe': name, 'steps': trainer.state.global_step, 'trainable_parameters': counts}
    if val_set:
        if rank == 0:
            print(f'evaluating on {len(val_set)} validation questions ({world} process(es))', flush=True)
        vlm.model.eval()
        answers = gather_answers(answer_questions(vlm, val_set, recipe['batch_size'], recipe['eval_max_new_tokens'],
                                                  rank, world), world)
        results.update(vqa_accuracy=accuracy(answers, val_set), questions=len(answers),
                       questions_left_out=left_out(answers, val_set))
        if rank == 0 and results['questions_left_out']:
            print(f'VQA accuracy over the {len(answers)} answered questions: {results["questions_left_out"]} '
                  f'validation questions left out (unreadable images, named above)', flush=True)
    if rank == 0:
        (run_dir / SKIPPED_IMAGES).write_text(json.dumps(skipped.record(), indent=1) + '\n')
        print(f'{name}: {skipped.summary()}' + (f' ({run_dir / SKIPPED_IMAGES})' if skipped.files else ''),
              flush=True)
        with writing(run_dir / 'adapter', 'the adapter', run_dir / 'checkpoints'):
            save_adapter(vlm.model, run_dir / 'adapter')
        log = run_log(run_dir)
        results['final_loss'] = log[-1]['loss'] if log else None
        if val_set:
            (run_dir / 'val_answers.json').write_text(json.dumps(answers) + '\n')
        write_results(run_dir, results, log)
        acc = f'{results["vqa_accuracy"]:.2f}' if 'vqa_accuracy' in results else 'n/a'
        print(f'\n{name}: {results["steps"]} steps, final loss {results["final_loss"]:.4f}, VQA accuracy {acc}\n'
              f'  {run_dir / "results.json"}\n  {run_dir / "loss.png"}\n  {run_dir / "adapter"}', flush=True)
    return results
