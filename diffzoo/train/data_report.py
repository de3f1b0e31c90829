"""The trainer's side of the data accounting (`diffzoo.train.data_events` counts in the loader processes):
`start_epoch` tells the loader processes which epoch their next pass belongs to, `report_epoch` gathers
every process's and rank's counts at the epoch's end, logs a summary (and each warning once a run: samples
trained twice, a sizes.json that counts fewer samples than the shards hold, key repeats) and appends the
epoch's record to RUN_DIR/data.jsonl. The counts and their definitions are `diffzoo.train.data_events`'s
docstring; the shards read to their end are compared with the sizes.json that sized the epoch (open_clip's:
the one beside the first shard, unless --train-num-samples is given).
"""
import json
import logging
import os
from collections import Counter
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch.distributed as dist
from open_clip_train.data import expand_urls, get_dataset_size

from diffzoo.data.keys import repeats_across
from diffzoo.data.shards import SIZES_FILE, DataError, read_sizes
from diffzoo.files import atomic_write_text
from .data_events import (DEVICE_COUNTS, DEVICE_PREFIX, EPOCH_FILE, MAX_EXAMPLES, REASONS, REPORT_FILE, SHARD_REASONS,
                          SHARDS_SUFFIX, mark, size, union)


def start_epoch(directory, epoch: int) -> None:
    """Tell the data-loader processes which epoch their next pass belongs to (before the epoch's loader starts)."""
    atomic_write_text(Path(directory) / EPOCH_FILE, str(epoch))


def collect(directory, epoch: Optional[int] = None) -> Dict:
    """One rank's counts for `epoch` (None: what was read outside `start_epoch`'s epochs, e.g. validation
    shards): every process's journal of `directory` for it, added up, and the shards read to their end
    ({url: [samples, with an image, keys, key repeats]}). Under data_backend device the training process's
    journal takes back what it could not decode (`untrained`) and adds its counts (`device`: PIL decodes, fill
    repeats); it is no loader process."""
    total = {'shards': Counter(), 'read': 0, 'trained': 0, 'trained_bits': {}, 'readable_bits': {}, 'bad_bits': {},
             'bad_shards': {}, 'events': Counter(), 'examples': [], 'processes': 0, 'all_read': True, 'ended': {},
             'device': None}
    examples, untrained = {}, {}
    for path in sorted(Path(directory).glob(f'*-{epoch}.jsonl')):
        passes, loader = 0, not path.name.startswith(DEVICE_PREFIX)
        if not loader and total['device'] is None:
            total['device'] = Counter()
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
            for url, positions in entry.get('untrained', {}).items():
                total['trained'] -= len(positions)
                for position in positions:
                    mark(untrained, url, position)
            if not loader:
                total['device'].update(entry.get('device', {}))
            for reason, url, position, key in entry.get('skip', ()):
                total['events'][reason] += 1
                if reason in SHARD_REASONS:
                    total['bad_shards'].setdefault(reason, set()).add(url)
                elif position is not None:
                    mark(total['bad_bits'].setdefault(reason, {}), url, position)
                if len(examples) < MAX_EXAMPLES:
                    examples.setdefault((reason, url, key), None)
        if loader:
            total['processes'] += 1
            total['all_read'] &= passes > 0
    for url, bits in untrained.items():  # a file no decoder reads never trains, however often it is met
        for name in ('trained_bits', 'readable_bits'):
            if url in total[name]:
                total[name][url] &= ~bits
    for path in sorted(Path(directory).glob(f'*-{epoch}{SHARDS_SUFFIX}')):
        for line in path.read_text().splitlines():
            try:
                shard = json.loads(line)
            except ValueError:
                continue
            # the same shard read again has the same contents: [samples, with an image, keys, key repeats]
            total['ended'].setdefault(shard['url'], [shard['samples'], shard['images'], shard['keys'],
                                                     shard['key_repeats']])
    total['examples'] = list(examples)
    return total


