"""The VLM trainer, `python -m diffzoo.train.vlm` (`cli`): one run (`run`: its inputs checked, its setup decided
once, then the run) of LoRA fine-tuning on VQAv2 (`finetune`) or of a LLaVA-style stage (`stage`), on transformers'
Trainer with diffzoo's additions (`trainer`); its checkpoints, reruns and failed writes (`resume`)."""
from .cli import main

__all__ = ['main']
