"""The prompt formats against the code each paper ran: vicuna_v1 and plain against LLaVA-1.5's own preprocessing
and collator (`llava-torch`, run on the same records and a SentencePiece Llama tokenizer trained here, legacy and
not), qwen2_instruct against TinyLLaVA_Factory's qwen2_instruct template (no package: the expected text and
scored spans written out by hand from `tinyllava/data/template/base.py` and `qwen2_instruct_template.py`)."""
import json
from pathlib import Path

import pytest
from PIL import Image
from torchvision import transforms

from diffzoo.vlm.conversations import ConversationCollator, load_conversations
from diffzoo.vlm.templates import VICUNA_V1_SYSTEM, encode, prompt
from tests.vlm.test_conversations import _llama_tokenizer
from tests.vlm.models import write_chat_language_model


def _turns(*pairs):
    return [{'from': f, 'value': v} for f, v in pairs]


RECORDS = {  # id → (record, whether LLaVA's rounds add up under a legacy tokenizer)
    'two rounds': {'image': 'x.png', 'conversations': _turns(
        ('human', '<image>\nwhat color is it?'), ('gpt', 'red'), ('human', 'and the shape?'), ('gpt', 'a circle'))},
    'image after the question': {'image': 'x.png', 'conversations': _turns(
        ('human', 'what color is it?\n<image>'), ('gpt', 'red'))},
    'a turn that is only the image': {'image': 'x.png', 'conversations': _turns(
        ('human', '<image>'), ('gpt', 'a red circle'))},
    'the image in a later turn': {'image': 'x.png', 'conversations': _turns(
        ('human', 'what color is it?'), ('gpt', 'red'), ('human', 'and the shape? <image>'), ('gpt', 'a circle'))},
    'a reply holding </s>': {'image': 'x.png', 'conversations': _turns(
        ('human', '<image>\nwhat color is it?'), ('gpt', 'red</s> and a circle'))},
    'a reply holding ASSISTANT:': {'image': 'x.png', 'conversations': _turns(
        ('human', '<image>\nwhat color is it?'), ('gpt', 'red ASSISTANT: a circle'))},
    'text only': {'conversations': _turns(
        ('human', 'what color is it?'), ('gpt', 'red'), ('human', 'and the shape?'), ('gpt', 'a circle'))},
    'a gpt turn first': {'image': 'x.png', 'conversations': _turns(
        ('gpt', 'hello'), ('human', '<image>\nwhat color is it?'), ('gpt', 'red'))},
    'a last question without its answer': {'image': 'x.png', 'conversations': _turns(
        ('human', '<image>\nwhat color is it?'), ('gpt', 'red'), ('human', 'and the shape?'))},
}


def _load(tmp_path, records, prompt_format='vicuna_v1'):
    """The records through diffzoo's loader (as a stage of that format reads them), by id."""
    Image.new('RGB', (40, 24), 'red').save(tmp_path / 'x.png')
    (tmp_path / 'data.json').write_text(json.dumps([{'id': k, **r} for k, r in records.items()]))
    kept, problems = load_conversations(tmp_path / 'data.json', tmp_path, prompt_format)
    return {c.id: c for c in kept}, problems


@pytest.fixture(scope='module')
def llava():
    """LLaVA-1.5's own preprocessing and collator (`tests.vlm.llava_reference` over `llava-torch`, a test dependency
    that a GPU machine may lack): the tests comparing with it skip where it is not installed."""
    pytest.importorskip('llava')
    from tests.vlm import llava_reference
    return llava_reference


@pytest.fixture(scope='module', params=[True, False], ids=['legacy', 'not legacy'])
def vicuna(request, tmp_path_factory):
    tok = _llama_tokenizer(tmp_path_factory.mktemp('llama') / 'tok', request.param)
    tok.pad_token = tok.unk_token  # LLaVA's train() for v1: pad with unk
    tok.model_max_length = 2048
    return tok


