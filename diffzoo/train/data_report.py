"""The trainer's side of the data accounting (`diffzoo.train.data_events` counts in the loader processes):
`start_epoch` tells the loader processes which epoch their next pass belongs to, `report_epoch` gathers
every process's and rank's counts at the epoch's end, logs a summary (and the repeat warning once a run)
and appends the epoch's record to RUN_DIR/data.jsonl. The counts and their definitions are
`diffzoo.train.data_events`'s docstring.
"""
import json
import logging
import os
from collections import Counter
from pathlib import Path
from typing import Dict, List, Optional

import torch.distributed as dist
from open_clip_train.data import expand_urls, get_dataset_size

from .data_events import EPOCH_FILE, MAX_EXAMPLES, REASONS, REPORT_FILE, SHARD_REASONS, mark, size, union


def start_epoch(directory, epoch: int) -> None:
    """Tell the data-loader processes which epoch their next pass belongs to (before the epoch's loader starts)."""
    tmp = Path(directory) / f'{EPOCH_FILE}.tmp'
    tmp.write_text(str(epoch))
    os.replace(tmp, Path(directory) / EPOCH_FILE)


def collect(directory, epoch: Optional[int] = None) -> Dict:
    """One rank's counts for `epoch` (None: what was read outside `start_epoch`'s epochs, e.g. validation
    shards): every process's journal of `directory` for it, added up."""
    total = {'shards': Counter(), 'read': 0, 'trained': 0, 'trained_bits': {}, 'readable_bits': {}, 'bad_bits': {},
             'bad_shards': {}, 'events': Counter(), 'examples': [], 'processes': 0, 'all_read': True}
    examples = {}
    for path in sorted(Path(directory).glob(f'*-{epoch}.jsonl')):
        passes = 0
        for line in path.read_text().splitlines():
            try:
                entry = json.loads(line)
            except ValueError:  # a line being appended as the epoch ended (a pass's end, never a trained batch)
                continue
            total['shards'].update(entry.get('open', ()))
            total['read'] += entry.get('read', 0)
            passes += entry.get('passes', 0)
            for url, positions in entry.get('trained', {}).items():
                total['trained'] += len(positions)
                for position in positions:
                    mark(total['trained_bits'], url, position)
                    mark(total['readable_bits'], url, position)
            for url, positions in entry.get('readable', {}).items():
                for position in positions:
                    mark(total['readable_bits'], url, position)
            for reason, url, position, key in entry.get('skip', ()):
                total['events'][reason] += 1
                if reason in SHARD_REASONS:
                    total['bad_shards'].setdefault(reason, set()).add(url)
                elif position is not None:
                    mark(total['bad_bits'].setdefault(reason, {}), url, position)
                if len(examples) < MAX_EXAMPLES:
                    examples.setdefault((reason, url, key), None)
        total['processes'] += 1
        total['all_read'] &= passes > 0
    total['examples'] = list(examples)
    return total


def epoch_record(epoch: int, per_rank: List[Dict]) -> Dict:
    """What data.jsonl holds for an epoch (1-based): the ranks' counts merged, distinct samples and shards
    as the union over ranks, plus each rank's shards and totals."""
    trained_bits, readable_bits, bad_bits, bad_shards, events = {}, {}, {}, {}, Counter()
    for r in per_rank:
        union(trained_bits, r['trained_bits'])
        union(readable_bits, r['readable_bits'])
        for reason, bits in r['bad_bits'].items():
            union(bad_bits.setdefault(reason, {}), bits)
        for reason, urls in r['bad_shards'].items():
            bad_shards.setdefault(reason, set()).update(urls)
        events.update(r['events'])
    trained = sum(r['trained'] for r in per_rank)
    distinct = size(trained_bits)
    skipped = {**{reason: size(bits) for reason, bits in bad_bits.items()},
               **{reason: len(urls) for reason, urls in bad_shards.items()}}
    examples = list({e: None for r in per_rank for e in r['examples']})
    return {
        'epoch': epoch, 'samples_trained': trained, 'samples_distinct': distinct, 'samples_repeated': trained - distinct,
        'samples_read': sum(r['read'] for r in per_rank), 'samples_readable': size(readable_bits),
        'all_shards_read': all(r['all_read'] and r['processes'] > 0 for r in per_rank),
        'skipped': dict(sorted(skipped.items())), 'skip_events': dict(sorted(events.items())),
        'examples': [list(e) for e in examples][:MAX_EXAMPLES],
        'ranks': [{'shards': dict(r['shards']), 'samples_read': r['read'], 'samples_trained': r['trained'],
                   'skip_events': dict(r['events'])} for r in per_rank],
    }


def _repeats(n: int) -> str:
    return f'{n:,} repeat' + ('s' if n != 1 else '')


