import os

import pytest
import torch

os.environ.setdefault('NO_ALBUMENTATIONS_UPDATE', '1')  # img2dataset's albumentations checks PyPI on import
os.environ.setdefault('HF_HUB_OFFLINE', '1')
if not torch.cuda.is_available():  # the Triton kernels run under Triton's interpreter (read at import)
    os.environ.setdefault('TRITON_INTERPRET', '1')

import diffzoo  # noqa: E402,F401  registers the timm and open_clip models


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
