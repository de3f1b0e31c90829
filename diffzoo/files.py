"""Files written whole or not at all: the content goes to a temporary file beside the target, which `os.replace`
(atomic within one filesystem) puts in the target's place only once the content is complete. A write that fails
removes the temporary file and leaves the target as it was, so a reader sees the old file or the new one, never
half of one, and a run cut while writing keeps what it wrote before. A JSON-lines file appended to as a run goes
(a log, answers so far) loses at most its last line to a stop: `repair_json_lines` drops it before the rerun appends.
"""
import contextlib
import json
import os
from pathlib import Path
from typing import Any, Iterator, Optional, Union

PathLike = Union[str, os.PathLike]


@contextlib.contextmanager
def atomic_write(path: PathLike, temporary: Optional[PathLike] = None) -> Iterator[Path]:
    """Yields the temporary path to write (`temporary`, by default `<path>.tmp` beside it); on leaving the block
    it replaces `path`, or, when the block raised, is removed (where it can be: a folder in its place is left)."""
    path = Path(path)
    temporary = path.with_name(path.name + '.tmp') if temporary is None else Path(temporary)
    try:
        yield temporary
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(temporary)
        raise


def atomic_write_text(path: PathLike, text: str, temporary: Optional[PathLike] = None) -> Path:
    """`text` written to `path` whole or not at all; returns `path` as a Path."""
    with atomic_write(path, temporary) as partial:
        partial.write_text(text)
    return Path(path)


def atomic_write_json(path: PathLike, value: Any, temporary: Optional[PathLike] = None, **dumps) -> Path:
    """`value` as indented JSON (`json.dumps(value, indent=1, **dumps)`) and a newline, written whole or not at
    all; returns `path` as a Path."""
    return atomic_write_text(path, json.dumps(value, indent=1, **dumps) + '\n', temporary)


def repair_json_lines(path: PathLike) -> Optional[str]:
    """`path` (a JSON-lines log) without the last line a stopped run left cut short (not JSON), rewritten
    atomically and ending in a newline; returns the line dropped, or None. A line before the last that is not
    JSON is no stop's doing: refused, naming it."""
    path = Path(path)
    text = path.read_text(errors='replace')
    lines = text.splitlines()
    for n, line in enumerate(lines[:-1], 1):
        try:
            json.loads(line)
        except ValueError:
            raise ValueError(f'{path}: line {n} is not JSON ({line[:80]!r}); only a last line cut short by a stopped '
                             f'run is dropped by itself. Remove line {n} (or the file, to log afresh) and '
                             f'rerun') from None
    dropped = None
    if lines:
        try:
            json.loads(lines[-1])
        except ValueError:
            dropped = lines.pop()
    if dropped is not None or not text.endswith('\n'):
        atomic_write_text(path, ''.join(line + '\n' for line in lines))
    return dropped