def summary(record: Dict) -> str:
    """One paragraph for the log: samples trained (distinct, repeats), shards per rank, what was skipped."""
    shards = [sorted(os.path.basename(s) for s in r['shards']) for r in record['ranks']]
    lines = [f'epoch {record["epoch"]} data: {record["samples_trained"]:,} samples trained '
             f'({record["samples_distinct"]:,} distinct, {_repeats(record["samples_repeated"])}: trained again in the '
             f'same epoch), from {len(set().union(*map(set, shards)))} shards read by {len(record["ranks"])} process(es)']
    if len(shards) > 1:
        for rank, names in enumerate(shards):
            lines.append(f'  rank {rank}: ' + ' '.join(names[:12]) + (' …' if len(names) > 12 else ''))
    if not record['skipped']:
        lines.append('  nothing skipped')
    for reason, n in record['skipped'].items():
        examples = [e for e in record['examples'] if e[0] == reason][:3]
        where = ', '.join(os.path.basename(str(u)) + (f'/{k}' if k else '') for _, u, k in examples)
        noun = REASONS.get(reason, reason) + ('s' if n != 1 and reason in SHARD_REASONS else '')
        met = record['skip_events'].get(reason, n)
        again = f', met {met} times ({_repeats(met - n)})' if met > n else ''
        lines.append(f'  skipped {n} {noun}{again}' + (f' ({where})' if where else ''))
    return '\n'.join(lines)


def repeat_warning(record: Dict, args) -> Optional[str]:
    """A warning when a sample was trained more than once in the epoch (None when none was, or under
    --dataset-resampled, which draws shards with replacement), with its cause: sizes.json or
    --train-num-samples declaring more samples than the shards hold (known exactly once every worker has read
    all of its shards), or a worker asked for more full batches than its own shards fill (shards that do not
    split evenly over the data-loader workers of every rank; an epoch rounded up to whole batches), which
    starts its shards again while others may still be on their first pass."""
    repeats = record['samples_repeated']
    if getattr(args, 'dataset_resampled', False) or not repeats:
        return None
    readable = record['samples_readable']
    exact = record['all_shards_read'] and readable
    times = record['samples_trained'] / (readable if exact else record['samples_distinct'])
    times = f'{times:.1f}'.rstrip('0').rstrip('.')
    if args.train_num_samples is not None:
        declared, folder = args.train_num_samples, None
        source = f'--train-num-samples {declared} asks for'
    else:
        declared, _ = get_dataset_size(args.train_data)
        folder = os.path.dirname(expand_urls(args.train_data)[0][0])
        source = f'{os.path.join(folder, "sizes.json")} says {declared} samples,'
    trained = f'each sample is trained ~{times}× per epoch ({repeats} repeats in epoch {record["epoch"]})'
    if exact and declared and declared > readable:
        fix = f'fix sizes.json with `python -m diffzoo.data sizes {folder} --recount` or pass ' if folder else 'pass '
        if folder:
            return f'{source} the shards hold {readable} readable ones: {trained}; {fix}--train-num-samples {readable}'
        return (f'{source} more samples than the shards hold ({readable} readable ones): {trained}; '
                f'{fix}--train-num-samples {readable}')
    workers = max(1, getattr(args, 'workers', 1) or 1) * len(record['ranks'])
    declared = f'{declared} samples declared by ' + ('--train-num-samples' if folder is None else 'sizes.json')
    return (f'{trained}: a data-loader worker ({workers} in all, {len(record["ranks"])} process(es)) was asked for '
            f'more full batches than its shards hold and started them again (open_clip rounds the epoch up to whole '
            f'batches per worker and drops the partial batch at the end of each pass). With {declared}, use shards '
            f'of equal size, a multiple of {workers} of them, or a smaller --train-num-samples')


_WARNED = set()  # event directories (one per run) whose repeat warning was given


def report_epoch(directory, epoch: int, args, run_dir: Optional[str]) -> Dict:
    """At the end of open_clip's epoch `epoch` (0-based): gather every rank's counts; rank 0 logs the summary
    (and, once a run, the repeat warning) and appends the record to RUN_DIR/data.jsonl."""
    report = collect(directory, epoch)
    per_rank = [report]
    if dist.is_available() and dist.is_initialized():
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, report)
    record = epoch_record(epoch + 1, per_rank)
    if args.rank == 0:
        logging.info(summary(record))
        warning = repeat_warning(record, args)
        if warning and directory not in _WARNED:
            _WARNED.add(directory)
            logging.warning(warning)
        if run_dir:
            with open(os.path.join(run_dir, REPORT_FILE), 'a') as f:
                f.write(json.dumps(record) + '\n')
    return record
