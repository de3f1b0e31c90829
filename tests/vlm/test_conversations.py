"""LLaVA-format conversations: the loader's checks, both prompt formats' label masks token by token (the
expectations written out by hand), and batches through a real `build_vlm` model with the image spliced
in at the `<image>` place."""
import json

import pytest
import torch
import transformers
from PIL import Image

from diffzoo.vlm import build_vlm
from diffzoo.vlm.conversations import ConversationCollator, encode, load_conversations
from tests.vlm.models import CHATML, lm_config
from tests.vlm.test_data import write_bomb

SYSTEM_WORDS = ['A', 'chat', 'between', 'a', 'curious', 'user', 'and', 'an', 'artificial', 'intelligence',
                'assistant.', 'The', 'assistant', 'gives', 'helpful,', 'detailed,', 'and', 'polite', 'answers', 'to',
                'the', "user's", 'questions.']
CONVERSATION = (('human', '<image>\nwhat color is it?'), ('gpt', 'red'),
                ('human', 'and the shape?'), ('gpt', 'a circle'))


def _tokenizer(specials=('<s>', '</s>', '<pad>', '<unk>'), extra=(), chat_template=None):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    words = set(SYSTEM_WORDS) | {'USER:', 'ASSISTANT:', 'what', 'color', 'is', 'it?', 'red', 'shape?', 'circle',
                                 'system', 'user', 'assistant', 'You', 'are', 'helpful', 'caption', 'green'} | set(extra)
    vocab = {t: i for i, t in enumerate(list(specials) + sorted(words))}
    core = Tokenizer(models.WordLevel(vocab, unk_token='<unk>'))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    named = dict(pad_token='<pad>', unk_token='<unk>')
    if '<s>' in specials:  # BOS added as Llama's tokenizer adds it
        named.update(bos_token='<s>', eos_token='</s>')
        core.post_processor = processors.TemplateProcessing(single='<s> $A', special_tokens=[('<s>', vocab['<s>'])])
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=core, additional_special_tokens=[
        s for s in specials if s.startswith('<|')], **named)
    if chat_template:
        tok.chat_template = chat_template
    return tok


def _marked(tok, ids, scored):
    """Tokens with the scored ones starred."""
    return [tok.convert_ids_to_tokens(i) + ('*' if s else '') for i, s in zip(ids, scored)]


def test_plain_scores_the_caption_and_its_newline_after_the_image():
    tok = _tokenizer()
    ids, scored, image_at, _ = encode((('human', '<image>'), ('gpt', 'a red circle')), tok, 'plain')
    assert _marked(tok, ids, scored) == ['<s>', 'a*', 'red*', 'circle*']  # the newline: whitespace to this tokenizer
    assert image_at == 1  # LLaVA's preprocess_plain: BOS, the image, the caption


def test_chat_template_scores_each_assistant_turn_with_its_end_of_turn():
    tok = _tokenizer(specials=('<|im_start|>', '<|im_end|>', '<pad>', '<unk>'), chat_template=CHATML)
    ids, scored, image_at, _ = encode(CONVERSATION, tok, 'chat_template')
    expected = ['<|im_start|>', 'system', 'You', 'are', 'a', 'helpful', 'assistant.', '<|im_end|>',
                '<|im_start|>', 'user', 'what', 'color', 'is', 'it?', '<|im_end|>', '<|im_start|>', 'assistant',
                'red*', '<|im_end|>*',
                '<|im_start|>', 'user', 'and', 'the', 'shape?', '<|im_end|>', '<|im_start|>', 'assistant',
                'a*', 'circle*', '<|im_end|>*']
    assert _marked(tok, ids, scored) == expected
    assert image_at == 10  # after "<|im_start|> user"
    with pytest.raises(ValueError, match='no chat template'):
        encode(CONVERSATION, _tokenizer(), 'chat_template')


def _image(path, colour='red', broken=False):
    path.parent.mkdir(parents=True, exist_ok=True)
    if broken:
        path.write_bytes(b'\xff\xd8\xff\xe0 not a jpeg')
    else:
        Image.new('RGB', (32, 32), colour).save(path)


def _record(i, image='img/0.jpg', turns=(('human', '<image>\nwhat color is it?'), ('gpt', 'red'))):
    record = {'id': i, 'conversations': [{'from': f, 'value': v} for f, v in turns]}
    if image is not None:
        record['image'] = image
    return record


