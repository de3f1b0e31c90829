"""Every place `python -m diffzoo.train` reaches into open_clip_train, in one module: `table(…)`
(`diffzoo.seam`, its rows' reasons listed in docs/architecture.md), applied by `installed()` for the duration of
one `open_clip_train.main.main` call, in the training process only (`import diffzoo` alone changes nothing in
open_clip_train), and undone after it, by an error too. Nothing of torch or webdataset is changed; the rows:

- `open_clip_train.main.torch`, the only name through which main saves checkpoints and wraps the model in DDP:
  a view of torch (`TorchForMain`) whose `save` (checkpoints only, in that module) writes a file whole or not at
  all, checking the disk's free space first (`diffzoo.train.saving`), and whose
  `nn.parallel.DistributedDataParallel` drops `device_ids=[device]` for a CPU module, which DDP refuses (gloo on
  CPU then works, e.g. `torchrun --nproc_per_node 2` on a laptop); every other name is torch's own.
- `open_clip_train.main.train_one_epoch`: reseeds the trainer's generators from --seed, rank and
  epoch (`diffzoo.train.shuffle.reseed`); around each epoch, logs λ and loss
  (`diffzoo.train.metrics`) and, at its end, gathers what the data pipeline skipped from every
  rank and reports it (`RUN_DIR/data.jsonl` and the log); a resumed run's epochs past its checkpoint,
  which it trains again, leave data.jsonl at the epoch's start, so each epoch is there once.
- `open_clip_train.data.filter_no_caption_or_no_image`, `.log_and_continue`,
  `.tarfile_to_samples_nothrow`: open_clip's skipping, counted, and blank captions skipped too
  (`diffzoo.train.data_events`).
- `open_clip_train.data.wds`: webdataset with a seeded `shuffle` (`diffzoo.train.shuffle`), so the
  same `--seed` trains on the same batches (webdataset seeds its sample shuffle from the clock);
  `open_clip_train.data.get_wds_dataset` hands that shuffle the run's seed and rank and the dataset's
  epoch, so a resumed run replays the uninterrupted run's sample order and augmentations; its
  `to_tuple` and `batched` count the samples trained, and each data-loader worker's passes over its shards are
  batched as one stream, so no sample is dropped at a pass's end (`diffzoo.train.data_stages.CountingWebdataset`).
- with a recipe's `data_backend: device`, `open_clip_train.data.get_wds_dataset` again, for training data: the
  workers hand over encoded images, crop boxes and tokens, and the training process decodes and transforms
  each batch on its device (`diffzoo.train.device_data`, `diffzoo.train.device_loader`).
- `open_clip_train.main.pt_load`, which main uses only to read the checkpoint it resumes from, and
  `.get_latest_checkpoint`, its choice of that checkpoint: `diffzoo.train.resume` reads it with
  weights_only=True whatever TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD says, locally or through fsspec, falls back to
  the newest intact `epoch_K.pt` beside an unreadable one and says which, and never picks a `tmp.pt`.
- with a recipe's `lambda_lr`: `open_clip_train.main.create_model_and_transforms` and `.optim` and
  `open_clip_train.scheduler.assign_learning_rate`, so λ and the sub-norm train in their own AdamW groups
  at lambda_lr under the same schedule (`diffzoo.train.lambda_lr`).
- `open_clip_train.main.setup_logging`: its console handler shows one line where open_clip_train logs the
  model's structure and every parameter (they stay in RUN_DIR/out.log).

Around the table, for the run: the data pipeline counts into a temporary folder that data-loader workers find
through the environment variable `DIFFZOO_DATA_EVENTS` (`_data_events_folder`); the root logger's handlers that
open_clip_train's set-up adds (console, RUN_DIR/out.log) are closed and removed and its level put back, and the
loggers that set-up lowers to INFO get their levels back (torch's during the run too), so a second run in the
same process (`diffzoo.train.launch.main(argv)` from Python) logs to its own out.log only (`_logging_restored`);
torch's FutureWarning that `torch.distributed.nn.functional.all_gather` is deprecated (open_clip's loss under
`--gather-with-grad` calls it every step) is not shown (`warnings.catch_warnings`, the filters as before after).
"""
import contextlib
import functools
import logging
import os
import shutil
import tempfile
import time
import warnings
from typing import Dict, Iterator, Optional, Tuple