def key_repeats(ended: Dict[str, list]) -> Tuple[int, List[list]]:
    """Samples of the shards read to their end ({url: [samples, images, keys, repeats]}) whose key another of
    them has, each counted once, and examples [key, [url of each sample holding it]]."""
    within = Counter((url, key) for url, shard in ended.items() for _, key in shard[3])
    examples = [[key, [url] * (n + 1)] for (url, key), n in within.items()]
    across, found = repeats_across({url: ended[url][2] for url in sorted(ended)}, MAX_EXAMPLES)
    return sum(within.values()) + across, (examples + [[key, urls] for key, urls in found])[:MAX_EXAMPLES]


def sizes_comparison(ended: Dict[str, list], sizes: Optional[Dict[str, int]]) -> Optional[Dict]:
    """The shards read to their end against sizes.json ({shard name: samples}; None: it did not size the epoch):
    how many sizes.json counts fewer or more samples with an image than they hold, by how many, and examples
    [url, sizes.json's count, samples with an image]."""
    if sizes is None:
        return None
    out = {'shards_compared': 0, 'undercounted_shards': 0, 'uncounted_samples': 0, 'overcounted_shards': 0,
           'overcounted_samples': 0, 'examples': []}
    for url in sorted(ended):
        declared, held = sizes.get(os.path.basename(url)), ended[url][1]
        if declared is None:
            continue
        out['shards_compared'] += 1
        if declared < held:
            out['undercounted_shards'] += 1
            out['uncounted_samples'] += held - declared
        elif declared > held:
            out['overcounted_shards'] += 1
            out['overcounted_samples'] += declared - held
        if declared != held and len(out['examples']) < MAX_EXAMPLES:
            out['examples'].append([url, declared, held])
    return out


def unreached(urls: List[str], sizes: Dict[str, int], ended: Dict[str, list], met: Dict[str, int],
              bad_shards: Dict[str, set]) -> int:
    """Samples with an image, as `sizes` ({shard name: samples}) counts them, of the shards `urls` that no process
    reached this epoch: in each shard not read to its end nor skipped as a whole, its count less the positions
    met (`met`: url -> bit set of samples that reached a batch or were skipped for a reason of their own)."""
    broken = set().union(*bad_shards.values()) if bad_shards else set()
    return sum(max(0, sizes.get(os.path.basename(url), 0) - met.get(url, 0).bit_count())
               for url in urls if url not in ended and url not in broken)


def epoch_record(epoch: int, per_rank: List[Dict], sizes: Optional[Dict[str, int]] = None,
                 urls: Optional[List[str]] = None) -> Dict:
    """What data.jsonl holds for an epoch (1-based): the ranks' counts merged, distinct samples and shards
    as the union over ranks, plus each rank's shards and totals; the shards read to their end compared with
    `sizes` (the sizes.json that sized the epoch, if one did), and the samples with an image they were seen to hold
    (`samples_held`: those of the shards read to their end, and those met in the others); the readable samples
    not trained in the epoch
    (`samples_untrained`: met, and not trained before the epoch ended) and, given the epoch's shards `urls` and
    `sizes`, those in shards no process read to their end (`samples_unreached`, as sizes.json counts them; None
    when unknown); under data_backend device, `device_data`: images decoded by PIL and samples trained again to
    fill the holes that skipped images left (`device_loader`)."""
    trained_bits, readable_bits, bad_bits, bad_shards, events, ended = {}, {}, {}, {}, Counter(), {}
    for r in per_rank:
        for url, shard in r.get('ended', {}).items():
            ended.setdefault(url, shard)
        union(trained_bits, r['trained_bits'])
        union(readable_bits, r['readable_bits'])
        for reason, bits in r['bad_bits'].items():
            union(bad_bits.setdefault(reason, {}), bits)
        for reason, names in r['bad_shards'].items():
            bad_shards.setdefault(reason, set()).update(names)
        events.update(r['events'])
    trained = sum(r['trained'] for r in per_rank)
    distinct = size(trained_bits)
    met = dict(readable_bits)
    for reason, bits in bad_bits.items():
        if reason != 'no_image':  # sizes.json counts samples with an image
            union(met, bits)
    skipped = {**{reason: size(bits) for reason, bits in bad_bits.items()},
               **{reason: len(urls) for reason, urls in bad_shards.items()}}
    examples = list({e: None for r in per_rank for e in r['examples']})
    repeats, repeat_examples = key_repeats(ended)
    devices = [r['device'] for r in per_rank if r.get('device') is not None]
    device = {'device_data': {name: sum(d.get(name, 0) for d in devices) for name in DEVICE_COUNTS}} if devices else {}
    return {
        'epoch': epoch, 'samples_trained': trained, 'samples_distinct': distinct, 'samples_repeated': trained - distinct,
        'samples_read': sum(r['read'] for r in per_rank), 'samples_readable': size(readable_bits),
        'samples_held': sum(shard[1] for shard in ended.values()) + sum(
            bits.bit_count() for url, bits in met.items() if url not in ended),
        'samples_untrained': size(readable_bits) - distinct,
        'samples_unreached': None if urls is None or sizes is None else unreached(urls, sizes, ended, met, bad_shards),
        'all_shards_read': all(r['all_read'] and r['processes'] > 0 for r in per_rank),
        'skipped': dict(sorted(skipped.items())), 'skip_events': dict(sorted(events.items())),
        'examples': [list(e) for e in examples][:MAX_EXAMPLES],
        'shards_read_to_end': len(ended), 'key_repeats': repeats, 'key_repeat_examples': repeat_examples,
        'sizes_json': sizes_comparison(ended, sizes),
        'ranks': [{'shards': dict(r['shards']), 'samples_read': r['read'], 'samples_trained': r['trained'],
                   'skip_events': dict(r['events'])} for r in per_rank],
        **device,
    }


