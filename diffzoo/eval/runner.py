"""Running what `python -m diffzoo.eval` was asked (its parsed arguments): load each model, run each dataset's
tasks, write the rows after every dataset, end with the table."""
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import List, Optional, Tuple

import torch

from diffzoo.checkpoint import CheckpointError
from diffzoo.data.shards import DataError
from diffzoo.flags import output_problem

from . import benchmark, suite
from .models import ModelSpec, column_labels, load, parse_model, run_checkpoints
from .options import EvalError, FewShotConfig
from .results import Row, plot_vs_epoch, table, write_json

ERRORS = (EvalError, CheckpointError, DataError)  # bad inputs: `main` prints the message and exits 2


def _run_of(text: str) -> Optional[Path]:
    """The training run directory of --model NAME,RUN (None when the second part is a file, a tag or absent);
    a directory named like a tag of NAME is refused, naming both readings."""
    name, _, where = (part.strip() for part in text.partition(','))
    if not where or not Path(where).is_dir():
        return None
    import open_clip
    if where in open_clip.list_pretrained_tags_by_model(name):
        raise EvalError(f'--model {text}: {where!r} is both a pretrained tag of {name} and a directory here; '
                        f'write --model {name},./{where} for the training run, or run from another directory '
                        f'for the tag')
    return Path(where)


def training_runs(args) -> List[Tuple[Path, Optional[str]]]:
    """The training run directories asked for, each with its model name (None: the run's record names it):
    --run-dir RUN, and every --model NAME,RUN whose second part is a directory."""
    runs = [(Path(args.run_dir), None)] if args.run_dir else []
    return runs + [(_run_of(text), text.partition(',')[0].strip() or None) for text in args.model if _run_of(text)]


def model_specs(args) -> List[ModelSpec]:
    """A table column per model (--model NAME[,PRETRAINED]) and per checkpoint taken from a training run."""
    specs = [parse_model(text) for text in args.model if _run_of(text) is None]
    for run_dir, name in training_runs(args):
        specs += run_checkpoints(run_dir, name, every=args.every_checkpoint)
    return specs


def default_output(args) -> Path:
    """--output, else RUN/eval/results.json when one training run is evaluated, else ./eval-results.json."""
    if args.output:
        return Path(args.output)
    runs = training_runs(args)
    return runs[0][0] / 'eval' / 'results.json' if len(runs) == 1 else Path('eval-results.json')


def _version(package: str) -> Optional[str]:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def run(args) -> int:
    """Evaluate as the parsed arguments of `python -m diffzoo.eval` say; 0 when done."""
    if args.every_checkpoint and not training_runs(args):
        raise EvalError('--every-checkpoint needs --run-dir RUN or --model NAME,RUN (a training run directory)')
    if not args.dataset:
        raise EvalError('pass at least one --dataset (see python -m diffzoo.eval -h)')
    specs = model_specs(args)
    if not specs:
        raise EvalError('nothing to evaluate: pass --model NAME[,PRETRAINED] or --run-dir RUN')
    columns = column_labels(specs)
    config = FewShotConfig(args.fewshot_way, args.fewshot_shot, args.fewshot_query, args.fewshot_episodes,
                            args.seed, args.fewshot_classifier)
    suites = [suite.suite_for(dataset) for dataset in dict.fromkeys(args.dataset)]  # an unknown one refused here
    suite.check_tasks(suites, args.task)
    plan = []
    for kind in suites:
        root = benchmark.dataset_root(args.dataset_root, kind.dataset)
        tasks = kind.tasks(args.task)
        kind.check(root, tasks)
        plan.append((kind, root, tasks, kind.counted(root)))
    device = args.device or ('cuda' if torch.cuda.is_available() else 'cpu')
    amp = device.startswith('cuda') and not args.no_amp
    output = default_output(args)
    problem = output_problem(str(output), folder=False)  # the default (RUN/eval/results.json): --output's, parsed
    if problem:  # the rows are written after every dataset: a bad path would end the run after its work
        raise EvalError(f'--output {output}: {problem}')
    settings = dict(vars(args), device=device, amp=amp, output=str(output), clip_benchmark=_version('clip-benchmark'),
                    open_clip=_version('open_clip_torch'))

    how = suite.RunSettings(device, amp, args.batch_size, args.workers, config, args.lp_epochs, args.lp_lr)
    rows: List[Row] = []
    for i, (spec, column) in enumerate(zip(specs, columns), 1):
        print(f'[{i}/{len(specs)}] {column}: loading {spec.name}'
              + (f' from {spec.pretrained}' if spec.pretrained else ' (random init)'), flush=True)
        loaded = load(spec, device, args.force_image_size, args.seed)
        for kind, root, tasks, counts in plan:
            dataset = kind.dataset
            for task in tasks:
                start = time.time()
                print(f'  {dataset}: {task} …', flush=True)
                results = kind.run(loaded, root, task, how, progress=print)
                for task_name, metrics in results.items():
                    rows += [Row(spec.name, spec.pretrained, loaded.checkpoint_sha256, dataset, task_name, metric,
                                 value, column, spec.epoch, *counts.get(metric, (None, None)))
                             for metric, value in metrics.items()]
                shown = ', '.join(f'{k} {v:.2f}' for m in results.values() for k, v in list(m.items())[:3])
                print(f'  {dataset}: {task} done in {time.time() - start:.0f}s ({shown})', flush=True)
                write_json(output, rows, settings)
        del loaded
    print()
    print(table(rows, '; '.join(kind.trials for kind, _, _, counts in plan if counts)))
    print(f'\nresults: {output}')
    if args.every_checkpoint:
        plot = plot_vs_epoch(rows, output.with_name(output.stem + '_vs_epoch.png'))
        if plot:
            print(f'plot: {plot}')
    return 0
