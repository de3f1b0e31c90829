"""Sample keys (`__key__`) of shards, held compactly, and the samples whose key another sample already has.

webdataset names a sample by its key alone, and nothing stops two samples from having the same one: the same key
twice in a tar, or a shard copied under a second name. Both are trained as two samples. `shard_keys` reads a
shard's keys in order into the samples that repeat a key met earlier in the shard, and the shard's distinct keys
as JSON-able groups small enough to travel in a training journal: img2dataset's keys are zero-padded numbers,
nearly consecutive within a shard (`SSSSSIIII`), and are held as a bit set from the smallest (a bit per number
in the range, base64); sparse numbers are listed as numbers, other keys as strings. Keys compare as strings:
'01' and '1' differ. `repeats_across` counts, over a set of shards, the samples whose key an earlier shard
already holds, reading only the shards whose key ranges overlap.

Each group is `[kind, lo, hi, payload]`: kind 'dW' (digits, W wide; payload a base64 bit set from lo, or a list
of numbers) or 's' (strings; payload the sorted list); lo and hi are the smallest and largest key.
"""
import base64
from typing import Dict, List, Sequence, Tuple

import numpy as np

MAX_DIGITS = 18  # wider numbers do not fit int64: held as strings
DENSE = 64  # a bit set when the key range is at most this many times the number of keys


def _numbers(keys: Sequence[str]):
    """Keys that are all ASCII digits of one width (img2dataset's) as (width, int64 array); None otherwise."""
    if not keys:
        return None
    width = len(keys[0])
    joined = ''.join(keys)
    if not (0 < width <= MAX_DIGITS and len(joined) == width * len(keys) and min(map(len, keys)) == width
            and joined.isascii() and joined.isdigit()):
        return None
    digits = np.frombuffer(joined.encode('ascii'), dtype=np.uint8).reshape(len(keys), width) - ord('0')  # (N, W)
    return width, digits.astype(np.int64) @ (10 ** np.arange(width - 1, -1, -1, dtype=np.int64))


def _number_group(width: int, values: np.ndarray) -> list:
    values = np.unique(values)
    lo, hi = int(values[0]), int(values[-1])
    if hi - lo < DENSE * len(values):
        bits = np.zeros(hi - lo + 1, dtype=bool)
        bits[values - lo] = True
        return [f'd{width}', lo, hi, base64.b64encode(np.packbits(bits).tobytes()).decode('ascii')]
    return [f'd{width}', lo, hi, values.tolist()]


def encode(keys: Sequence[str]) -> List[list]:
    """Distinct keys as groups (see the module docstring)."""
    keys = list(keys)
    numbers = _numbers(keys)
    if numbers is not None:  # the common case, without a Python step per key
        return [_number_group(*numbers)]
    by_width: Dict[int, List[int]] = {}
    strings = []
    for key in keys:
        if key.isascii() and key.isdigit() and len(key) <= MAX_DIGITS:
            by_width.setdefault(len(key), []).append(int(key))
        else:
            strings.append(key)
    groups = [_number_group(width, np.array(values, dtype=np.int64)) for width, values in sorted(by_width.items())]
    if strings:
        strings = sorted(set(strings))
        groups.append(['s', strings[0], strings[-1], strings])
    return groups


def decode(group: list) -> np.ndarray:
    """A group's keys, sorted: int64 numbers for a 'dW' group, strings (objects) for an 's' group."""
    kind, lo, hi, payload = group
    if kind == 's':
        return np.array(payload, dtype=object)
    if isinstance(payload, str):
        bits = np.unpackbits(np.frombuffer(base64.b64decode(payload), dtype=np.uint8), count=hi - lo + 1)
        return np.flatnonzero(bits).astype(np.int64) + lo
    return np.array(payload, dtype=np.int64)


def key_text(kind: str, value) -> str:
    """A decoded key as the shard has it ('d9', 12 -> '000000012')."""
    return value if kind == 's' else str(int(value)).zfill(int(kind[1:]))


def shard_keys(keys: Sequence[str]) -> Tuple[List[list], List[Tuple[int, str]]]:
    """A shard's keys in sample order -> (its distinct keys as groups, [(position, key)] of each sample whose key
    an earlier sample of the shard has)."""
    groups = encode(keys)
    repeats = []
    if sum(len(decode(group)) for group in groups) < len(keys):
        seen = set()
        for position, key in enumerate(keys):
            if key in seen:
                repeats.append((position, key))
            seen.add(key)
    return groups, repeats


def _overlapping(spans: List[Tuple[object, object, str, list]]) -> List[List[Tuple[str, list]]]:
    """Spans (lo, hi, shard, group) of one kind, in clusters whose key ranges overlap; clusters of one left out."""
    clusters, current, reach = [], [], None
    for lo, hi, shard, group in sorted(spans, key=lambda s: (s[0], s[1])):
        if current and lo > reach:
            clusters.append(current)
            current = []
        reach = max(reach, hi) if current else hi
        current.append((shard, group))
    clusters.append(current)
    return [c for c in clusters if len(c) > 1]


def repeats_across(shards: Dict[str, List[list]], examples: int = 20) -> Tuple[int, List[Tuple[str, List[str]]]]:
    """Over shards' distinct keys ({shard: groups}): the samples whose key another of these shards holds too,
    counted once each (a key in n shards is n - 1 repeats), and up to `examples` (key, [shards holding it]),
    shards in the order given. Only shards whose key ranges overlap are decoded."""
    order = {shard: i for i, shard in enumerate(shards)}
    spans: Dict[str, list] = {}
    for shard, groups in shards.items():
        for group in groups:
            spans.setdefault(group[0], []).append((group[1], group[2], shard, group))
    count, found = 0, []
    for kind, kind_spans in sorted(spans.items()):
        for cluster in _overlapping(kind_spans):
            parts = [(shard, decode(group)) for shard, group in cluster]
            values = np.concatenate([v for _, v in parts])
            unique, counts = np.unique(values, return_counts=True)
            count += len(values) - len(unique)
            for value in unique[counts > 1][:max(0, examples - len(found))]:
                holders = [s for s, v in parts if _holds(v, value)]
                found.append((key_text(kind, value), sorted(holders, key=order.__getitem__)))
    return count, found


def _holds(values: np.ndarray, value) -> bool:
    at = np.searchsorted(values, value)
    return bool(at < len(values) and values[at] == value)
