"""Tiny random VLM checkpoints and data sets, written to folders as the real ones are (no download): the
`python -m diffzoo.demo_vlm` VLMs, the VLM tests and `python -m diffzoo.bench.gpu` train on them.

`write_tiny_qwen2`: a Qwen2-style language model. `write_paligemma`: a PaliGemma checkpoint (Gemma MQA
decoder, SigLIP tower) with its processor. `write_vqav2_split`: a set in VQAv2's official layout.
`write_chat_language_model` and `write_llava_sets`: the LLaVA-style stages' language model and JSON sets.
Every image is one coloured shape, drawn as `diffzoo.data.synthetic` draws it.

The Qwen2 model's tokenizer is a byte-level BPE trained on the texts it will see, with Qwen2.5's special tokens
and ChatML chat template (<|im_end|> ends a turn and is the EOS; no BOS), so that `AutoTokenizer` reads it back
as the Qwen2 tokenizer transformers builds for a qwen2 model (a word-level tokenizer would be rebuilt as
byte-level BPE without merges and read every word as its first letters)."""
import json
from pathlib import Path
from typing import Dict, Iterable

import torch
import transformers
from PIL import Image, ImageDraw
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from diffzoo.data.synthetic import SceneObject, draw_object
from diffzoo.vlm.data import PROMPT
from diffzoo.vlm.templates import VICUNA_V1_SYSTEM

CHATML = ("{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
          "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")  # Qwen2.5's layout
SPECIALS = ('<|endoftext|>', '<|im_start|>', '<|im_end|>')
COLOURS = ('red', 'green', 'blue', 'yellow')  # drawn in diffzoo.data.synthetic's palette
SHAPES = ('square', 'circle')


def write_tiny_qwen2(directory, texts: Iterable[str], hidden: int = 32, layers: int = 2, vocab_size: int = 512,
                     seed: int = 0) -> Path:
    """Save the tokenizer (trained on `texts` and the chat template's words) and a random Qwen2 decoder of
    `layers` layers, width `hidden`, 4 query heads on 2 KV heads, tied embeddings."""
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


def write_paligemma(directory: Path) -> None:
    """A tiny random PaliGemma checkpoint (Gemma MQA decoder, SigLIP tower) with its processor."""
    words = set(PROMPT.format(question='what color is the shape? what shape is it?').split())
    words |= set(COLOURS) | set(SHAPES)
    vocab = {t: i for i, t in enumerate(['<pad>', '<bos>', '<eos>', '<unk>', '<image>'] + sorted(words))}
    core = Tokenizer(models.WordLevel(vocab, unk_token='<unk>'))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=core, bos_token='<bos>', eos_token='<eos>',
                                                     pad_token='<pad>', unk_token='<unk>',
                                                     additional_special_tokens=['<image>'])
    images = transformers.SiglipImageProcessor(size={'height': 32, 'width': 32})
    images.image_seq_length = 16  # (32 / 8)² patches
    transformers.PaliGemmaProcessor(image_processor=images, tokenizer=tokenizer).save_pretrained(directory)
    torch.manual_seed(0)
    config = paligemma_config(len(vocab), vocab['<image>'], pad_token_id=0, bos_token_id=1, eos_token_id=2)
    transformers.PaliGemmaForConditionalGeneration(config).save_pretrained(directory)


def paligemma_config(vocab_size: int = 80, image_token_index: int = 79, **kw) -> 'transformers.PaliGemmaConfig':
    """A tiny PaliGemma: Gemma MQA decoder (4 query heads, 1 KV head, 2 layers), one-block SigLIP tower."""
    return transformers.PaliGemmaConfig(
        text_config=dict(model_type='gemma', vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=8),
        vision_config=dict(model_type='siglip_vision_model', image_size=32, patch_size=8, hidden_size=16,
                           intermediate_size=32, num_hidden_layers=1, num_attention_heads=2),
        image_token_index=image_token_index, projection_dim=32, **kw)


