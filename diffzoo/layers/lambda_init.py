"""λ_init policies: a constant in [0, 1) (DiffCLIP: 0.8 in every layer) or "depth",
λ_init(l) = 0.8 − 0.6·exp(−0.3·l) with l the 0-based block index (Differential Transformer, DiffCLIP*)."""
import math
import numbers
from typing import Union

LambdaInit = Union[float, str]
LAMBDA_INIT_FIX = ("pass a constant such as lambda_init=0.8 (DiffCLIP) or lambda_init='depth' "
                   "(0.8 − 0.6·exp(−0.3·l) in block l)")


def resolve_lambda_init(lambda_init: LambdaInit, depth: int) -> float:
    """λ_init for block `depth` (0-based) under a policy: a number in [0, 1), or "depth".

    Anything else is refused: λ = exp(λ_q1·λ_k1) − exp(λ_q2·λ_k2) + λ_init and the sub-norm scale
    (1 − λ_init) need 0 ≤ λ_init < 1 (at 1 every head outputs 0 and q/k/v get no gradient), and
    NaN or inf would reach the outputs. Bools are not numbers here.
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
