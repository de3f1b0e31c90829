"""Every place `python -m diffzoo.train` reaches into open_clip_train, in one module.

Installed by `installed()` for the duration of one `open_clip_train.main.main` call, in the
training process only (`import diffzoo` alone changes nothing in open_clip_train):

- `torch.nn.parallel.DistributedDataParallel` as open_clip_train.main sees it: open_clip wraps the
  model with `device_ids=[device]`, which DDP refuses for a CPU module; the CPU case drops them
  (gloo on CPU then works, e.g. `torchrun --nproc_per_node 2` on a laptop).
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
- `open_clip_train.main.torch`: the same torch, but its `save` (checkpoints only, in that module) writes a
  file whole or not at all, checking the disk's free space first (`diffzoo.train.saving`).
- with a recipe's `lambda_lr`: `open_clip_train.main.create_model_and_transforms` and `.optim` and
  `open_clip_train.scheduler.assign_learning_rate`, so λ and the sub-norm train in their own AdamW groups
  at lambda_lr under the same schedule (`diffzoo.train.lambda_lr`).
- `open_clip_train.main.setup_logging`: its console handler shows one line where open_clip_train logs the
  model's structure and every parameter (they stay in RUN_DIR/out.log).
- torch's loggers, which open_clip_train's logging set-up lowers to INFO, get their levels back; the
  root logger's handlers that its set-up adds (console, RUN_DIR/out.log) are closed and removed after
  the run, so a second run in the same process (`diffzoo.train.launch.main(argv)` from Python) logs
  to its own out.log only.
"""
import contextlib
import logging
import os
import shutil
import tempfile
import warnings
from typing import Optional

import open_clip_train.data
import open_clip_train.main
import open_clip_train.scheduler
import torch
from torch.nn.parallel import DistributedDataParallel

from diffzoo.clip.seams import expect_function
from . import data_events, data_report, data_stages, device_data, lambda_lr
from .metrics import LambdaLog, drop_records_after
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
        try:
            original(model, data, loss, epoch, optimizer, scaler, log.wrap_scheduler(scheduler), dist_model,
                     args, tb_writer=tb_writer)
        finally:
            hook.remove()
        log.end_epoch()
        data_report.report_epoch(events_dir, epoch, args, run_dir)
    return train_one_epoch


