"""python -m diffzoo.data {download,sizes,check,retry,synthetic,llava-qa} — see `python -m diffzoo.data -h`."""
import argparse
import os
import sys
from pathlib import Path
from typing import Dict, List, Optional

from diffzoo.flags import FlagError, at_least, output_file, output_folder, parse_pairs

from .download import card_names, download, load_card
from .check import check_dataset
from .retry import write_retry
from .shards import DataError, write_sizes
from .synthetic import CorpusConfig, write_corpus


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == '':
        return default
    try:
        return int(value)
    except ValueError:
        raise DataError(f'{name}={value!r} is not a whole number') from None


def _img2dataset_flags(tokens: List[str]) -> Dict:
    """['--number_sample_per_shard', '20', '--skip_reencode', 'True'] -> {…: 20, …: True}."""
    try:
        return parse_pairs(tokens)
    except FlagError as exc:
        raise DataError(f'img2dataset flags after -- must be --name value pairs; got {exc.token!r}') from None


def _cmd_download(args, extra) -> int:
    card = load_card(args.dataset)
    processes = args.processes or _env_int('IMG2DATASET_PROCESSES', os.cpu_count() or 1)
    threads = args.threads or _env_int('IMG2DATASET_THREADS', 64)
    wandb = os.environ.get('WANDB', '0').lower() in ('1', 'true', 'yes', 'on')
    report = download(card, args.tsv, args.out_dir, processes, threads, wandb, args.extend, _img2dataset_flags(extra))
    for line in report.lines(args.tsv, args.out_dir):
        print(line)
    if 'downloaded' in card.expected:
        lo, hi = card.expected['downloaded']
        print(f'  the full {card.name} ends with about {lo:,}-{hi:,}')
    return 0


def _cmd_sizes(args, _) -> int:
    report = write_sizes(args.directory, recount=args.recount)
    counted = f' ({len(report.counted)} counted from the tar, no stats)' if report.counted else ''
    print(f'{args.directory}/sizes.json: {len(report.sizes)} shards, {report.total:,} samples{counted}')
    return 0


def _cmd_check(args, _) -> int:
    report = check_dataset(args.directory, workers=args.workers, decode=not args.no_decode)
    undecodable = sum(len(s.undecodable) for s in report.shards)
    undecodable_text = sum(len(s.undecodable_text) for s in report.shards)
    missing = sum(sum(s.missing.values()) for s in report.shards)
    empty = sum(1 for s in report.shards if s.samples == 0 and not s.error)
    unreadable = sum(1 for s in report.shards if s.error)
    rows = [('shards', len(report.shards)), ('samples', report.samples),
            ('samples training uses', sum(s.usable for s in report.shards)),
            ('samples missing a member', missing), ('undecodable images', undecodable),
            ('undecodable captions or json', undecodable_text),
            ('samples repeating a key', report.key_repeats),
            ('members named to leave the dir', sum(len(s.hostile) for s in report.shards)),
            ('captions holding other rows', sum(len(s.merged) for s in report.shards)),
            ('empty shards', empty), ('unreadable shards', unreadable)]
    if report.sizes is not None:
        rows.insert(1, ('samples in sizes.json', sum(report.sizes.get(s.name, 0) for s in report.shards)))
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f'  {name:<{width}}  {value:>12,}')
    problems = report.problems()
    if problems:
        print(f'{args.directory}: {len(problems)} problems')
        for p in problems[:50]:
            print(f'  {p}')
        if len(problems) > 50:
            print(f'  … and {len(problems) - 50} more')
        return 1
    print(f'{args.directory}: OK')
    return 0


def _cmd_retry(args, _) -> int:
    report = write_retry(args.directory, args.out, exclude=args.exclude_error)
    print(f'{report.failed:,} failed URLs in {args.directory}; {report.written:,} written to {args.out}'
          + (f', {report.excluded:,} excluded' if report.excluded else ''))
    for error, n in report.errors.most_common(8):
        print(f'  {n:>10,}  {error}')
    if report.unfinished:
        print(f'{len(report.unfinished)} shards are unfinished (no _stats.json; {", ".join(report.unfinished[:3])}): '
              f're-run the download script first, it finishes them')
    print(f'download them into the same directory: scripts/download_<dataset>.sh {args.out} {args.directory} --extend')
    return 0


def _cmd_synthetic(args, _) -> int:
    config = CorpusConfig(train=args.train, val=args.val, image_size=args.image_size, per_shard=args.per_shard,
                          seed=args.seed)
    manifest = write_corpus(args.out_dir, config, fresh=args.fresh)
    for split, n in manifest['samples'].items():
        print(f'  {args.out_dir}/{split}: {n:,} scenes')
    print('  classes: ' + '; '.join(f'{task} ({", ".join(names)})' for task, names in manifest['classes'].items()))
    return 0


