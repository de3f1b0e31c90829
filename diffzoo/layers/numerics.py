"""The dtype that differential attention's softmax, λ and norm statistics are computed in."""
import torch


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for fp32/bf16/fp16, fp64 for fp64: promoted, never rounded down."""
    return torch.promote_types(dtype, torch.float32)