@contextlib.contextmanager
def installed(lambda_lr_scale: Optional[float] = None, data_backend: str = 'open_clip'):
    """Patch open_clip_train for one run and restore it afterwards; `lambda_lr_scale`: λ and the sub-norm
    train at this multiple of the schedule's lr (`diffzoo.train.lambda_lr`); `data_backend` 'device': images
    decoded and transformed in the training process, on its device (`diffzoo.train.device_data`)."""
    if data_backend not in DATA_BACKENDS:
        raise ValueError(f'data_backend {data_backend!r}: one of {", ".join(DATA_BACKENDS)}')
    data_mod, main_mod, scheduler_mod = open_clip_train.data, open_clip_train.main, open_clip_train.scheduler
    originals = {
        (data_mod, 'filter_no_caption_or_no_image'): expect_function(data_mod, 'filter_no_caption_or_no_image',
                                                                     ('sample',)),
        (data_mod, 'log_and_continue'): expect_function(data_mod, 'log_and_continue', ('exn',)),
        (data_mod, 'tarfile_to_samples_nothrow'): expect_function(data_mod, 'tarfile_to_samples_nothrow',
                                                                  ('src', 'handler')),
        (data_mod, 'get_wds_dataset'): expect_function(data_mod, 'get_wds_dataset',
                                                       ('args', 'preprocess_img', 'is_train', 'epoch')),
        (main_mod, 'pt_load'): expect_function(main_mod, 'pt_load', ('file_path', 'map_location')),
        (main_mod, 'get_latest_checkpoint'): expect_function(main_mod, 'get_latest_checkpoint', ('path', 'remote')),
        (main_mod, 'setup_logging'): expect_function(main_mod, 'setup_logging', ('log_file', 'level', 'include_host')),
        (main_mod, 'train_one_epoch'): expect_function(
            main_mod, 'train_one_epoch',
            ('model', 'data', 'loss', 'epoch', 'optimizer', 'scaler', 'scheduler', 'dist_model', 'args')),
    }
    if lambda_lr_scale is not None:
        originals[(scheduler_mod, 'assign_learning_rate')] = expect_function(
            scheduler_mod, 'assign_learning_rate', ('optimizer', 'new_lr'))
        originals[(main_mod, 'create_model_and_transforms')] = expect_function(
            main_mod, 'create_model_and_transforms', ('model_name', 'pretrained'))
    main_optim = main_mod.optim
    if not callable(getattr(getattr(data_mod, 'wds', None), 'shuffle', None)):
        raise RuntimeError('open_clip_train.data no longer uses webdataset as `wds` with a `shuffle` stage; '
                           'diffzoo.train.seams needs updating for this open_clip_train version')
    main_torch = getattr(main_mod, 'torch', None)
    if not (main_torch is torch or isinstance(main_torch, TorchForCheckpoints)):  # (the latter: installed twice)
        raise RuntimeError('open_clip_train.main no longer imports torch as `torch` (its checkpoints are saved '
                           'through torch.save there); diffzoo.train.seams needs updating for this version')
    if 'shared_epoch' not in getattr(data_mod.DataInfo, '__dataclass_fields__', {}):
        raise RuntimeError('open_clip_train.data.DataInfo no longer carries `shared_epoch`; '
                           'diffzoo.train.seams needs updating for this open_clip_train version')
    webdataset_module = data_mod.wds
    parallel = main_mod.torch.nn.parallel
    ddp = parallel.DistributedDataParallel
    events_dir = tempfile.mkdtemp(prefix='diffzoo-data-')
    warnings.filterwarnings('ignore', message='torch.distributed.nn.functional.all_gather is deprecated')
    previous_env = os.environ.get(data_events.ENV)
    os.environ[data_events.ENV] = events_dir  # data-loader workers inherit it
    root_handlers, root_level = list(logging.root.handlers), logging.root.level
    try:
        data_mod.filter_no_caption_or_no_image = data_events.filter_no_caption_or_no_image
        data_mod.log_and_continue = data_events.log_and_continue
        data_mod.tarfile_to_samples_nothrow = data_events.tarfile_to_samples_nothrow
        seeded = WebdatasetSeededShuffle(webdataset_module)
        data_mod.wds = data_stages.CountingWebdataset(seeded)
        data_mod.get_wds_dataset = seeded.bind(originals[(data_mod, 'get_wds_dataset')])
        if data_backend == 'device':
            data_mod.get_wds_dataset = device_data.wds_dataset_on_device(data_mod.get_wds_dataset, data_mod)
        main_mod.pt_load = load_resume_checkpoint
        main_mod.get_latest_checkpoint = latest_checkpoint
        main_mod.setup_logging = _quiet_console(originals[(main_mod, 'setup_logging')])
        main_mod.train_one_epoch = _epoch_wrapper(originals[(main_mod, 'train_one_epoch')], events_dir)
        parallel.DistributedDataParallel = CpuAwareDistributedDataParallel
        main_mod.torch = TorchForCheckpoints(torch)
        if lambda_lr_scale is not None:
            noted = set()
            main_mod.create_model_and_transforms = lambda_lr.model_creator(
                originals[(main_mod, 'create_model_and_transforms')], noted)
            main_mod.optim = lambda_lr.OptimWithLambdaGroups(main_optim, noted, lambda_lr_scale)
            scheduler_mod.assign_learning_rate = lambda_lr.assign_learning_rate
        yield
    finally:
        for (module, name), fn in originals.items():
            setattr(module, name, fn)
        parallel.DistributedDataParallel = ddp
        main_mod.torch = main_torch
        main_mod.optim = main_optim
        data_mod.wds = webdataset_module
        if previous_env is None:
            os.environ.pop(data_events.ENV, None)
        else:
            os.environ[data_events.ENV] = previous_env
        shutil.rmtree(events_dir, ignore_errors=True)
        _quiet_torch_loggers()
        for handler in [h for h in logging.root.handlers if h not in root_handlers]:
            logging.root.removeHandler(handler)
            handler.close()
        logging.root.setLevel(root_level)