def test_the_loader_keeps_what_trains_and_counts_each_left_out_record_once(tmp_path):
    _image(tmp_path / 'images/img/0.jpg')
    records = [
        _record('ok'),
        _record('text-only', image=None, turns=(('human', 'what color is it?'), ('gpt', 'red'))),
        _record('moved', turns=(('human', 'what color is it? <image>'), ('gpt', 'red'))),
        _record('no-file', image='img/missing.jpg'),
        _record('no-placeholder', turns=(('human', 'what color is it?'), ('gpt', 'red'))),
        _record('twice', turns=(('human', '<image> <image>'), ('gpt', 'red'))),
        _record('stray', image=None),
        _record('order', turns=(('human', '<image>'), ('human', 'what color is it?'), ('gpt', 'red'))),
        _record('gpt-first', turns=(('gpt', 'hello'), ('human', '<image>\nwhat color is it?'), ('gpt', 'red'))),
        _record('ends-human', turns=(('human', '<image>\nwhat color is it?'), ('gpt', 'red'), ('human', 'and?'))),
        _record('only-human', image=None, turns=(('human', 'hello'),)),
        {'id': 'junk', 'conversations': 'red'},
    ]
    (tmp_path / 'data.json').write_text(json.dumps(records))
    kept, problems = load_conversations(tmp_path / 'data.json', tmp_path / 'images')
    assert [c.id for c in kept] == ['ok', 'text-only', 'moved', 'gpt-first', 'ends-human']
    assert kept[2].turns[0] == ('human', '<image>\nwhat color is it?')  # LLaVA: the placeholder leads the turn
    assert kept[3].turns == kept[4].turns == kept[0].turns and kept[1].image is None
    assert problems.left_out == {'image file missing': 1, '<image> missing from an image sample': 1,
                                 '<image> repeated': 1, '<image> in a sample without an image': 1,
                                 'turns not alternating human, gpt': 1, 'no gpt turn': 1,
                                 'not a conversation (a list of {from: human|gpt, value})': 1}
    assert problems.truncated == {'ended on a human turn (that turn dropped)': 1,  # ends-human (only-human: once,
                                  'started on a gpt turn (that turn dropped)': 1}  # as no gpt turn); as LLaVA
    assert 'no-file' in problems.summary()
    with pytest.raises(FileNotFoundError, match='nothere.json'):
        load_conversations(tmp_path / 'nothere.json', tmp_path / 'images')
    with pytest.raises(FileNotFoundError, match='noimages'):
        load_conversations(tmp_path / 'data.json', tmp_path / 'noimages')


def test_records_with_an_unusable_id_or_image_are_left_out_and_counted_under_their_reason(tmp_path):
    """Ids and images of other JSON types, an image name the system refuses, and image paths that leave the
    image folder (absolute, `..`): each record left out and counted once; a symlink inside the folder to an
    image elsewhere is followed, as datasets link their images."""
    _image(tmp_path / 'images/img/0.jpg')
    _image(tmp_path / 'elsewhere/1.jpg')
    (tmp_path / 'images/img/linked.jpg').symlink_to(tmp_path / 'elsewhere/1.jpg')
    records = [_record('ok'), _record('linked', image='img/linked.jpg'), _record(None),
               _record('int', image=5), _record('list', image=['img/0.jpg']), _record('dict', image={'path': 'x'}),
               _record('bool', image=True), _record('long', image='x' * 300 + '.jpg'),
               _record('up', image='img/../../elsewhere/1.jpg'), _record('up-inside', image='img/../img/0.jpg'),
               _record('absolute', image=str(tmp_path / 'elsewhere/1.jpg')),
               _record(['a']), _record(1.5), _record(False), _record(7)]
    (tmp_path / 'data.json').write_text(json.dumps(records))
    kept, problems = load_conversations(tmp_path / 'data.json', tmp_path / 'images')
    assert [c.id for c in kept] == ['ok', 'linked', '#2', '7']  # a null id: its position, as a missing one
    assert kept[1].load_image().size == (32, 32)
    assert problems.left_out == {'image not a string (a path relative to the image folder)': 4,
                                 'image path refused by the system (File name too long)': 1,
                                 'image path outside the image folder (a ../ component)': 2,
                                 'image path outside the image folder (an absolute path)': 1,
                                 'id not a string or a whole number': 3}
    assert problems.examples['image path outside the image folder (a ../ component)'] == ['up', 'up-inside']
    assert problems.examples['id not a string or a whole number'] == ['#11', '#12', '#13']


