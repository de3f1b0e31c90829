"""Image–text datasets from URL lists to webdataset shards, with img2dataset and a dataset card.

A card (`data/<name>.yaml`) names the TSV's column order and the img2dataset arguments. The
published CC3M/CC12M TSVs have no header and captions that start with `"`, so `url_list.prepare_url_list`
reads every row and writes the rows that can be downloaded as a parquet file, naming the others (a card
without `columns`, e.g. for LAION's or DataComp's parquet files, passes its list through); img2dataset then
downloads into OUT_DIR in its incremental mode (a re-run skips shards that have a _stats.json).
img2dataset's incremental mode reads every `*.json` in OUT_DIR as a shard's stats, so a
`sizes.json` left there by an earlier run is removed before, and written again after, a download.
"""
import os
import shlex
from dataclasses import MISSING, dataclass, fields
from importlib import resources
from pathlib import Path
from typing import Dict, List, Optional

import yaml

from .shards import SIZES_FILE, DataError, SizesReport, count_samples, read_stats, write_sizes
from .url_list import UrlList, describe, prepare_url_list


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


# What each key of a card holds, for the message that names a missing or wrong one.
CARD_KEYS = {
    'name': 'the dataset name, e.g. cc3m',
    'title': 'a title for the log, e.g. Conceptual Captions 3M',
    'source': 'where the URL list is published (a URL)',
    'img2dataset': 'img2dataset arguments, at least input_format, url_col and caption_col',
    'expected': 'figures to compare a download with: urls: N, downloaded: [LOW, HIGH]; {} when there are none',
    'columns': 'the column names of a headerless TSV, in order, e.g. [caption, url]',
    'file': 'the URL list file as published',
    'shards': 'the brace pattern of the shards a full download writes',
}


def card_names() -> List[str]:
    return sorted(p.name[:-5] for p in resources.files('diffzoo.data').joinpath('cards').iterdir()
                  if p.name.endswith('.yaml'))


def _card_problem(data) -> Optional[str]:
    """What is wrong with a card's keys (None: nothing), naming the key and what it holds."""
    if not isinstance(data, dict):
        return f'holds {type(data).__name__ if data is not None else "nothing"}, not the keys of a card'
    required = [f.name for f in fields(DatasetCard) if f.default is MISSING]
    missing = [k for k in required if k not in data]
    if missing:
        return 'no ' + '; no '.join(f'`{k}` key ({CARD_KEYS[k]})' for k in missing)
    unknown = sorted(set(map(str, data)) - set(CARD_KEYS))
    if unknown:
        return f'unknown key{"s" * (len(unknown) > 1)} {", ".join(unknown)}; a card\'s keys are {", ".join(CARD_KEYS)}'
    for key in ('img2dataset', 'expected'):
        if not isinstance(data[key], dict):
            return f'`{key}` is {data[key]!r}, not a mapping ({CARD_KEYS[key]})'
    absent = [k for k in ('url_col', 'caption_col') if k not in data['img2dataset']]
    if absent:
        return f'`img2dataset` has no {" and no ".join(absent)} (the names of the URL and caption columns)'
    columns = data.get('columns')
    if columns is not None:
        if not (isinstance(columns, list) and all(isinstance(c, str) for c in columns)):
            return f'`columns` is {columns!r}, not a list of column names ({CARD_KEYS["columns"]})'
        absent = [data['img2dataset'][k] for k in ('url_col', 'caption_col') if data['img2dataset'][k] not in columns]
        if absent:
            return f'`columns` {columns} lacks {" and ".join(map(str, absent))}, which `img2dataset` names'
    return None


def load_card(name_or_path: str) -> DatasetCard:
    """A card by name ('cc3m') or by path to a YAML file; a DataError naming the card, the key and the fix when it
    is not one."""
    path = Path(name_or_path)
    if not path.suffix:
        path = Path(str(resources.files('diffzoo.data').joinpath('cards', f'{name_or_path}.yaml')))
        if not path.exists():
            raise DataError(f'no dataset card {name_or_path!r}; known: {", ".join(card_names())}')
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        raise DataError(f'dataset card {path}: {exc.strerror}') from None
    except yaml.YAMLError as exc:
        raise DataError(f'dataset card {path} is not YAML ({exc})') from None
    problem = _card_problem(data)
    if problem:
        raise DataError(f'dataset card {path}: {problem}. Fix the card (data/cc3m.yaml is one to follow)')
    data.pop('shards', None)
    return DatasetCard(**data)


