"""What a VLM recipe may hold (`diffzoo.recipes`, kind "vlm"; shipped ones in recipes/vlm/).

    model:        {type: paligemma, path: DIR} or {type: build_vlm, vision, language_model, integration, …}
    attention:    {type: vanilla} (the decoder as pretrained, the default) or
                  {type: differential, variant, lambda_init, layers, mlp} (differentialize's settings)
    data:         {type: vqav2, root, split, fraction, seed, val_split, val_fraction, max_length} (the
                  default type) or {type: conversations, json, image_folder, format, max_length,
                  image_aspect, mismatch}
                  (LLaVA-format conversations, `diffzoo.vlm.conversations`)
    train:        a stage (`diffzoo.train.vlm.stage`): {projector, vision, language_model: frozen | full |
                  lora, differential, gradient_checkpointing}; null: LoRA fine-tuning as `lora` and
                  `train_projector` say (Differential PaliGemma's run)
    init_from:    a stage starts from an earlier stage's output: its recipe name (run directory under
                  `output`) or a run directory
    fsdp:         {version, reshard_after_forward, cpu_offload, activation_checkpointing}: FSDP through
                  Trainer/accelerate instead of DDP (a 7B language model's full fine-tuning); null: DDP
    lora:         {r, alpha, dropout, mlp}; train_projector (build_vlm models)
    optimisation: lr, lambda_lr, weight_decay, batch_size (per process), grad_accum or global_batch_size,
                  epochs, max_steps, lr_scheduler, warmup_steps or warmup_ratio, max_grad_norm, precision, seed
    running:      device, workers, log_every, save_every, eval_max_new_tokens, report_to, output

`attention` is chosen by type as `model` is, so a recipe over a differential base says
`attention: {type: vanilla}` and the base's settings go with the replaced mapping. A validated recipe
holds `differential`: differentialize's settings, or None for vanilla attention.

`python -m diffzoo.train.vlm recipes` lists the shipped recipes; `--help` lists every key.
"""
from typing import Dict, Mapping, Sequence

from diffzoo.recipes import (REQUIRED, Key, RecipeError, Section, Typed, apply_overrides, expand_env, load_recipe,
                             parse_overrides, unknown_keys_error, validate)

from .options import (CONVERSATION_FORMATS, FINAL_NORM, IMAGE_ASPECTS, INJECTED_QUERIES, INTEGRATIONS, MISMATCH_RULES,
                      MLPS, PROJECTOR_NAMES, SEQUENCE_MASKS, VARIANTS, check_select_layer)


class SelectLayerKey(Key):
    """`select_layer`: a block counted from the end (negative) or from 1, or 'final_norm' (checked as
    `build_vlm` checks it, except against the tower's depth, which only the model knows)."""

    def check(self, value, where: str):
        value = super().check(value, where)
        if value is not None:
            try:
                check_select_layer(value)
            except ValueError as exc:
                raise RecipeError(f'recipe key {where}: {exc}') from None
        return value


class PositiveKey(Key):
    """A count or a length above 0 (a batch, steps, epochs): 0 or less would train nothing, or divide by it;
    null where the key's default is null."""

    def check(self, value, where: str):
        value = super().check(value, where)
        if value is not None and value <= 0:
            null = ' or null' if self.default is None else ''
            raise RecipeError(f'recipe key {where}: {value!r}; it must be above 0{null} ({self.doc})')
        return value