@pytest.mark.parametrize('content, problem', [
    (b'', r'an empty file \(Expecting value at line 1 column 1; 0 bytes\)'),
    (b'[{"id": "caf\xe9"}]', r"not UTF-8 text \(byte 12 of 16 is b'\\xe9'"),
    (b'[{"id": "a"},\n {"id": "b", "image": ', r'not valid JSON \(Expecting value at line 2 column 23; 36 bytes\)'),
])
def test_a_json_file_that_cannot_be_read_is_named_with_what_is_wrong_and_the_fix(tmp_path, content, problem):
    (tmp_path / 'images').mkdir()
    (tmp_path / 'data.json').write_bytes(content)
    with pytest.raises(ValueError, match=rf'{tmp_path / "data.json"}: {problem}.*LLaVA-format JSON'):
        load_conversations(tmp_path / 'data.json', tmp_path / 'images')


def test_an_image_over_pils_decompression_bomb_limit_leaves_its_sample_out_of_the_batch(tmp_path):
    """A small PNG of more pixels than PIL decodes (Image.DecompressionBombError, not an OSError): its sample is
    dropped and named like any unreadable image, and PIL's limit stays as it was."""
    limit = Image.MAX_IMAGE_PIXELS
    _image(tmp_path / 'images/img/0.jpg')
    write_bomb(tmp_path / 'images/img/bomb.png')
    (tmp_path / 'data.json').write_text(json.dumps([_record('good'), _record('bomb', image='img/bomb.png')]))
    kept, problems = load_conversations(tmp_path / 'data.json', tmp_path / 'images')
    assert [c.id for c in kept] == ['good', 'bomb'] and not problems.left_out  # it is a file; decoding fails
    with pytest.raises(Image.DecompressionBombError):
        kept[1].load_image()
    batch = ConversationCollator(_tokenizer(), lambda im: torch.zeros(3, 8, 8), 'vicuna_v1')(kept)
    assert batch['input_ids'].shape[0] == 1
    why = batch['skipped_images'].pop('why')
    assert batch['skipped_images'] == {'sources': [kept[1].image], 'kept': [0], 'placeholder': False}
    assert why[kept[1].image].startswith('DecompressionBombError: Image size')  # PIL's refusal, over 2× its limit
    assert Image.MAX_IMAGE_PIXELS == limit


def _vlm(tok):
    torch.manual_seed(0)
    config = lm_config('qwen2', vocab=len(tok), layers=2)
    lm = transformers.AutoModelForCausalLM.from_config(config)
    return build_vlm('diffclip-tiny', lm, projector='mlp2x_gelu', sequence_mask='causal')


def test_a_batch_splices_the_image_at_its_place_and_scores_the_assistant_tokens(tmp_path):
    """The model's loss on a collated batch (an image sample, a text-only one) equals the loss written out
    by hand: [text before <image> | image tokens | text after] through the LM with a causal mask, the
    text-only row without image tokens, cross-entropy over the starred tokens."""
    tok = _llama_tokenizer(tmp_path / 'llama', legacy=True)
    tok.pad_token = tok.unk_token
    model = _vlm(tok)
    _image(tmp_path / 'images/img/0.jpg')
    (tmp_path / 'data.json').write_text(json.dumps([
        _record('with-image'), _record('text', image=None, turns=(('human', 'what color is it?'), ('gpt', 'a red')))]))
    kept, _ = load_conversations(tmp_path / 'data.json', tmp_path / 'images')
    transform = model.vision.preprocess
    batch = ConversationCollator(tok, transform, 'vicuna_v1', image_size=(64, 64))(kept)
    before_image = tok(_vicuna_v1_text([('human', '')]).split('USER: ')[0] + 'USER: ')['input_ids']
    assert batch['image_at'].tolist() == [len(before_image), -1]
    loss = model(**batch).loss

    embed = model.language_model.get_input_embeddings()
    image = model.image_embeddings(batch['pixel_values'][:1])[0]  # (P, D)
    terms = []
    for row, at in enumerate(batch['image_at'].tolist()):
        n = int(batch['attention_mask'][row].sum())
        ids, labels = batch['input_ids'][row, :n], batch['labels'][row, :n]
        text = embed(ids)
        if at >= 0:
            seq = torch.cat([text[:at], image, text[at:]])
            targets = torch.cat([labels[:at], torch.full((image.shape[0],), -100), labels[at:]])
        else:
            seq, targets = text, labels
        logits = model.language_model(inputs_embeds=seq[None]).logits[0]  # causal by default
        terms.append(torch.nn.functional.cross_entropy(logits[:-1], targets[1:], reduction='sum',
                                                       ignore_index=-100))
    expected = sum(terms) / int((batch['labels'] != -100).sum())
    torch.testing.assert_close(loss, expected)
    scored = batch['input_ids'][1][batch['labels'][1] != -100]
    assert tok.decode(scored.tolist()) == 'a red</s>'  # LLaVA's mask: the answer and its </s>


