"""`python -m diffzoo.train.vlm --recipe NAME|PATH [--key value …]`: LoRA fine-tuning of a VLM on VQAv2, or
one LLaVA-style stage (a recipe with `train:`, `diffzoo.train.vlm.stage`); `chain STAGE …` runs stages in order.

The recipe (`diffzoo.vlm.recipe`; shipped ones in recipes/vlm/, `python -m diffzoo.train.vlm recipes`
lists them) names the model (`diffzoo.vlm.load_vlm`), its differential settings, LoRA, the data and
the optimisation; `--key value` overrides any key, with dots for nested
ones (`--data.fraction 0.1`, `--lr 2e-5`, `--attention '{type: vanilla}'` for the vanilla baseline).

The loop is transformers' `Trainer` with peft: DDP under torchrun (gradient accumulation without
all-reducing the micro-batches in between), AdamW, LR schedule with warm-up, gradient clipping,
bf16 autocast, progress bars, tensorboard / wandb, checkpoints with optimizer, scheduler and RNG
state, resume from the newest checkpoint. What diffzoo adds (`VLMTrainer`, in `diffzoo.train.vlm.trainer`):

- λ and the sub-norm train at `lambda_lr` (their own parameter group; default `lr`);
- a checkpoint holds what trains: fine-tuning's as `save_adapter` writes it (adapter, λ/sub-norm, projector,
  `finetune.FineTuneTrainer`), a stage's what the stage holds (`stage_model.safetensors`, `stage.StageTrainer`);
- every log line carries λ of each differential layer (`lambda/layer_<i>`, also to tensorboard/wandb);
- a rerun resumes from the newest complete checkpoint (`last_complete_checkpoint`: a run killed while
  saving leaves a partial `checkpoint-<step>`, which is named, set aside as `incomplete-checkpoint-<step>`
  and passed over), and is refused when its settings changed (other than how long it runs and what it logs); a
  checkpoint keeps what the data lost so far, so the rerun's records cover the whole run, and a finished run
  rerun trains nothing; a last log line cut short by the stop is dropped (`diffzoo.train.vlm.resume`);
- a checkpoint or output that cannot be written (a full disk) ends the run naming the path, the disk's free space
  and the checkpoint a rerun resumes from;
- a batch, steps or epochs of 0 or less are refused by key; `chain` checks every stage's recipe, data files and
  `init_from` before the first trains (`diffzoo.train.vlm.run.check_chain`);
- an image that does not decode drops its samples (`diffzoo.vlm.data.SkippedImages`): each file is named
  once in the log and listed in `skipped_images.json`; a resumed run skips the trained batches in the
  sampler, so their images are not decoded again;
- the validation questions are answered by every process, each its share, and scored with the
  official VQA accuracy (`diffzoo.eval.vqa`); a question whose image does not decode is not answered
  (the file is named once) and counted as `questions_left_out` in `results.json`.

Run directory `<output>/<recipe name>`: `recipe.json` (the settings), `log.jsonl` (one line per
logged step), `checkpoints/checkpoint-<step>/`, `tensorboard/`, at the end `adapter/`,
`results.json` (VQA accuracy on the validation subset, trainable-parameter counts),
`skipped_images.json` (unreadable image files; samples trained and left out in this run),
`val_answers.json` and `loss.png`. A stage writes, in place of `adapter/` and `val_answers.json`, `stage/` (the
stage's output, which the next stage's `init_from` names) and `data_problems.json` (the conversations left out or cut).
"""
import argparse
import sys
from pathlib import Path
from typing import List, Optional

from diffzoo.recipes import RecipeError, recipe_names
from diffzoo.vlm.recipe import VLM_RECIPE, checked_recipe, load_vlm_recipe


def parser() -> argparse.ArgumentParser:
    keys = '\n'.join(f'  {k:<20} {v.doc}' for k, v in VLM_RECIPE.keys.items())
    p = argparse.ArgumentParser(prog='python -m diffzoo.train.vlm', description=__doc__.split('\n\n')[0],
                                epilog=f'recipe keys:\n{keys}', formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--recipe', help='a YAML file or a shipped name (`recipes` lists them)')
    return p


def _list_recipes() -> int:
    for name in recipe_names('vlm'):
        print(f'  {name:<32} {load_vlm_recipe(name).get("description", "")}')
    return 0


CHAIN_HELP = """usage: python -m diffzoo.train.vlm chain STAGE … [--key value …]

Run LLaVA-style stages in order, each STAGE a recipe (file or shipped name) with `train:`; `--key value` overrides
apply to every stage. Every stage's recipe, data files and init_from are checked before the first trains; the
chain stops at the first stage that fails, and a stage already finished ends at once.

  e.g. python -m diffzoo.train.vlm chain llava-1.5-7b-pretrain llava-1.5-7b-finetune --output runs/vlm
       torchrun --nproc-per-node 8 -m diffzoo.train.vlm chain eramv-vicuna-7b-pretrain eramv-vicuna-7b-continue \\
           eramv-vicuna-7b-finetune"""


def _chain(argv: List[str]) -> int:
    """`chain RECIPE … [--key value …]`: each stage in order (the overrides apply to every one), stopping at the
    first that fails; a stage already finished resumes at its last step and ends at once. Every stage's recipe,
    data files and `init_from` are checked before the first runs (`diffzoo.train.vlm.run.check_chain`)."""
    if argv[:1] in (['-h'], ['--help']):
        print(CHAIN_HELP)
        return 0
    split = next((i for i, arg in enumerate(argv) if arg.startswith('--')), len(argv))
    names, overrides = argv[:split], argv[split:]
    if not names:
        print('error: chain needs the stage recipes in order, e.g. chain llava-1.5-7b-pretrain llava-1.5-7b-finetune',
              file=sys.stderr)
        return 2
    from .run import check_chain  # imports torch and transformers: once the command is parsed
    try:
        check_chain(names, overrides)
    except (RecipeError, ValueError, OSError) as exc:
        print(f'error: {exc}', file=sys.stderr)
        return 2
    for i, name in enumerate(names):
        print(f'=== stage {i + 1} of {len(names)}: {name}', flush=True)
        code = main(['--recipe', name, *overrides])
        if code:
            return code
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv == ['recipes']:  # as `python -m diffzoo.train recipes` lists the CLIP ones
        return _list_recipes()
    if argv[:1] == ['chain']:
        return _chain(argv[1:])
    p = parser()
    p.usage = ('%(prog)s --recipe NAME|PATH [--key value …]\n       %(prog)s chain STAGE … [--key value …]\n'
               '       %(prog)s recipes')
    args, rest = p.parse_known_args(argv)
    try:
        if not args.recipe:
            p.error('--recipe is required (`recipes` lists the shipped ones)')
        recipe = checked_recipe(args.recipe, rest)
        if recipe['train'] is not None:  # a LLaVA-style stage
            from .stage import run_stage as run
        else:
            from .finetune import run_fine_tune as run  # transformers' Trainer: once the recipe is checked
        run(recipe, Path(args.recipe).stem)
    except (RecipeError, ValueError, OSError) as exc:  # OSError: a missing file, a failed write (resume.writing)
        print(f'error: {exc}', file=sys.stderr)
        return 2
    return 0


if __name__ == '__main__':
    sys.exit(main())