LM_TRAINING = ('frozen', 'full', 'lora')
DATA_TYPE = Key((str,), REQUIRED, 'which data: vqav2 (default) or conversations')
DATA = Typed({
    'vqav2': Section({
        'type': DATA_TYPE,
        'root': Key((str,), REQUIRED, 'a VQAv2 copy: official JSON + COCO images, or Hugging Face parquet'),
        'split': Key((str,), 'train', 'training split'),
        'fraction': Key((float,), 1.0, 'seeded subset of the training split, in (0, 1]'),
        'seed': Key((int,), None, 'subset seed (default: seed)'),
        'val_split': Key((str,), 'val', 'validation split for VQA accuracy, or null', nullable=True),
        'val_fraction': Key((float,), 1.0, 'seeded subset of the validation split'),
        'max_length': Key((int,), 64, 'longest prompt + answer in tokens (build_vlm models)'),
    }),
    'conversations': Section({
        'type': DATA_TYPE,
        'json': Key((str,), REQUIRED, "a LLaVA-format JSON file (LLaVA's 558K, 665K, …)"),
        'image_folder': Key((str,), None, 'the folder its image paths are relative to (null: text only)'),
        'format': Key((str,), REQUIRED, 'prompt format: plain (LLaVA and TinyLLaVA pre-training), vicuna_v1 '
                                        "(LLaVA-1.5), qwen2_instruct (TinyLLaVA_Factory's Qwen2) or chat_template "
                                        "(the language model's own)", CONVERSATION_FORMATS),
        'max_length': Key((int,), 2048, "longest conversation (LLaVA's model_max_length): cut in tokens with the "
                                        "image placeholder one, then in positions with the image's (as LLaVA's "
                                        'collator and model); longer ones are cut, counted; prompts asked are cut '
                                        'to it too'),
        'image_aspect': Key((str,), 'pad', "pad (LLaVA-1.5's: to a square of the normaliser's mean colour first) or "
                                          "crop (the tower's transform alone: TinyLLaVA's Qwen2 scripts' 'square')",
                            IMAGE_ASPECTS),
        'mismatch': Key((str,), 'mask', "a conversation whose rounds the format's reference cannot count (LLaVA's "
                                        "'tokenization mismatch'): mask (nothing scored, as LLaVA and TinyLLaVA) or "
                                        'score (its answers scored); counted either way', MISMATCH_RULES),
    }),
}, doc='the training data, chosen by type (vqav2 when not given)')

TYPE = Key((str,), REQUIRED, 'which model: paligemma or build_vlm')
MODEL = Typed({
    'paligemma': Section({
        'type': TYPE,
        'path': Key((str,), REQUIRED, 'a local PaliGemma checkpoint directory (transformers weights + processor)'),
    }),
    'build_vlm': Section({
        'type': TYPE,
        'vision': Key((str,), REQUIRED, 'the vision tower: an open_clip name[,pretrained] or timm:<name>'),
        'language_model': Key((str,), REQUIRED, 'a local transformers causal LM directory with its tokenizer'),
        'integration': Key((str,), 'full', 'full (every visual token in the sequence) or eramv', INTEGRATIONS),
        # build_vlm's keywords; null: the integration's default (diffzoo.vlm.model, diffzoo.vlm.eramv)
        'select_layer': SelectLayerKey((int, str), None, f'vision features: a block counted from the end (-2: the '
                                       f'penultimate, eramv default) or from 1, or {FINAL_NORM} (the last block '
                                       f'through the final norm, full default)'),
        'projector': Key((str,), None, 'linear (PaliGemma, full default) or mlp2x_gelu (LLaVA-1.5, eramv default)',
                         PROJECTOR_NAMES),
        'sequence_mask': Key((str,), None, 'attention over [image | text]: prefix_lm (PaliGemma, full default) or '
                             "causal (eRAM-V's Eq. 4, eramv default)", SEQUENCE_MASKS),
        'anchors': Key((int,), None, "eRAM-V's visual anchors: top-k patches by CLS attention (default 64)"),
        'include_cls': Key((bool,), None, "eRAM-V: [CLS] first among the anchors (default true: 65 anchors)"),
        'inject_layers': Key((list,), None, "eRAM-V's injection layers (default: the paper's 8, 10, …, 22 of 32, "
                                            "scaled)"),
        'layer_base': Key((int,), None, "eRAM-V: inject_layers counted from 1 (default, the paper's) or 0",
                          (0, 1)),
        'injected_queries': Key((str,), None, "eRAM-V: who reads the injected features: all (Eq. 8, default) "
                                              "or text", INJECTED_QUERIES),
        'post_mlp': Key((bool,), None, "eRAM-V's post-projection MLP (default true)"),
    }),
}, doc='the model, chosen by type')