def _cmd_llava_qa(args, _) -> int:
    from .llava_qa import READERS, convert
    sets = {name: getattr(args, name) for name in READERS if getattr(args, name)}
    if not sets:
        raise DataError(f'name at least one set: {", ".join("--" + n for n in READERS)}')
    report = convert(sets, args.image_root, Path(args.out), args.split, None if args.no_prompt else args.prompt)
    print(f'{"set":<8} {"kept":>10} {"no image":>10} {"no answer":>10}')
    for name, kept, missing, empty in report.rows():
        print(f'{name:<8} {kept:>10,} {missing:>10,} {empty:>10,}')
    for line in report.notes():  # what else each set left out, by reason
        print(line)
    print(f'{args.out}: {sum(report.kept.values()):,} conversations; image paths relative to {args.image_root} '
          f'(the recipe\'s data.image_folder)')
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog='python -m diffzoo.data', description=__doc__)
    sub = p.add_subparsers(dest='command', required=True)

    d = sub.add_parser('download', help='URL list (TSV) -> webdataset shards with img2dataset, then sizes.json',
                       description='Processes and threads come from IMG2DATASET_PROCESSES / IMG2DATASET_THREADS '
                                   '(default: CPU cores / 64); WANDB=1 turns on wandb logging. '
                                   'img2dataset flags after -- override the card.')
    d.add_argument('dataset', help=f'dataset card: {", ".join(card_names())} or a YAML path')
    d.add_argument('tsv', help="the dataset's URL list as published (no header) or as `retry` writes it")
    d.add_argument('out_dir', type=output_folder)
    d.add_argument('--processes', type=at_least(0), default=0)
    d.add_argument('--threads', type=at_least(0), default=0)
    d.add_argument('--extend', action='store_true',
                   help='add new shards after the existing ones (for a list written by `retry`)')
    d.set_defaults(run=_cmd_download)

    s = sub.add_parser('sizes', help="write open_clip's sizes.json from img2dataset's *_stats.json")
    s.add_argument('directory')
    s.add_argument('--recount', action='store_true', help='count samples by reading every tar')
    s.set_defaults(run=_cmd_sizes)

    c = sub.add_parser('check', help='read every shard; non-zero exit on a broken dataset')
    c.add_argument('directory')
    c.add_argument('--workers', type=at_least(0), default=0, help='processes (default: one per CPU core)')
    c.add_argument('--no-decode', action='store_true',
                   help='do not decode images (captions and json are decoded all the same)')
    c.set_defaults(run=_cmd_check)

    r = sub.add_parser('retry', help='write the URLs that failed to download, to download them again')
    r.add_argument('directory')
    r.add_argument('out', type=output_file, help='TSV to write (url<TAB>caption, with a header)')
    r.add_argument('--exclude-error', action='append', default=[], metavar='TEXT',
                   help="leave out failures whose message contains TEXT (e.g. 'HTTP Error 404'); repeatable")
    r.set_defaults(run=_cmd_retry)

    g = sub.add_parser('synthetic', help='generate the shapes-and-captions corpus (train/val shards, no download)')
    g.add_argument('out_dir', type=output_folder)
    g.add_argument('--train', type=int, default=4000, help='training scenes')
    g.add_argument('--val', type=int, default=500, help='validation scenes')
    g.add_argument('--image-size', type=int, default=96)
    g.add_argument('--per-shard', type=int, default=500)
    g.add_argument('--seed', type=int, default=0)
    g.add_argument('--fresh', action='store_true', help='write it again even if a finished one is there')
    g.set_defaults(run=_cmd_synthetic)

    from . import llava_qa  # plain Python: the --help of every command still answers without torch
    q = sub.add_parser('llava-qa', help="single-round QA sets (eRAM-V's Table 6) in their published layouts -> one "
                                        'LLaVA-format JSON', description=llava_qa.__doc__,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    q.add_argument('out', type=output_file, help='the JSON to write')
    q.add_argument('--image-root', type=Path, required=True,
                   help="the folder the JSON's image paths are relative to (it holds every set's folder)")
    for name in llava_qa.READERS:
        q.add_argument(f'--{name}', type=Path, metavar='DIR', help=f'the {name} folder')
    q.add_argument('--split', default='train')
    q.add_argument('--prompt', default=llava_qa.SHORT_ANSWER,
                   help="appended to each question (LLaVA-1.5's short-answer prompt)")
    q.add_argument('--no-prompt', action='store_true', help='the question alone')
    q.set_defaults(run=_cmd_llava_qa)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = []
    if '--' in argv:
        at = argv.index('--')
        argv, extra = argv[:at], argv[at + 1:]
    args = parser().parse_args(argv)
    if extra and args.command != 'download':
        parser().error('flags after -- are img2dataset flags, for `download` only')
    try:
        return args.run(args, extra)
    except DataError as exc:
        print(f'error: {exc}', file=sys.stderr)
        return 2


if __name__ == '__main__':
    sys.exit(main())
