"""One run of `python -m diffzoo.train.vlm`, LoRA fine-tuning or a LLaVA-style stage: checked, set up once, then run.

    setup_run(recipe, name, job) -> RunSetup   the recipe's settings checked (`check_settings`), the
                                               output it starts from (a stage's `init_from`), its data
                                               read, the TrainingArguments, the steps, the checkpoint a rerun
                                               resumes from (`resume.resume_point`), the model it trains with its
                                               plan applied (`diffzoo.vlm.factory.trainable_vlm`), and on rank 0
                                               the run directory with its recipe.json and the run's first line
    run(recipe, name, job) -> results          that setup, then the job's Trainer with its callbacks, the training,
                                               and the job's end: its outputs, then results.json and loss.png

Fine-tuning and a stage differ only in what they read, how their samples become batches (a stage's checked against
the model), the Trainer they train with and what they write at the end: a `Job` says it (`finetune.FineTuning`,
`stage.Stage`). Where the model starts is the recipe's: as built, or a stage's `init_from`.

`python -m diffzoo.train.vlm chain STAGE …` checks what every stage needs before the first trains (`check_chain`: its
recipe, settings, data files — that they are there, not what they hold, which the run's loader reads once — and
`init_from`), so a stage that cannot run is named before hours of the ones before it, not after.
"""
import codecs
import contextlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, FrozenSet, List, Optional, Sequence

import matplotlib
import torch
from transformers import TrainerCallback, TrainingArguments
from transformers.trainer import TRAINER_STATE_NAME

from diffzoo.recipes import RecipeError
from diffzoo.vlm.factory import VLM, trainable_vlm
from diffzoo.vlm.parts import trainable_parameters
from diffzoo.vlm.plan import TrainingPlan
from diffzoo.vlm.recipe import checked_recipe
from diffzoo.vlm.stages import STAGE_CONFIG, check_spec, model_spec, spec_differences, stage_output

from .resume import RUN_RECIPE, resume_point
from .trainer import RunLog, VLMTrainer

LOG = 'log.jsonl'  # RunLog's, a record per logged step
SKIPPED_IMAGES = 'skipped_images.json'


@dataclass(frozen=True)
class RunSetup:
    """What a run decided before its Trainer is made (`setup_run`); every process makes its own."""
    recipe: Dict
    name: str
    run_dir: Path
    args: TrainingArguments
    samples_per_step: int  # batch × accumulation × processes
    max_steps: int
    checkpoint: Optional[Path]  # the one a rerun resumes from; None for a new run
    start: Optional[Path]  # an earlier stage's output the model starts from (`init_from`)
    vlm: VLM  # the model it trains, its plan applied
    plan: TrainingPlan
    held_names: FrozenSet[str]  # what a stage's output holds besides what trains (`trainable_vlm`)
    collator: Callable  # the data's samples → the model's batches
    trainable: Dict[str, int]  # `trainable_parameters`

    @property
    def rank(self) -> int:
        return self.args.process_index

    @property
    def world(self) -> int:
        return self.args.world_size

    @property
    def schedule(self) -> str:
        """`S steps of batch × accumulation × processes`, as the run's first line says it."""
        return (f'{self.max_steps} steps of {self.recipe["batch_size"]} × {self.args.gradient_accumulation_steps} × '
                f'{self.world}')


class Job:
    """What one kind of run reads, checks, trains with and writes (module docstring). An instance serves one run and
    keeps what it read for the run's end."""
    weights: Optional[str] = None  # a checkpoint's model file (`resume.checkpoint_problem`); None: an adapter's
    no_step = ''  # the error for data of no step; its fields: samples, samples_per_step, batch, accumulation, world

    def read(self, recipe: Dict) -> int:
        """Read the training data (a missing file is named here); returns how many samples it holds."""
        raise NotImplementedError

    def collator(self, vlm: VLM, recipe: Dict) -> Callable:
        """What makes the data's samples `vlm`'s batches; a model this run cannot train on its data is refused here,
        before the run directory is written."""
        raise NotImplementedError

    def first_line(self, setup: RunSetup) -> str:
        """What rank 0 prints as the run starts: the data, `setup.schedule`, what trains."""
        raise NotImplementedError

    def trainer(self, setup: RunSetup, callbacks: List[TrainerCallback]) -> VLMTrainer:
        """The run's Trainer, made with `callbacks` and its own."""
        raise NotImplementedError

    def finish(self, setup: RunSetup, trainer: VLMTrainer, results: Dict) -> None:
        """After the last step, on every process: the run's outputs written, `results` completed and, on rank 0,
        written (`write_results`)."""
        raise NotImplementedError


LLAVA_JSON = 'a LLaVA-format JSON (a list of {id, image?, conversations})'