ATTENTION_TYPE = Key((str,), REQUIRED, 'which decoder attention: vanilla or differential')
ATTENTION = Typed({
    'vanilla': Section({'type': ATTENTION_TYPE}),
    'differential': Section({
        'type': ATTENTION_TYPE,
        'variant': Key((str,), 'duplicate', 'duplicate (Differential PaliGemma, Eq. 5) or split', VARIANTS),
        'lambda_init': Key((float, str), 'depth', 'a number in [0, 1) or "depth"'),
        'layers': Key((list,), None, 'decoder layer indices (default: all)'),
        'mlp': Key((str,), 'original', 'original or swiglu', MLPS),
    }),
}, doc="the decoder attention, chosen by type: vanilla (default) or differential with differentialize's settings")
VANILLA = {'type': 'vanilla'}

VLM_RECIPE = Section({
    'description': Key((str,), '', 'one line saying what the run reproduces'),
    'model': MODEL,
    'attention': ATTENTION,
    'lora': Section({
        'r': Key((int,), 32, 'LoRA rank'),
        'alpha': Key((int, float), 64, 'LoRA alpha'),
        'dropout': Key((float,), 0.0, 'LoRA dropout'),
        'mlp': Key((bool,), False, 'adapters on gate/up/down too'),
    }, doc='LoRA on the decoder'),
    'train_projector': Key((bool,), False, 'train a build_vlm projector (and eRAM-V post-MLP)'),
    'data': DATA,
    'train': Section({
        'projector': Key((bool,), False, 'train the projector (and eRAM-V\'s post-MLP)'),
        'vision': Key((bool,), False, 'train the vision tower'),
        'language_model': Key((str,), 'frozen', 'the language model: frozen, full or lora (the lora section)',
                              LM_TRAINING),
        'differential': Key((bool,), None, 'train λ and the sub-norm of a differential decoder (default: when '
                                           'the language model trains)'),
        'gradient_checkpointing': Key((bool,), False, "recompute the language model's layers in backward"),
    }, doc='what a stage trains (null: LoRA fine-tuning as lora and train_projector say)', optional=True),
    'fsdp': Section({
        'version': Key((int,), 2, 'FSDP2 (2) or the legacy FSDP1 (1)', (1, 2)),
        'reshard_after_forward': Key((bool,), True, 'free the gathered weights after each forward (ZeRO-3-like)'),
        'cpu_offload': Key((bool,), False, 'keep parameters and gradients on the CPU between uses'),
        'activation_checkpointing': Key((bool,), False, "FSDP's activation checkpointing of the wrapped layers"),
    }, doc="shard a language model too large for DDP with FSDP through Trainer/accelerate (its decoder layers "
           "wrapped); null: DDP", optional=True),
    'init_from': Key((str,), None, "an earlier stage's output to start from: its recipe name (the run directory "
                                   "under output) or a run directory"),
    'lr': Key((float,), REQUIRED, 'learning rate of the LoRA adapters (and projector)'),
    'lambda_lr': Key((float,), None, 'learning rate of λ and the sub-norm (default: lr)'),
    'weight_decay': Key((float,), 0.0, 'AdamW weight decay'),
    'batch_size': PositiveKey((int,), 4, 'samples per process and micro-batch'),
    'grad_accum': PositiveKey((int,), 1, 'micro-batches per optimizer step'),
    'global_batch_size': PositiveKey((int,), None, 'samples per optimizer step over every process: sets grad_accum '
                                                   'from batch_size and the number of processes'),
    'epochs': PositiveKey((int, float), 1, 'training epochs (when max_steps is null)'),
    'max_steps': PositiveKey((int,), None, 'optimizer steps (overrides epochs; null: epochs decide)'),
    'lr_scheduler': Key((str,), 'constant', "transformers' lr_scheduler_type: constant, linear, cosine, …"),
    'warmup_steps': Key((int,), 0, 'linear warm-up steps'),
    'warmup_ratio': Key((float,), None, 'linear warm-up as a fraction of the steps (LLaVA: 0.03); instead of '
                                        'warmup_steps'),
    'max_grad_norm': Key((float,), 1.0, 'gradient clipping norm (0: off)'),
    'precision': Key((str,), None, 'fp32 or bf16 (default: bf16 on CUDA, fp32 on CPU)', ('fp32', 'bf16')),
    'seed': Key((int,), 0, 'seed of the model init, data order and subsets'),
    'device': Key((str,), 'auto', 'auto, cpu or cuda', ('auto', 'cpu', 'cuda')),
    'workers': Key((int,), 0, 'data loader workers per process'),
    'log_every': PositiveKey((int,), 10, 'optimizer steps between log lines'),
    'save_every': PositiveKey((int,), 500, 'optimizer steps between checkpoints'),
    'eval_max_new_tokens': Key((int,), 8, 'answer length when scoring VQA'),
    'report_to': Key((str,), 'tensorboard', 'tensorboard, wandb, both comma-separated, or none'),
    'output': Key((str,), 'runs/vlm', 'run directories go to <output>/<recipe name>'),
}, doc='a VLM fine-tuning recipe')

