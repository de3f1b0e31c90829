"""Prompt formats of LLaVA-style conversations: the text a conversation becomes, its tokens, and which are scored.

Formats (`FORMATS`, a stage recipe's `data.format`), each the template of the code a paper ran:

    plain           LLaVA's pre-training (`conv_llava_plain`, `preprocess_plain`) and TinyLLaVA_Factory's
                    `pretrain` template: '<image>', the first answer and '\\n', scored; the human text is dropped
    vicuna_v1       LLaVA-1.5's conversation (`conv_vicuna_v1`, `preprocess_v1`): its system line, then
                    'USER: q ASSISTANT: a</s>' per round (separators ' ' and '</s>')
    qwen2_instruct  TinyLLaVA_Factory's `qwen2_instruct` template (its Qwen2 fine-tuning script,
                    `train_qwen2_instruct.sh`; DiffCLIP §5.1 ran in that repository): the same system line, then
                    'USER: q ASSISTANT: a<|im_end|>' per round
    chat_template   the tokenizer's own chat template (Qwen2.5's ChatML): each assistant turn is what the
                    template adds after its generation prompt; not what either paper's code ran

BOS leads plain and vicuna_v1 when the tokenizer has one (Llama's adds it; Qwen's has none). A question is
asked (`prompt`) with the text up to where its answer starts: 'ASSISTANT:' for vicuna_v1 and qwen2_instruct,
as LLaVA's and TinyLLaVA's evaluation prompt.

Tokens: the whole conversation's text tokenized as LLaVA's `tokenizer_image_token` does (each side of
`<image>` at once, the image one position between them), so that a model trains on the tokens it is prompted
with. `image_at` is the text position the image goes before (-1: none).

Which tokens are scored follows the reference code's own rule:

    vicuna_v1       `preprocess_v1`: the text split into rounds at '</s>', each round at ' ASSISTANT: '; the
                    first token (BOS) and each round's instruction masked by token counts, instruction =
                    len(tokens('… ASSISTANT: ')) − 2 and round = len(tokens(round)) with the image as one
                    token, both one fewer after the first round for a non-legacy tokenizer
    qwen2_instruct  TinyLLaVA's `Template.make_labels`: rounds split at '<|im_end|>' and ' ASSISTANT: ',
                    instruction = len(tokens('… ASSISTANT: ')) − 1, round = len(tokens(round)) +
                    len(tokens('<|im_end|>')), so each answer is scored with its leading space and '<|im_end|>'
    plain           `preprocess_plain`: BOS and the image masked, the rest scored
    chat_template   each assistant turn's tokens (found from the tokenization of the text before it)

When the counted rounds do not add up to the sample's length (a reply holding a literal '</s>' or
' ASSISTANT: ', or any text whose round lengths do not add up under the tokenizer) and the count is under
`max_length`, LLaVA and TinyLLaVA print "tokenization mismatch" and score nothing of the sample; so does
`encode` by default (`mismatch='mask'`, `Encoded.mismatched` set, counted by the stage). `mismatch='score'`
scores such a sample's answers by their characters instead (each answer's tokens, found from the tokenization
of the text before it).

Cost: only the rounds that can reach `max_length` are rendered and tokenized (`fitting`), and a fast tokenizer's
offset mapping places each token in its piece in one pass, so a conversation of thousands of turns cut to a few
hundred tokens costs what fits.
"""
import bisect
from dataclasses import dataclass
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

from .options import CONVERSATION_FORMATS as FORMATS
from .options import MISMATCH_RULES

IMAGE = '<image>'
HUMAN, GPT = 'human', 'gpt'
VICUNA_V1_SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. "
                    "The assistant gives helpful, detailed, and polite answers to the user's questions.")
ANSWER_SEPARATOR = ' ASSISTANT: '  # LLaVA's conv.sep + roles[1] + ': ', TinyLLaVA's separator[0]
QWEN2_END = '<|im_end|>'  # TinyLLaVA's qwen2_instruct: the end of each answer


class Encoded(NamedTuple):
    ids: List[int]
    scored: List[bool]  # per token
    image_at: int  # the token index the image goes before; -1: no image
    mismatched: bool = False  # the reference's round count missed the length: nothing scored (mismatch='mask')


