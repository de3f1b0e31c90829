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
    training_plan(recipe) / apply_plan(model, plan)              what a run trains, decided once and applied once
    model_parts(model)                                           the decoder model, tower and projector of any VLM

Fine-tuning: `python -m diffzoo.train.vlm`; VQA accuracy and MMNeedle: `diffzoo.eval.vqa`, `diffzoo.eval.needle`.
"""
from diffzoo._lazy import lazy_exports

_LAZY = {  # name → submodule; imported on first use (PEP 562), so `diffzoo.vlm.recipe` and `.options`
    # load without torch or transformers (a command's --help)
    'differential_parameters': 'parts', 'differentialize': 'differential', 'load_differential': 'differential',
    'VLM': 'factory', 'load_vlm': 'factory',
    'add_lora': 'lora', 'load_adapter': 'lora', 'save_adapter': 'lora', 'trainable_parameters': 'parts',
    'VisionLanguageModel': 'model', 'build_vlm': 'model', 'model_parts': 'parts',
    'TrainingPlan': 'plan', 'apply_plan': 'plan', 'training_plan': 'plan',
}
__all__ = sorted(_LAZY)
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