import open_clip_train.data
import open_clip_train.main
import open_clip_train.scheduler
import torch
import webdataset
from torch.nn.parallel import DistributedDataParallel

from diffzoo import seam
from diffzoo.clip.seams import OpenClipChanged
from diffzoo.seam import ModuleView, Seam, constant, standing_in, wrapping
from . import data_events, data_report, data_stages, device_data, lambda_lr
from .metrics import DataWait, LambdaLog, drop_records_after, log_data_wait
from .recipe import DATA_BACKENDS
from .resume import latest_checkpoint, load_resume_checkpoint
from .saving import TorchForCheckpoints
from .shuffle import WebdatasetSeededShuffle, reseed

DATA_REPORT_FILE = data_events.REPORT_FILE


class ModelDumpFilter(logging.Filter):
    """On the console only: open_clip_train's model structure and parameter list (hundreds of lines before the
    first step) become one line naming the log file that keeps them."""

    def __init__(self, log_file):
        super().__init__()
        self.log_file, self.skipping = log_file, None  # None, 'model' (the next record) or 'params'

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message == 'Model:':
            self.skipping = 'model'
            record.msg, record.args = f'model structure and settings: in {self.log_file or "the run log"}', None
            return True
        if self.skipping == 'model':
            self.skipping = None
            return False
        if message == 'Params:':
            self.skipping = 'params'
            return False
        if self.skipping == 'params' and message.startswith('  '):
            return False
        self.skipping = None
        return True


def _quiet_console(original):
    def setup_logging(log_file, level, include_host=False):
        before = list(logging.root.handlers)
        original(log_file, level, include_host)
        for handler in logging.root.handlers:
            if handler not in before and type(handler) is logging.StreamHandler:
                handler.addFilter(ModelDumpFilter(log_file))
    return setup_logging


class CpuAwareDistributedDataParallel(DistributedDataParallel):
    """DDP that ignores `device_ids` naming only CPU devices (DDP accepts none for CPU modules)."""

    def __init__(self, module, device_ids=None, output_device=None, *args, **kwargs):
        if device_ids and all(torch.device(d).type == 'cpu' for d in device_ids):
            device_ids, output_device = None, None
        super().__init__(module, device_ids, output_device, *args, **kwargs)


def _quiet_torch_loggers() -> None:
    """open_clip_train's logging set-up lowers every logger to INFO, torch's too (DDP bucket
    messages each step, compiler statistics at exit); give torch its own levels back."""
    for name in list(logging.root.manager.loggerDict):
        if name == 'torch' or name.startswith('torch.'):
            logging.getLogger(name).setLevel(logging.WARNING if name == 'torch' else logging.NOTSET)


def _epoch_wrapper(original, events_dir: str):
    def train_one_epoch(model, data, loss, epoch, optimizer, scaler, scheduler, dist_model, args, tb_writer=None):
        _quiet_torch_loggers()
        reseed(f'{args.seed}/{args.rank}/trainer/{epoch}')  # what the epoch draws, whether resumed or not
        master = args.rank == 0
        run_dir = os.path.join(args.logs, args.name) if master and args.logs else None
        steps = data['train'].dataloader.num_batches // args.accum_freq  # as train_one_epoch counts them
        log = LambdaLog(run_dir, model, optimizer, epoch, steps, args.log_every_n_steps, tb_writer, args.wandb)
        report = os.path.join(run_dir, DATA_REPORT_FILE) if run_dir else None
        if report and os.path.exists(report):
            drop_records_after(report, epoch, key='epoch')  # a resumed run's epochs after its checkpoint, again
        hook = loss.register_forward_hook(log.on_loss)
        data_report.start_epoch(events_dir, epoch)
        waits = data['train'].dataloader = DataWait(data['train'].dataloader)
        started = time.perf_counter()
        try:
            original(model, data, loss, epoch, optimizer, scaler, log.wrap_scheduler(scheduler), dist_model,
                     args, tb_writer=tb_writer)
        finally:
            hook.remove()
            data['train'].dataloader = waits.loader
        if master:
            log_data_wait(epoch, waits.summary(started, time.perf_counter()))
        log.end_epoch()
        data_report.report_epoch(events_dir, epoch, args, run_dir)
    return train_one_epoch