# why an epoch trains samples again: open_clip_train rounds its samples up to whole batches for every worker
REPEATS_WHY = ', to fill the whole batches open_clip_train makes of each data-loader worker\'s share'


def _repeats(n: int) -> str:
    return f'{n:,} repeat' + ('s' if n != 1 else '')


def summary(record: Dict) -> str:
    """One paragraph for the log: samples trained (distinct, repeats), shards per rank, what was skipped."""
    shards = [sorted(os.path.basename(s) for s in r['shards']) for r in record['ranks']]
    lines = [f'epoch {record["epoch"]} data: {record["samples_trained"]:,} samples trained '
             f'({record["samples_distinct"]:,} distinct, {_repeats(record["samples_repeated"])}: trained again in the '
             f'same epoch{REPEATS_WHY if record["samples_repeated"] else ""}), from '
             f'{len(set().union(*map(set, shards)))} shards read by {len(record["ranks"])} process(es)']
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
    if record.get('samples_untrained') or record.get('samples_unreached'):
        lines.append(f'  {_untrained(record)}')
    if record.get('key_repeats'):
        lines.append(f'  {_key_repeats(record)}')
    device = record.get('device_data') or {}
    if any(device.values()):
        lines.append(f'  decoded on the device, except {device["pil_decodes"]:,} image(s) by PIL (PNG, WebP, CMYK or '
                     f'refused by the JPEG decoder); {device["fill_repeats"]:,} sample(s) trained again to fill the '
                     f'holes skipped images left in the last batch (among the repeats)')
    compared = record.get('sizes_json')
    for kind, fewer in (('under', True), ('over', False)):
        if compared and compared[f'{kind}counted_shards']:
            n = compared['uncounted_samples' if fewer else 'overcounted_samples']
            shown = '; '.join([f'{os.path.basename(url)}: {declared} in sizes.json, {held} in the tar'
                               for url, declared, held in compared['examples'] if (declared < held) == fewer][:3])
            lines.append(f'  sizes.json counts {n:,} samples {"fewer" if fewer else "more"} than '
                         f'{compared[f"{kind}counted_shards"]} of the {record["shards_read_to_end"]} shards read to '
                         f'their end hold ({shown})')
    return '\n'.join(lines)


def _key_repeats(record: Dict) -> str:
    shown = []
    for key, urls in record['key_repeat_examples'][:3]:
        names = Counter(os.path.basename(u) for u in urls)
        shown.append(f'{key} in ' + ', '.join(name + (f' ×{n}' if n > 1 else '') for name, n in names.items()))
    n = record['key_repeats']
    return (f'{n:,} key repeat{"s" if n != 1 else ""} (samples whose __key__ another sample of the '
            f'{record["shards_read_to_end"]} shards read to their end has; trained all the same): '
            + '; '.join(shown) + (' …' if n > len(shown) else ''))


