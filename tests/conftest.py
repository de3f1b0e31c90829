import os
from pathlib import Path
from typing import Dict, NamedTuple

import pytest
import torch

os.environ.setdefault('NO_ALBUMENTATIONS_UPDATE', '1')  # img2dataset's albumentations checks PyPI on import
os.environ.setdefault('HF_HUB_OFFLINE', '1')
if not torch.cuda.is_available():  # the Triton kernels run under Triton's interpreter (read at import)
    os.environ.setdefault('TRITON_INTERPRET', '1')

import diffzoo  # noqa: E402,F401  registers the timm and open_clip models
from tests.clip import official_reference  # noqa: E402
from tests.factory import hub_cache  # noqa: E402
from tests.vlm.models import write_language_model, write_paligemma  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope='session')
def language_model_dir(tmp_path_factory) -> Path:
    """tests.vlm.models' word-level Gemma (tokenizer + weights) saved once as a local checkpoint; read-only."""
    directory = tmp_path_factory.mktemp('language_model') / 'lm'
    write_language_model(directory)
    return directory


@pytest.fixture(scope='session')
def paligemma_dir(tmp_path_factory) -> Path:
    """tests.vlm.models' tiny PaliGemma checkpoint with its processor, saved once; read-only."""
    directory = tmp_path_factory.mktemp('paligemma') / 'paligemma'
    write_paligemma(directory)
    return directory


class OfficialCheckpoint(NamedTuple):
    path: Path  # checkpoint_best.pt, as the official DiffCLIP repositories hold it
    state_dict: Dict[str, torch.Tensor]


@pytest.fixture(scope='session')
def official(tmp_path_factory) -> OfficialCheckpoint:
    """A random DiffCLIP ViT-B/16 checkpoint in the official format and its state dict; read-only."""
    state_dict = official_reference.random_official_state_dict(seed=1)
    path = tmp_path_factory.mktemp('official') / 'checkpoint_best.pt'
    official_reference.save_official_checkpoint(path, state_dict)
    return OfficialCheckpoint(path, state_dict)


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """An offline Hugging Face cache that huggingface_hub reads in this process (HF_HUB_OFFLINE is set above):
    call it with (repo, files) to hold `files` (a folder or a file) as that repository's snapshot."""
    import huggingface_hub
    assert huggingface_hub.constants.HF_HUB_OFFLINE
    cache = tmp_path / 'hub'
    monkeypatch.setattr(huggingface_hub.constants, 'HF_HUB_CACHE', str(cache))
    return lambda repo, files: hub_cache(cache, repo, files)
