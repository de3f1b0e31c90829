from .diff_attention import (
    VARIANTS,
    DifferentialAttention,
    diff_attn_layer,
    resolve_lambda_init,
    set_split_kernel,
)
from .maps import capture_attention_maps
