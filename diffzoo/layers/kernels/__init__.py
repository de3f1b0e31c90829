"""Fused kernels for differential attention (`DifferentialAttention(split_kernel=...)`).

    dispatch      the layer's attention kernels and the choice among them at run time (fx leaves)
    sub_norm      A1V − λ·A2V, sub-norm and output projection over SDPA's outputs: one autograd op
    triton_op     the split variant as one Triton kernel behind a custom op (`split_kernel="triton"`)
    split_triton  its launchers; tl_common, fwd, bwd the Triton kernels themselves

Fused split attention: q/k heads are d = C/2h wide and v heads 2d, and SDPA's flash kernels need
one width, so `split_kernel` chooses how the two maps are computed (all exact; `auto` is chosen at
run time from the device, dtype and token count, `kernels.auto_split_kernel`: on CUDA the Triton kernel
where its GPU tests pass (`kernels.TRITON_ON_CUDA`: bf16 to 4096 tokens, fp16 to 577), else two_calls
(cuDNN takes the unequal widths); four_calls on CPU, which keeps the flash kernel without copying q, k
or v where two_calls / one_call fall back to the math kernel and hold the N×N matrices):

    two_calls    SDPA(Q1, K1, V) and SDPA(Q2, K2, V): cuDNN / memory-efficient kernels (unequal widths)
    one_call     one SDPA over the 2h query heads, V repeated for each pair: same kernels, one launch
    padded       one SDPA over 2h heads with Q, K zero-padded to 2d (Q·K unchanged, scale 1/√d):
                 equal widths, so flash kernels (CUDA and CPU) apply; the padded copies are saved
    four_calls   SDPA(Qm, Km, V[:d]) and SDPA(Qm, Km, V[d:]) for m = 1, 2: four flash-eligible calls
                 of width d on views of the qkv projection (Q·K computed twice, nothing copied); with
                 attention dropout in training it runs as padded, so each map has one dropout mask
    triton       one Triton kernel (`triton_op`): both maps over one pass of K/V,
                 P1 − λ·P2 formed before a single P·V product, the sub-norm in its epilogue and a
                 FlashAttention-2-style backward; it takes is_causal and key-padding masks in bf16,
                 fp16 or fp32. Calls it cannot take (attention dropout, other masks, no Triton, a
                 CPU tensor outside Triton's interpreter) run `sdpa_split_kernel`'s, with a warning
                 naming the reason when it was asked for by name. `auto` on CUDA where its GPU
                 tests pass; in fp16 beyond 577 tokens its λ gradient does not yet
                 (docs/performance.md).
"""
from .dispatch import (SPLIT_KERNELS, TRITON_ON_CUDA, add_mask, auto_split_kernel, duplicate_attention,
                       explicit_output, sdpa_split_kernel, split_attention, split_parts, v2_attention)
from .sub_norm import sub_normed_difference
from .triton_op import HAS_TRITON, INTERPRETED, key_padding_bias, split_diff_attention, unsupported
