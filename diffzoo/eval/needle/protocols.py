"""The two ways of asking a model for the needle (MMNeedle's single prompt, the two-step row/column
questions) and how their answers are read."""
import re
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

from .haystack import ABSENT, UNREADABLE, Location, Sample, mmneedle_prompt

PROTOCOLS = ('mmneedle', 'two_step')
# The two-step questions (diffzoo's words); every prompt ends with the caption line, as MMNeedle's.
ROW_PROMPTS = {
    1: "Does this image match the caption? Answer 'yes' or 'no'.",
    2: "This image is a grid of 2 by 2 pictures. Is the picture that matches the caption in the top half or "
       "the bottom half? Answer 'top' or 'bottom', or 'none' if no picture matches the caption.",
    'n': "This image is a grid of {n} by {n} pictures, its rows numbered 1 (top) to {n} (bottom). Which row holds "
         "the picture that matches the caption? Answer with the row number, or 'none' if no picture matches "
         "the caption.",
}
COLUMN_PROMPTS = {
    2: "This image is a grid of 2 by 2 pictures. The picture that matches the caption is in the {half} half. "
       "Is it on the left or on the right? Answer 'left' or 'right'.",
    'n': "This image is a grid of {n} by {n} pictures, its columns numbered 1 (left) to {n} (right). The picture "
         "that matches the caption is in row {row}. Which column holds it? Answer with the column number.",
}
ABSENT_WORDS = {'none', 'no', 'not', 'neither', 'nowhere', 'absent', 'nothing'}
POSITION_WORDS = {'row': {'top': 1, 'upper': 1, 'bottom': -1, 'lower': -1},  # -1: the last, N
                  'column': {'left': 1, 'right': -1}}
_INTEGER = re.compile(r'(?<!\d)-?\d+')
_TOKEN = re.compile(r'(?<!\d)-?\d+|[a-z]+')


def row_prompt(n: int, caption: str) -> str:
    return ROW_PROMPTS.get(n, ROW_PROMPTS['n']).format(n=n) + f'\nCaption: {caption}'


def column_prompt(n: int, row: int, caption: str) -> str:
    half = {1: 'top', 2: 'bottom'}.get(row, str(row))
    return COLUMN_PROMPTS.get(n, COLUMN_PROMPTS['n']).format(n=n, row=row, half=half) + f'\nCaption: {caption}'


def parse_answer(text: Optional[str]) -> Location:
    """(index, row, column) from an answer to the MMNeedle prompt: its first three integers, in order.
    A first integer of -1 is ABSENT; fewer integers leave the rest None ("2" gives index 2, as
    MMNeedle's index accuracy reads the first field); no integer at all is UNREADABLE."""
    numbers = [int(x) for x in _INTEGER.findall(text or '')]
    if not numbers:
        return UNREADABLE
    if numbers[0] == -1:
        return ABSENT
    numbers = (numbers + [None, None])[:3]
    return Location(*numbers)


def parse_step(text: Optional[str], n: int, axis: str) -> Optional[int]:
    """A row or column (1..n) from a two-step answer, -1 for "none"/"no"/"-1", None if unreadable.
    The first word that says something decides: "top"/"upper" = 1, "bottom"/"lower" = n, "left" = 1,
    "right" = n, an integer 1..n; and for a 1×1 row question "yes" = 1."""
    words = POSITION_WORDS[axis]
    for token in _TOKEN.findall((text or '').lower()):
        if token in ABSENT_WORDS or token == '-1':
            return -1
        if token == 'yes' and n == 1 and axis == 'row':
            return 1
        if token in words:
            return words[token] if words[token] > 0 else n
        if token.lstrip('-').isdigit() and 1 <= int(token) <= n:
            return int(token)
    return None


@dataclass(frozen=True)
class Query:
    name: str  # with the sample id, the key of an answer: 'mmneedle', 'row/K', 'column/K'
    stitches: Tuple[int, ...]  # 1-based indices of the images shown
    prompt: str


Ask = Callable[[Query], Optional[str]]


def _mmneedle(sample: Sample, ask: Ask) -> Tuple[Optional[Location], List[Tuple[Query, Optional[str]]]]:
    query = Query('mmneedle', tuple(range(1, sample.m + 1)), mmneedle_prompt(sample.m, sample.n, sample.needle))
    answer = ask(query)
    return (None if answer is None else parse_answer(answer)), [(query, answer)]


def _two_step(sample: Sample, ask: Ask) -> Tuple[Optional[Location], List[Tuple[Query, Optional[str]]]]:
    asked = []
    for k in range(1, sample.m + 1):
        query = Query(f'row/{k}', (k,), row_prompt(sample.n, sample.needle))
        answer = ask(query)
        asked.append((query, answer))
        if answer is None:
            return None, asked
        row = parse_step(answer, sample.n, 'row')
        if row == -1:
            continue
        if row is None:
            return Location(k, None, None), asked
        if sample.n == 1:
            return Location(k, 1, 1), asked
        query = Query(f'column/{k}', (k,), column_prompt(sample.n, row, sample.needle))
        answer = ask(query)
        asked.append((query, answer))
        if answer is None:
            return None, asked
        column = parse_step(answer, sample.n, 'column')
        return Location(k, row, column if column != -1 else None), asked
    return ABSENT, asked


RUN = {'mmneedle': _mmneedle, 'two_step': _two_step}
