"""A dataset's URL list read row by row and handed to img2dataset as a parquet file, which it reads exactly.

img2dataset reads a TSV with pyarrow's CSV reader, for which `"` quotes a field: a caption that starts with `"` loses
its quotes, or runs on over the rows after it to the next `"` (their URLs end up in its caption, and they are neither
downloaded nor counted as failed); a row with one field too few or too many stops the whole download. So every line is
read here first, with Python's csv module and quoting off (a `"` is a character of the caption like any other):

- a row with the card's columns and an http(s) URL goes into OUT_DIR/_url_list/STEM.parquet as it is, in list order;
- any other line (another number of fields, no URL or one that is not http(s), bytes that are not UTF-8, a blank line,
  a carriage return inside the line) is left out: counted once, and written with its line number, the reason and its
  bytes to OUT_DIR/_url_list/STEM.left_out.tsv.

The first line decides the layout: a header naming the card's url and caption columns (as `retry` writes it), or a
row of the card's columns with the URL where the card says; a first line that is neither is the wrong file, refused
before anything is written, and so is a list that leaves no row to download.
"""
import csv
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

from diffzoo.files import atomic_write

from .shards import DataError

URL_LIST_DIR = '_url_list'
LEFT_OUT_SUFFIX = '.left_out.tsv'
LEFT_OUT_HEADER = 'line\treason\ttext'
BATCH_ROWS = 1 << 16  # rows per parquet row group
SHOWN = 10  # left-out rows named in the command's output (the file lists every one)


@dataclass
class UrlList:
    """What img2dataset reads (`path`, in `input_format`) and what was left out of the list on the way."""
    path: Path
    input_format: str
    rows: Optional[int] = None  # data rows of the list (None: a list img2dataset reads as it is, unread here)
    left_out: int = 0
    examples: List[Tuple[int, str]] = field(default_factory=list)  # (line, reason) of the first rows left out
    left_out_file: Optional[Path] = None

    @property
    def kept(self) -> Optional[int]:
        return None if self.rows is None else self.rows - self.left_out


def is_url(value: str) -> bool:
    return value[:8].lower().startswith(('http://', 'https://')) and len(value.split('://', 1)[1]) > 0


def _lines(path: Path, undecodable: dict) -> Iterator[str]:
    """The lines of `path` as text (split at '\\n' only); a line that is not UTF-8 is decoded with
    surrogateescape and its number put in `undecodable` with the reason."""
    with open(path, 'rb') as f:
        for number, raw in enumerate(f, 1):
            try:
                yield raw.decode('utf-8')
            except UnicodeDecodeError as exc:
                undecodable[number] = f'not UTF-8 (byte 0x{raw[exc.start]:02x} at byte {exc.start + 1} of the line)'
                yield raw.decode('utf-8', 'surrogateescape')


def _layout(card, tsv: Path, first: List[str]) -> Tuple[List[str], bool]:
    """(the list's column names, whether its first line is a header), or a DataError for the wrong file."""
    url_col, caption_col = card.img2dataset['url_col'], card.img2dataset['caption_col']
    if sorted(first) == sorted([url_col, caption_col]):
        return first, True
    if len(first) != len(card.columns):
        raise DataError(f'{tsv}: line 1 has {len(first)} tab-separated fields; {card.name} expects '
                        f'{len(card.columns)} ({" <TAB> ".join(card.columns)}) or a header naming '
                        f'{url_col} and {caption_col}')
    url_at = card.columns.index(url_col)
    if not is_url(first[url_at]):
        other = [i for i, v in enumerate(first) if is_url(v)]
        hint = f'; the URL is in column {other[0] + 1}: is this the TSV of another dataset?' if other else ''
        raise DataError(f'{tsv}: column {url_at + 1} of the first line is not a URL; {card.name} files are '
                        f'{" <TAB> ".join(card.columns)}{hint}')
    return list(card.columns), False


def _reason(row: List[str], columns: List[str], url_at: int) -> Optional[str]:
    if not row:
        return 'a blank line'
    if len(row) != len(columns):
        return (f'{len(row)} tab-separated field{"s" * (len(row) != 1)}, expected {len(columns)} '
                f'({" <TAB> ".join(columns)})')
    url = row[url_at]
    if not url.strip():
        return 'no URL'
    if not is_url(url):
        return f'the URL {url[:60]!r} does not start with http:// or https://'
    return None


def _csv_reason(exc: csv.Error) -> str:
    """A csv.Error of a line read with quoting off, in words: a '\\r' inside it, or a field over csv's size limit."""
    return 'a carriage return (\\r) inside the line' if 'new-line' in str(exc) else f'what csv cannot read ({exc})'


def _first_row(tsv: Path) -> List[str]:
    with open(tsv, 'rb') as f:
        line = f.readline().decode('utf-8', 'replace')
    try:
        return next(csv.reader([line], delimiter='\t', quoting=csv.QUOTE_NONE), [])
    except csv.Error as exc:  # the layout cannot be told from it
        raise DataError(f'{tsv}: line 1 holds {_csv_reason(exc)}; it must be a header or a row of the list') from None


def _left_out_record(number: int, reason: str, raw: str) -> bytes:
    text = raw.rstrip('\n').rstrip('\r')
    return f'{number}\t{reason}\t{text}\n'.encode('utf-8', 'surrogateescape')


