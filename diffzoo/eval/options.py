"""What `python -m diffzoo.eval` can be asked: the task names, the few-shot settings and the error a bad
input raises. Nothing here imports torch, so the command's --help answers at once."""
from dataclasses import dataclass

SYNTHETIC = 'synthetic'
MMVP = 'mmvp'
TASKS = ('zeroshot_classification', 'zeroshot_retrieval', 'linear_probe', 'fewshot', 'mmvp')
CLASSIFIERS = ('logistic', 'prototype')


class EvalError(ValueError):
    """A bad evaluation input; the message names it and the fix."""


@dataclass(frozen=True)
class FewShotConfig:
    """The episodic protocol's settings (see `diffzoo.eval.fewshot`)."""
    way: int = 5
    shot: int = 5
    query: int = 15
    episodes: int = 600
    seed: int = 0
    classifier: str = 'logistic'

    def __post_init__(self):
        for name in ('way', 'shot', 'query', 'episodes'):
            if getattr(self, name) < 1:
                raise EvalError(f'--fewshot-{name} {getattr(self, name)}: must be at least 1')
        if self.way < 2:
            raise EvalError(f'--fewshot-way {self.way}: an episode needs at least 2 classes')
        if self.classifier not in CLASSIFIERS:
            raise EvalError(f'--fewshot-classifier {self.classifier!r}: choose one of {", ".join(CLASSIFIERS)}')