def test_an_unreadable_image_and_a_sample_cut_to_nothing_are_left_out_and_named(tmp_path):
    tok = _tokenizer()
    _image(tmp_path / 'images/img/0.jpg')
    _image(tmp_path / 'images/img/bad.jpg', broken=True)
    (tmp_path / 'data.json').write_text(json.dumps([_record('good'), _record('bad', image='img/bad.jpg')]))
    kept, _ = load_conversations(tmp_path / 'data.json', tmp_path / 'images')
    batch = ConversationCollator(tok, lambda im: torch.zeros(3, 8, 8), 'vicuna_v1')(kept)
    assert batch['input_ids'].shape[0] == 1 and batch['skipped_images']['sources'][0].endswith('bad.jpg')
    short = ConversationCollator(tok, lambda im: torch.zeros(3, 8, 8), 'vicuna_v1', max_length=20)(kept[:1])
    assert short['cut_short'] == ['good'] and short['left_out_long'] == ['good']
    assert bool((short['labels'] == -100).all())  # the placeholder row scores nothing


def test_images_are_padded_to_a_square_of_the_mean_colour_as_llava_does(tmp_path):
    """LLaVA-1.5's expand2square (image_aspect_ratio 'pad'): a wide image centred on a square of the
    normaliser's mean, so the tower's centre crop keeps all of it; 'crop' leaves the transform alone."""
    from torchvision import transforms
    from diffzoo.vlm.conversations import pad_to_square, transform_mean
    wide = Image.new('RGB', (4, 2), (255, 0, 0))
    square = pad_to_square(wide, (10, 20, 30))
    assert square.size == (4, 4)
    assert [square.getpixel((0, y)) for y in range(4)] == [(10, 20, 30), (255, 0, 0), (255, 0, 0), (10, 20, 30)]
    transform = transforms.Compose([transforms.Resize(4, transforms.InterpolationMode.NEAREST), transforms.CenterCrop(4),
                                    transforms.ToTensor(),
                                    transforms.Normalize((0.5, 0.25, 0.0), (1, 1, 1))])
    assert transform_mean(transform) == (0.5, 0.25, 0.0)
    _image(tmp_path / 'images/img/0.jpg')
    Image.new('RGB', (8, 4), 'blue').save(tmp_path / 'images/img/0.jpg')
    (tmp_path / 'data.json').write_text(json.dumps([_record('wide')]))
    kept, _ = load_conversations(tmp_path / 'data.json', tmp_path / 'images')
    padded = ConversationCollator(_tokenizer(), transform, 'vicuna_v1')(kept)['pixel_values'][0]
    cropped = ConversationCollator(_tokenizer(), transform, 'vicuna_v1', image_aspect='crop')(kept)['pixel_values'][0]
    mean = torch.tensor([127, 63, 0]) / 255 - torch.tensor([0.5, 0.25, 0.0])  # the pad colour, normalised
    torch.testing.assert_close(padded[:, 0, 0], mean, atol=0.02, rtol=0)  # the top row is padding
    assert cropped[2, 0, 0] > 0.5  # all blue: the crop kept only the middle of the image