def test_vicuna_v1_gives_llavas_ids_labels_and_mismatches_record_by_record(tmp_path, vicuna, llava):
    """Each record through diffzoo's loader and encode equals LLaVA's preprocess_multimodal + preprocess_v1 on
    it: the ids (the image where LLaVA puts it: at the start of the turn that holds it, '<image>' alone when
    the turn is only the image), the label mask, and the samples LLaVA masks whole with its "tokenization
    mismatch" (a reply holding '</s>' or ' ASSISTANT: ', a conversation ending on a question; for this non-legacy
    tokenizer, every later round). Before, the last question was dropped and its conversation trained on."""
    conversations, problems = _load(tmp_path, RECORDS)
    assert problems.truncated['started on a gpt turn (that turn dropped)'] == 1
    mismatches = set()
    for key, record in RECORDS.items():
        ref_ids, ref_labels, ref_mismatch = llava.preprocess(record, vicuna, 'v1')
        got = encode(conversations[key].turns, vicuna, 'vicuna_v1')
        assert llava.with_image(got.ids, got.scored, got.image_at) == (ref_ids, ref_labels), key
        assert got.mismatched == ref_mismatch, key
        if got.mismatched:
            mismatches.add(key)
            scored = encode(conversations[key].turns, vicuna, 'vicuna_v1', mismatch='score').scored
            answer = vicuna.decode([i for i, s in zip(got.ids, scored) if s])
            assert 'circle' in answer or 'red' in answer  # mismatch='score': the answers scored by characters
    assert {'a reply holding </s>', 'a reply holding ASSISTANT:', 'a last question without its answer'} <= mismatches
    if vicuna.legacy:
        assert mismatches == {'a reply holding </s>', 'a reply holding ASSISTANT:', 'a last question without its answer'}
    assert conversations['a last question without its answer'].turns[-1] == ('human', 'and the shape?')
    plain, problems = _load(tmp_path, RECORDS, 'plain')  # LLaVA's preprocess_plain reads the first two turns
    assert plain['a last question without its answer'].turns == conversations['two rounds'].turns[:2]
    assert problems.truncated['ended on a human turn (that turn dropped)'] == 1


def test_the_image_only_turn_and_a_later_image_are_where_llava_puts_them(tmp_path):
    conversations, _ = _load(tmp_path, RECORDS)
    assert conversations['a turn that is only the image'].turns[0] == ('human', '<image>')
    assert conversations['image after the question'].turns[0] == ('human', '<image>\nwhat color is it?')
    assert [t for _, t in conversations['the image in a later turn'].turns] == [
        'what color is it?', 'red', '<image>\nand the shape?', 'a circle']


@pytest.mark.parametrize('max_length', [12, 40, 45, 46, 47, 60])
def test_the_collator_cuts_where_llavas_does_the_image_one_token(tmp_path, vicuna, llava, max_length):
    """LLaVA's DataCollatorForSupervisedDataset cuts the ids, the image placeholder one of them, to
    model_max_length: diffzoo's rows equal its rows at lengths around the later image's place (and a mismatch
    is checked only under the cut, as LLaVA checks it)."""
    conversations, _ = _load(tmp_path, RECORDS)
    keys = ['two rounds', 'the image in a later turn', 'a turn that is only the image', 'text only']
    longer = sorted(k for k in keys if len(llava.preprocess(RECORDS[k], vicuna, 'v1')[0]) > max_length)
    vicuna.model_max_length = max_length  # LLaVA cuts a text-only sample as it tokenizes it, the others in its collator
    try:
        refs = [llava.preprocess(RECORDS[k], vicuna, 'v1') for k in keys]
        ref_ids, ref_labels = llava.collate([(i, l) for i, l, _ in refs], vicuna)
        collator = ConversationCollator(vicuna, transforms.Compose([transforms.Resize((8, 8)), transforms.ToTensor()]),
                                        'vicuna_v1', max_length, image_aspect='crop')
        batch = collator([conversations[k] for k in keys])
    finally:
        vicuna.model_max_length = 2048
    kept = [k for k in keys if k not in batch.get('left_out_long', ()) and k not in batch.get('mismatched', ())]
    for r, key in enumerate(kept):
        j = keys.index(key)
        n = int(batch['attention_mask'][r].sum())
        ids, labels = batch['input_ids'][r, :n].tolist(), batch['labels'][r, :n].tolist()
        at = int(batch['image_at'][r])
        assert llava.with_image(ids, [l != -100 for l in labels], at) == (ref_ids[j], ref_labels[j]), key
    for key in set(keys) - set(kept):  # left out here: LLaVA's row scores nothing either
        assert set(ref_labels[keys.index(key)]) == {-100}, key
    assert sorted(batch.get('cut_short', [])) == [k for k in longer if k not in batch.get('mismatched', ())]


