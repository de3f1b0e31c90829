"""One training stage of a LLaVA-style run (`python -m diffzoo.train.vlm` with a recipe that has `train:`).

LLaVA-1.5, TinyLLaVA (DiffCLIP §5.1) and eRAM-V train a `build_vlm` model in stages, each on its own data
with its own parts unfrozen: pre-training (the projector alone, on captions), eRAM-V's continued
pre-training (vision tower and projector), instruction tuning (projector and language model). A stage
recipe says what trains (`train:` — projector, vision, language_model: frozen | full | lora, differential,
gradient_checkpointing: the plan, `diffzoo.vlm.plan`, that `diffzoo.vlm.factory.trainable_vlm` applies) and where
it starts (`init_from:` an earlier stage's output); the data is a LLaVA-format conversation set
(`diffzoo.vlm.conversations`).

What a stage holds — the parameters it trained and those it started from — goes to its checkpoints
(`stage_model.safetensors` beside Trainer's optimizer, scheduler and RNG state; a rerun of the same
command resumes from the newest complete one) and, when it ends, to `<run dir>/stage/`:
`stage_model.safetensors` and `stage.json` (the model part of the recipe, which the next stage must
match, and the names held). LoRA adapters are merged into the language model's weights there, so the
next stage may train the language model in full or freeze it. Everything not held is rebuilt from
the recipe's model (the pretrained tower and language model, a projector drawn from `seed`), so a frozen
part is bit-identical before and after.

A stage is one `diffzoo.train.vlm.run` job (`Stage`): the run and its loop are the fine-tuning one (Trainer, λ at
`lambda_lr`, logs, resume), the model the one `diffzoo.vlm.factory.trainable_vlm` builds from the recipe and its
`init_from`; `global_batch_size` sets the accumulation, `warmup_ratio` the warm-up, as LLaVA's scripts do.
"""
import json
from pathlib import Path
from typing import Dict, FrozenSet, List, Optional, Set, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor
from transformers import TrainerCallback

from diffzoo.files import atomic_write, atomic_write_json
from diffzoo.recipes import RecipeError
from diffzoo.vlm.conversations import CONVERSATION_ID_LISTS, ConversationCollator, Problems, load_conversations
from diffzoo.vlm.data import SkippedImages
from diffzoo.vlm.factory import VLM
from diffzoo.vlm.lora import merge_lora
from diffzoo.vlm.stages import STAGE_CONFIG, STAGE_DIR, STAGE_WEIGHTS, copy_tensors, model_spec
from diffzoo.vlm.templates import RULES, encode

from .resume import writing
from .run import SKIPPED_IMAGES, Job, RunSetup, run, run_log, write_results
from .trainer import VLMTrainer, all_gathered

DATA_PROBLEMS = 'data_problems.json'


def whole_tensor(p: torch.Tensor) -> torch.Tensor:
    """A parameter's whole tensor on the CPU: an FSDP2 shard (DTensor) gathered (a collective: every rank calls it)."""
    p = p.detach()
    return (p.full_tensor() if isinstance(p, DTensor) else p).cpu().contiguous()


