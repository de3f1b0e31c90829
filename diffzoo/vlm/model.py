"""A PaliGemma-style vision-language model from any vision tower and any transformers causal LM.

    image (B, 3, S, S) → vision tower → patch tokens (B, P, D_v) → Linear → (B, P, D)
    sequence = [image tokens | prompt tokens | answer tokens]  → causal LM (inputs_embeds)

PaliGemma's numerics: one Linear projector, and only text embeddings carry Gemma's √D scale. Where
the scale lives in the embedding module (transformers ≥ 5: `embed_tokens.embed_scale`), image
embeddings enter as projected; where the model scales all `inputs_embeds` in its forward (the Gemma
family in older transformers), they are divided by √D first, as PaliGemma did. The prefix-LM mask (PaliGemma): image and prompt tokens (the prefix)
attend to each other in both directions, answer tokens attend causally to everything before them,
padding is never attended:

    allowed(q, k) = valid_k ∧ (k ≤ q ∨ (prefix_q ∧ prefix_k))

`sequence_mask='causal'` (eRAM-V's, the default of `integration="eramv"`) has no prefix: every position
attends to the valid positions up to itself. `sequence_mask='prefix_lm'` is the default of
`integration="full"`.

The mask is handed to the LM as a 4D additive mask (transformers uses a 4D mask as given), with
explicit position ids, so any padding layout works and the differential kernels of
`diffzoo.vlm.differentialize` see the same mask as the LM's own.

Vision towers and which of their features (`select_layer`): `diffzoo.vlm.towers`.
Its parts as training and saving see them (tower, projector and post-MLP, language model): registered here with
`diffzoo.vlm.parts.model_parts`.

Projector (`projector`, LLaVA-1.5's `mm_projector_type`): 'linear' (PaliGemma's one Linear, the
default of `integration="full"`) or 'mlp2x_gelu' (LLaVA-1.5's Linear → GELU → Linear, the default of
`integration="eramv"`, which projects the anchors and the injected features with it alike).
"""
import inspect
from typing import Optional, Sequence, Union

import torch
import torch.nn as nn
from transformers import DynamicCache

from .attention import DIFF_EAGER, DIFF_SDPA, INJECTED, register_attention
from .eramv import (ERAMV_DEFAULTS, InjectedFeatures, PostProjectionMLP, anchor_scores, check_tower,
                    default_inject_layers, module_indices, select_anchors)
from .options import FINAL_NORM, INJECTED_QUERIES, INTEGRATIONS, SEQUENCE_MASKS
from .parts import PROJECTION, ModelParts, find_decoder, model_parts
from .towers import VisionTokens, build_vision_tokens

GEMMA_FAMILY = ('gemma', 'gemma2', 'gemma3_text', 'gemma3')
PROJECTORS = {  # name → (D_v, D) → module
    'linear': lambda d_in, d_out: nn.Linear(d_in, d_out),  # PaliGemma
    'mlp2x_gelu': lambda d_in, d_out: nn.Sequential(  # LLaVA-1.5 (its state-dict keys: 0.weight, 2.weight, …)
        nn.Linear(d_in, d_out), nn.GELU(), nn.Linear(d_out, d_out)),
}
FULL_DEFAULTS = {'select_layer': FINAL_NORM, 'projector': 'linear', 'sequence_mask': 'prefix_lm'}  # PaliGemma's


def build_projector(projector: str, vision_dim: int, hidden_size: int) -> nn.Module:
    """The projector `projector` names (module docstring), vision_dim → hidden_size."""
    if projector not in PROJECTORS:
        raise ValueError(f'projector={projector!r}: expected one of {", ".join(PROJECTORS)} (linear: PaliGemma\'s one '
                         f'Linear; mlp2x_gelu: LLaVA-1.5\'s Linear → GELU → Linear, as eRAM-V)')
    return PROJECTORS[projector](vision_dim, hidden_size)


