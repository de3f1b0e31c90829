"""The VLM trainer, `python -m diffzoo.train.vlm` (`cli`): LoRA fine-tuning of a VLM on VQAv2 (`trainer`) or one
LLaVA-style stage (`stage`) on transformers' Trainer; a run's inputs checked before it starts (`inputs`), its
checkpoints, rerun and failed writes (`resume`)."""
from .cli import main

__all__ = ['main']