def _times(record: Dict) -> str:
    readable = record['samples_readable'] if record['all_shards_read'] and record['samples_readable'] else None
    times = record['samples_trained'] / (readable or record['samples_distinct'])
    times = f'{times:.1f}'.rstrip('0').rstrip('.')
    repeats = record['samples_repeated']
    return f'each sample is trained ~{times}× per epoch ({repeats} repeats in epoch {record["epoch"]})'


def _readers(record: Dict, args) -> Tuple[int, str]:
    workers = max(1, getattr(args, 'workers', 1) or 1)
    readers = workers * len(record['ranks'])
    return readers, f'{readers} data-loader worker(s): {workers} per process × {len(record["ranks"])} process(es)'


def repeat_warning(record: Dict, args) -> Optional[str]:
    """A warning when samples were trained more than once in the epoch for a reason the run can fix; None when
    none was, under --dataset-resampled (shards drawn with replacement), and for the epoch's own repeats: open_clip
    sizes an epoch in whole batches per data-loader worker, so a worker goes on into its next pass for the rest of
    its last batch (416 samples for 400 in batches of 32), and a skipped sample leaves its place to one trained
    again. The causes: sizes.json or --train-num-samples declaring more samples than the shards hold (known once
    every worker has read all of its shards), or shards split unevenly over the workers (a worker whose shards
    hold less than its share trains them again while others have not read all of theirs)."""
    repeats = record['samples_repeated']
    if getattr(args, 'dataset_resampled', False) or not repeats:
        return None
    readable, held = record['samples_readable'], record.get('samples_held', record['samples_readable'])
    exact = record['all_shards_read'] and readable
    if args.train_num_samples is not None:
        declared, folder = args.train_num_samples, None
    else:
        declared, _ = get_dataset_size(args.train_data)
        folder = os.path.dirname(expand_urls(args.train_data)[0][0])
    if exact and declared and declared > held:
        if folder is None:
            return (f'--train-num-samples {declared} asks for more samples than the shards hold ({held} with an image, '
                    f'{readable} readable): {_times(record)}; pass --train-num-samples {readable}')
        return (f'{os.path.join(folder, SIZES_FILE)} says {declared} samples, the shards hold {held} ({readable} '
                f'readable): {_times(record)}; fix sizes.json with `python -m diffzoo.data sizes {folder} --recount` '
                f'or pass --train-num-samples {readable}')
    if exact or untrained_warning(record, args):
        return None  # the epoch's own (docstring); or readable samples left untrained too: `untrained_warning`
    readers, which = _readers(record, args)
    declared = f'{declared} samples declared by ' + ('--train-num-samples' if folder is None else 'sizes.json')
    return (f'{_times(record)}: a data-loader worker ({which}) was asked for more batches than its shards hold and '
            f'started them again, while another had not read all of its own (open_clip gives each worker an equal '
            f'share of the epoch). With {declared}, use shards of equal size, a multiple of {readers} of them, or a '
            f'smaller --train-num-samples')


def untrained_warning(record: Dict, args) -> Optional[str]:
    """A warning when readable samples were not trained in the epoch, with how many and why; None when every one
    was, under --dataset-resampled, when --train-num-samples asked for fewer than the shards hold, or when
    sizes.json counts fewer than they hold (`undercount_warning` says so, with the fix)."""
    read, unreached = record.get('samples_untrained', 0), record.get('samples_unreached') or 0
    compared = record.get('sizes_json')
    if getattr(args, 'dataset_resampled', False) or not read + unreached:
        return None
    if args.train_num_samples is not None and args.train_num_samples < record.get('samples_held', 0):
        return None
    if compared and compared['undercounted_shards']:
        return None
    readers, which = _readers(record, args)
    repeats = f' and {_repeats(record["samples_repeated"])}' if record['samples_repeated'] else ''
    return (f'{_untrained(record)}{repeats} in epoch {record["epoch"]}: open_clip gives each of the {which} an '
            f'equal share of the epoch, and the shards of some hold more than their share (others less: they start '
            f'theirs again), as shards of unequal sizes or a number of them that is not a multiple of {readers} do; '
            f'each epoch\'s shard order decides which samples are left out. Use shards of equal size, a multiple of '
            f'{readers} of them, or --dataset-resampled')