def plain_pieces(turns: Sequence[Tuple[str, str]], tokenizer=None) -> List[Tuple[str, bool]]:
    """LLaVA's `conv_llava_plain` (its `preprocess_plain`): '<image>' then the first answer and '\\n', scored."""
    return [(IMAGE if IMAGE in turns[0][1] else '', False), (turns[1][1] + '\n', True)]


def _eos(tokenizer) -> str:
    return getattr(tokenizer, 'eos_token', None) or '</s>'


def vicuna_v1_pieces(turns: Sequence[Tuple[str, str]], tokenizer=None) -> List[Tuple[str, bool]]:
    """LLaVA-1.5's `conv_vicuna_v1` (sep ' ', sep2 '</s>'): 'SYSTEM USER: q ASSISTANT: a</s>USER: …', the
    answers and their '</s>' scored."""
    return _rounds(turns, VICUNA_V1_SYSTEM + ' ', _eos(tokenizer))


def qwen2_instruct_pieces(turns: Sequence[Tuple[str, str]], tokenizer=None) -> List[Tuple[str, bool]]:
    """TinyLLaVA_Factory's `qwen2_instruct`: 'SYSTEM USER: q ASSISTANT: a<|im_end|>USER: …', the answers (with
    their leading space) and '<|im_end|>' scored."""
    return _rounds(turns, VICUNA_V1_SYSTEM + ' ', QWEN2_END)


def _rounds(turns, system: str, end: str) -> List[Tuple[str, bool]]:
    """The rounds' pieces; a last question without its answer is 'USER: q ' as conv_vicuna_v1 writes a message and
    its separator."""
    pieces = [(system, False)]
    for i in range(0, len(turns), 2):
        if i + 1 == len(turns):
            pieces.append((f'USER: {turns[i][1]} ', False))
            break
        pieces.append((f'USER: {turns[i][1]} ASSISTANT:', False))
        pieces.append((f' {turns[i + 1][1]}{end}', True))
    return pieces


def chat_template_pieces(turns: Sequence[Tuple[str, str]], tokenizer) -> List[Tuple[str, bool]]:
    """The tokenizer's chat template: each assistant turn is what the template renders after the
    generation prompt of the turns before it; everything else is context."""
    if not getattr(tokenizer, 'chat_template', None):
        raise ValueError(f'{type(tokenizer).__name__} has no chat template; choose data.format vicuna_v1 or a '
                         f'tokenizer with one (Qwen2.5-Instruct has)')
    messages = [{'role': 'user' if role == HUMAN else 'assistant', 'content': text} for role, text in turns]
    pieces, done = [], ''
    for i, message in enumerate(messages):
        if message['role'] != 'assistant':
            continue
        before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        upto = tokenizer.apply_chat_template(messages[:i + 1], tokenize=False)
        if not before.startswith(done) or not upto.startswith(before):
            raise ValueError('the chat template renders a conversation differently from its first turns '
                             '(a later turn changes the text before it), so the assistant tokens cannot be told '
                             'apart; use data.format vicuna_v1')
        pieces += [(before[len(done):], False), (upto[len(before):], True)]
        done = upto
    return pieces


@dataclass(frozen=True)
class RoundRule:
    """A reference's label rule by token counts (module docstring): `end` splits the text into rounds, the
    first `start` tokens are masked, instruction = len(tokens(instruction + ANSWER_SEPARATOR)) −
    `instruction_less`, round = len(tokens(round)) + (len(tokenizer.encode(end)) when `end_counted`), and with
    `non_legacy_correction` both one fewer after the first round for a non-legacy tokenizer (LLaVA's
    IS_TOKENIZER_GREATER_THAN_0_14 branch)."""
    start: int
    instruction_less: int
    end_counted: bool
    non_legacy_correction: bool


LLAVA_V1 = RoundRule(start=1, instruction_less=2, end_counted=False, non_legacy_correction=True)  # preprocess_v1
TINYLLAVA = RoundRule(start=0, instruction_less=1, end_counted=True, non_legacy_correction=False)  # make_labels


def image_tokens(text: str, tokenizer, special_tokens: bool = True) -> Tuple[List[int], int]:
    """LLaVA's `tokenizer_image_token` (TinyLLaVA's alike): (ids, image_at) of `text`, each side of '<image>'
    tokenized with the tokenizer's special tokens and a later side's leading BOS dropped; the image goes before
    ids[image_at] (-1: no image). `special_tokens=False`: no special tokens added (a chat template writes its
    own)."""
    chunks = [tokenizer(chunk, add_special_tokens=special_tokens)['input_ids'] for chunk in text.split(IMAGE)]
    bos = tokenizer.bos_token_id
    offset = 1 if chunks[0] and bos is not None and chunks[0][0] == bos else 0
    ids, image_at = list(chunks[0]), -1
    for chunk in chunks[1:]:
        image_at = len(ids)
        ids += chunk[offset:]
    return ids, image_at


