"""One factory for every vision-language model: `load_vlm(spec) -> VLM`.

A spec is a recipe's `model` mapping (`diffzoo.recipes`, kind "vlm"), chosen by its `type`:

    {type: paligemma, path: DIR}                a local PaliGemma checkpoint with its processor
    {type: build_vlm, vision: NAME, language_model: DIR, integration: full | eramv, select_layer,
     projector, sequence_mask, anchors, include_cls, inject_layers, layer_base, injected_queries, post_mlp}
                                                `build_vlm`: a timm / open_clip tower (open_clip
                                                name[,pretrained] or timm:<name>) + a local causal LM;
                                                the other keys are build_vlm's keywords (null: the
                                                integration's default)

The spec is checked against the recipe schema (`diffzoo.vlm.recipe.MODEL`): an unknown key is
refused with the valid ones listed.

The returned `VLM` holds the model with its own preprocessing (the processor, or the tower's
transform with its pretrained tag's mean/std) and answers the questions every caller asks —
training batches, prompts for generation, greedy answers — so
no caller branches on the kind of model. With `adapter` (a directory `save_adapter` wrote) the model
is made differential as saved and the adapter loaded; otherwise `differential` (differentialize's
keywords) is applied when given: the one place a model is made ready to run. `trainable_vlm` is the same
place for a training run: the model a recipe trains, an earlier stage's output loaded into it, what its plan
trains made trainable (`diffzoo.vlm.plan`).
"""
from pathlib import Path
from typing import Callable, Dict, FrozenSet, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
import transformers

from diffzoo.recipes import RecipeError, expand_env

from .conversations import pad_colour, pad_to_square
from .conversations import prompt as conversation_prompt
from .data import PaliGemmaCollator, VLMCollator
from .differential import differentialize
from .lora import add_lora, load_adapter
from .model import VisionLanguageModel, build_vlm
from .parts import model_parts
from .plan import TrainingPlan, apply_plan, training_plan
from .recipe import DATA, MODEL, check_model, load_vlm_recipe
from .stages import STAGE_CONFIG, STAGE_DIR, load_stage, model_spec, stage_problem


class VLM:
    """A vision-language model and its preprocessing (module docstring). `model` is what trains and
    runs (a peft wrapper once LoRA is added); `tokenizer` its text tokenizer. `max_length`: the positions (the
    image's and the text's) a prompt may take; a longer one is cut to them (`prompt_positions` says how many it
    takes)."""

    type = ''
    image_token_id: Optional[int] = None  # the id of the image positions in input_ids (PaliGemma's <image>)
    max_length: Optional[int] = None

    def __init__(self, model: nn.Module, tokenizer):
        self.model, self.tokenizer = model, tokenizer

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def to(self, device) -> 'VLM':
        self.model.to(device)
        return self

    def differentialize(self, **settings) -> 'VLM':
        """The decoder made differential (`diffzoo.vlm.differentialize`'s keywords)."""
        differentialize(self.decoder_model(), **settings)
        return self

    def add_lora(self, **settings) -> 'VLM':
        """LoRA on the decoder (`diffzoo.vlm.add_lora`'s keywords); `model` becomes the trained one."""
        self.model = add_lora(self.model, **settings)
        return self

    def load_adapter(self, directory, trainable: bool = False) -> 'VLM':
        self.model = load_adapter(self.model, directory, trainable=trainable)
        return self

    def decoder_model(self) -> nn.Module:
        """The transformers model that holds the decoder `differentialize` changes (`diffzoo.vlm.parts`)."""
        return model_parts(self.model).decoder_model

    def collator(self, train: bool = True, max_length: int = 64) -> Callable:
        """VQA samples → batches for `model(**batch)` (with labels when `train`) or for `generate`."""
        raise NotImplementedError

    def prompts(self, images: Sequence, prompts: Sequence[str]) -> Dict[str, torch.Tensor]:
        """A batch of images and prompts (all prefix, no answer), on the model's device."""
        raise NotImplementedError

    def generate(self, batch: Mapping[str, torch.Tensor], max_new_tokens: int = 20) -> List[str]:
        """Greedy answers to a batch from `prompts` or `collator(train=False)`, decoded and stripped."""
        raise NotImplementedError

    def prompt_positions(self, prompt: str) -> int:
        """The positions one question takes with its image, before any cut (what `max_length` counts)."""
        raise NotImplementedError

    @torch.no_grad()
    def answer(self, images: Sequence, prompts: Sequence[str], max_new_tokens: int = 20) -> List[str]:
        """Greedy answers, one per (image, prompt) pair."""
        return self.generate(self.prompts(images, prompts), max_new_tokens)