class TorchForMain(TorchForCheckpoints):
    """torch as open_clip_train.main sees it during a run: `save` writes checkpoints whole (`TorchForCheckpoints`),
    `nn.parallel.DistributedDataParallel` is `CpuAwareDistributedDataParallel`; every other name is torch's."""

    def __init__(self, module):
        super().__init__(module)
        parallel = ModuleView(module.nn.parallel, DistributedDataParallel=CpuAwareDistributedDataParallel)
        self.nn = ModuleView(module.nn, parallel=parallel)


def table(events_dir: str, lambda_lr_scale: Optional[float] = None,
          data_backend: str = 'open_clip') -> Tuple[Seam, ...]:
    """The table for one run (module docstring); `events_dir`: where the data pipeline counts."""
    data, main, scheduler = open_clip_train.data, open_clip_train.main, open_clip_train.scheduler
    seeded = WebdatasetSeededShuffle(webdataset)  # open_clip_train.data's `wds`, as its row checks

    def get_wds_dataset(original):
        build = seeded.bind(original)
        return device_data.wds_dataset_on_device(build, data) if data_backend == 'device' else build

    def shared_epoch(_) -> bool:  # what seeded.bind reads from the DataInfo get_wds_dataset returns
        return 'shared_epoch' in getattr(data.DataInfo, '__dataclass_fields__', {})
    rows = [
        Seam(data, 'filter_no_caption_or_no_image', constant(data_events.filter_no_caption_or_no_image),
             'it drops a sample without caption or image uncounted: counted, and a blank caption dropped too',
             ('sample',)),
        Seam(data, 'log_and_continue', constant(data_events.log_and_continue),
             'its handler of a sample or shard that fails only logs it: counted and named', ('exn',)),
        Seam(data, 'tarfile_to_samples_nothrow', constant(data_events.tarfile_to_samples_nothrow),
             'it passes over an empty or unreadable shard uncounted and keeps no sample\'s place in its shard: '
             'both counted and kept', ('src', 'handler')),
        Seam(data, 'wds', lambda wds: standing_in(data_stages.CountingWebdataset(seeded), wds),
             'webdataset seeds its shuffle from the clock and no stage counts what is trained: a seeded shuffle, '
             'counting stages, a worker\'s passes batched as one stream',
             holds=lambda wds: wds is webdataset, what='the webdataset module'),
        Seam(data, 'get_wds_dataset', wrapping(get_wds_dataset),
             'its shuffles get no seed: the run\'s seed, rank and epoch handed to them (a resume replays the '
             'order); with data_backend device, training batches decoded on the device',
             ('args', 'preprocess_img', 'is_train', 'epoch'), shared_epoch, 'a builder of DataInfo(shared_epoch=…)'),
        Seam(main, 'pt_load', constant(load_resume_checkpoint),
             'it reads the checkpoint it resumes from with torch.load as the environment sets it, and a damaged '
             'one ends the run: weights_only always, the newest intact epoch_K.pt instead',
             ('file_path', 'map_location')),
        Seam(main, 'get_latest_checkpoint', constant(latest_checkpoint),
             'it picks the last `*.pt` by name, a `tmp.pt` left by a cut save too: `epoch_latest.pt` or the newest '
             '`epoch_K.pt`', ('path', 'remote')),
        Seam(main, 'setup_logging', wrapping(_quiet_console),
             'its console shows the model\'s structure and every parameter: one line (the log file keeps them)',
             ('log_file', 'level', 'include_host')),
        Seam(main, 'train_one_epoch', wrapping(functools.partial(_epoch_wrapper, events_dir=events_dir)),
             'no hook around an epoch: the trainer reseeded, λ and loss logged, the data skipped reported',
             ('model', 'data', 'loss', 'epoch', 'optimizer', 'scaler', 'scheduler', 'dist_model', 'args')),
        Seam(main, 'torch', lambda module: standing_in(TorchForMain(module), module),
             'main saves checkpoints with torch.save straight to their names (a cut save leaves a truncated file) '
             'and gives a CPU model\'s DDP device_ids=[cpu], which DDP refuses, both through its own `torch`: a '
             'view of torch that saves whole and drops those device_ids',
             holds=lambda module: module is torch, what='torch'),
    ]
    if lambda_lr_scale is not None:
        noted = set()  # the differential parameters of the model main creates, for its optimizer
        rows += [
            Seam(main, 'create_model_and_transforms', wrapping(functools.partial(lambda_lr.model_creator, noted=noted)),
                 '(lambda_lr) the model\'s λ and sub-norm parameters noted for the optimizer',
                 ('model_name', 'pretrained')),
            Seam(main, 'optim',
                 lambda optim: standing_in(lambda_lr.OptimWithLambdaGroups(optim, noted, lambda_lr_scale), optim),
                 '(lambda_lr) its AdamW groups are by weight decay only: λ and the sub-norm in groups of their own',
                 holds=lambda optim: optim is torch.optim, what='torch.optim'),
            Seam(scheduler, 'assign_learning_rate', constant(lambda_lr.assign_learning_rate),
                 '(lambda_lr) it sets one lr on every group: each group\'s lr_scale kept', ('optimizer', 'new_lr')),
        ]
    return tuple(rows)


