"""Differential PaliGemma's LoRA fine-tuning on VQAv2 (a recipe of `train: null`), one `diffzoo.train.vlm.run`
job: it reads the training and validation questions, trains with `FineTuneTrainer` and, at the end, answers the
validation questions on every process (each its share), scores them with the official VQA accuracy
(`diffzoo.eval.vqa`) and writes the adapter, `skipped_images.json` and `val_answers.json`."""
import json
from typing import Callable, Dict, List, Optional

from transformers import TrainerCallback

from diffzoo.eval.vqa import accuracy, answer_questions, gather_answers, left_out
from diffzoo.vlm.data import load_vqav2
from diffzoo.vlm.factory import VLM
from diffzoo.vlm.lora import load_adapter_weights, save_adapter

from .resume import writing
from .run import SKIPPED_IMAGES, Job, RunSetup, run, run_log, write_results
from .trainer import VLMTrainer


class FineTuneTrainer(VLMTrainer):
    """`VLMTrainer` whose checkpoints hold what trains, as `save_adapter` writes it: the adapter, λ and the sub-norm,
    a trained projector."""

    def _save(self, output_dir: Optional[str] = None, state_dict=None) -> None:
        if self.args.should_save:
            save_adapter(self.model, output_dir or self.args.output_dir)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        load_adapter_weights(self.model, resume_from_checkpoint)


class FineTuning(Job):
    """LoRA fine-tuning on VQAv2 (module docstring)."""
    no_step = ('{samples} training samples make no optimizer step at batch {batch} × accumulation {accumulation} × '
               '{world} processes; lower batch_size or raise data.fraction')

    def read(self, recipe: Dict) -> int:
        data = recipe['data']
        seed = recipe['seed'] if data['seed'] is None else data['seed']
        self.train_set = load_vqav2(data['root'], data['split'], data['fraction'], seed)
        self.val_set = (load_vqav2(data['root'], data['val_split'], data['val_fraction'], seed) if data['val_split']
                        else [])
        return len(self.train_set)

    def collator(self, vlm: VLM, recipe: Dict) -> Callable:
        return vlm.collator(train=True, max_length=recipe['data']['max_length'])

    def first_line(self, setup: RunSetup) -> str:
        return f'{setup.name}: {len(self.train_set)} training questions, {setup.schedule}; trainable {setup.trainable}'

    def trainer(self, setup: RunSetup, callbacks: List[TrainerCallback]) -> FineTuneTrainer:
        return FineTuneTrainer(model=setup.vlm.model, args=setup.args, train_dataset=self.train_set,
                               data_collator=setup.collator, callbacks=callbacks, lambda_lr=setup.recipe['lambda_lr'])

    def finish(self, setup: RunSetup, trainer: FineTuneTrainer, results: Dict) -> None:
        recipe, name, run_dir, rank, world, vlm = (setup.recipe, setup.name, setup.run_dir, setup.rank, setup.world,
                                                   setup.vlm)
        val_set = self.val_set
        skipped = trainer.gathered_skipped_images()
        if val_set:
            if rank == 0:
                print(f'evaluating on {len(val_set)} validation questions ({world} process(es))', flush=True)
            vlm.model.eval()
            answers = gather_answers(answer_questions(vlm, val_set, recipe['batch_size'],
                                                      recipe['eval_max_new_tokens'], rank, world), world)
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


def run_fine_tune(recipe: Dict, name: str) -> Dict:
    """Fine-tune as the (checked) recipe says; returns what results.json holds."""
    return run(recipe, name, FineTuning())