def check_settings(recipe: Dict) -> None:
    """Refuse what no run of this recipe could do: a stage of a model whose tower and projector are inside its
    checkpoint, a stage on VQAv2, LoRA fine-tuning on conversations or from a stage's output, FSDP without GPUs
    (accelerate would train unsharded), FSDP over LoRA."""
    data, stage = recipe['data'], recipe['train'] is not None
    if stage and recipe['model']['type'] != 'build_vlm':
        raise RecipeError('train: stages apply to build_vlm models (model.type: build_vlm); a PaliGemma checkpoint '
                          'trains with LoRA (train: null)')
    if stage and data['type'] != 'conversations':
        raise RecipeError('train: a stage trains on conversations (data.type: conversations); VQAv2 fine-tuning is '
                          'train: null')
    if not stage and recipe['init_from']:
        raise RecipeError(f'init_from={recipe["init_from"]!r}: a stage (train: {{…}}) starts from an earlier stage\'s '
                          f'output; LoRA fine-tuning (train: null) starts from the model as the recipe builds it. To '
                          f'fine-tune a stage\'s output with LoRA, run a stage of train.language_model: lora')
    if not stage and data['type'] != 'vqav2':
        raise RecipeError(f'data.type {data["type"]}: LoRA fine-tuning (train: null) reads VQAv2; conversations train '
                          f'in a stage (train: {{projector, vision, language_model, …}})')
    cuda = torch.cuda.is_available() and recipe['device'] != 'cpu'
    if recipe['fsdp'] is not None and not cuda:
        raise RecipeError('fsdp: accelerate shards with FSDP on GPUs only (on CPUs it trains with DDP, every process '
                          'holding the whole model); run on GPUs, or set fsdp: null')
    if recipe['fsdp'] is not None and stage and recipe['train']['language_model'] == 'lora':
        raise RecipeError('fsdp with train.language_model: lora: LoRA trains a few adapters, which DDP holds; FSDP is '
                          'for training a large language model in full (set fsdp: null)')


def check_data_files(data: Dict) -> None:
    """The data files are there and readable: a conversation set's JSON (its first bytes open a list) and image
    folder, a VQAv2 copy's folder. Reads a few bytes, not the file."""
    if data['type'] == 'vqav2':
        if not Path(data['root']).is_dir():
            raise FileNotFoundError(f'data.root {data["root"]}: no such folder; point it at a VQAv2 copy (official '
                                    f'JSON + COCO images, or Hugging Face parquet)')
        return
    path = Path(data['json'])
    if not path.is_file():
        raise FileNotFoundError(f'{path}: no such file; point data.json at {LLAVA_JSON}')
    with open(path, 'rb') as f:
        head = f.read(4096).removeprefix(codecs.BOM_UTF8).lstrip()
    if not head.startswith(b'['):
        found = 'empty' if not head else f'starts with {head[:24]!r}'
        raise ValueError(f'{path}: {found}, not a JSON list; point data.json at {LLAVA_JSON}')
    folder = data['image_folder']
    if folder is not None and not Path(folder).is_dir():
        raise FileNotFoundError(f'{folder}: no such folder; point data.image_folder at the images the JSON names')


def _check_init_from(recipe: Dict, chain: List[Path], specs: List[Dict], at: int) -> None:
    """`init_from` names an earlier stage of the chain (its model this recipe's), or a finished stage on disk of
    this recipe's model (`stage_output`); a later stage of the chain is named as such."""
    init_from, spec = recipe['init_from'], model_spec(recipe)
    named = {Path(init_from).resolve(), (Path(recipe['output']) / init_from).resolve()}
    for i, run_dir in enumerate(chain):
        if run_dir.resolve() not in named or i == at:
            continue
        if i > at:
            raise RecipeError(f'init_from={init_from!r} is stage {i + 1} of the chain, which runs after this one; '
                              f'list the stages in the order they train')
        differs = spec_differences(specs[i], spec)
        if differs:
            raise RecipeError(f'init_from={init_from!r}: stage {i + 1} of the chain trains another model '
                              f'({"; ".join(differs)}); start from a stage of the same model, or give this recipe '
                              f'its model')
        return
    directory = stage_output(init_from, recipe['output'])  # finished, trained, whole: else refused, named
    check_spec(directory, json.loads((directory / STAGE_CONFIG).read_text())['spec'], spec)


def check_chain(names: Sequence[str], overrides: Sequence[str]) -> None:
    """Every stage of a chain checked before the first trains: its recipe (with the overrides), settings, data
    files and `init_from`. The error names the stage."""
    recipes, chain = [], []
    for name in names:
        try:
            recipes.append(checked_recipe(name, overrides))
        except (RecipeError, ValueError, OSError) as exc:
            raise RecipeError(f'stage {len(recipes) + 1} of {len(names)} ({name}), checked before any stage '
                              f'runs: {exc}') from exc
        chain.append(Path(recipes[-1]['output']) / Path(name).stem)  # its run directory (diffzoo.train.vlm.cli.main)
    specs = [model_spec(r) for r in recipes]
    for i, (name, recipe) in enumerate(zip(names, recipes)):
        try:
            check_settings(recipe)
            check_data_files(recipe['data'])
            if recipe['init_from']:
                _check_init_from(recipe, chain, specs, i)
        except (RecipeError, ValueError, OSError) as exc:
            raise RecipeError(f'stage {i + 1} of {len(names)} ({name}), checked before any stage runs: '
                              f'{exc}') from exc