def _length(text: str, tokenizer) -> int:
    """len(tokenizer_image_token(text)), the image one token."""
    ids, _ = image_tokens(text, tokenizer)
    return len(ids) + text.count(IMAGE)


def _mask(scored: List[bool], begin: int, end: int) -> None:
    """scored[begin:end] unscored, with Python's (and torch's) slice rules, as the references index."""
    scored[begin:end] = [False] * len(scored[begin:end])


def reference_labels(text: str, ids: Sequence[int], image_at: int, tokenizer, rule: RoundRule, end: str,
                     max_length: int) -> Optional[List[bool]]:
    """Scored flags over `text`'s tokens `ids` by `rule` (module docstring); None where the reference reports a
    tokenization mismatch: its rounds' count under `max_length` and not the sample's length, which it counts
    as the positions not holding the pad token (the image one), plus each EOS when the pad token is the EOS
    (TinyLLaVA)."""
    positions = list(ids[:image_at]) + [None] + list(ids[image_at:]) if image_at >= 0 else list(ids)
    scored = [True] * len(positions)
    _mask(scored, 0, rule.start)
    cur = rule.start
    end_len = len(tokenizer.encode(end)) if rule.end_counted else 0
    legacy = getattr(tokenizer, 'legacy', True)
    for i, round_text in enumerate(text.split(end)):
        if round_text == '':
            break
        parts = round_text.split(ANSWER_SEPARATOR)
        if len(parts) != 2:
            break
        round_len = _length(round_text, tokenizer) + end_len
        instruction_len = _length(parts[0] + ANSWER_SEPARATOR, tokenizer) - rule.instruction_less
        if rule.non_legacy_correction and i != 0 and not legacy:
            round_len, instruction_len = round_len - 1, instruction_len - 1
        _mask(scored, cur, cur + instruction_len)
        cur += round_len
    _mask(scored, cur, len(scored))
    pad = tokenizer.pad_token_id
    total = sum(p != pad for p in positions)
    if rule.end_counted and pad is not None and pad == tokenizer.eos_token_id:
        total += text.count(tokenizer.eos_token)
    if cur < max_length and cur != total:
        return None
    if image_at >= 0:
        del scored[image_at]
    return scored


PIECES: Dict[str, Callable] = {'plain': plain_pieces, 'vicuna_v1': vicuna_v1_pieces,
                               'qwen2_instruct': qwen2_instruct_pieces, 'chat_template': chat_template_pieces}
RULES: Dict[str, Tuple[RoundRule, Callable]] = {  # format → (its reference's rule, the end of a round)
    'vicuna_v1': (LLAVA_V1, _eos), 'qwen2_instruct': (TINYLLAVA, lambda tokenizer: QWEN2_END)}


def encode(turns: Sequence[Tuple[str, str]], tokenizer, prompt_format: str, max_length: int = 2048,
           mismatch: str = 'mask') -> Encoded:
    """The conversation's tokens, scored flags and image place (module docstring). The ids are the whole
    text tokenized as LLaVA's `tokenizer_image_token` does it; plain's and chat_template's scored tokens are
    their pieces' (a piece's first token is the first one the tokenization of the text before it does not
    hold; a token that spans two pieces belongs to the later one); vicuna_v1's and qwen2_instruct's follow
    their reference's rule, and a mismatch scores nothing (`mismatch='mask'`) or the pieces' tokens
    (`mismatch='score'`)."""
    if prompt_format not in PIECES:
        raise ValueError(f'prompt format {prompt_format!r}: expected one of {FORMATS}')
    if mismatch not in MISMATCH_RULES:
        raise ValueError(f'mismatch={mismatch!r}: expected one of {MISMATCH_RULES}')
    pieces = PIECES[prompt_format](fitting(turns, tokenizer, max_length), tokenizer)
    text = ''.join(piece for piece, _ in pieces)
    ids, image_at = image_tokens(text, tokenizer, special_tokens=prompt_format != 'chat_template')
    if prompt_format in RULES:
        rule, end = RULES[prompt_format]
        flags = reference_labels(text, ids, image_at, tokenizer, rule, end(tokenizer), max_length)
        if flags is not None:
            return Encoded(ids, flags, image_at)
        if mismatch == 'mask':
            return Encoded(ids, [False] * len(ids), image_at, mismatched=True)
        return Encoded(ids, _piece_flags(pieces, text, ids, tokenizer), image_at, mismatched=True)
    return Encoded(ids, _piece_flags(pieces, text, ids, tokenizer), image_at)


