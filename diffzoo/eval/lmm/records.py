"""What the benchmark readers share: a question as a file gives it (`Sample`), the questions left out and why
(`LeftOut`), and the checks every reader makes (an image name that would leave the folder, a JSON-lines record
without its fields, a file that is not JSON or is missing)."""
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

from PIL import Image

from diffzoo.data.shards import DataError, hostile_name
from diffzoo.vlm.images import open_rgb


@dataclass
class Sample:
    id: str
    image: Path
    prompt: str
    meta: Dict = field(default_factory=dict)  # what scoring needs: label, split, answers, …
    where: str = ''  # where its file gives it ("<file>:<line>"), to name it

    @property
    def source(self) -> str:
        return str(self.image)

    def load_image(self) -> Image.Image:
        return open_rgb(self.image)


IMAGE_OUTSIDE = 'image name leaves the benchmark folder'
REPEATED = 'repeated question id (the first is kept)'


@dataclass
class LeftOut:
    """The questions a task leaves out: reason → where each lies, in the order met. `strict`: refuse the first
    (DataError) instead, for a reader called on its own."""
    named: Dict[str, List[str]] = field(default_factory=dict)
    strict: bool = False

    def add(self, reason: str, where: str) -> None:
        if self.strict:
            raise DataError(f'{where}: {reason}; fix that question, or read the task through Task.questions, which '
                            f'leaves such questions out and counts them')
        self.named.setdefault(reason, []).append(where)

    def counts(self) -> Dict[str, int]:
        return {reason: len(places) for reason, places in self.named.items()}

    def examples(self, n: int = 3) -> Dict[str, List[str]]:
        return {reason: places[:n] for reason, places in self.named.items()}


def strict_unless(left_out: Optional[LeftOut]) -> LeftOut:
    return LeftOut(strict=True) if left_out is None else left_out


def image_in(folder: Path, name, left_out: LeftOut, where: str) -> Optional[Path]:
    """folder / name for an image name a benchmark file gives; None (left out) for a name that is not a string or
    would leave the folder (`hostile_name`)."""
    why = hostile_name(name) if isinstance(name, str) else 'not a file name'
    if why:
        left_out.add(IMAGE_OUTSIDE, f'{where} ({name!r}: {why})')
        return None
    return folder / name


def with_fields(records: Iterable[Tuple[str, object]], needs: Sequence[str], left_out: LeftOut,
                not_object: str = 'not a JSON object') -> Iterator[Tuple[str, Dict]]:
    """(where, record) for each record that is a JSON object holding every field in `needs`; the others left out."""
    for where, record in records:
        missing = [k for k in needs if k not in record] if isinstance(record, dict) else None
        if missing is None:
            left_out.add(not_object, where)
        elif missing:
            left_out.add(f'no {", ".join(missing)}', where)
        else:
            yield where, record


def strings(record: Dict, fields: Sequence[str], left_out: LeftOut, where: str) -> bool:
    """Whether each of `fields` of a record holds a string (a question, a prompt, an answer); else the record is
    left out under the first that does not."""
    wrong = next((k for k in fields if not isinstance(record[k], str)), None)
    if wrong is not None:
        left_out.add(f'{wrong} not a string', f'{where} ({wrong} {record[wrong]!r:.60})')
    return wrong is None


def json_lines(path: Path, needs: Sequence[str], left_out: LeftOut) -> Iterator[Tuple[str, Dict]]:
    """("<file>:<line>", record) for each line of a JSON-lines file that is a JSON object holding every field in
    `needs`; any other line is left out (a line that does not parse, or is not UTF-8, is not a JSON object)."""
    def parsed():
        for n, line in enumerate(path.read_bytes().splitlines(), 1):
            if line.strip():
                try:
                    yield f'{path}:{n}', json.loads(line.decode('utf-8'))
                except ValueError:  # JSONDecodeError, UnicodeDecodeError
                    yield f'{path}:{n}', None
    return with_fields(parsed(), needs, left_out, 'malformed line (not a JSON object)')


def read_json(path: Path):
    """A benchmark's JSON file; DataError naming it when it does not parse."""
    try:
        return json.loads(path.read_bytes())
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise DataError(f'{path}: not JSON ({exc}); put the benchmark\'s published file there') from None


def required(path: Path) -> Path:
    if not path.exists():
        raise DataError(f'{path}: not found; the benchmark\'s local copy is expected there (python -m diffzoo.eval.lmm '
                        f'-h lists each task\'s files)')
    return path