UNKNOWN = {  # records holding '<unk>', the id the vicuna fixture pads with (LLaVA's train() for v1: pad = unk)
    'an unknown word': {'image': 'x.png', 'conversations': _turns(
        ('human', '<image>\nwhat <unk> is it?'), ('gpt', 'red <unk> and a circle'))},
    'an unknown word, text only': {'conversations': _turns(('human', 'what <unk> is it?'), ('gpt', 'red <unk>'))},
}
CAPTIONS = {  # plain: LLaVA's pre-training captions (preprocess_plain: no round count, nothing masked whole)
    'a caption': {'image': 'x.png', 'conversations': _turns(('human', '<image>'), ('gpt', 'a red circle'))},
    'a caption with an unknown word': {'image': 'x.png', 'conversations': _turns(
        ('human', '<image>'), ('gpt', 'a red <unk> circle and <unk> the shape'))},
}


@pytest.mark.parametrize('max_length', [12, 30, 40, 44, 48, 52, 60, 2048])
@pytest.mark.parametrize('prompt_format', ['vicuna_v1', 'plain'])
def test_a_row_is_what_llavas_model_takes_after_its_collator_and_its_splice(tmp_path, vicuna, llava,
                                                                           max_length, prompt_format):
    """Each row, the image spliced in as the model's 7 positions, equals the sequence LLaVA's forward pass takes
    (its collator, then `prepare_inputs_labels_for_multimodal`): the tokens equal to the pad id are dropped (LLaVA
    attends only `ids != pad` and removes the rest), and the whole is cut to model_max_length with the image's 7
    positions counted (where the cut reaches into the image, LLaVA keeps part of it and nothing after; the row keeps
    the text before it, the same tokens scored). A row left out scores nothing in LLaVA's either. Before, a '<unk>'
    was attended and scored, and only the text was cut, the image counted as one token."""
    records = {**{k: RECORDS[k] for k in ('two rounds', 'the image in a later turn', 'a turn that is only the image',
                                          'text only')}, **UNKNOWN} if prompt_format == 'vicuna_v1' else CAPTIONS
    conversations, _ = _load(tmp_path, records, prompt_format)
    keys, version = list(records), 'v1' if prompt_format == 'vicuna_v1' else 'plain'
    whole = [llava.preprocess(records[k], vicuna, version)[:2] for k in keys]
    longer = {k for k, (ids, _), row in zip(keys, whole, llava.spliced(whole, vicuna, 7))
              if len(ids) > max_length or len(row) > max_length}  # before the collator's cut, or once spliced in
    vicuna.model_max_length = max_length
    try:
        refs = llava.spliced([llava.preprocess(records[k], vicuna, version)[:2] for k in keys], vicuna, 7)
        collator = ConversationCollator(vicuna, transforms.Compose([transforms.Resize((8, 8)), transforms.ToTensor()]),
                                        prompt_format, max_length, image_aspect='crop', image_positions=7)
        batch = collator([conversations[k] for k in keys])
    finally:
        vicuna.model_max_length = 2048
    dropped = set(batch.get('left_out_long', ())) | set(batch.get('mismatched', ()))
    kept = [k for k in keys if k not in dropped]
    for r, key in enumerate(kept):
        n, at = int(batch['attention_mask'][r].sum()), int(batch['image_at'][r])
        row = list(zip(batch['input_ids'][r, :n].tolist(), batch['labels'][r, :n].tolist()))
        if at >= 0:
            row[at:at] = [(-1, -100)] * 7
        ref = refs[keys.index(key)]
        if at < 0 and 'image' in records[key]:  # the cut reached into the image: LLaVA's row ends on part of it
            assert len(ref) == max_length and ref[len(row):] == [(-1, -100)] * (max_length - len(row)), key
            ref = ref[:len(row)]
        assert row == ref, key
        assert len(ref) <= max_length
    for key in dropped:  # left out here: nothing of LLaVA's row is scored
        assert {label for _, label in refs[keys.index(key)]} == {-100}, key
    assert sorted(batch.get('cut_short', [])) == sorted(longer - set(batch.get('mismatched', ())))