@contextlib.contextmanager
def _data_events_folder() -> Iterator[str]:
    """A temporary folder the data pipeline counts into (`diffzoo.train.data_events`), named to data-loader workers
    by the environment variable they inherit; after the run the variable is as it was and the folder is gone."""
    folder = tempfile.mkdtemp(prefix='diffzoo-data-')
    previous = os.environ.get(data_events.ENV)
    os.environ[data_events.ENV] = folder
    try:
        yield folder
    finally:
        if previous is None:
            os.environ.pop(data_events.ENV, None)
        else:
            os.environ[data_events.ENV] = previous
        shutil.rmtree(folder, ignore_errors=True)


def _logger_levels() -> Dict[str, int]:
    return {name: logger.level for name, logger in logging.root.manager.loggerDict.items()
            if isinstance(logger, logging.Logger)}


@contextlib.contextmanager
def _logging_restored() -> Iterator[None]:
    """After the run: the root logger's handlers that open_clip_train's set-up added closed and removed, its level
    and every logger's that set-up lowered back, torch's loggers made during the run at torch's levels."""
    handlers, level, levels = list(logging.root.handlers), logging.root.level, _logger_levels()
    try:
        yield
    finally:
        _quiet_torch_loggers()
        for name, logger_level in levels.items():
            logging.getLogger(name).setLevel(logger_level)
        for handler in [h for h in logging.root.handlers if h not in handlers]:
            logging.root.removeHandler(handler)
            handler.close()
        logging.root.setLevel(level)


@contextlib.contextmanager
def installed(lambda_lr_scale: Optional[float] = None, data_backend: str = 'open_clip') -> Iterator[None]:
    """open_clip_train with the table for one run, as it was afterwards; `lambda_lr_scale`: λ and the sub-norm
    train at this multiple of the schedule's lr (`diffzoo.train.lambda_lr`); `data_backend` 'device': images
    decoded and transformed in the training process, on its device (`diffzoo.train.device_data`)."""
    if data_backend not in DATA_BACKENDS:
        raise ValueError(f'data_backend {data_backend!r}: one of {", ".join(DATA_BACKENDS)}')
    with _data_events_folder() as events_dir, _logging_restored(), warnings.catch_warnings():
        warnings.filterwarnings('ignore', message='torch.distributed.nn.functional.all_gather is deprecated')
        with seam.patched(table(events_dir, lambda_lr_scale, data_backend), OpenClipChanged):
            yield
