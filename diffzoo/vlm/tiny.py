"""A tiny random Qwen2-style language model, written to a folder as a checkpoint is (no download): the
`python -m diffzoo.demo_vlm` VLMs and the stage tests train on it.

Its tokenizer is a byte-level BPE trained on the texts it will see, with Qwen2.5's special tokens and ChatML
chat template (<|im_end|> ends a turn and is the EOS; no BOS), so that `AutoTokenizer` reads it back as the
Qwen2 tokenizer transformers builds for a qwen2 model (a word-level tokenizer would be rebuilt as byte-level
BPE without merges and read every word as its first letters)."""
from pathlib import Path
from typing import Iterable

CHATML = ("{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
          "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")  # Qwen2.5's layout
SPECIALS = ('<|endoftext|>', '<|im_start|>', '<|im_end|>')


def write_tiny_qwen2(directory, texts: Iterable[str], hidden: int = 32, layers: int = 2, vocab_size: int = 512,
                     seed: int = 0) -> Path:
    """Save the tokenizer (trained on `texts` and the chat template's words) and a random Qwen2 decoder of
    `layers` layers, width `hidden`, 4 query heads on 2 KV heads, tied embeddings."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    directory = Path(directory)
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator([*texts, 'system user assistant You are a helpful assistant.'], trainer)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=core, eos_token='<|im_end|>',
                                                     pad_token='<|endoftext|>', additional_special_tokens=list(SPECIALS[1:]))
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(directory)
    torch.manual_seed(seed)
    config = transformers.Qwen2Config(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=512, eos_token_id=tokenizer.eos_token_id,
                                      pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True)
    transformers.Qwen2ForCausalLM(config).save_pretrained(directory)
    return directory
