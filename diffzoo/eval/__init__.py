"""Evaluation of open_clip models, diffzoo's and any other: the synthetic corpus (`synthetic`)."""
