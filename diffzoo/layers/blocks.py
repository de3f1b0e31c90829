"""Which blocks of a stack to convert: the one check `diffzoo.differentialize` (timm / open_clip blocks) and
`diffzoo.vlm.differentialize` (a transformers decoder's layers) share."""
import numbers
from typing import List


def block_indices(value, size: int, where: str, key: str = 'blocks') -> List[int]:
    """`value` checked against a stack of `size` blocks: None (all), or a non-empty list / tuple of distinct ints
    (not bools) in 0..size − 1; the sorted indices. A bad value is a ValueError naming it, `key` (the argument's
    name) and the stack's range (`where`)."""
    if value is None:
        return list(range(size))
    valid = f'{where} has blocks 0..{size - 1}; pass a list of some of them, or {key}=None for all'
    if not isinstance(value, (list, tuple)):
        raise ValueError(f'{key}={value!r}: expected a list of block indices; {valid}')
    if not value:
        raise ValueError(f'{key}={value!r} converts nothing; {valid}')
    for i in value:
        integer = isinstance(i, numbers.Integral) and not isinstance(i, bool)
        if not integer or not 0 <= i < size:
            why = 'not an int' if not integer else 'negative indices are not taken' if i < 0 else 'past the last block'
            raise ValueError(f'{key}={value!r}: {i!r} is not a block index ({why}); {valid}')
    twice = sorted({int(i) for i in value if value.count(i) > 1})
    if twice:
        raise ValueError(f'{key}={value!r}: {twice} given more than once; {valid}')
    return sorted(int(i) for i in value)