def img2dataset_arguments(card: DatasetCard, url_list: Path, out_dir, processes: int, threads: int,
                          wandb: bool, extend: bool = False, extra: Optional[Dict] = None,
                          input_format: Optional[str] = None) -> Dict:
    """img2dataset's arguments: the card's, then the run's, then `extra` (flags after --)."""
    args = dict(card.img2dataset)
    args.update(url_list=str(url_list), output_folder=str(out_dir), processes_count=processes,
                thread_count=threads, enable_wandb=wandb)
    if input_format:
        args['input_format'] = input_format
    if extend:
        args['incremental_mode'] = 'extend'
    args.update(extra or {})
    return args


def command_line(args: Dict) -> str:
    """The img2dataset command equivalent to `args`, for the log and for users to re-run by hand."""
    parts = ['img2dataset'] + [f'--{k} {shlex.quote(str(v))}' for k, v in args.items()]
    return ' '.join(parts)


@dataclass
class DownloadReport:
    sizes: SizesReport
    url_list: UrlList
    shards: int  # shards img2dataset finished in this run's share of OUT_DIR (all of them; with extend, the new ones)
    urls: int  # the URLs those shards' _stats.json count
    successes: int

    def lines(self, tsv, out_dir) -> List[str]:
        """What the command prints at the end: the list's rows in, img2dataset's URLs out, and whether they agree."""
        failed = self.urls - self.successes
        out = [f'{len(self.sizes.sizes)} shards, {self.sizes.total:,} samples in {out_dir} (sizes.json written)',
               f'  img2dataset: {self.urls:,} URLs in {self.shards} shards, {self.successes:,} downloaded, '
               f'{failed:,} failed' + (f' (to download again: python -m diffzoo.data retry {out_dir} failed.tsv)'
                                       if failed else '')]
        kept = self.url_list.kept
        if kept is not None:
            left = (f', {self.url_list.left_out:,} left out ({self.url_list.left_out_file})'
                    if self.url_list.left_out else '')
            out.append(f'  {tsv}: {self.url_list.rows:,} rows{left}')
            if self.urls != kept:
                out.append(f'warning: img2dataset counts {self.urls:,} URLs, and the list gave it {kept:,}: '
                           f'{out_dir} holds shards of another list, or shards img2dataset did not finish '
                           f'(re-run the same command)')
        return out


def download(card: DatasetCard, tsv, out_dir, processes: int, threads: int, wandb: bool = False,
             extend: bool = False, extra: Optional[Dict] = None, log=print) -> DownloadReport:
    """Check the list's rows, run img2dataset for a card, then write sizes.json. Safe to re-run: finished shards are
    kept."""
    os.environ.setdefault('NO_ALBUMENTATIONS_UPDATE', '1')  # img2dataset's albumentations phones home
    out_dir = Path(out_dir).absolute()
    out_dir.mkdir(parents=True, exist_ok=True)
    url_list = prepare_url_list(card, tsv, out_dir)
    for line in describe(url_list, tsv):
        log(line)
    (out_dir / SIZES_FILE).unlink(missing_ok=True)
    before = set(read_stats(out_dir)) if extend else set()
    args = img2dataset_arguments(card, url_list.path, out_dir, processes, threads, wandb, extend, extra,
                                 url_list.input_format)
    log(f'{card.title}: {url_list.path} -> {out_dir}')
    log(command_line(args))
    from img2dataset import download as img2dataset_download
    img2dataset_download(**args)
    stats = read_stats(out_dir)
    for name, shard_stats in sorted(stats.items()):
        shard = out_dir / name
        if shard_stats.get('successes') == 0 and shard.exists() and count_samples(shard) == 0:
            shard.unlink()  # stats and parquet stay: a re-run skips it, `retry` lists its URLs
            log(f'{name}: no URL of this shard downloaded; removed the empty tar')
    ours = [s for name, s in stats.items() if name not in before]
    return DownloadReport(write_sizes(out_dir), url_list, len(ours), sum(int(s.get('count', 0)) for s in ours),
                          sum(int(s.get('successes', 0)) for s in ours))