def write_vqav2_split(root: Path, split: str, count: int, seed: int) -> None:
    """Official VQAv2 layout: questions + annotations JSON, COCO-named JPEGs of one coloured shape
    (drawn as diffzoo.data.synthetic draws it)."""
    rng = torch.Generator().manual_seed(seed)
    images = root / f'{split}2014'
    images.mkdir(parents=True, exist_ok=True)
    questions, annotations = [], []
    for i in range(count):
        colour = list(COLOURS)[int(torch.randint(len(COLOURS), (1,), generator=rng))]
        shape = SHAPES[int(torch.randint(2, (1,), generator=rng))]
        im = Image.new('RGB', (64, 64), (245, 245, 245))
        draw_object(ImageDraw.Draw(im), SceneObject(shape, colour, 'large', (32, 32), 20))
        image_id = 1000 + i
        im.save(images / f'COCO_{split}2014_{image_id:012d}.jpg', quality=95)
        for j, (question, answer, qtype) in enumerate([('what color is the shape?', colour, 'what color is the'),
                                                        ('what shape is it?', shape, 'what shape is')]):
            qid = image_id * 10 + j
            questions.append({'image_id': image_id, 'question': question, 'question_id': qid})
            annotations.append({'image_id': image_id, 'question_id': qid, 'question_type': qtype,
                                'answer_type': 'other', 'multiple_choice_answer': answer,
                                'answers': [{'answer': answer, 'answer_id': k + 1} for k in range(10)]})
    (root / f'v2_OpenEnded_mscoco_{split}2014_questions.json').write_text(json.dumps({'questions': questions}))
    (root / f'v2_mscoco_{split}2014_annotations.json').write_text(json.dumps({'annotations': annotations}))


def write_chat_language_model(directory: Path, layers: int = 2, seed: int = 0) -> None:
    """A tiny random Qwen2-style LM (`diffzoo.vlm.tiny`) whose tokenizer was trained on the LLaVA-style sets'
    words (`write_llava_sets`) and the prompts asked of them."""
    texts = [f'a {c} {s}' for c in COLOURS for s in SHAPES] + [
        'what color is the shape? what shape is it? say hello hi there Yes No',
        f'{VICUNA_V1_SYSTEM} USER: ASSISTANT:',
        'Answer the question using a single word or phrase. Is there a in the image?']
    write_tiny_qwen2(directory, texts * 4, layers=layers, seed=seed)


def write_llava_sets(root: Path, count: int = 48, seed: int = 0) -> Dict[str, Path]:
    """LLaVA-format JSON over images of one coloured shape (drawn as diffzoo.data.synthetic draws it):
    `pretrain.json` (LLaVA's 558K layout: '<image>' and a caption), `qa.json` (single-round questions, as
    eRAM-V's continued pre-training mix), `instruct.json` (two rounds per image, and text-only samples, as
    the 665K mix); images under `root/images`."""
    rng = torch.Generator().manual_seed(seed)
    images = root / 'images'
    images.mkdir(parents=True, exist_ok=True)
    pretrain, qa, instruct = [], [], []
    for i in range(count):
        colour = list(COLOURS)[int(torch.randint(len(COLOURS), (1,), generator=rng))]
        shape = SHAPES[int(torch.randint(2, (1,), generator=rng))]
        im = Image.new('RGB', (64, 64), (245, 245, 245))
        draw_object(ImageDraw.Draw(im), SceneObject(shape, colour, 'large', (32, 32), 20))
        name = f'scenes/{i:05d}.jpg'
        (images / name).parent.mkdir(exist_ok=True)
        im.save(images / name, quality=95)

        def turns(*pairs):
            return [{'from': f, 'value': v} for f, v in pairs]
        pretrain.append({'id': f'p{i}', 'image': name,
                         'conversations': turns(('human', '<image>'), ('gpt', f'a {colour} {shape}'))})
        question = ('what color is the shape?', colour) if i % 2 else ('what shape is it?', shape)
        qa.append({'id': f'q{i}', 'image': name,
                   'conversations': turns(('human', f'<image>\n{question[0]}'), ('gpt', question[1]))})
        instruct.append({'id': f'i{i}', 'image': name, 'conversations': turns(
            ('human', 'what color is the shape?\n<image>'), ('gpt', colour),
            ('human', 'what shape is it?'), ('gpt', f'a {shape}'))})
        if i % 4 == 0:
            instruct.append({'id': f't{i}', 'conversations': turns(('human', 'say hello'), ('gpt', 'hi there'))})
    paths = {}
    for name, records in (('pretrain', pretrain), ('qa', qa), ('instruct', instruct)):
        paths[name] = root / f'{name}.json'
        paths[name].write_text(json.dumps(records))
    return paths
