"""λ of differential attention, written once for every layer diffzoo builds or converts:

    λ = exp(λ_q1·λ_k1) − exp(λ_q2·λ_k2) + λ_init,    λ_q1, λ_k1, λ_q2, λ_k2 ∈ R^d, N(0, 0.1) at first

with d the q/k head width. λ_init is a constant in [0, 1) (DiffCLIP: 0.8 in every layer) or "depth",
λ_init(l) = 0.8 − 0.6·exp(−0.3·l) with l the 0-based block index (Differential Transformer, DiffCLIP*).
The dot products are taken in torch.promote_types(dtype, float32): fp32 for fp32, bf16 and fp16 vectors, fp64
for fp64 ones.
"""
import math
import numbers
from typing import Union

import torch

from .numerics import stats_dtype

LambdaInit = Union[float, str]
LAMBDA_INIT_FIX = ("pass a constant such as lambda_init=0.8 (DiffCLIP) or lambda_init='depth' "
                   "(0.8 − 0.6·exp(−0.3·l) in block l)")
LAMBDA_VECTORS = ('lambda_q1', 'lambda_k1', 'lambda_q2', 'lambda_k2')
# what a differential layer has that plain attention has not (attribute names): the λ vectors or timm's dual
# scalars, v2's W_λ and the sub-norm; `lambda_lr` trains them at their own rate and a converted layer starts them
# from its own initial values
LAMBDA_PARAMETERS = (*LAMBDA_VECTORS, 'lambda_a', 'lambda_b', 'lambda_proj', 'sub_norm')
# state-dict key endings one of which every differential layer holds: the λ vectors', timm's dual scalars', v2's W_λ
DIFFERENTIAL_KEYS = (LAMBDA_VECTORS[0], 'lambda_a', 'lambda_proj.weight')
LAMBDA_STD = 0.1  # the λ vectors' N(0, 0.1) at first (timm's and unilm's)


def resolve_lambda_init(lambda_init: LambdaInit, depth: int) -> float:
    """λ_init for block `depth` (0-based) under a policy: a number in [0, 1), or "depth".

    Anything else is refused: λ's reparameterisation and the sub-norm scale (1 − λ_init) need
    0 ≤ λ_init < 1 (at 1 every head outputs 0 and q/k/v get no gradient), and NaN or inf would reach
    the outputs. Bools are not numbers here.
    """
    if isinstance(lambda_init, str):
        if lambda_init != 'depth':
            raise ValueError(f"lambda_init={lambda_init!r}: expected a number in [0, 1) or 'depth'; {LAMBDA_INIT_FIX}")
        if isinstance(depth, bool) or not isinstance(depth, numbers.Integral) or depth < 0:
            raise ValueError(f"depth={depth!r}: lambda_init='depth' needs the block's 0-based index, an int >= 0; "
                             f'pass depth=i for block i')
        return 0.8 - 0.6 * math.exp(-0.3 * depth)
    if isinstance(lambda_init, bool) or not isinstance(lambda_init, numbers.Real) or not 0 <= lambda_init < 1:
        raise ValueError(
            f"lambda_init={lambda_init!r}: expected a number in [0, 1) or 'depth' (λ's reparameterisation and the "
            f'(1 − λ_init) sub-norm scale need 0 ≤ λ_init < 1; at 1 every head outputs 0); {LAMBDA_INIT_FIX}')
    return float(lambda_init)


def reparameterized_lambda(lambda_q1: torch.Tensor, lambda_k1: torch.Tensor, lambda_q2: torch.Tensor,
                           lambda_k2: torch.Tensor, lambda_init: float) -> torch.Tensor:
    """λ = exp(λ_q1·λ_k1) − exp(λ_q2·λ_k2) + λ_init over the last dimension, in fp32 (fp64 for fp64)."""
    dtype = stats_dtype(lambda_q1.dtype)
    lambda_1 = torch.exp(torch.sum(lambda_q1.to(dtype) * lambda_k1.to(dtype), dim=-1))
    lambda_2 = torch.exp(torch.sum(lambda_q2.to(dtype) * lambda_k2.to(dtype), dim=-1))
    return lambda_1 - lambda_2 + lambda_init
