"""A seeded sample shuffle for open_clip_train's webdataset pipeline.

open_clip_train shuffles samples with `wds.shuffle(bufsize, initial)`, whose generator webdataset
seeds from the process id and the clock, so two runs with the same `--seed` train on different
batches. `SeededShuffle` is the same buffer shuffle with a generator seeded from

    the data-loader worker's seed (torch gives worker i base_seed + i, base_seed drawn from the
    trainer's RNG, which open_clip_train seeds with --seed and the rank), or torch.initial_seed()
    without workers, and the number of passes this stage has made (one per epoch),

so runs with the same seed, data, world size and worker count see the same batches, and every
epoch, worker and rank shuffles differently.
"""
import random

import torch
import webdataset as wds
from webdataset.filters import _shuffle


class SeededShuffle(wds.PipelineStage):
    def __init__(self, bufsize: int = 1000, initial: int = 100, rng=None, handler=None):
        self.bufsize, self.initial, self.rng, self.handler = bufsize, initial, rng, handler
        self.passes = 0

    def run(self, src):
        rng = self.rng
        if rng is None:
            info = torch.utils.data.get_worker_info()
            seed = info.seed if info is not None else torch.initial_seed()
            rng = random.Random(f'{seed}/{self.passes}')
        self.passes += 1
        return _shuffle(src, self.bufsize, self.initial, rng, self.handler)


class WebdatasetSeededShuffle:
    """The webdataset module as open_clip_train.data sees it: the same, but `shuffle` is seeded."""

    shuffle = SeededShuffle

    def __init__(self, module):
        self._module = module

    def __getattr__(self, name):
        return getattr(self._module, name)
