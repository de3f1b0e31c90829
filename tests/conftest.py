import gc
import os
import shutil
import tempfile
from pathlib import Path
from typing import Dict, NamedTuple

import pytest

# pytest-xdist (make test runs -n auto): the cores shared out between the workers, each torch and OpenMP
# pool sized to its share (pools of every core in every worker spin against each other: no faster than serial)
if os.environ.get('PYTEST_XDIST_WORKER_COUNT'):
    _THREADS = max(1, (os.cpu_count() or 1) // int(os.environ['PYTEST_XDIST_WORKER_COUNT']))
    os.environ.setdefault('OMP_NUM_THREADS', str(_THREADS))
os.environ.setdefault('NO_ALBUMENTATIONS_UPDATE', '1')  # img2dataset's albumentations checks PyPI on import
os.environ.setdefault('HF_HUB_OFFLINE', '1')

# torch, diffzoo and the fixtures' helpers are imported where tests run (pytest_configure, the fixtures), not in
# pytest-xdist's controller, which runs none: its start is the only time a single core works while the other
# waits, and these imports took about 6 s of it


def _runs_no_tests(config) -> bool:
    """pytest-xdist's controller: it hands the tests out to its workers."""
    return config.getoption('dist', default='no') != 'no' and not hasattr(config, 'workerinput')


def pytest_configure(config):
    if _runs_no_tests(config):
        return
    gc.disable()  # until the tests are collected (pytest_collection_finish), as diffzoo's commands import theirs
    import torch
    if os.environ.get('PYTEST_XDIST_WORKER_COUNT'):
        torch.set_num_threads(_THREADS)
    if not torch.cuda.is_available():  # the Triton kernels run under Triton's interpreter (read at import)
        os.environ.setdefault('TRITON_INTERPRET', '1')
    import diffzoo  # noqa: F401  registers the timm and open_clip models


# the suite's files at their peak (checkpoints, shards, runs of the tests running at once), measured on a full
# run with passed tests' folders removed as they end: 2.2 GB; a disk with less than this left fails mid-run
# as a hundred unrelated errors, so it is named before anything runs (a run of the whole suite, as make test's)
_DISK_NEEDED_GB = 4


def _temporary_files_under(base: Path) -> None:
    """The processes this one starts write their temporary files under `base`/tmp, which pytest prunes with its
    older runs, not into the system's: torchrun's torchelastic_* folders, wandb's tmp*wandb-media and
    tmp*wandb-artifacts, a killed training's diffzoo-data-* are never removed by the processes that made them.
    This process keeps the system's: what it makes there it removes at its exit, after pytest has removed `base`
    (multiprocessing's pymp-* folder). torch.compile's cache stays where torch keeps it by default, for every
    process: kept between runs, as it is for any user of torch."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    os.environ.setdefault('TORCHINDUCTOR_CACHE_DIR', default_cache_dir())
    tempfile.gettempdir()  # this process's own, read before TMPDIR changes
    tmp = base / 'tmp'
    tmp.mkdir(exist_ok=True)
    os.environ['TMPDIR'] = str(tmp)


def pytest_sessionstart(session):
    base = session.config._tmp_path_factory.getbasetemp()
    if not _runs_no_tests(session.config):  # the controller's workers each set their own
        _temporary_files_under(base)
    if hasattr(session.config, 'workerinput') or session.config.args:  # a worker (the controller checks), or a
        return                                                            # chosen file or test: not the whole suite
    free_gb = shutil.disk_usage(base).free / 1e9
    if free_gb < _DISK_NEEDED_GB:
        pytest.exit(f'{free_gb:.1f} GB free on the disk holding {base}; the suite needs about '
                    f'{_DISK_NEEDED_GB} GB there. Free some space, or point --basetemp at a disk that has it '
                    f'(the folder is emptied when the run starts)', returncode=1)


def pytest_collection_finish(session):
    """The objects alive once the tests are collected (the modules of torch, timm, open_clip, transformers, …: most
    of a worker's objects, alive until it ends) are left out of the garbage collector's full passes, which walk
    them all each time: 15.7 s of the 200 s of CPU two workers spent on tests/clip, tests/models and two VLM
    files, 9.4 s once frozen (gc.freeze, for objects that live as long as the process). The collector, off while
    they were imported, runs again for what the tests make."""
    gc.freeze()
    gc.enable()


def pytest_unconfigure(config):
    """Python's exit ends with a garbage collection over every object still alive: in a worker, seconds on two
    cores, which the controller waits for before it reports. Everything is done by now (results sent, files closed,
    atexit's cleanup still to come), so what is alive is frozen too and the exit frees it without that walk."""
    gc.freeze()


@pytest.fixture(autouse=True)
def _seed():
    import torch
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _pil_refuses_images_cut_short():
    """lmms_eval.api.task sets PIL's ImageFile.LOAD_TRUNCATED_IMAGES = True when it is imported (the harness's own
    setting, for the lmms-eval process): an image cut short then loads padded with grey, in every later test of the
    same process. Each test starts with PIL's default, as diffzoo's own processes (which import lmms_eval only as
    lmms-eval's plugin) run."""
    from PIL import ImageFile
    ImageFile.LOAD_TRUNCATED_IMAGES = False


@pytest.fixture(scope='session')
def language_model_dir(tmp_path_factory) -> Path:
    """tests.vlm.models' word-level Gemma (tokenizer + weights) saved once as a local checkpoint; read-only."""
    from tests.vlm.models import write_language_model
    directory = tmp_path_factory.mktemp('language_model') / 'lm'
    write_language_model(directory)
    return directory


@pytest.fixture(scope='session')
def paligemma_dir(tmp_path_factory) -> Path:
    """tests.vlm.models' tiny PaliGemma checkpoint with its processor, saved once; read-only."""
    from tests.vlm.models import write_paligemma
    directory = tmp_path_factory.mktemp('paligemma') / 'paligemma'
    write_paligemma(directory)
    return directory


class OfficialCheckpoint(NamedTuple):
    path: Path  # checkpoint_best.pt, as the official DiffCLIP repositories hold it
    state_dict: Dict[str, 'torch.Tensor']


@pytest.fixture(scope='session')
def official(tmp_path_factory) -> OfficialCheckpoint:
    """A random DiffCLIP ViT-B/16 checkpoint in the official format and its state dict; read-only."""
    from tests.clip import official_reference
    state_dict = official_reference.random_official_state_dict(seed=1)
    path = tmp_path_factory.mktemp('official') / 'checkpoint_best.pt'
    official_reference.save_official_checkpoint(path, state_dict)
    return OfficialCheckpoint(path, state_dict)


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """An offline Hugging Face cache that huggingface_hub reads in this process (HF_HUB_OFFLINE is set above):
    call it with (repo, files) to hold `files` (a folder or a file) as that repository's snapshot."""
    import huggingface_hub

    from tests.factory import hub_cache
    assert huggingface_hub.constants.HF_HUB_OFFLINE
    cache = tmp_path / 'hub'
    monkeypatch.setattr(huggingface_hub.constants, 'HF_HUB_CACHE', str(cache))
    return lambda repo, files: hub_cache(cache, repo, files)



# The files over ~7 s on the 2-core machine, longest first (their time in a `make test` run, summed over their
# tests): pytest-xdist's loadfile (with --no-loadscope-reorder, as `make test` runs it; by default it orders files
# by their number of tests) hands out whole files in this order, the next to the first worker that is nearly done,
# and a long file handed out last would run alone at the end while the other worker waits
LONGEST_FIRST = ('tests.test_demo', 'tests.train.test_train_sh', 'tests.layers.test_kernels', 'tests.train.test_launch',
                 'tests.train.test_end_to_end', 'tests.bench.test_bench', 'tests.models.test_vit_diff',
                 'tests.test_readme', 'tests.clip.test_tracing', 'tests.train.test_saving', 'tests.eval.test_lmms_eval',
                 'tests.clip.test_official_checkpoint', 'tests.vlm.test_train', 'tests.clip.test_models',
                 'tests.vlm.test_stages', 'tests.test_cli', 'tests.train.test_device_data', 'tests.vlm.test_fsdp',
                 'tests.train.test_resume', 'tests.bench.test_gpu_check', 'tests.vlm.test_hf_auto',
                 'tests.test_differential', 'tests.vlm.test_stage_reruns', 'tests.train.test_distributed',
                 'tests.vlm.test_differential', 'tests.eval.test_lmm_resume', 'tests.data.test_download',
                 'tests.eval.test_clip_benchmark', 'tests.vlm.test_eramv', 'tests.layers.test_diff_attention',
                 'tests.layers.test_tracing', 'tests.analysis.test_layers', 'tests.bench.test_tune')


def pytest_collection_modifyitems(items):
    """The longest files first, then the other files with slow tests, then the rest; each file's tests kept
    together and in order (module fixtures are built once)."""
    has_slow = {item.module.__name__ for item in items if item.get_closest_marker('slow')}
    order = {item.nodeid: i for i, item in enumerate(items)}

    def rank(item):
        name = item.module.__name__
        first = LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)
        return first, name not in has_slow, order[item.nodeid]
    items.sort(key=rank)


@pytest.fixture(scope='session')
def commands():
    """`python -m diffzoo.X …` for short commands, each a process forked after `import diffzoo` (tests/commands.py)."""
    from tests.commands import Commands
    server = Commands()
    yield server
    server.close()
