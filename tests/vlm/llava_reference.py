"""LLaVA-1.5's own preprocessing (the `llava-torch` package, LLaVA's repository as published on PyPI, installed by
`make` without its pins) as the reference the conversation tests compare with: `preprocess_multimodal`,
`preprocess` (its `preprocess_v1` and `preprocess_plain`), `DataCollatorForSupervisedDataset` and its model's
`prepare_inputs_labels_for_multimodal`, run on the same records and tokenizer."""
import contextlib
import copy
import io
from types import SimpleNamespace
from typing import Dict, List, Tuple

import torch
import torch.nn as nn
import transformers.trainer

# LLaVA's trainer module imports this list, which transformers 5 no longer has; its value in transformers 4.36
transformers.trainer.ALL_LAYERNORM_LAYERS = getattr(transformers.trainer, 'ALL_LAYERNORM_LAYERS', [nn.LayerNorm])

import llava.conversation as llava_conversation  # noqa: E402
import llava.model.llava_arch as llava_arch  # noqa: E402
import llava.train.train as llava_train  # noqa: E402
from llava.constants import IGNORE_INDEX, IMAGE_TOKEN_INDEX  # noqa: E402

DATA_ARGS = SimpleNamespace(is_multimodal=True, mm_use_im_start_end=False)


def preprocess(record: Dict, tokenizer, version: str) -> Tuple[List[int], List[int], bool]:
    """(input_ids with IMAGE_TOKEN_INDEX, labels with IGNORE_INDEX, whether LLaVA printed its tokenization
    mismatch) of one LLaVA-format record, as LLaVA's LazySupervisedDataset prepares it under `version`
    (the training script's --version: 'v1' for vicuna_v1, 'plain')."""
    llava_train.conversation_lib.default_conversation = llava_conversation.conv_templates[version]
    sources = [copy.deepcopy(record['conversations'])]
    has_image = 'image' in record
    if has_image:
        sources = llava_train.preprocess_multimodal(sources, DATA_ARGS)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        out = llava_train.preprocess(sources, tokenizer, has_image=has_image)
    return out['input_ids'][0].tolist(), out['labels'][0].tolist(), 'tokenization mismatch' in printed.getvalue()


def collate(rows: List[Tuple[List[int], List[int]]], tokenizer) -> Tuple[List[List[int]], List[List[int]]]:
    """LLaVA's DataCollatorForSupervisedDataset on (input_ids, labels) rows: padded, then cut to
    tokenizer.model_max_length; each row back without its padding."""
    batch = llava_train.DataCollatorForSupervisedDataset(tokenizer)(
        [{'input_ids': torch.tensor(i), 'labels': torch.tensor(l)} for i, l in rows])
    lengths = [min(len(i), tokenizer.model_max_length) for i, _ in rows]
    return ([ids[:n].tolist() for ids, n in zip(batch['input_ids'], lengths)],
            [labels[:n].tolist() for labels, n in zip(batch['labels'], lengths)])


def with_image(ids: List[int], scored: List[bool], image_at: int) -> Tuple[List[int], List[int]]:
    """diffzoo's (ids, scored, image_at) written as LLaVA's input_ids and labels."""
    ids, labels = list(ids), [i if s else IGNORE_INDEX for i, s in zip(ids, scored)]
    if image_at >= 0:
        ids.insert(image_at, IMAGE_TOKEN_INDEX)
        labels.insert(image_at, IGNORE_INDEX)
    return ids, labels


class _Splicing(llava_arch.LlavaMetaForCausalLM):
    """A stand-in for LLaVA's model around its own `prepare_inputs_labels_for_multimodal`: a token's embedding is
    its id, and an image's features are `image_tokens` positions of -1."""

    def __init__(self, image_tokens: int, max_length: int):
        self.config = SimpleNamespace(tokenizer_model_max_length=max_length)
        self.image_tokens, self.device = image_tokens, torch.device('cpu')

    def get_model(self):
        return self

    def get_vision_tower(self):
        return self

    def embed_tokens(self, ids):
        return ids[:, None].float()

    def encode_images(self, images):
        return torch.full((images.shape[0], self.image_tokens, 1), -1.0)


def spliced(rows: List[Tuple[List[int], List[int]]], tokenizer, image_tokens: int) -> List[List[Tuple[int, int]]]:
    """(id, label) at each position of the sequences LLaVA's forward pass takes for `rows` ((input_ids, labels) from
    `preprocess`): its collator (padded, cut to tokenizer.model_max_length, `attention_mask = ids != pad`), then its
    `prepare_inputs_labels_for_multimodal` (the unattended tokens removed, each image spliced in as `image_tokens`
    positions, id -1, cut to model_max_length again)."""
    batch = llava_train.DataCollatorForSupervisedDataset(tokenizer)(
        [{'input_ids': torch.tensor(i), 'labels': torch.tensor(l)} for i, l in rows])
    model = _Splicing(image_tokens, tokenizer.model_max_length)
    _, _, mask, _, embeds, labels = model.prepare_inputs_labels_for_multimodal(
        batch['input_ids'], None, batch['attention_mask'], None, batch['labels'], torch.zeros(len(rows), 3, 2, 2))
    return [[(int(e), int(l)) for e, l, m in zip(embeds[r, :, 0], labels[r], mask[r]) if m] for r in range(len(rows))]