def test_a_question_is_asked_in_the_format_up_to_where_the_answer_starts():
    from diffzoo.vlm.conversations import prompt
    tok = _tokenizer()
    ids, image_at = prompt('what color is it?', tok, 'vicuna_v1')
    assert tok.convert_ids_to_tokens(ids) == ['<s>'] + SYSTEM_WORDS + ['USER:', 'what', 'color', 'is', 'it?',
                                                                      'ASSISTANT:']
    assert image_at == 1 + len(SYSTEM_WORDS) + 1
    chat = _tokenizer(specials=('<|im_start|>', '<|im_end|>', '<pad>', '<unk>'), chat_template=CHATML)
    ids, image_at = prompt('what color is it?', chat, 'chat_template')
    assert chat.convert_ids_to_tokens(ids) == ['<|im_start|>', 'system', 'You', 'are', 'a', 'helpful', 'assistant.',
                                               '<|im_end|>', '<|im_start|>', 'user', 'what', 'color', 'is', 'it?',
                                               '<|im_end|>', '<|im_start|>', 'assistant']
    assert image_at == 10


def _llama_tokenizer(directory, legacy: bool):
    """A SentencePiece BPE model trained here the way Llama's is laid out (byte fallback, a prefix space,
    <unk> <s> </s>), read by transformers from `tokenizer.model` as a Vicuna checkpoint is."""
    import io
    import random

    import sentencepiece as spm
    from transformers import AutoTokenizer

    from diffzoo.vlm.conversations import VICUNA_V1_SYSTEM
    rng = random.Random(0)
    words = (VICUNA_V1_SYSTEM + ' USER: ASSISTANT: what color is it? red and the shape? a circle').split()
    lines = [' '.join(rng.choice(words) for _ in range(12)) for _ in range(2000)] + [VICUNA_V1_SYSTEM] * 20
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model, vocab_size=400,
                                   model_type='bpe', byte_fallback=True, add_dummy_prefix=True,
                                   remove_extra_whitespaces=False, normalization_rule_name='identity',
                                   unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    directory.mkdir(parents=True)
    (directory / 'tokenizer.model').write_bytes(model.getvalue())
    (directory / 'tokenizer_config.json').write_text(json.dumps({
        'tokenizer_class': 'LlamaTokenizer', 'legacy': legacy, 'bos_token': '<s>', 'eos_token': '</s>',
        'unk_token': '<unk>', 'add_bos_token': True, 'add_eos_token': False}))
    return AutoTokenizer.from_pretrained(directory)


def _vicuna_v1_text(turns):
    """conv_vicuna_v1's prompt: the system line, then 'USER: q ASSISTANT: a</s>' per round (seps ' ', '</s>')."""
    from diffzoo.vlm.conversations import VICUNA_V1_SYSTEM
    text = VICUNA_V1_SYSTEM + ' '
    for i, (role, value) in enumerate(turns):
        text += ('USER' if role == 'human' else 'ASSISTANT') + ': ' + value + (' ', '</s>')[i % 2]
    return text


def _answer_tokens_by_offsets(turns, tok):
    """Independently of encode: each token of the whole text (each side of <image>) scored when the character
    it starts at lies in an answer (' a</s>' after 'ASSISTANT:'), from the tokenizer's offset mapping."""
    text, spans = _vicuna_v1_text(turns[:0]), []
    for i in range(0, len(turns), 2):
        text += f'USER: {turns[i][1]} ASSISTANT:'
        spans.append((len(text), len(text) + len(f' {turns[i + 1][1]}</s>')))
        text += f' {turns[i + 1][1]}</s>'
    scored, begin = [False], 0  # BOS
    for chunk in text.split('<image>'):
        encoded = tok(chunk, add_special_tokens=False, return_offsets_mapping=True)
        for start, end in encoded['offset_mapping']:
            scored.append(any(a <= begin + start < b for a, b in spans))
        begin += len(chunk) + len('<image>')
    return scored


@pytest.mark.parametrize('legacy', [True, False])
def test_mismatch_score_scores_each_answer_and_its_eos_by_characters(tmp_path, legacy):
    """data.mismatch: score: a conversation LLaVA's rule cannot count is scored on its answers, found from the
    tokenization of the text before each (checked by character offsets): with Vicuna's SentencePiece tokenizer,
    legacy or not, each answer and its </s>, nothing of the question (LLaVA's own ids and masks:
    tests/vlm/test_templates.py)."""
    tok = _llama_tokenizer(tmp_path / 'llama', legacy)
    for turns in (CONVERSATION, CONVERSATION[:2], (('human', 'what color is it?'), ('gpt', 'red')),
                  (('human', '<image>\nwhat color is it?'), ('gpt', 'red</s> and a circle'))):
        assert encode(turns, tok, 'vicuna_v1', mismatch='score').scored == _answer_tokens_by_offsets(turns, tok)
