"""Vision-language models with differential decoders (Differential PaliGemma) and eRAM-V.

    load_vlm(spec, adapter, differential)                        every VLM (PaliGemma checkpoint or build_vlm)
                                                                 with its preprocessing and generation
    differentialize(model, variant, lambda_init, layers, mlp,   transformers decoders made differential
                    head_pairing)                                (split: DiffLlama's 'halves' or 'adjacent')
    load_differential(path)                                      a saved differential model, reloaded (or any
                                                                 transformers Auto class after import diffzoo)
    diffllama.to_diffllama / from_diffllama                      to and from transformers' DiffLlama
    build_vlm(vision, language_model, integration,               PaliGemma-style model, prefix-LM mask; eRAM-V
              select_layer, projector, …)                        (penultimate block, LLaVA-1.5's MLP projector)
    add_lora / save_adapter / load_adapter                       LoRA on the decoder, λ and sub-norm trained

Fine-tuning: `python -m diffzoo.train.vlm`; VQA accuracy and MMNeedle: `diffzoo.eval.vqa`, `diffzoo.eval.needle`.
"""
from .differential import differential_parameters, differentialize, load_differential
from .factory import VLM, load_vlm
from .lora import add_lora, load_adapter, save_adapter, trainable_parameters
from .model import VisionLanguageModel, build_vlm

__all__ = ['load_vlm', 'VLM', 'differentialize', 'differential_parameters', 'load_differential', 'build_vlm',
           'VisionLanguageModel', 'add_lora', 'save_adapter', 'load_adapter', 'trainable_parameters']
