"""A stopped VLM run and its rerun (`python -m diffzoo.train.vlm`, fine-tuning or a stage): which checkpoint it
resumes from, its log when the stop cut a line short, and the error when a save fails.

- `last_complete_checkpoint`: the newest `checkpoint-<step>` every file of which loads (`checkpoint_problem`); newer,
  part-written ones are set aside as `incomplete-checkpoint-<step>`. `resume_point` chooses it and refuses a
  rerun whose settings changed (`check_resume`: other than how long it runs and what it logs).
- a run stopped while writing a line of `log.jsonl` leaves it cut short; the rerun drops that line
  (`diffzoo.files.repair_json_lines`), with a note, and logs its step again when it trains it again.
- `writing`: a checkpoint or a stage's output that cannot be written (a full disk, a limit on file size) ends the
  run with `WriteFailed`, naming the path, the disk's free space and the checkpoint a rerun resumes from,
  instead of torch's `basic_ios::clear: iostream error`.
"""
import contextlib
import json
import shutil
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from transformers import TrainingArguments
from transformers.trainer import OPTIMIZER_NAME, SCALER_NAME, SCHEDULER_NAME, TRAINER_STATE_NAME
from transformers.trainer_pt_utils import safe_globals
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from diffzoo.recipes import RecipeError
from diffzoo.vlm.lora import ADAPTER_WEIGHTS, EXTRA_CONFIG, EXTRA_WEIGHTS
from diffzoo.vlm.recipe import RESUMABLE_CHANGES

RUN_RECIPE = 'recipe.json'
INCOMPLETE = 'incomplete-'  # set-aside checkpoints: not `checkpoint-*`, so Trainer neither resumes nor rotates them
ADAPTER_CONFIG = 'adapter_config.json'  # peft's
DATA_COUNTS = 'data_counts.json'  # what the data lost up to a checkpoint (VLMTrainer.data_counts)


def checkpoint_problem(checkpoint: Path, weights: Optional[str] = None) -> Optional[str]:
    """Why `checkpoint` cannot be resumed from, or None when every file a checkpoint save writes is there
    and loads: trainer_state.json (written last), the adapter and extra tensors with their settings (or,
    for a stage, its `weights` file), optimizer, scheduler, the RNG state of each process (and the gradient
    scaler and the data's counts, when there)."""
    def torch_file(path: Path):
        with safe_globals():  # Trainer's allow-list for numpy RNG states
            torch.load(path, map_location='cpu', weights_only=True)

    model_files = [(weights, lambda p: load_file(str(p)))] if weights else [
        (ADAPTER_CONFIG, lambda p: json.loads(p.read_text())), (EXTRA_CONFIG, lambda p: json.loads(p.read_text())),
        (ADAPTER_WEIGHTS, lambda p: load_file(str(p))), (EXTRA_WEIGHTS, lambda p: load_file(str(p)))]
    loaders = [(TRAINER_STATE_NAME, lambda p: json.loads(p.read_text())['global_step']), *model_files,
               (OPTIMIZER_NAME, torch_file), (SCHEDULER_NAME, torch_file)]
    rng = sorted(p.name for p in checkpoint.glob('rng_state*.pth'))
    if not rng:
        return 'no rng_state*.pth'
    optional = [SCALER_NAME] if (checkpoint / SCALER_NAME).exists() else []
    loaders += [(name, torch_file) for name in rng + optional]
    if (checkpoint / DATA_COUNTS).exists():  # absent from checkpoints written before the counts were kept
        loaders.append((DATA_COUNTS, lambda p: json.loads(p.read_text())['skipped_images']))
    for name, load in loaders:
        path = checkpoint / name
        if not path.is_file():
            return f'no {name}'
        try:
            load(path)
        except Exception as exc:  # any failure to read it back makes the checkpoint unusable
            return f'{name} does not load ({type(exc).__name__}: {str(exc)[:200]})'
    return None


def last_complete_checkpoint(folder: Path, set_aside: bool = True, weights: Optional[str] = None
                             ) -> Tuple[Optional[Path], List[Tuple[Path, str, Optional[Path]]]]:
    """The newest `checkpoint-<step>` in `folder` that `checkpoint_problem` passes, and the newer ones passed
    over as (path, reason, where it was set aside). Unlike transformers' `get_last_checkpoint` (the highest
    step, complete or not), a run killed while saving resumes from the checkpoint before. With `set_aside`
    the incomplete ones are renamed `incomplete-checkpoint-<step>` (kept for inspection, out of Trainer's
    resume and rotation). `weights`: a stage's model file (`checkpoint_problem`)."""
    folder = Path(folder)
    steps = {}
    for path in folder.glob(f'{PREFIX_CHECKPOINT_DIR}-*') if folder.is_dir() else []:
        step = path.name[len(PREFIX_CHECKPOINT_DIR) + 1:]
        if step.isdigit() and path.is_dir():
            steps[int(step)] = path
    skipped = []
    for step in sorted(steps, reverse=True):
        problem = checkpoint_problem(steps[step], weights)
        if problem is None:
            return steps[step], skipped
        target = None
        if set_aside:
            target, n = folder / f'{INCOMPLETE}{steps[step].name}', 1
            while target.exists():
                n += 1
                target = folder / f'{INCOMPLETE}{steps[step].name}.{n}'
            steps[step].rename(target)
        skipped.append((steps[step], problem, target))
    return None, skipped


