"""Image–text datasets from URL lists to webdataset shards, with img2dataset and a dataset card.

A card (`data/<name>.yaml`) names the TSV's column order and the img2dataset arguments. The
published CC3M/CC12M TSVs have no header, so `prepare_url_list` writes a copy with one (a card
without `columns`, e.g. for LAION's or DataComp's parquet files, passes its list through); img2dataset then
downloads into OUT_DIR in its incremental mode (a re-run skips shards that have a _stats.json).
img2dataset's incremental mode reads every `*.json` in OUT_DIR as a shard's stats, so a
`sizes.json` left there by an earlier run is removed before, and written again after, a download.
"""
import os
import shlex
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Dict, List, Optional

import yaml

from .shards import SIZES_FILE, DataError, count_samples, read_stats, write_sizes

URL_LIST_DIR = '_url_list'


@dataclass
class DatasetCard:
    name: str
    title: str
    source: str
    img2dataset: Dict
    expected: Dict
    columns: Optional[List[str]] = None  # the header a headerless TSV needs; None: the list names its columns
    file: str = ''
    shards: str = ''


def card_names() -> List[str]:
    return sorted(p.name[:-5] for p in resources.files('diffzoo.data').joinpath('cards').iterdir()
                  if p.name.endswith('.yaml'))


def load_card(name_or_path: str) -> DatasetCard:
    """A card by name ('cc3m') or by path to a YAML file."""
    path = Path(name_or_path)
    if not path.suffix:
        path = Path(str(resources.files('diffzoo.data').joinpath('cards', f'{name_or_path}.yaml')))
        if not path.exists():
            raise DataError(f'no dataset card {name_or_path!r}; known: {", ".join(card_names())}')
    with open(path) as f:
        data = yaml.safe_load(f)
    data.pop('shards', None)
    try:
        return DatasetCard(**data)
    except TypeError as exc:
        raise DataError(f'dataset card {path}: {exc}') from exc


def prepare_url_list(card: DatasetCard, tsv, out_dir) -> Path:
    """A copy of `tsv` with the card's header line, in OUT_DIR/_url_list/ (reused when up to date).

    A file that already starts with a header naming the card's url and caption columns (in any
    order, as `python -m diffzoo.data retry` writes) is copied as it is. For a card without
    `columns` the list (a file or a directory of parquet files) is used where it is."""
    tsv = Path(tsv)
    if card.columns is None and tsv.exists():
        return tsv  # parquet, or a table with its own header: img2dataset reads it as it is
    if not tsv.is_file():
        raise DataError(f'URL list {tsv} not found; download {card.file or "the URL list"} from {card.source}')
    url_col, caption_col = card.img2dataset['url_col'], card.img2dataset['caption_col']
    with open(tsv, encoding='utf-8', errors='replace') as f:
        first = f.readline().rstrip('\n').split('\t')
    has_header = sorted(first) == sorted([url_col, caption_col])
    if not has_header:
        if len(first) != len(card.columns):
            raise DataError(f'{tsv}: first line has {len(first)} tab-separated fields; {card.name} expects '
                            f'{len(card.columns)} ({" <TAB> ".join(card.columns)})')
        url_at = card.columns.index(url_col)
        if not first[url_at].startswith(('http://', 'https://')):
            other = [i for i, v in enumerate(first) if v.startswith(('http://', 'https://'))]
            hint = (f'; the URL is in column {other[0] + 1}: is this the TSV of another dataset?' if other else '')
            raise DataError(f'{tsv}: column {url_at + 1} of the first line is not a URL; {card.name} files are '
                            f'{" <TAB> ".join(card.columns)}{hint}')
    target = Path(out_dir) / URL_LIST_DIR / f'{tsv.stem}.tsv'
    if target.exists() and target.stat().st_mtime >= tsv.stat().st_mtime:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix('.tmp')
    with open(tsv, 'rb') as src, open(tmp, 'wb') as dst:
        if not has_header:
            dst.write(('\t'.join(card.columns) + '\n').encode())
        while chunk := src.read(1 << 24):
            dst.write(chunk)
    os.replace(tmp, target)
    return target


def img2dataset_arguments(card: DatasetCard, url_list: Path, out_dir, processes: int, threads: int,
                          wandb: bool, extend: bool = False, extra: Optional[Dict] = None) -> Dict:
    args = dict(card.img2dataset)
    args.update(url_list=str(url_list), output_folder=str(out_dir), processes_count=processes,
                thread_count=threads, enable_wandb=wandb)
    if extend:
        args['incremental_mode'] = 'extend'
    args.update(extra or {})
    return args


def command_line(args: Dict) -> str:
    """The img2dataset command equivalent to `args`, for the log and for users to re-run by hand."""
    parts = ['img2dataset'] + [f'--{k} {shlex.quote(str(v))}' for k, v in args.items()]
    return ' '.join(parts)


def download(card: DatasetCard, tsv, out_dir, processes: int, threads: int, wandb: bool = False,
             extend: bool = False, extra: Optional[Dict] = None, log=print):
    """Run img2dataset for a card, then write sizes.json. Safe to re-run: finished shards are kept."""
    os.environ.setdefault('NO_ALBUMENTATIONS_UPDATE', '1')  # img2dataset's albumentations phones home
    out_dir = Path(out_dir).absolute()
    out_dir.mkdir(parents=True, exist_ok=True)
    url_list = prepare_url_list(card, tsv, out_dir)
    (out_dir / SIZES_FILE).unlink(missing_ok=True)
    args = img2dataset_arguments(card, url_list, out_dir, processes, threads, wandb, extend, extra)
    log(f'{card.title}: {url_list} -> {out_dir}')
    log(command_line(args))
    from img2dataset import download as img2dataset_download
    img2dataset_download(**args)
    for name, stats in sorted(read_stats(out_dir).items()):
        shard = out_dir / name
        if stats.get('successes') == 0 and shard.exists() and count_samples(shard) == 0:
            shard.unlink()  # stats and parquet stay: a re-run skips it, `retry` lists its URLs
            log(f'{name}: no URL of this shard downloaded; removed the empty tar')
    return write_sizes(out_dir)