def prefix_lm_mask(attention_mask: torch.Tensor, prefix_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, 1, L, L) additive mask from (B, L) valid and prefix flags (module docstring)."""
    valid, prefix = attention_mask.bool(), prefix_mask.bool()
    L = valid.shape[1]
    causal = torch.ones(L, L, dtype=torch.bool, device=valid.device).tril()  # (L, L): k ≤ q
    allowed = causal | (prefix[:, :, None] & prefix[:, None, :])  # (B, L, L)
    allowed = allowed & valid[:, None, :]
    allowed = allowed | torch.eye(L, dtype=torch.bool, device=valid.device)  # a padded query sees itself
    return torch.zeros(allowed.shape, dtype=dtype, device=valid.device).masked_fill_(
        ~allowed, torch.finfo(dtype).min)[:, None]


class VisionLanguageModel(nn.Module):
    """vision → projector → causal LM with a prefix-LM mask (module docstring)."""

    # forward's loss is the mean over a micro-batch's scored tokens and takes no num_items_in_batch: Trainer
    # must divide it by the accumulation steps itself (and not multiply it by the number of processes)
    accepts_loss_kwargs = False

    def __init__(self, vision: VisionTokens, language_model: nn.Module, integration: str = 'full',
                 select_layer=None, projector: Optional[str] = None, sequence_mask: Optional[str] = None,
                 anchors: Optional[int] = None,
                 include_cls: Optional[bool] = None, inject_layers: Optional[Sequence[int]] = None,
                 injected_queries: Optional[str] = None, layer_base: Optional[int] = None,
                 post_mlp: Optional[bool] = None):
        super().__init__()
        if integration not in INTEGRATIONS:
            raise ValueError(f'integration={integration!r}: expected one of {INTEGRATIONS}')
        eramv = dict(anchors=anchors, include_cls=include_cls, inject_layers=inject_layers,
                     injected_queries=injected_queries, layer_base=layer_base, post_mlp=post_mlp)
        given = {k: v for k, v in eramv.items() if v is not None}
        if integration == 'full' and given:
            raise ValueError(f'{", ".join(f"{k}={v!r}" for k, v in given.items())}: eRAM-V settings, which apply to '
                             f'integration="eramv"; leave them out for integration="full"')
        defaults = ERAMV_DEFAULTS if integration == 'eramv' else FULL_DEFAULTS  # None: the integration's default
        self.select_layer = defaults['select_layer'] if select_layer is None else select_layer
        self.projector_type = defaults['projector'] if projector is None else projector
        self.sequence_mask = defaults['sequence_mask'] if sequence_mask is None else sequence_mask
        if self.sequence_mask not in SEQUENCE_MASKS:
            raise ValueError(f'sequence_mask={sequence_mask!r}: expected causal (eRAM-V, LLaVA-1.5) or prefix_lm '
                             f'(PaliGemma)')
        self.vision = vision.select(self.select_layer)
        config = language_model.config.get_text_config()
        self.hidden_size = config.hidden_size
        self.projector = build_projector(self.projector_type, vision.dim, self.hidden_size)  # V and V_A alike
        self.language_model = language_model
        # FSDP's auto-wrap reads the classes to wrap from here, as from a transformers model: the decoder layers
        self._no_split_modules = list(getattr(language_model, '_no_split_modules', None) or [])
        scales_inputs = (config.model_type in GEMMA_FAMILY
                         and not hasattr(language_model.get_input_embeddings(), 'embed_scale'))
        self.embed_scale = self.hidden_size ** -0.5 if scales_inputs else 1.0  # module docstring
        self.integration = integration
        # the KV cache's keyword: `cache` where the LM's forward has it (transformers 5.x; `past_key_values` is
        # deprecated there and goes in 5.40), `past_key_values` before
        forward_parameters = inspect.signature(type(language_model).forward).parameters
        self.cache_keyword = 'cache' if 'cache' in forward_parameters else 'past_key_values'
        if integration == 'eramv':  # diffzoo.vlm.eramv
            depth = len(find_decoder(language_model).layers)
            eramv = {k: ERAMV_DEFAULTS[k] if v is None and k in ERAMV_DEFAULTS else v for k, v in eramv.items()}
            if eramv['injected_queries'] not in INJECTED_QUERIES:
                raise ValueError(f'injected_queries={injected_queries!r}: expected all (eRAM-V\'s Eq. 8: anchors '
                                 f'and text read the injected features) or text (text positions only)')
            self.anchors, self.include_cls = int(eramv['anchors']), bool(eramv['include_cls'])
            check_tower(self.vision, self.anchors)
            self.injected_queries = eramv['injected_queries']
            inject_layers, layer_base = eramv['inject_layers'], eramv['layer_base']
            if inject_layers is None:
                inject_layers, layer_base = default_inject_layers(depth), 1
            self.inject_indices = module_indices(inject_layers, depth, layer_base)  # 0-based decoder modules
            self.inject_layers = [i + 1 for i in self.inject_indices]  # counted from 1, as eRAM-V
            self.post_mlp = PostProjectionMLP(self.hidden_size) if eramv['post_mlp'] else nn.Identity()
            register_attention()  # injected keys enter through diffzoo's attention functions
            config._attn_implementation = DIFF_EAGER if config._attn_implementation in ('eager', DIFF_EAGER) else DIFF_SDPA

    @property
    def config(self):
        return self.language_model.config

    @property
    def dtype(self) -> torch.dtype:
        """The projector's dtype, which the pixels are cast to."""
        return next(self.projector.parameters()).dtype

    @torch.no_grad()
    def image_positions(self) -> int:
        """How many sequence positions an image takes (the tower's patch tokens, or eRAM-V's anchors), counted on
        one blank image: what a maximum length counts beside the text."""
        parameter = next(self.projector.parameters())
        pixels = torch.zeros(1, 3, *self.vision.image_size, dtype=parameter.dtype, device=parameter.device)
        return self.visual_inputs(pixels)[0].shape[1]

    def image_embeddings(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(B, P, D): projected patch tokens (pre-divided by √D for LMs that scale all input embeddings)."""
        tokens = self.vision(pixel_values.to(self.dtype))  # (B, P, D_v)
        return self.projector(tokens) * self.embed_scale

    def visual_inputs(self, pixel_values: torch.Tensor):
        """(sequence image embeddings (B, P or k, D), injected features (B, P, D) or None, anchor indices)."""
        if self.integration == 'full':
            return self.image_embeddings(pixel_values), None, None
        tokens, scores, cls = anchor_scores(self.vision, pixel_values.to(self.dtype), with_cls=True)
        features = self.post_mlp(self.projector(tokens))  # (B, P, D): every patch, fine-grained
        anchors, index = select_anchors(features, scores, self.anchors)  # (B, k, D), original order
        if self.include_cls:  # eRAM-V's 65 anchors: [CLS] (first in the tower's order), then the top-k patches
            anchors = torch.cat([self.post_mlp(self.projector(cls[:, None])), anchors], 1)  # (B, 1 + k, D)
        return anchors * self.embed_scale, features, index

    def _injected(self, features, text_at, image_at=None) -> dict:
        """The language model's extra forward keyword: eRAM-V's injected keys/values ({} without). A row
        without an image (`image_at` −1: a text-only conversation's blank picture) reads none."""
        if features is None:
            return {}
        queries = text_at  # (B, L): the positions that read the features
        if self.injected_queries == 'all':  # Eq. 8: the whole multimodal sequence reads the features
            queries = torch.ones_like(text_at)
        if image_at is not None:
            queries = queries & (image_at >= 0)[:, None]
        decoder = find_decoder(self.language_model)
        return {INJECTED: InjectedFeatures.from_features(decoder, self.inject_indices, features, queries)}

    def _inputs(self, pixel_values, input_ids, attention_mask, prefix_mask, image_at=None):
        """inputs_embeds (B, P + T, D), 4D mask, position ids, valid flags, injected features, the text
        positions (B, P + T) and each text token's position (B, T). Without `image_at` the sequence is
        [image | text]; with it (B,), row b's image tokens go before its text token image_at[b] (LLaVA's
        `<image>` place; -1: no image, the row's P slots are padding at its end)."""
        image, features, _ = self.visual_inputs(pixel_values)  # (B, P, D)
        text = self.language_model.get_input_embeddings()(input_ids)  # (B, T, D)
        B, P = image.shape[:2]
        T = input_ids.shape[1]
        if image_at is None:
            image_at = input_ids.new_zeros(B)
        t = torch.arange(T, device=input_ids.device)[None]  # (1, T)
        has_image = image_at >= 0  # (B,)
        text_to = t + P * (has_image[:, None] & (t >= image_at[:, None]))  # (B, T): where each text token goes
        image_to = torch.where(has_image, image_at, T)[:, None] + torch.arange(P, device=t.device)  # (B, P)
        L = T + P
        embeds = text.new_zeros(B, L, text.shape[-1])
        embeds.scatter_(1, text_to[..., None].expand_as(text), text)
        embeds = embeds.scatter(1, image_to[..., None].expand(-1, -1, text.shape[-1]), image.to(text.dtype))
        valid = attention_mask.new_zeros(B, L).scatter_(1, text_to, attention_mask)
        valid.scatter_(1, image_to, has_image[:, None].to(valid.dtype).expand(-1, P))
        prefix = attention_mask.new_zeros(B, L).scatter_(1, text_to, prefix_mask.to(attention_mask.dtype))
        prefix.scatter_(1, image_to, has_image[:, None].to(prefix.dtype).expand(-1, P))
        text_at = torch.zeros(B, L, dtype=torch.bool, device=t.device).scatter_(1, text_to, True)
        positions = (valid.cumsum(1) - 1).clamp_(min=0)  # (B, P + T)
        mask = prefix_lm_mask(valid, self._prefix(prefix), embeds.dtype)
        return embeds, mask, positions, valid, features, text_at, text_to

    def _prefix(self, prefix: torch.Tensor) -> torch.Tensor:
        """The positions that attend both ways: `prefix` under prefix_lm, none under causal."""
        return prefix if self.sequence_mask == 'prefix_lm' else torch.zeros_like(prefix)

    def forward(self, pixel_values, input_ids, attention_mask=None, prefix_mask=None, labels=None, image_at=None,
                **kwargs):
        """Logits over [image | text] (or the text with the image spliced in at `image_at`, `_inputs`); with
        `labels` (B, T; -100 ignored), the next-token loss on the text: a scored token is predicted from
        the position before it in the sequence (with `image_at`, the image's last token for one right after
        the image, as LLaVA's captions are; without, the text's first token is never scored).

        prefix_mask (B, T): 1 for prompt tokens (bidirectional under sequence_mask='prefix_lm'), 0 for answer
        tokens; default all prefix. Under sequence_mask='causal' every token attends causally.
        """
        attention_mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        prefix_mask = attention_mask if prefix_mask is None else prefix_mask
        embeds, mask, positions, valid, features, text_at, text_to = self._inputs(
            pixel_values, input_ids, attention_mask, prefix_mask, image_at)
        out = self.language_model(inputs_embeds=embeds, attention_mask=mask, position_ids=positions,
                                  **self._injected(features, text_at, image_at), **kwargs)
        if labels is not None:
            if image_at is None:  # [image | text]: the text's first token (BOS) is not predicted from the image
                labels = torch.cat([labels.new_full((labels.shape[0], 1), -100), labels[:, 1:]], 1)
            targets = labels.new_full(embeds.shape[:2], -100).scatter_(1, text_to, labels)  # (B, P + T)
            logits = out.logits[:, :-1].float()  # (B, P + T - 1, V): position i predicts i + 1
            out.loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets[:, 1:].reshape(-1),
                                                   ignore_index=-100)
        return out

    @torch.no_grad()
    def generate(self, pixel_values, input_ids, attention_mask=None, max_new_tokens: int = 10,
                 eos_token_id: Optional[int] = None, use_cache: bool = True, image_at=None) -> torch.Tensor:
        """Greedy answers (B, ≤ max_new_tokens) to prompts `input_ids` (all prefix), right padding allowed;
        `image_at` as `forward`."""
        attention_mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        embeds, mask, positions, valid, features, text_at, _ = self._inputs(pixel_values, input_ids, attention_mask,
                                                                            attention_mask, image_at)
        injected = self._injected(features, text_at, image_at)
        return self._generate(embeds, mask, positions, valid, input_ids, max_new_tokens, eos_token_id, use_cache,
                              injected)

    def _generate(self, embeds, mask, positions, valid, input_ids, max_new_tokens, eos_token_id, use_cache,
                  injected):
        B = input_ids.shape[0]
        prompt = valid  # (B, P + T): image and prompt tokens, the prefix
        last = valid.sum(1) - 1  # (B,) index of each prompt's last valid token
        cache = DynamicCache(config=self.language_model.config) if use_cache else None
        out = self.language_model(inputs_embeds=embeds, attention_mask=mask, position_ids=positions,
                                  use_cache=use_cache, **{self.cache_keyword: cache}, **injected)
        rows = torch.arange(B, device=input_ids.device)
        token = out.logits[rows, last].argmax(-1)  # (B,)
        answers, done = [token], torch.zeros(B, dtype=torch.bool, device=token.device)
        embed = self.language_model.get_input_embeddings()
        position = positions[rows, last]
        for _ in range(max_new_tokens - 1):
            if eos_token_id is not None:
                done |= token == eos_token_id
                if done.all():
                    break
            position = position + 1
            valid = torch.cat([valid, valid.new_ones(B, 1)], 1)
            if use_cache:
                step = torch.zeros(B, 1, 1, valid.shape[1], dtype=embeds.dtype, device=valid.device)
                step.masked_fill_(~valid.bool()[:, None, None], torch.finfo(embeds.dtype).min)
                out = self.language_model(inputs_embeds=embed(token)[:, None], attention_mask=step,
                                          position_ids=position[:, None], use_cache=True, **{self.cache_keyword: cache},
                                          **injected)
                token = out.logits[:, -1].argmax(-1)
            else:  # the whole sequence again: [image | prompt (padded) | answers so far]
                embeds = torch.cat([embeds, embed(token)[:, None]], 1)
                positions = torch.cat([positions, position[:, None]], 1)
                prefix = torch.cat([prompt, valid.new_zeros(B, valid.shape[1] - prompt.shape[1])], 1)
                out = self.language_model(inputs_embeds=embeds,
                                          attention_mask=prefix_lm_mask(valid, self._prefix(prefix), embeds.dtype),
                                          position_ids=positions, **injected)
                token = out.logits[:, -1].argmax(-1)
            answers.append(token)
        result = torch.stack(answers, 1)  # (B, n)
        if eos_token_id is not None:  # everything after a sequence's first EOS becomes EOS
            after = (result == eos_token_id).cumsum(1) > 0
            result = result.masked_fill(after, eos_token_id)
        return result


@model_parts.register
def _(model: VisionLanguageModel) -> ModelParts:
    """Its tower, projector (and post-MLP) and language model, held apart (`diffzoo.vlm.parts`)."""
    projection = {name: module for name, module in model.named_children() if name in PROJECTION}
    return ModelParts(model, model.language_model, model.vision, projection)


def build_vlm(vision: Union[str, nn.Module], language_model: nn.Module, integration: str = 'full',
              **settings) -> VisionLanguageModel:
    """A PaliGemma-style model: `vision` (timm / open_clip tower or name) + projector + `language_model`
    (a transformers causal LM, differential or not).

    Both integrations take select_layer (module docstring; 'final_norm' for full, -2 for eramv),
    projector ('linear' for full, 'mlp2x_gelu' for eramv) and sequence_mask ('prefix_lm' for full, PaliGemma's;
    'causal' for eramv, the paper's Eq. 4). integration="eramv" feeds visual anchors and
    injects the fine-grained features instead (`diffzoo.vlm.eramv`), with keywords anchors=64 patches,
    include_cls=True ([CLS] too: 65 anchors), inject_layers=None (eRAM-V's, scaled; counted from 1, or
    from 0 with layer_base=0), injected_queries='all' (Eq. 8; 'text': text positions only),
    post_mlp=True."""
    if not hasattr(language_model, 'get_input_embeddings'):
        raise ValueError(f'language_model: {type(language_model).__name__} is not a transformers causal LM')
    return VisionLanguageModel(build_vision_tokens(vision), language_model, integration, **settings)