def check_resume(recipe: Dict, run_dir: Path) -> None:
    """A run directory with checkpoints of other settings is refused (only RESUMABLE_CHANGES may differ)."""
    stored = json.loads((run_dir / RUN_RECIPE).read_text())
    changed = sorted(k for k in set(stored) | set(recipe)
                     if k not in RESUMABLE_CHANGES and stored.get(k) != recipe.get(k))
    if changed:
        raise RecipeError(f'{run_dir}: the checkpoint was trained with other settings for {changed}; resume with '
                          f'the same recipe (only {", ".join(RESUMABLE_CHANGES)} may change) or set --output elsewhere')


def resume_point(recipe: Dict, run_dir: Path, args: TrainingArguments, weights: Optional[str] = None
                 ) -> Optional[Path]:
    """The checkpoint a rerun resumes from (`last_complete_checkpoint`; rank 0 sets incomplete ones aside and
    names them), its settings checked against the recipe's (`check_resume`); None for a new run."""
    rank = args.process_index
    with args.main_process_first(local=False, desc='choosing the checkpoint'):
        checkpoint, incomplete = last_complete_checkpoint(Path(args.output_dir), set_aside=rank == 0, weights=weights)
    if rank == 0:
        for path, problem, target in incomplete:
            print(f'skipping {path}: incomplete ({problem}), most likely a run stopped while saving it; '
                  f'set aside as {target.name}', flush=True)
    if checkpoint is not None:
        check_resume(recipe, run_dir)
    return checkpoint


class WriteFailed(OSError):
    """A checkpoint or a stage's output could not be written; the message names the path, the disk's free space
    and what a rerun resumes from (`writing`)."""


# torch.save's stream writer reports a failed write as a RuntimeError ('basic_ios::clear: iostream error',
# 'PytorchStreamWriter failed writing file'), safetensors as a SafetensorError, Python as an OSError
WRITE_ERRORS = (OSError, RuntimeError, SafetensorError)
MB = 2 ** 20


def last_saved(checkpoints: Path, besides: Path) -> Optional[Path]:
    """The newest `checkpoint-<step>` in `checkpoints` other than `besides` that got as far as its
    trainer_state.json (written last); its files are checked when a rerun resumes from it."""
    steps = {p.name[len(PREFIX_CHECKPOINT_DIR) + 1:]: p for p in checkpoints.glob(f'{PREFIX_CHECKPOINT_DIR}-*')}
    saved = [(int(step), p) for step, p in steps.items()
             if step.isdigit() and p != besides and (p / TRAINER_STATE_NAME).is_file()]
    return max(saved)[1] if saved else None


def write_failure(path: Path, what: str, exc: BaseException, checkpoints: Path) -> str:
    """The message for `what` not written at `path`: the error, the disk's free space, and the checkpoint in
    `checkpoints` that the same command resumes from."""
    there = next(p for p in (path, *path.parents) if p.exists())
    disk = shutil.disk_usage(there)
    last = last_saved(checkpoints, path)
    resume = (f'it resumes from its last complete checkpoint, {last}' if last is not None else
              'no checkpoint was complete, so it starts over')
    return (f'{path}: writing {what} failed ({type(exc).__name__}: {str(exc)[:300]}). The disk holding {there} has '
            f'{disk.free / MB:,.0f} MB free of {disk.total / MB:,.0f} MB: free space there (or point --output at a '
            f'disk with room; a limit on file size, ulimit -f, fails the same way) and run the same command again: '
            f'{resume} (a checkpoint left part-written is set aside)')


@contextlib.contextmanager
def writing(path: Path, what: str, checkpoints: Path):
    """Writes to `path` whose failure ends the run with `WriteFailed` (`write_failure`'s message)."""
    try:
        yield
    except WriteFailed:
        raise
    except WRITE_ERRORS as exc:
        raise WriteFailed(write_failure(Path(path), what, exc, Path(checkpoints))) from exc
