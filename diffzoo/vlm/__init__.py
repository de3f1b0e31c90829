"""Vision-language models with differential decoders (Differential PaliGemma) and their benchmarks.

    differentialize(model, variant, lambda_init, layers, mlp)   transformers decoders made differential
    load_differential(path)                                      a saved differential model, reloaded
    build_vlm(vision, language_model)                            PaliGemma-style model, prefix-LM mask
"""
from .differential import differential_parameters, differentialize, load_differential
from .model import VisionLanguageModel, build_vlm

__all__ = ['differentialize', 'differential_parameters', 'load_differential', 'build_vlm', 'VisionLanguageModel']