class BuiltVLM(VLM):
    """`build_vlm`'s `VisionLanguageModel`: [image tokens | prompt | answer], the tower's transform. With a
    `prompt_format` (a conversation format, `diffzoo.vlm.conversations`: what a LLaVA-style stage trained
    on) prompts are asked in that format, the image at its `<image>` place, padded to a square when
    `image_aspect` is 'pad'. `max_length` is the recipe's `data.max_length` when it trains on conversations
    (LLaVA's `tokenizer_model_max_length`), else the language model's `max_position_embeddings`: a longer prompt is
    cut to it with its image spliced in, as LLaVA's `prepare_inputs_labels_for_multimodal` cuts at evaluation too
    (where the cut reaches into the image, LLaVA keeps part of it and nothing after; here the text before it is
    asked without the image)."""

    type = 'build_vlm'

    def __init__(self, model: VisionLanguageModel, tokenizer, transform):
        super().__init__(model, tokenizer)
        self.transform = transform
        self.prompt_format: Optional[str] = None
        self.image_aspect = 'crop'
        self.max_length = getattr(model.config.get_text_config(), 'max_position_embeddings', None)
        self._image_positions: Optional[int] = None

    @property
    def image_positions(self) -> int:
        """The positions the model splices an image into (counted once)."""
        if self._image_positions is None:
            self._image_positions = self.model.image_positions()
        return self._image_positions

    def collator(self, train: bool = True, max_length: int = 64) -> Callable:
        return VLMCollator(self.tokenizer, self.transform, max_length, train=train)

    def _rows(self, prompts: Sequence[str]) -> Tuple[List[List[int]], Optional[List[int]]]:
        """Each prompt's ids and where its image goes (None: before the text, PaliGemma's layout)."""
        tok = self.tokenizer
        if self.prompt_format is None:  # PaliGemma's layout: [image | BOS prompt]
            if tok.bos_token_id is None:
                raise ValueError(f'the tokenizer ({type(tok).__name__}) has no BOS token, which the prompt layout '
                                 f'[image | BOS prompt] starts with; set prompt_format to the conversation format the '
                                 f'model trained on (diffzoo.vlm.conversations), or load it with vlm_from_recipe')
            return [[tok.bos_token_id] + tok(p, add_special_tokens=False)['input_ids'] for p in prompts], None
        asked = [conversation_prompt(p, tok, self.prompt_format) for p in prompts]  # the image where <image> goes
        return [ids for ids, _ in asked], [at for _, at in asked]

    def prompt_positions(self, prompt: str) -> int:
        rows, image_at = self._rows([prompt])
        return len(rows[0]) + (self.image_positions if image_at is None or image_at[0] >= 0 else 0)

    def _cut(self, rows: List[List[int]], image_at: Optional[List[int]]) -> None:
        """Each row, with its image spliced in, cut in place to `max_length` positions (class docstring)."""
        limit, positions = self.max_length, self.image_positions
        for i, row in enumerate(rows):
            at = 0 if image_at is None else image_at[i]
            if limit is None or len(row) + (positions if at >= 0 else 0) <= limit:
                continue
            if at < 0:
                rows[i] = row[:limit]
            elif at + positions <= limit:
                rows[i] = row[:limit - positions]
            else:  # the image reaches past the cut: the text before it, without the image
                rows[i], image_at[i] = row[:at], -1

    def prompts(self, images: Sequence, prompts: Sequence[str]) -> Dict[str, torch.Tensor]:
        tok = self.tokenizer
        rows, image_at = self._rows(prompts)
        self._cut(rows, image_at)
        if self.prompt_format is not None and self.image_aspect == 'pad':
            colour = pad_colour(self.transform)
            images = [pad_to_square(im.convert('RGB'), colour) for im in images]
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        T = max(len(r) for r in rows)
        ids = torch.full((len(rows), T), pad, dtype=torch.long)
        mask = torch.zeros(len(rows), T, dtype=torch.long)
        for i, r in enumerate(rows):  # right padding, as the collators pad
            ids[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), 1
        pixels = torch.stack([self.transform(im) for im in images])
        device = self.device
        batch = {'pixel_values': pixels.to(device), 'input_ids': ids.to(device), 'attention_mask': mask.to(device)}
        if image_at is not None:
            batch['image_at'] = torch.tensor(image_at, device=device)
        return batch

    @torch.no_grad()
    def generate(self, batch: Mapping[str, torch.Tensor], max_new_tokens: int = 20) -> List[str]:
        out = self.model.generate(batch['pixel_values'], batch['input_ids'], batch.get('attention_mask'),
                                  max_new_tokens=max_new_tokens, eos_token_id=self.tokenizer.eos_token_id,
                                  image_at=batch.get('image_at'))
        return [t.strip() for t in self.tokenizer.batch_decode(out, skip_special_tokens=True)]