# keys a resumed run may change: how long it runs and what it logs, not what it trains
RESUMABLE_CHANGES = ('max_steps', 'epochs', 'log_every', 'save_every', 'eval_max_new_tokens', 'workers', 'report_to')


def load_vlm_recipe(name_or_path: str) -> Dict:
    """A VLM recipe with its `base` chain merged (not yet validated: overrides may follow)."""
    return load_recipe(name_or_path, kind='vlm')


def checked_recipe(name_or_path: str, overrides: Sequence[str] = ()) -> Dict:
    """The recipe a command runs: loaded, its `--key value` overrides applied, `${VAR}`s expanded, validated
    (`check`)."""
    return check(expand_env(apply_overrides(load_vlm_recipe(name_or_path), parse_overrides(list(overrides)))))


MODEL_PART = Section({k: VLM_RECIPE.keys[k] for k in ('model', 'attention')}, doc='the model a recipe builds')


def _attention(recipe: Mapping) -> Dict:
    """The recipe with its `attention` stated (vanilla when not given) and its data's type (vqav2 when not
    given). The retired `differential` key (the decoder's settings, or null for vanilla) is refused, naming
    its replacement."""
    recipe = dict(recipe)
    if isinstance(recipe.get('data'), Mapping) and 'type' not in recipe['data']:
        recipe['data'] = {'type': 'vqav2', **recipe['data']}
    if 'differential' in recipe:
        raise RecipeError(f'recipe key differential ({recipe["differential"]!r}) is retired: write '
                          f'attention: {{type: differential, variant: …}} for its settings, or attention: '
                          f'{{type: vanilla}} for null')
    recipe.setdefault('attention', VANILLA)
    return recipe


def _differential(checked: Dict) -> Dict:
    """A validated recipe's `attention` as `differential`: differentialize's settings, or None (vanilla)."""
    attention = checked.pop('attention')
    settings = {k: v for k, v in attention.items() if k != 'type'}
    return dict(checked, differential=settings if attention['type'] == 'differential' else None)


def check(recipe: Dict) -> Dict:
    """The recipe validated against VLM_RECIPE, with its defaults; `attention` becomes `differential`
    (differentialize's settings, or None for vanilla attention)."""
    return _differential(validate(_attention(recipe), VLM_RECIPE))


def check_model(recipe: Dict) -> Dict:
    """The model part of a recipe (`model`, `attention`) validated as `check` does, for running it rather
    than training it: the training keys may be absent, and unknown keys are still refused."""
    recipe = _attention(recipe)
    unknown = [k for k in recipe if k not in VLM_RECIPE.keys]
    if unknown:
        raise unknown_keys_error(unknown, {k: v.doc for k, v in VLM_RECIPE.keys.items()})
    return _differential(validate({k: recipe[k] for k in MODEL_PART.keys if k in recipe}, MODEL_PART))
