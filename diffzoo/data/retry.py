"""`python -m diffzoo.data retry`: the URLs img2dataset failed to download, from its per-shard parquet files, as
a new URL list (img2dataset's incremental mode never retries them)."""
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, List, Tuple

from diffzoo.files import atomic_write

from .shards import DataError


@dataclass
class RetryReport:
    failed: int
    written: int
    excluded: int
    errors: Counter
    unfinished: List[str] = field(default_factory=list)  # shards img2dataset did not finish


def finished_parquets(directory) -> Tuple[List[Path], List[Path]]:
    """img2dataset's NNNNN.parquet files of finished shards (with NNNNN_stats.json), and the others."""
    parquets = sorted(Path(directory).glob('*.parquet'))
    if not parquets:
        raise DataError(f'no NNNNN.parquet files in {directory}; img2dataset writes them next to the shards '
                        f'(is this the download OUT_DIR?)')
    finished = [p for p in parquets if p.with_name(f'{p.stem}_stats.json').exists()]
    return finished, [p for p in parquets if p not in finished]


def failed_urls(parquets: List[Path]) -> Iterator[dict]:
    """Rows of img2dataset's NNNNN.parquet files whose status is not 'success'.

    A URL that later succeeded (a retry downloaded with --extend) is left out."""
    import pyarrow
    import pyarrow.parquet as pq

    columns = ['url', 'caption', 'status', 'error_message']
    failed, succeeded = [], set()
    for path in parquets:
        try:
            table = pq.read_table(path, columns=[c for c in columns if c in pq.read_schema(path).names])
        except (pyarrow.ArrowException, OSError) as exc:  # ArrowInvalid: not parquet, cut short
            raise DataError(f'{path}: not a readable parquet file ({type(exc).__name__}: {exc}); img2dataset wrote '
                            f'it with its _stats.json, so it was damaged since: delete both and the shard, then '
                            f're-run the download into {path.parent} (it redoes shards without _stats.json)') from None
        for row in table.to_pylist():
            if row.get('status') == 'success':
                succeeded.add(row['url'])
            else:
                failed.append(row)
    seen = set()
    for row in failed:
        if row['url'] not in succeeded and row['url'] not in seen:
            seen.add(row['url'])
            yield row


def write_retry(directory, out, exclude: Iterable[str] = ()) -> RetryReport:
    """Write failed URLs as a TSV with a `url<TAB>caption` header (the download script reads it).
    Shards img2dataset did not finish are left out: re-running the download finishes them.

    `exclude`: substrings of error messages to leave out (e.g. 'HTTP Error 404')."""
    exclude = list(exclude)
    finished, unfinished = finished_parquets(directory)
    report = RetryReport(0, 0, 0, Counter(), [p.stem + '.tar' for p in unfinished])
    with atomic_write(out) as tmp, open(tmp, 'w', encoding='utf-8') as f:
        f.write('url\tcaption\n')
        for row in failed_urls(finished):
            report.failed += 1
            error = row.get('error_message') or row.get('status') or 'unknown'
            report.errors[error] += 1
            if any(e in error for e in exclude):
                report.excluded += 1
                continue
            caption = ' '.join(str(row.get('caption') or '').split())  # no tabs or newlines
            f.write(f"{row['url']}\t{caption}\n")
            report.written += 1
    return report