class PaliGemmaVLM(VLM):
    """A PaliGemma checkpoint with its processor: [<image> × P | BOS prompt | answer]. A prompt longer than
    `max_length` (its Gemma's `max_position_embeddings`) is cut to it by the processor's tokenizer, the image tokens
    first, kept."""

    type = 'paligemma'

    def __init__(self, model: nn.Module, processor):
        super().__init__(model, processor.tokenizer)
        self.processor = processor
        config = model.config
        self.image_token_id = getattr(config, 'image_token_id', None)
        if self.image_token_id is None:
            self.image_token_id = config.image_token_index
        self.max_length = getattr(config.get_text_config(), 'max_position_embeddings', None)

    def prompt_positions(self, prompt: str) -> int:
        image_tokens = self.processor.image_seq_length
        return image_tokens + len(self.tokenizer(self.tokenizer.bos_token + prompt + '\n',
                                                 add_special_tokens=False)['input_ids'])

    def collator(self, train: bool = True, max_length: int = 64) -> Callable:
        return PaliGemmaCollator(self.processor, train=train)

    def prompts(self, images: Sequence, prompts: Sequence[str]) -> Dict[str, torch.Tensor]:
        image = getattr(self.processor, 'image_token', '<image>')  # PaliGemma's prompts start with the image tokens
        cut = {} if self.max_length is None else {'truncation': True, 'max_length': self.max_length}
        batch = self.processor(text=[image + p for p in prompts], images=list(images), return_tensors='pt',
                               padding='longest', **cut)
        return {k: v.to(self.device) for k, v in batch.items()}

    @torch.no_grad()
    def generate(self, batch: Mapping[str, torch.Tensor], max_new_tokens: int = 20) -> List[str]:
        batch = {k: v for k, v in batch.items() if k != 'labels'}
        out = self.model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False)
        out = out[:, batch['input_ids'].shape[1]:]
        return [t.strip() for t in self.tokenizer.batch_decode(out, skip_special_tokens=True)]


def _build_paligemma(spec: Mapping) -> VLM:
    path = spec['path']
    model = transformers.PaliGemmaForConditionalGeneration.from_pretrained(path)
    return PaliGemmaVLM(model, transformers.AutoProcessor.from_pretrained(path))


def _build_vlm(spec: Mapping) -> VLM:
    lm = transformers.AutoModelForCausalLM.from_pretrained(spec['language_model'])
    tokenizer = transformers.AutoTokenizer.from_pretrained(spec['language_model'])
    settings = {k: v for k, v in spec.items() if k not in BUILD_VLM_PARTS and v is not None}  # build_vlm's keywords
    model = build_vlm(spec['vision'], lm, spec['integration'], **settings)
    return BuiltVLM(model, tokenizer, model.vision.preprocess)


BUILD_VLM_PARTS = ('type', 'vision', 'language_model', 'integration')  # the rest of a build_vlm spec: keywords
BUILDERS = {'paligemma': _build_paligemma, 'build_vlm': _build_vlm}


def built_vlm(spec: Mapping, differential: Optional[Mapping] = None) -> VLM:
    """The VLM a spec names (module docstring), built on the CPU, made differential when `differential` is given."""
    kind = spec.get('type')
    if kind not in BUILDERS:
        raise ValueError(f'model.type={kind!r}: expected one of {sorted(BUILDERS)}')
    vlm = BUILDERS[kind](MODEL.check(spec, 'model'))
    return vlm.differentialize(**differential) if differential else vlm


