"""Files written whole or not at all: the content goes to a temporary file beside the target, which `os.replace`
(atomic within one filesystem) puts in the target's place only once the content is complete. A write that fails
removes the temporary file and leaves the target as it was, so a reader sees the old file or the new one, never
half of one, and a run cut while writing keeps what it wrote before."""
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