def _untrained(record: Dict) -> str:
    read, unreached = record.get('samples_untrained', 0), record.get('samples_unreached')
    where = (f'{unreached:,} in shards no data-loader worker read to their end, as sizes.json counts them'
             if unreached is not None else 'and any in shards no data-loader worker read to their end')
    return (f'{read + (unreached or 0):,} readable samples not trained ({read:,} read as a worker\'s share of the '
            f'epoch ended, {where})')


def _sizes_folder(args) -> Optional[str]:
    """The folder of the sizes.json that sized the epoch (open_clip's: beside the first shard), if one did."""
    if getattr(args, 'train_num_samples', None) is not None or not getattr(args, 'train_data', None):
        return None
    return os.path.dirname(expand_urls(args.train_data)[0][0])


def undercount_warning(record: Dict, folder: Optional[str]) -> Optional[str]:
    """A warning when the sizes.json that sized the epoch counts fewer samples than shards read hold (None: it
    does not, or none sized the epoch): open_clip ends each epoch after the samples it counts, so the rest of
    the corpus is left out of every epoch's share."""
    compared = record.get('sizes_json')
    if not compared or not compared['undercounted_shards'] or folder is None:
        return None
    shown = '; '.join([f'{os.path.basename(url)}: {declared} in sizes.json, {held} in the tar'
                       for url, declared, held in compared['examples'] if declared < held][:3])
    more = ' …' if compared['undercounted_shards'] > 3 else ''
    return (f'{os.path.join(folder, SIZES_FILE)} counts {compared["uncounted_samples"]} samples fewer than '
            f'{compared["undercounted_shards"]} of the {compared["shards_compared"]} shards read to their end in epoch '
            f'{record["epoch"]} hold ({shown}{more}): open_clip sizes each epoch from it, so each epoch ends that many '
            f'samples short and part of the corpus goes untrained; fix it with '
            f'`python -m diffzoo.data sizes {folder} --recount`')


def key_repeat_warning(record: Dict, args) -> Optional[str]:
    """A warning when samples share a key (None when none does)."""
    if not record.get('key_repeats'):
        return None
    folder = os.path.dirname(expand_urls(args.train_data)[0][0]) if getattr(args, 'train_data', None) else 'DIR'
    return (f'{_key_repeats(record)}. `python -m diffzoo.data check {folder}` names every one; re-create the '
            f'shards with a key of its own for every sample, or delete a shard that is a copy of another')


_WARNED = set()  # (event directory, kind): each warning once a run


def report_epoch(directory, epoch: int, args, run_dir: Optional[str]) -> Dict:
    """At the end of open_clip's epoch `epoch` (0-based): gather every rank's counts; rank 0 logs the summary
    (and, once a run, each warning) and appends the record to RUN_DIR/data.jsonl."""
    report = collect(directory, epoch)
    per_rank = [report]
    if dist.is_available() and dist.is_initialized():
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, report)
    folder = _sizes_folder(args)
    try:
        sizes = read_sizes(folder) if folder is not None else None
    except DataError:  # a sizes.json broken since the run began: the comparison is left out
        sizes = None
    resampled, data = getattr(args, 'dataset_resampled', False), getattr(args, 'train_data', None)
    urls = expand_urls(data)[0] if data and not resampled else None
    record = epoch_record(epoch + 1, per_rank, sizes, urls)
    if args.rank == 0:
        logging.info(summary(record))
        for kind, warning in (('repeats', repeat_warning(record, args)),
                              ('untrained', untrained_warning(record, args)),
                              ('undercount', undercount_warning(record, folder)),
                              ('keys', key_repeat_warning(record, args))):
            if warning and (directory, kind) not in _WARNED:
                _WARNED.add((directory, kind))
                logging.warning(warning)
        if run_dir:
            with open(os.path.join(run_dir, REPORT_FILE), 'a') as f:
                f.write(json.dumps(record) + '\n')
    return record
