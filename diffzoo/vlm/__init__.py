"""Vision-language models with differential decoders (Differential PaliGemma) and their benchmarks.

    differentialize(model, variant, lambda_init, layers, mlp)   transformers decoders made differential
    load_differential(path)                                      a saved differential model, reloaded
"""
from .differential import differential_parameters, differentialize, load_differential

__all__ = ['differentialize', 'differential_parameters', 'load_differential']
