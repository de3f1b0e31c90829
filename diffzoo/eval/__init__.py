"""Evaluation of open_clip models, diffzoo's and any other (`python -m diffzoo.eval`): CLIP_benchmark's tasks
in-process (`benchmark`), few-shot episodes (`fewshot`), MMVP-VLM (`mmvp`), the synthetic corpus (`synthetic`)."""
