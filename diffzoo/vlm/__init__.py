"""Vision-language models with differential decoders (Differential PaliGemma) and their benchmarks.

    differentialize(model, variant, lambda_init, layers, mlp)   transformers decoders made differential
    load_differential(path)                                      a saved differential model, reloaded
    build_vlm(vision, language_model, integration)               PaliGemma-style model, prefix-LM mask; eRAM-V
    add_lora / save_adapter / load_adapter                       LoRA on the decoder, λ and sub-norm trained
    vqa_accuracy(prediction, answers)                            the official VQAv2 accuracy
"""
from .differential import differential_parameters, differentialize, load_differential
from .lora import add_lora, load_adapter, save_adapter, trainable_parameters
from .model import VisionLanguageModel, build_vlm
from .vqa import normalize_answer, vqa_accuracy

__all__ = ['differentialize', 'differential_parameters', 'load_differential', 'build_vlm', 'VisionLanguageModel',
           'add_lora', 'save_adapter', 'load_adapter', 'trainable_parameters', 'vqa_accuracy', 'normalize_answer']