class StageTrainer(VLMTrainer):
    """`VLMTrainer` whose checkpoints hold what the stage holds: what trains, and the parameters `held_names` names
    (`trainable_vlm`); under FSDP its state is Trainer's gathered one. It keeps the ids of the conversations the
    collator cut or left out (`CONVERSATION_ID_LISTS`), and its `EpochReport` (of `max_length` and `mismatch`, the
    data's) is one of its callbacks from the start."""

    def __init__(self, *args, held_names: FrozenSet[str] = frozenset(), max_length: int, mismatch: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.held_names = held_names
        self.conversation_ids: Dict[str, Set[str]] = {key: set() for key in CONVERSATION_ID_LISTS}  # each once
        self.add_callback(EpochReport(self, max_length, mismatch))

    def training_step(self, model, inputs, num_items_in_batch=None):
        for key in CONVERSATION_ID_LISTS:
            self.conversation_ids[key].update(inputs.pop(key, ()))
        return super().training_step(model, inputs, num_items_in_batch)

    def held_parameters(self) -> Dict[str, nn.Parameter]:
        """The parameters the stage's output and checkpoints hold: what trains and `held_names`, by name."""
        return {n: p for n, p in self.model.named_parameters() if p.requires_grad or n in self.held_names}

    def held_state_dict(self, state_dict: Optional[Dict] = None) -> Dict[str, torch.Tensor]:
        held = self.held_parameters()
        if state_dict is not None:  # FSDP: accelerate's full state dict, gathered on every rank
            return {n: state_dict[n].detach().cpu().contiguous() for n in held}
        return {n: whole_tensor(p) for n, p in held.items()}

    def _save(self, output_dir: Optional[str] = None, state_dict=None) -> None:
        if self.args.should_save:
            directory = Path(output_dir or self.args.output_dir)
            directory.mkdir(parents=True, exist_ok=True)
            save_file(self.held_state_dict(state_dict), str(directory / STAGE_WEIGHTS))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        copy_tensors(self.model, load_file(str(Path(resume_from_checkpoint) / STAGE_WEIGHTS)), resume_from_checkpoint,
                     '; resume with the recipe that wrote it')

    def gathered_data_losses(self) -> Tuple[SkippedImages, Dict[str, Set[str]]]:
        """(unreadable images, {CONVERSATION_ID_LISTS key: conversation ids}) over every process (one collective
        under DDP: every rank calls it)."""
        parts = all_gathered((self.skipped_images, self.conversation_ids), self.args.world_size)
        return (parts[0][0].merge([p[0] for p in parts[1:]]),
                {key: set().union(*(p[1][key] for p in parts)) for key in CONVERSATION_ID_LISTS})

    def data_counts(self) -> Dict:
        skipped, conversation_ids = self.gathered_data_losses()
        return {'skipped_images': skipped.record(), **{key: sorted(ids) for key, ids in conversation_ids.items()}}

    def restore_data_counts(self, checkpoint: Optional[Path]) -> Dict:
        counts = super().restore_data_counts(checkpoint)
        self.conversation_ids = {key: set(counts.get(key, ())) for key in CONVERSATION_ID_LISTS}  # alike on each rank
        return counts


def collator_summary(conversation_ids: Dict[str, Set[str]], max_length: int, mismatch: str) -> str:
    """What the collator cut or left out, in words."""
    cut, left_out, mismatched = (len(conversation_ids[key]) for key in CONVERSATION_ID_LISTS)
    return (f'{cut} conversation(s) cut to {max_length} positions (image and text), {left_out} left out after the '
            f'cut, {mismatched} with a tokenization mismatch '
            + ('(nothing of them scored, as the reference does)' if mismatch == 'mask' else '(scored: mismatch score)'))


def data_problems_report(problems: Problems, conversation_ids: Dict[str, Set[str]], mismatch: str) -> Dict:
    """`data_problems.json`: what reading the conversations left out (`Problems`), then what the collator cut or
    left out, with a few ids of each."""
    cut, left_out, mismatched = (conversation_ids[key] for key in CONVERSATION_ID_LISTS)
    return {**problems.record(), 'cut_to_max_length': len(cut), 'left_out_after_cut': len(left_out),
            'cut_examples': sorted(cut)[:3], 'tokenization_mismatch': len(mismatched), 'mismatch': mismatch,
            'mismatch_examples': sorted(mismatched)[:3]}


class EpochReport(TrainerCallback):
    """At the end of each epoch, what the data lost so far, over every process: conversations cut to the
    maximum length (each counted once), those left out after the cut, unreadable images. A resumed run goes on
    from the counts its checkpoint kept (`VLMTrainer.data_counts`). Not after the last epoch: the stage's
    closing line gives the same counts for the whole run; nor where nothing was lost since the epoch before (a
    line that would only repeat the last one's losses)."""

    def __init__(self, trainer: StageTrainer, max_length: int, mismatch: str):
        self.trainer, self.max_length, self.mismatch = trainer, max_length, mismatch
        self.last_counted = None  # what the last printed line counted

    def on_epoch_end(self, args, state, control, **kwargs):
        if state.global_step >= state.max_steps:  # the same on every rank: none enters the collective below
            return
        skipped, conversation_ids = self.trainer.gathered_data_losses()
        counted = (len(skipped.files), skipped.samples_skipped,
                   {key: len(ids) for key, ids in conversation_ids.items()})
        if state.is_world_process_zero and counted != self.last_counted:
            self.last_counted = counted
            print(f'epoch {round(state.epoch)}: {collator_summary(conversation_ids, self.max_length, self.mismatch)}; '
                  f'{skipped.summary()}', flush=True)


def check_rounds(train_set, tokenizer, data: Dict, first: int = 32) -> None:
    """Refuse vicuna_v1 over a tokenizer that adds no BOS (LLaVA's rule counts one in each round), and a format
    whose reference rule counts the rounds of none of the first conversations: under mismatch 'mask' the stage
    would train on nothing."""
    sample = train_set[:first]
    if data['format'] == 'vicuna_v1' and tokenizer('USER')['input_ids'][:1] != [tokenizer.bos_token_id]:
        raise RecipeError(f'data.format vicuna_v1: LLaVA\'s preprocess_v1 counts each round with the BOS its Llama '
                          f'tokenizer adds, and this tokenizer ({type(tokenizer).__name__}) adds none, so its label '
                          f'mask would be shifted; for Qwen\'s tokenizer choose qwen2_instruct (TinyLLaVA\'s) or '
                          f'chat_template')
    if data['mismatch'] == 'score' or data['format'] not in RULES or not sample:
        return
    if all(encode(c.turns, tokenizer, data['format'], data['max_length']).mismatched for c in sample):
        raise RecipeError(f'data.format {data["format"]}: its reference\'s rule (diffzoo.vlm.templates) cannot count '
                          f'the rounds of any of the first {len(sample)} conversations with this tokenizer '
                          f'({type(tokenizer).__name__}), so nothing would be scored; vicuna_v1 is for a tokenizer '
                          f'that adds BOS as Vicuna\'s does, qwen2_instruct for Qwen\'s. Choose the format of the '
                          f'language model, or data.mismatch: score')


def write_output(setup: RunSetup, trainer: StageTrainer) -> Path:
    """The stage's output (module docstring), `<run dir>/stage/`: LoRA merged into the weights it adapted, then every
    held or trained parameter under the model's own names, with the spec the next stage checks. Every rank calls it
    (FSDP gathers the shards); rank 0 writes, `stage.json` last (an output without it is not finished), each
    file under a temporary name first. A stage of no step writes nothing."""
    directory, name = setup.run_dir / STAGE_DIR, setup.name
    if trainer.state.global_step < 1:
        raise RecipeError(f'{name} trained no step, so {directory} is not written (a stage of 0 steps would start the '
                          f'next from nothing trained); give it max_steps or epochs above 0, and data for a step')
    model = trainer.model
    held_ids = {id(p) for p in trainer.held_parameters().values()}
    if setup.plan.lora is not None:  # never under FSDP (run.check_settings); merged in place, held from now on
        model, adapted = merge_lora(model)
        held_ids |= adapted
    state = {n: whole_tensor(p) for n, p in model.named_parameters() if id(p) in held_ids}  # LoRA's own: merged, gone
    if setup.rank == 0:
        config = {'stage': name, 'steps': trainer.state.global_step, 'spec': model_spec(setup.recipe),
                  'tensors': sorted(state)}
        with writing(directory, "the stage's output", directory.parent / 'checkpoints'):
            directory.mkdir(parents=True, exist_ok=True)
            (directory / STAGE_CONFIG).unlink(missing_ok=True)  # a rerun's: unfinished until written again
            with atomic_write(directory / STAGE_WEIGHTS) as weights:
                save_file(state, str(weights))
            atomic_write_json(directory / STAGE_CONFIG, config)
    return directory


class Stage(Job):
    """One LLaVA-style stage (module docstring): conversations, the model from `init_from`, `StageTrainer`, and at
    the end the stage's output and its records of the data (`data_problems.json`, `skipped_images.json`)."""
    weights = STAGE_WEIGHTS
    no_step = ('{samples} conversations make no optimizer step of {samples_per_step} samples ({batch} × '
               '{accumulation} × {world} processes); lower the batch or add data')

    def read(self, recipe: Dict) -> int:
        data = recipe['data']
        self.train_set, self.problems = load_conversations(data['json'], data['image_folder'], data['format'])
        return len(self.train_set)

    def collator(self, vlm: VLM, recipe: Dict) -> ConversationCollator:
        data = recipe['data']
        if vlm.model.sequence_mask != 'causal':
            raise RecipeError(f'model.sequence_mask: {vlm.model.sequence_mask}: a conversation stage trains causally, '
                              f'as LLaVA does (prefix_lm would let the answers see themselves); set '
                              f'model.sequence_mask: causal')
        tok = vlm.tokenizer
        if tok.pad_token is None:  # Llama/Vicuna tokenizers have none; LLaVA pads with unk
            tok.pad_token = tok.unk_token if tok.unk_token is not None else tok.eos_token
        check_rounds(self.train_set, tok, data)
        return ConversationCollator(tok, vlm.transform, data['format'], data['max_length'],
                                    image_aspect=data['image_aspect'], mismatch=data['mismatch'],
                                    image_positions=vlm.model.image_positions())

    def first_line(self, setup: RunSetup) -> str:
        return (f'{setup.name}: {len(self.train_set)} conversations ({self.problems.summary()}), {setup.schedule}; '
                f'trainable {setup.trainable}' + (f'; starts from {setup.start}' if setup.start else ''))

    def trainer(self, setup: RunSetup, callbacks: List[TrainerCallback]) -> StageTrainer:
        data = setup.recipe['data']
        trainer = StageTrainer(model=setup.vlm.model, args=setup.args, train_dataset=self.train_set,
                               data_collator=setup.collator, callbacks=callbacks, lambda_lr=setup.recipe['lambda_lr'],
                               held_names=setup.held_names, max_length=data['max_length'], mismatch=data['mismatch'])
        fsdp = setup.recipe['fsdp']
        if setup.rank == 0 and fsdp is not None:
            print(f'FSDP{fsdp["version"]}: ' + (f'the model sharded over {setup.world} processes' if
                  trainer.is_fsdp_enabled else f'not enabled by accelerate ({setup.world} process(es): nothing to '
                                               f'shard)'), flush=True)
        return trainer

    def finish(self, setup: RunSetup, trainer: StageTrainer, results: Dict) -> None:
        data, name, run_dir = setup.recipe['data'], setup.name, setup.run_dir
        skipped, conversation_ids = trainer.gathered_data_losses()
        report = data_problems_report(self.problems, conversation_ids, data['mismatch'])
        collated = collator_summary(conversation_ids, data['max_length'], data['mismatch'])
        output = write_output(setup, trainer)
        if setup.world > 1:  # the next stage of a chain reads what rank 0 wrote
            dist.barrier()
        if setup.rank == 0:
            with writing(run_dir / DATA_PROBLEMS, "the stage's records", run_dir / 'checkpoints'):
                (run_dir / DATA_PROBLEMS).write_text(json.dumps(report, indent=1) + '\n')
                (run_dir / SKIPPED_IMAGES).write_text(json.dumps(skipped.record(), indent=1) + '\n')
            log = run_log(run_dir)
            results.update(final_loss=log[-1]['loss'] if log else None, first_loss=log[0]['loss'] if log else None,
                           data_problems=report, stage=str(output))
            write_results(run_dir, results, log)
            print(f'\n{name}: {results["steps"]} steps, loss {results["first_loss"]:.4f} → '
                  f'{results["final_loss"]:.4f}; {collated}; {skipped.summary()}\n  {output}\n  '
                  f'{run_dir / "results.json"}', flush=True)


def run_stage(recipe: Dict, name: str) -> Dict:
    """Train one stage as the (checked) recipe says; returns what results.json holds."""
    return run(recipe, name, Stage())
