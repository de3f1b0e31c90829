"""The intervals and chance verdicts the demos and `python -m diffzoo.eval` print: Wilson's score interval at
CONFIDENCE around each accuracy (from scipy), and one table of models side by side with them.

An accuracy of `hits` out of `n` trials gets its interval; two models are "within chance" of each other where their
intervals overlap (the trials cannot tell them apart), and a model is at chance where its interval holds the chance
level (the accuracy of guessing)."""
import textwrap
from typing import Dict, List, Optional, Sequence, Tuple

CONFIDENCE = 0.95  # of the interval around each accuracy in the tables


def wilson(hits: int, n: int) -> Tuple[float, float]:
    """The Wilson score interval (CONFIDENCE) of hits out of n, in percent (Python floats: results.json holds them)."""
    from scipy.stats import binomtest  # scipy.stats takes seconds to import: not for a --help
    ci = binomtest(hits, n).proportion_ci(CONFIDENCE, method='wilson')
    return 100 * float(ci.low), 100 * float(ci.high)


def interval(percent: float, n: int) -> Tuple[int, float, float]:
    """The hits behind `percent` of `n` trials and their Wilson score interval (CONFIDENCE), in percent."""
    hits = round(percent * n / 100)
    if abs(100 * hits / n - percent) > 1e-3:
        raise ValueError(f'{percent}% is no whole number of hits out of {n}')
    return (hits, *wilson(hits, n))


def overlap(a: Sequence[float], b: Sequence[float]) -> bool:
    """Whether two intervals (low, high) overlap: the accuracies they surround are within chance of each other."""
    return a[0] <= b[1] and b[0] <= a[1]


# a table row: its labels, each column's value (percent; None where not measured), trials n (None: the value is no
# share of hits, so no interval) and the chance level (None where none applies)
TableRow = Tuple[Tuple[str, ...], Dict[str, Optional[float]], Optional[int], Optional[float]]


def _cell(value: Optional[float], n: Optional[int], digits: int) -> str:
    if value is None:
        return '-'
    if n is None:
        return f'{value:.{digits}f}'
    _, low, high = interval(value, n)
    return f'{value:.{digits}f} ({low:.{digits}f}–{high:.{digits}f})'


def table(labels: Sequence[str], columns: Sequence[str], rows: Sequence[TableRow], trials: str, digits: int = 1) -> str:
    """Models side by side (a column each, in order), each accuracy with its interval where its row counts trials,
    the chance level and n; with two columns, their difference (second − first) where the intervals do not overlap,
    "within chance" where they do. Below it, what the intervals are (`trials` says what one trial is) and which
    accuracies are at chance, or below it."""
    counted = any(n is not None for _, _, n, _ in rows)
    chances = any(chance is not None for _, _, _, chance in rows)
    compared = counted and len(columns) == 2
    lines: List[List[str]] = [[*labels, *columns] + ['chance'] * chances + ['n'] * counted]
    at_chance, below = [], []
    for label, values, n, chance in rows:
        values = {c: v for c, v in values.items() if v is not None and v == v}  # not NaN
        line = [*label, *(_cell(values.get(c), n, digits) for c in columns)]
        line += [f'{chance:.{digits}f}' if chance is not None else ''] * chances
        line += [str(n) if n is not None else ''] * counted
        if n is not None:
            spans = {c: interval(values[c], n)[1:] for c in columns if c in values}
            at_chance += [f'{c} {label[-1]}' for c, (low, high) in spans.items()
                          if chance is not None and low <= chance <= high]
            below += [f'{c} {label[-1]}' for c, (low, high) in spans.items() if chance is not None and high < chance]
            if compared and len(spans) == 2:
                first, second = (spans[c] for c in columns)
                line.append('within chance' if overlap(first, second) else
                            f'{values[columns[1]] - values[columns[0]]:+.{digits}f}')
        lines.append(line)
    widths = [max(len(line[i]) for line in lines if i < len(line)) for i in range(len(lines[0]))]

    def render(cells: List[str]) -> str:
        text = '  '.join(c.ljust(w) if i < len(labels) else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
        return ('  ' + text + (f'   {cells[-1]}' if len(cells) > len(widths) else '')).rstrip()

    head = render(lines[0] + ['difference'] * compared)
    body = [head, '  ' + '─' * (len(head) - 2)] + [render(line) for line in lines[1:]]
    if not counted:
        return '\n'.join(body)
    notes = f'(a–b): Wilson {CONFIDENCE:.0%} interval of each accuracy over its n trials ({trials}).'
    if compared:
        notes += (f' difference: {columns[1]} − {columns[0]} where the two intervals do not overlap; "within chance" '
                  f'where they overlap: these trials cannot tell the two apart there.')
    if at_chance:
        notes += ' At chance (the interval holds the chance level): ' + ', '.join(at_chance) + '.'
    if below:
        notes += (' Below chance (the whole interval under it, a systematic confusion): ' + ', '.join(below) + '.')
    return '\n'.join(body + [''] + textwrap.wrap(notes, width=max(len(head), 100), initial_indent='  ',
                                                 subsequent_indent='  ', break_on_hyphens=False))
