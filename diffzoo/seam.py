"""The names of other libraries that diffzoo replaces: one table, checked whole, applied and undone as one.

A row (`Seam`) names a module's attribute, makes what takes its place from the library's own value and says,
in one line, what the library cannot do without it. `apply(rows)` first finds every row's original (the
library's own value, also behind a replacement diffzoo put there before) and checks it: a function's leading
parameters, or what the row says the value is. A library that changed raises `LibraryChanged` naming the
name, before any name is replaced. Then each name takes its replacement, in the table's order. `patched(rows)`
holds them for one block and puts back what each name held, in reverse order, when the block ends, by an
error too; `restore(rows)` puts back the libraries' own values.

The tables: `diffzoo.clip.seams` (open_clip, for the process), `diffzoo.models.seams` (timm, for the process),
`diffzoo.train.seams` (open_clip_train, for one training run); `docs/architecture.md` lists their rows.
"""
import contextlib
import dataclasses
import functools
import inspect
from types import ModuleType
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

ORIGINAL = '__diffzoo_original__'  # on a replacement diffzoo made: the library's own value it stands in for
_MISSING = object()


class LibraryChanged(RuntimeError):
    """A name a seam replaces is gone or is no longer what diffzoo was tested with. A library's subclass says
    which library (`library`: its name and installed version) and what diffzoo is tested with (`tested`)."""
    library = 'the library'
    tested = 'the versions its requirements name'


@dataclasses.dataclass(frozen=True)
class Seam:
    """`module.name` replaced by `replace(original)`, because of `reason`. The original is checked first: a
    function taking `params` first, and, where given, `holds(original)` true (`what` says what it tests)."""
    module: ModuleType
    name: str
    replace: Callable[[Any], Any]
    reason: str
    params: Tuple[str, ...] = ()
    holds: Optional[Callable[[Any], bool]] = None
    what: str = ''

    @property
    def where(self) -> str:
        return f'{self.module.__name__}.{self.name}'

    def original(self, changed=LibraryChanged) -> Any:
        """The library's own value of this name, checked (`LibraryChanged`, or `changed`, when it is not)."""
        current = getattr(self.module, self.name, _MISSING)
        original = getattr(current, ORIGINAL, current)
        if original is _MISSING or (self.params and not callable(original)):
            raise changed(f'{changed.library} has no {self.where}; diffzoo is tested with {changed.tested}')
        if self.params:
            found = tuple(inspect.signature(original).parameters)[:len(self.params)]
            if found != self.params:
                raise changed(f'{changed.library}: {self.where}{found} no longer takes {self.params}; '
                              f'diffzoo is tested with {changed.tested}')
        if self.holds is not None and not self.holds(original):
            raise changed(f'{changed.library}: {self.where} is no longer {self.what}; '
                          f'diffzoo is tested with {changed.tested}')
        return original


def standing_in(replacement: Any, original: Any) -> Any:
    """`replacement`, holding `original` as `ORIGINAL`: the table finds the library's own value behind it."""
    setattr(replacement, ORIGINAL, original)
    return replacement


def wrapping(make_wrapper: Callable[[Callable], Callable]) -> Callable[[Callable], Callable]:
    """A `Seam.replace` for a function: `make_wrapper(original)` under the original's name, docstring and
    signature, standing in for it, so that applying the table again wraps the library's own function, never a
    wrapper."""
    def replace(original):
        return standing_in(functools.wraps(original)(make_wrapper(original)), original)
    return replace


def constant(value: Any) -> Callable[[Any], Any]:
    """A `Seam.replace` that puts `value` in the original's place (a drop-in function of diffzoo's own)."""
    return lambda original: value


class ModuleView:
    """A module as the library a seam replaces it in sees it: `names` replaced, every other name the module's."""

    def __init__(self, module: ModuleType, **names: Any):
        self.__dict__.update(names, _module=module)

    def __getattr__(self, name: str) -> Any:  # names not given
        return getattr(self._module, name)


def apply(rows: Sequence[Seam], changed=LibraryChanged, keep: bool = False) -> List[Tuple[ModuleType, str, Any]]:
    """Check every row, make every replacement, then replace each name in order; returns (module, name, value
    it held) for `undo`. Rows with the same `replace` and the same original (a library's second reference to
    one function) get one replacement. With `keep`, a name holding a replacement diffzoo made keeps it."""
    originals = [row.original(changed) for row in rows]
    previous = [(row.module, row.name, getattr(row.module, row.name)) for row in rows]
    made, replacements = {}, []
    for row, original, (_, _, current) in zip(rows, originals, previous):
        if keep and hasattr(current, ORIGINAL):
            replacements.append(current)
            continue
        key = (row.replace, id(original))
        if key not in made:
            made[key] = row.replace(original)
        replacements.append(made[key])
    for (module, name, _), replacement in zip(previous, replacements):
        setattr(module, name, replacement)
    return previous


def undo(previous: Sequence[Tuple[ModuleType, str, Any]]) -> None:
    """Put back what `apply` found, in reverse order."""
    for module, name, value in reversed(previous):
        setattr(module, name, value)


@contextlib.contextmanager
def patched(rows: Sequence[Seam], changed=LibraryChanged) -> Iterator[None]:
    """`rows` applied for the block; what the names held before is back after it, whatever ends it."""
    previous = apply(rows, changed)
    try:
        yield
    finally:
        undo(previous)


def restore(rows: Sequence[Seam]) -> None:
    """Every row's name back to the library's own value, which a replacement standing in for it holds (`ORIGINAL`:
    `wrapping`, `standing_in`; the tables applied for the process have only such rows)."""
    for row in reversed(rows):
        current = getattr(row.module, row.name, _MISSING)
        if current is not _MISSING:
            setattr(row.module, row.name, getattr(current, ORIGINAL, current))


def describe(rows: Sequence[Seam]) -> List[str]:
    """The table as docs/architecture.md lists it: a line per name, with its reason."""
    return [f'- `{row.where}`: {row.reason}' for row in rows]