def fitting(turns: Sequence[Tuple[str, str]], tokenizer, max_length: int) -> Sequence[Tuple[str, str]]:
    """The rounds of `turns` that can reach the first `max_length` tokens: the rounds up to the first one at whose
    end the texts' own tokens, each counted alone (less one for a token its context could merge, `<image>` not
    counted), already pass `max_length`. What follows never reaches the cut, and its rounds cannot change the
    tokens before it (a round ends at a special token), so a long conversation costs what fits, not its length."""
    count = 0
    for r in range(0, len(turns), 2):
        count += sum(max(len(_tokens(tokenizer, text.replace(IMAGE, ''))) - 1, 0) for _, text in turns[r:r + 2])
        if count > max_length:
            return turns[:r + 2]
    return turns


def _piece_flags(pieces: Sequence[Tuple[str, bool]], text: str, ids: Sequence[int], tokenizer) -> List[bool]:
    """Scored flags of `text`'s tokens `ids` by the piece each token belongs to, each side of `<image>` tokenized
    at once; the special tokens the tokenizer put first (BOS) unscored. A fast tokenizer's offsets place each token
    in one pass (a token that spans two pieces belongs to the later one); otherwise a piece's first token is the
    first one the tokenization of the text before it does not hold."""
    starts, at = [], 0  # (where each piece starts in `text`, whether it is scored)
    for piece, is_scored in pieces:
        starts.append((at, is_scored))
        at += len(piece)
    if getattr(tokenizer, 'is_fast', False):
        return _offset_flags(starts, text, ids, tokenizer)
    scored, begin = [], 0
    for chunk in text.split(IMAGE):
        end = begin + len(chunk)
        if chunk:
            chunk_ids = _tokens(tokenizer, chunk)
            flag = [f for p, f in starts if p <= begin][-1]
            done = 0
            for p, is_scored in starts:
                if begin < p < end and is_scored != flag:
                    before = _tokens(tokenizer, chunk[:p - begin])
                    held = next((i for i, (a, b) in enumerate(zip(chunk_ids, before)) if a != b),
                                min(len(chunk_ids), len(before)))
                    scored += [flag] * max(0, held - done)
                    done, flag = max(done, held), is_scored
            scored += [flag] * (len(chunk_ids) - done)
        begin = end + len(IMAGE)
    return [False] * (len(ids) - len(scored)) + scored


def _offset_flags(starts: Sequence[Tuple[int, bool]], text: str, ids: Sequence[int], tokenizer) -> List[bool]:
    """`_piece_flags` from the offset mapping: each token scored as the piece holding its last character."""
    bounds = [p for p, _ in starts]
    scored, begin = [], 0
    for chunk in text.split(IMAGE):
        if chunk:
            offsets = tokenizer(chunk, add_special_tokens=False, return_offsets_mapping=True)['offset_mapping']
            scored += [starts[bisect.bisect_right(bounds, begin + max(end - 1, start)) - 1][1] for start, end in offsets]
        begin += len(chunk) + len(IMAGE)
    return [False] * (len(ids) - len(scored)) + scored


def _tokens(tokenizer, text: str) -> List[int]:
    return tokenizer(text, add_special_tokens=False)['input_ids']


def prompt(question: str, tokenizer, prompt_format: str, image: bool = True) -> Tuple[List[int], int]:
    """(token ids, image_at) of one question as the format asks it, up to where the answer starts (vicuna_v1 and
    qwen2_instruct: after 'ASSISTANT:'; a chat template: after its generation prompt): what a model trained on
    that format is given to answer."""
    turns = ((HUMAN, f'{IMAGE}\n{question}' if image else question), (GPT, ''))
    asked = ''.join(piece for piece, _ in PIECES[prompt_format](turns, tokenizer)[:-1])
    return image_tokens(asked, tokenizer, special_tokens=prompt_format != 'chat_template')