def test_after_an_image_only_turn_llavas_slow_tokenizer_gives_one_space_token_more(tmp_path, vicuna):
    """The difference docs/vlm-stages.md names: after a turn that is only the image, the text goes on with
    ' ASSISTANT: …'; SentencePiece, which LLaVA-1.5 ran (its slow LlamaTokenizer), starts it with a lone '▁' that
    transformers' Llama tokenizer (tokenizers, all transformers 5 has) does not give. Everything else is the same
    tokens, so LLaVA's rows hold one unscored token more there, before 'ASSISTANT:'."""
    import sentencepiece as spm
    conversations, _ = _load(tmp_path, {'only the image': RECORDS['a turn that is only the image']})
    got = encode(conversations['only the image'].turns, vicuna, 'vicuna_v1')
    after = vicuna.convert_ids_to_tokens(got.ids[got.image_at:])
    slow = spm.SentencePieceProcessor(model_file=str(Path(vicuna.name_or_path) / 'tokenizer.model'))
    assert slow.encode(' ASSISTANT: a red circle', out_type=str) == ['▁'] + after[:-1]  # after[-1]: '</s>'
    assert after[0] == '▁ASSISTANT'


def test_plain_gives_llavas_pretraining_ids_and_labels(tmp_path, vicuna, llava):
    record = {'image': 'x.png', 'conversations': _turns(('human', '<image>'), ('gpt', 'a red circle'))}
    conversations, _ = _load(tmp_path, {'caption': record})
    got = encode(conversations['caption'].turns, vicuna, 'plain')
    ids, labels, _ = llava.preprocess(record, vicuna, 'plain')
    assert llava.with_image(got.ids, got.scored, got.image_at) == (ids, labels)


def test_a_question_is_asked_as_llavas_eval_prompt(vicuna, llava):
    """model_vqa_loader's prompt: conv_vicuna_v1 with '<image>\\n' + question and an empty answer, tokenized
    by tokenizer_image_token."""
    conv = llava.llava_conversation.conv_templates['vicuna_v1'].copy()
    conv.append_message(conv.roles[0], '<image>\nwhat color is it?')
    conv.append_message(conv.roles[1], None)
    from llava.mm_utils import tokenizer_image_token
    expected = tokenizer_image_token(conv.get_prompt(), vicuna)
    ids, image_at = prompt('what color is it?', vicuna, 'vicuna_v1')
    assert llava.with_image(ids, [False] * len(ids), image_at)[0] == expected


@pytest.fixture(scope='module')
def qwen(tmp_path_factory):
    from transformers import AutoTokenizer
    directory = tmp_path_factory.mktemp('qwen') / 'lm'
    write_chat_language_model(directory)
    return AutoTokenizer.from_pretrained(directory)


def _scored_text(tok, got):
    """The scored tokens' text, run by run."""
    runs, run = [], []
    for i, s in zip(got.ids, got.scored):
        if s:
            run.append(i)
        elif run:
            runs, run = runs + [tok.decode(run)], []
    return runs + ([tok.decode(run)] if run else [])


