"""Tiny transformers models for the VLM tests: decoders of every head layout, a word-level Gemma
that knows the VQA answer format, a PaliGemma checkpoint with its processor; and a VQAv2-layout set."""
import json
from pathlib import Path
from typing import Dict

import torch
import transformers
from PIL import Image, ImageDraw

from diffzoo.data.synthetic import SceneObject, draw_object
from diffzoo.vlm.data import PROMPT
from diffzoo.vlm.conversations import VICUNA_V1_SYSTEM
from diffzoo.vlm.tiny import CHATML, write_tiny_qwen2  # noqa: F401 (CHATML: the conversation tests')

COLOURS = ('red', 'green', 'blue', 'yellow')  # drawn in diffzoo.data.synthetic's palette
SHAPES = ('square', 'circle')


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


def write_paligemma(directory: Path) -> None:
    """A tiny random PaliGemma checkpoint (Gemma MQA decoder, SigLIP tower) with its processor."""
    from tokenizers import Tokenizer, models, pre_tokenizers
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
