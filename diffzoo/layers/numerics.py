"""The dtype that differential attention's softmax, λ and norm statistics are computed in, and autocast
switched off around the code that sets its dtypes itself."""
import contextlib

import torch


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for fp32/bf16/fp16, fp64 for fp64: promoted, never rounded down."""
    return torch.promote_types(dtype, torch.float32)


def autocast_off(device_type: str):
    """autocast disabled for `device_type`; nothing to disable where autocast does not exist (the meta
    device, on which models are built and run for shapes and FLOP counts)."""
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()
