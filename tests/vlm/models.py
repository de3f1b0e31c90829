"""Tiny transformers models for the VLM tests: decoders of every head layout and a word-level Gemma that
knows the VQA answer format; the PaliGemma checkpoint, the VQAv2-layout set and the LLaVA-style stages' model
and sets are the package's (`diffzoo.vlm.tiny`, which `python -m diffzoo.bench.gpu` writes too)."""
from pathlib import Path

import torch
import transformers

from diffzoo.vlm.data import PROMPT
from diffzoo.vlm.tiny import (CHATML, COLOURS, SHAPES, paligemma_config, write_chat_language_model,  # noqa: F401
                              write_llava_sets, write_paligemma, write_tiny_qwen2, write_vqav2_split)


def lm_config(family: str = 'gemma', vocab: int = 64, layers: int = 3, **kw):
    """A tiny random decoder config; the head layouts cover GQA, MQA, MHA and an odd group size."""
    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                  max_position_embeddings=256, **kw)
    if family == 'llama':  # GQA: 4 query heads on 2 KV heads
        return transformers.LlamaConfig(num_attention_heads=4, num_key_value_heads=2, **common)
    if family == 'llama_odd_groups':  # 6 query heads on 2 KV heads: groups of 3
        return transformers.LlamaConfig(num_attention_heads=6, num_key_value_heads=2, head_dim=8,
                                        **{**common, 'hidden_size': 48})
    if family == 'gemma':  # MQA like PaliGemma-3B's Gemma: 4 query heads, 1 KV head
        return transformers.GemmaConfig(num_attention_heads=4, num_key_value_heads=1, head_dim=8, **common)
    if family == 'gemma2':
        return transformers.Gemma2Config(num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                         attn_logit_softcapping=20.0, **common)
    if family == 'qwen2':  # MHA with q/k/v biases
        return transformers.Qwen2Config(num_attention_heads=4, num_key_value_heads=4, **common)
    raise ValueError(family)


def tiny_lm(family: str = 'gemma', implementation: str = 'sdpa', seed: int = 0, **geometry):
    """A random causal LM of `lm_config(family, **geometry)` in eval mode."""
    torch.manual_seed(seed)
    config = lm_config(family, **geometry)
    config._attn_implementation = implementation
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def write_language_model(directory: Path) -> None:
    """A word-level tokenizer over the task's words and a tiny random Gemma, saved as a local checkpoint."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    words = set(PROMPT.format(question='what color is the shape? what shape is it?').split())
    words |= set(COLOURS) | set(SHAPES) | {'shape?', 'it?'}
    vocab = {t: i for i, t in enumerate(['<pad>', '<bos>', '<eos>', '<unk>'] + sorted(words))}
    core = Tokenizer(models.WordLevel(vocab, unk_token='<unk>'))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=core, bos_token='<bos>', eos_token='<eos>',
                                                     pad_token='<pad>', unk_token='<unk>')
    tokenizer.save_pretrained(directory)
    torch.manual_seed(0)
    config = transformers.GemmaConfig(vocab_size=len(vocab), hidden_size=48, intermediate_size=96,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                                      head_dim=12, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = transformers.GemmaForCausalLM(config)
    # A short text-only pre-training, so the model knows the answer format (as a pretrained LM does)
    # and fine-tuning has to teach it to read the image, not to speak.
    texts = [f'<bos> {PROMPT.format(question=q)}{a} <eos>' for q, answers in
             (('what color is the shape?', COLOURS), ('what shape is it?', SHAPES)) for a in answers]
    ids = tokenizer(texts, padding=True, return_tensors='pt', add_special_tokens=False)
    labels = ids['input_ids'].masked_fill(ids['attention_mask'] == 0, -100)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(60):
        model(**ids, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(directory)