def test_qwen2_instruct_is_tinyllavas_template_and_label_rule(tmp_path, qwen):
    """TinyLLaVA's Template._prompt: system + ' ', then per round 'USER: ' + question + ' ' + 'ASSISTANT: ' +
    answer + '<|im_end|>', the image leading its question ('<image>\\n' + the rest, stripped); no BOS (Qwen has
    none). make_labels: instruction = len(tokens('… ASSISTANT: ')) − 1, so each answer is scored with its
    leading space, and '<|im_end|>' (counted by len(tokenizer.encode('<|im_end|>'))) with it."""
    conversations, _ = _load(tmp_path, RECORDS)
    got = encode(conversations['two rounds'].turns, qwen, 'qwen2_instruct')
    text = (f'{VICUNA_V1_SYSTEM} USER: <image>\nwhat color is it? ASSISTANT: red<|im_end|>'
            f'USER: and the shape? ASSISTANT: a circle<|im_end|>')
    before, after = text.split('<image>')
    assert got.ids == qwen(before)['input_ids'] + qwen(after)['input_ids']
    assert got.image_at == len(qwen(before)['input_ids']) and not got.mismatched
    assert _scored_text(qwen, got) == [' red<|im_end|>', ' a circle<|im_end|>']
    only = encode(conversations['a turn that is only the image'].turns, qwen, 'qwen2_instruct')
    assert qwen.decode(only.ids[:only.image_at]).endswith('USER: ')  # 'USER: <image> ASSISTANT: …'
    assert qwen.decode(only.ids[only.image_at:]).startswith(' ASSISTANT: a red circle')
    # a reply holding '<|im_end|>' splits TinyLLaVA's rounds otherwise than its tokens: nothing scored
    mixed = encode((('human', 'what color is it?'), ('gpt', 'red<|im_end|>USER: and')), qwen, 'qwen2_instruct')
    assert mixed.mismatched and not any(mixed.scored)


def test_qwen2_instruct_asks_as_tinyllavas_eval_prompt(qwen):
    """Template.encode(mode='eval'): the assistant's slot with no answer renders 'ASSISTANT:'."""
    ids, image_at = prompt('what color is it?', qwen, 'qwen2_instruct')
    assert qwen.decode(ids[:image_at]) == f'{VICUNA_V1_SYSTEM} USER: '
    assert qwen.decode(ids[image_at:]) == '\nwhat color is it? ASSISTANT:'


def test_a_stage_refuses_a_format_whose_rounds_its_tokenizer_cannot_count(tmp_path, qwen):
    """LLaVA's vicuna_v1 rule over Qwen's tokenizer (no BOS) shifts every mask; TinyLLaVA's qwen2_instruct rule
    over a Llama tokenizer (BOS in every round's count) miscounts every round: nothing would train."""
    from diffzoo.recipes import RecipeError
    from diffzoo.train.vlm.stage import check_rounds
    conversations, _ = _load(tmp_path, RECORDS)
    data = {'format': 'vicuna_v1', 'mismatch': 'mask', 'max_length': 2048}
    with pytest.raises(RecipeError, match='adds none'):
        check_rounds(list(conversations.values()), qwen, data)
    check_rounds(list(conversations.values()), qwen, dict(data, format='qwen2_instruct'))
    llama = _llama_tokenizer(tmp_path / 'llama', legacy=True)
    llama.pad_token = llama.unk_token
    check_rounds(list(conversations.values()), llama, data)
    with pytest.raises(RecipeError, match='cannot count the rounds of any of the first 9'):
        check_rounds(list(conversations.values()), llama, dict(data, format='qwen2_instruct'))
    check_rounds(list(conversations.values()), llama, dict(data, format='qwen2_instruct', mismatch='score'))


@pytest.mark.parametrize('prompt_format,mismatch', [('qwen2_instruct', 'mask'), ('qwen2_instruct', 'score'),
                                                    ('chat_template', 'mask'), ('plain', 'mask')])
def test_a_long_conversation_is_tokenized_as_far_as_it_can_reach_the_cut(qwen, prompt_format, mismatch):
    """5,000 turns cut to 64 tokens: encode tokenizes the rounds that can reach the cut, not the whole
    conversation (what it returns is bounded by the cut, not by the turns), and the first 64 tokens and their
    flags are those of the whole conversation's encoding."""
    rounds = [('human', 'what shape is it?'), ('gpt', 'a red circle')]
    turns = [('human', '<image>\nwhat color is the shape?'), ('gpt', 'red')] + rounds * 2499
    long = encode(turns, qwen, prompt_format, 64, mismatch)
    assert len(long.ids) < 400
    whole = encode(turns[:40], qwen, prompt_format, 10 ** 6, mismatch)  # 40 turns: past the cut, all encoded
    assert (long.ids[:64], long.scored[:64], long.image_at) == (whole.ids[:64], whole.scored[:64], whole.image_at)