def _convert(tsv: Path, columns: List[str], header: bool, url_at: int, target: Path, left_out_path: Path
             ) -> UrlList:
    """Write the rows of `tsv` that pass to `target` (parquet) and the others to `left_out_path`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([(name, pa.string()) for name in columns])
    undecodable, rows, batch = {}, 0, []
    report = UrlList(target, 'parquet', left_out_file=left_out_path)
    lines = _lines(tsv, undecodable)
    last = ['']  # the line the reader took last: a left-out record keeps its bytes

    def remembered() -> Iterator[str]:
        for line in lines:
            last[0] = line
            yield line

    reader = csv.reader(remembered(), delimiter='\t', quoting=csv.QUOTE_NONE)
    # the parquet file is put in place last: one newer than the list is a finished one
    with (atomic_write(target, target.with_suffix('.tmp')) as tmp,
          atomic_write(left_out_path, left_out_path.with_suffix('.tmp')) as tmp_left):
        with pq.ParquetWriter(tmp, schema) as writer, open(tmp_left, 'wb') as left:
            left.write((LEFT_OUT_HEADER + '\n').encode())

            def leave_out(number: int, reason: str) -> None:
                report.left_out += 1
                if len(report.examples) < SHOWN:
                    report.examples.append((number, reason))
                left.write(_left_out_record(number, reason, last[0]))

            while True:
                try:
                    row = next(reader)
                except StopIteration:
                    break
                except csv.Error as exc:  # a '\r' inside the line, or a field over csv's size limit
                    rows += 1
                    leave_out(reader.line_num, _csv_reason(exc))
                    continue
                number = reader.line_num
                if header and number == 1:
                    continue
                rows += 1
                reason = undecodable.pop(number, None) or _reason(row, columns, url_at)
                if reason:
                    leave_out(number, reason)
                    continue
                batch.append(row)
                if len(batch) == BATCH_ROWS:
                    writer.write_table(pa.table(list(map(list, zip(*batch))), schema=schema))
                    batch = []
            if batch:
                writer.write_table(pa.table(list(map(list, zip(*batch))), schema=schema))
        report.rows = rows
        if report.kept == 0:  # neither file is written
            shown = '; '.join(f'line {n}: {r}' for n, r in report.examples[:3])
            raise DataError(f'{tsv}: none of its {rows} rows can be downloaded ({shown}); is this the right file?')
    return report


def _reused(target: Path, left_out_path: Path) -> UrlList:
    """The report of a list converted before, from its files."""
    import pyarrow.parquet as pq

    report = UrlList(target, 'parquet', left_out_file=left_out_path)
    with open(left_out_path, 'rb') as f:
        f.readline()
        for raw in f:
            report.left_out += 1
            if len(report.examples) < SHOWN:
                number, reason, _ = raw.decode('utf-8', 'replace').split('\t', 2)
                report.examples.append((int(number), reason))
    report.rows = pq.read_metadata(target).num_rows + report.left_out
    return report


def prepare_url_list(card, tsv, out_dir) -> UrlList:
    """`tsv` checked row by row into OUT_DIR/_url_list/STEM.parquet (module docstring); reused when it is newer than
    `tsv`. A card without `columns` (LAION's or DataComp's parquet files) hands its list to img2dataset as it is."""
    tsv = Path(tsv)
    input_format = card.img2dataset.get('input_format', 'tsv')
    if card.columns is None and tsv.exists():
        return UrlList(tsv, input_format)  # parquet, or a table with its own header: img2dataset reads it as it is
    if not tsv.is_file():
        raise DataError(f'URL list {tsv} not found; download {card.file or "the URL list"} from {card.source}')
    if input_format != 'tsv':
        raise DataError(f'dataset card {card.name}: `columns` names the columns of a headerless TSV, and its '
                        f'img2dataset input_format is {input_format!r}; set input_format: tsv, or leave out columns '
                        f'for a list with its own header')
    columns, header = _layout(card, tsv, _first_row(tsv))
    url_at = columns.index(card.img2dataset['url_col'])
    target = Path(out_dir) / URL_LIST_DIR / f'{tsv.stem}.parquet'
    left_out_path = target.with_name(tsv.stem + LEFT_OUT_SUFFIX)
    if (target.exists() and left_out_path.exists() and target.stat().st_mtime >= tsv.stat().st_mtime
            and left_out_path.stat().st_mtime >= tsv.stat().st_mtime):
        return _reused(target, left_out_path)
    target.parent.mkdir(parents=True, exist_ok=True)
    return _convert(tsv, columns, header, url_at, target, left_out_path)


def describe(url_list: UrlList, tsv) -> List[str]:
    """Lines for the command's output: the rows read and handed on, and the first ones left out, by line."""
    if url_list.rows is None:
        return []
    lines = [f'{tsv}: {url_list.rows:,} rows; {url_list.kept:,} handed to img2dataset ({url_list.path})'
             + (f', {url_list.left_out:,} left out (every one in {url_list.left_out_file})' if url_list.left_out
                else '')]
    for number, reason in url_list.examples:
        lines.append(f'  left out: {tsv}, line {number}: {reason}')
    if url_list.left_out > len(url_list.examples):
        lines.append(f'  … and {url_list.left_out - len(url_list.examples):,} more')
    return lines
