from .diff_attention import (
    VARIANTS,
    DifferentialAttention,
    diff_attn_layer,
    set_split_kernel,
)
from .lambdas import resolve_lambda_init
from .maps import capture_attention_maps