def setup_run(recipe: Dict, name: str, job: Job) -> RunSetup:
    """The run's setup (module docstring)."""
    check_settings(recipe)
    run_dir = Path(recipe['output']) / name
    # a stage's `init_from`: a finished stage's output (a missing or unfinished one is named before the data is read)
    start = stage_output(recipe['init_from'], recipe['output']) if recipe['init_from'] else None
    samples = job.read(recipe)
    cuda = torch.cuda.is_available() and recipe['device'] != 'cpu'
    args = training_arguments(recipe, run_dir, cuda)
    batch, accumulation, world = recipe['batch_size'], args.gradient_accumulation_steps, args.world_size
    samples_per_step = batch * accumulation * world
    steps_per_epoch = epoch_steps(samples, batch, accumulation, world)
    if steps_per_epoch == 0:
        raise RecipeError(job.no_step.format(samples=samples, samples_per_step=samples_per_step, batch=batch,
                                             accumulation=accumulation, world=world))
    max_steps = recipe['max_steps'] or math.ceil(steps_per_epoch * recipe['epochs'])  # as Trainer counts them
    checkpoint = resume_point(recipe, run_dir, args, weights=job.weights)
    vlm, plan, held_names = trainable_vlm(recipe, start)
    trainable = trainable_parameters(vlm.model)
    collator = job.collator(vlm, recipe)
    setup = RunSetup(recipe, name, run_dir, args, samples_per_step, max_steps, checkpoint, start, vlm, plan,
                     held_names, collator, trainable)
    if setup.rank == 0:
        start_run(setup, job.first_line(setup))
    return setup


def run(recipe: Dict, name: str, job: Job) -> Dict:
    """One run of a checked recipe as `job` says (module docstring); returns what results.json holds."""
    with tensorboard_dir(Path(recipe['output']) / name):
        setup = setup_run(recipe, name, job)
        callbacks = [RunLog(setup.run_dir / LOG, setup.samples_per_step)]
        trainer = job.trainer(setup, callbacks)
        trainer.restore_data_counts(setup.checkpoint)
        trainer.train(resume_from_checkpoint=str(setup.checkpoint) if setup.checkpoint else None)
        results = {'recipe': name, 'steps': trainer.state.global_step, 'trainable_parameters': setup.trainable}
        job.finish(setup, trainer, results)
        return results


def start_run(setup: RunSetup, line: str) -> None:
    """Rank 0's start of a run: its recipe in the run directory, `line` printed, and the step it resumes from."""
    setup.run_dir.mkdir(parents=True, exist_ok=True)
    (setup.run_dir / RUN_RECIPE).write_text(json.dumps(setup.recipe, indent=1) + '\n')
    print(line, flush=True)
    if setup.checkpoint is not None:
        step = json.loads((setup.checkpoint / TRAINER_STATE_NAME).read_text())['global_step']
        print(f'resuming {setup.name} from step {step} ({setup.checkpoint})', flush=True)


def epoch_steps(samples: int, batch_size: int, accumulation: int, world: int) -> int:
    """Optimizer steps in an epoch as Trainer counts them with the last partial batch kept: the batches of each
    process (accelerate gives each the same number), then a step per `accumulation` of them, the last one partial."""
    return math.ceil(math.ceil(samples / (batch_size * world)) / accumulation)


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
        seed=recipe['seed'], use_cpu=not cuda,
        dataloader_drop_last=False,  # the last partial batch trains, as in LLaVA's and TinyLLaVA's trainers
        dataloader_num_workers=recipe['workers'], remove_unused_columns=False, report_to=report or 'none',
        log_level='warning', disable_tqdm=True)  # RunLog prints the progress


@contextlib.contextmanager
def tensorboard_dir(run_dir: Path):
    """transformers' TensorBoard callback writes to $TENSORBOARD_LOGGING_DIR: RUN_DIR/tensorboard for this run
    (unless the user set it), put back afterwards so the next run in the same process writes to its own."""
    given = os.environ.get('TENSORBOARD_LOGGING_DIR')
    os.environ['TENSORBOARD_LOGGING_DIR'] = given or str(run_dir / 'tensorboard')
    try:
        yield
    finally:
        if given is None:
            os.environ.pop('TENSORBOARD_LOGGING_DIR', None)


def run_log(run_dir: Path) -> List[Dict]:
    """The run's loss log (RunLog's log.jsonl)."""
    return [json.loads(line) for line in (run_dir / LOG).read_text().splitlines()]


def write_results(run_dir: Path, results: Dict, log: List[Dict]) -> None:
    """results.json and, with a log, the loss curve (loss.png)."""
    (run_dir / 'results.json').write_text(json.dumps(results, indent=1) + '\n')
    if log:
        plot_loss(log, run_dir / 'loss.png')


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