def load_vlm(spec: Mapping, adapter: Union[str, Path, None] = None, differential: Optional[Mapping] = None,
             device: Union[str, torch.device] = 'cpu', trainable: bool = False) -> VLM:
    """The VLM a spec names (`built_vlm`), made differential (`differential`) or given its saved `adapter`, on
    `device`; `trainable` keeps a loaded adapter's parameters trainable (resuming)."""
    if adapter is not None:
        return built_vlm(spec).load_adapter(adapter, trainable=trainable).to(device)
    return built_vlm(spec, differential).to(device)


def vlm_from_recipe(recipe: Union[str, Mapping], adapter: Union[str, Path, None] = None,
                    device: Union[str, torch.device] = 'cpu', stage: Union[str, Path, None] = None) -> VLM:
    """The model a VLM recipe (name, path, or loaded mapping) trains, with `adapter` when given (as
    saved) or made differential as the recipe says, in eval mode: what MMNeedle, the benchmarks and the
    analysis run. `stage`: a LLaVA-style stage's run directory (or its `stage/`), whose tensors are loaded
    (`diffzoo.vlm.stages`; one that trained no step or whose weights are cut short is refused first,
    RecipeError); a recipe that trains on conversations asks its prompts in their format."""
    if stage is not None:  # refused before any model is built, as a chain refuses it (`stage_problem`)
        stage = Path(stage) if (Path(stage) / STAGE_CONFIG).is_file() else Path(stage) / STAGE_DIR
        problem = stage_problem(stage)
        if problem:
            raise RecipeError(f'stage {stage}: {problem}')
    raw = load_vlm_recipe(recipe) if isinstance(recipe, str) else dict(recipe)
    spec = expand_env(check_model(raw))
    vlm = load_vlm(spec['model'], adapter=adapter, differential=spec['differential'])
    if stage is not None:
        load_stage(vlm.model, stage, spec)
    data = raw.get('data') or {}
    if data.get('type') == 'conversations' and isinstance(vlm, BuiltVLM):
        vlm.prompt_format, vlm.image_aspect = data['format'], data.get('image_aspect', 'pad')
        vlm.max_length = data.get('max_length', DATA.sections['conversations'].keys['max_length'].default)
    if isinstance(vlm, BuiltVLM) and vlm.prompt_format is None and vlm.tokenizer.bos_token_id is None:
        raise RecipeError(f'{recipe}: its language model\'s tokenizer ({type(vlm.tokenizer).__name__}) has no BOS '
                          f'token, which the VQA prompt layout [image | BOS prompt] starts with (its training refuses '
                          f'it too); give the recipe the conversation data it trained on (data.type: conversations, '
                          f'with its format), or a language model whose tokenizer has BOS')
    vlm = vlm.to(device)
    vlm.model.eval()
    return vlm


class TrainableVLM(NamedTuple):
    """What `trainable_vlm` returns: the model, the plan applied to it, and `held_names`, the parameters a stage's
    output holds besides what trains."""
    vlm: VLM
    plan: TrainingPlan
    held_names: FrozenSet[str]


def trainable_vlm(recipe: Mapping, start: Optional[Path] = None) -> TrainableVLM:
    """The model a checked VLM recipe trains (`python -m diffzoo.train.vlm`): built and made differential as the
    recipe says, its random parts (a `build_vlm` projector, eRAM-V's post-projection MLP) drawn from its `seed`, a
    finished stage's output loaded (`start`, its `stage/` folder: `diffzoo.vlm.stages`), then what the recipe trains
    made trainable and the rest frozen (`diffzoo.vlm.plan`: `model` becomes the trained one, a peft wrapper with LoRA).
    Returns it, the plan, and the names of what a stage holds besides what trains: the parameters `start` filled, and
    λ and the sub-norm, which `differentialize` draws at random (held even when frozen, so the next stage and
    evaluation see the same), by their names once LoRA wrapped the language model."""
    torch.manual_seed(recipe['seed'])
    vlm = built_vlm(recipe['model'], recipe['differential'])
    held_ids = load_stage(vlm.model, start, model_spec(recipe)) if start is not None else set()
    plan = training_plan(recipe)
    vlm.model = apply_plan(vlm.model, plan)
    held_ids |= {id(p) for p in model_parts(vlm.model).differential()}
    return TrainableVLM(vlm, plan, frozenset(name for name, p in vlm.model.named_parameters() if id(p) in held_ids))


__all__ = ['VLM', 'BuiltVLM', 'PaliGemmaVLM', 'TrainableVLM', 'built_vlm', 'load_vlm', 'trainable_vlm',
           'vlm_from_recipe']
