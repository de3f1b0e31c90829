"""Fused kernels for differential attention (`DifferentialAttention(split_kernel=...)`).

    dispatch      the layer's attention kernels and the choice among them at run time (fx leaves)
    sub_norm      A1V − λ·A2V, sub-norm and output projection over SDPA's outputs: one autograd op
    triton_op     the split variant as one Triton kernel behind a custom op (`split_kernel="triton"`)
    split_triton  its launchers; tl_common, fwd, bwd the Triton kernels themselves
"""
from .dispatch import (SPLIT_KERNELS, add_mask, auto_split_kernel, duplicate_attention, explicit_output,
                       split_attention, split_parts, v2_attention)
from .sub_norm import sub_normed_difference
from .triton_op import HAS_TRITON, INTERPRETED, key_padding_bias, split_diff_attention, unsupported
