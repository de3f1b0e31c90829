"""Few-shot classification on frozen image features, in N-way K-shot episodes.

DiffCLIP (Hammoud & Ghanem, TMLR 2025) reports few-shot accuracy next to linear probing on nine
datasets (Table 1: Caltech-101, DTD, Pets, Flowers, SUN397, Aircraft, CIFAR-10/100, Food-101).
Its Table 1 shows the numbers, not the episode settings, so this is the standard episodic protocol
on frozen features, every setting a flag:

- features: the image encoder's output, L2-normalised, computed once per dataset split;
- episode e (e = 0 … episodes-1, drawn from a generator seeded with (seed, e)): `way` classes
  chosen uniformly among those with at least shot + query images, then `shot` support and
  `query` query images of each, without replacement and disjoint;
- classifier: multinomial logistic regression (scikit-learn, L-BFGS, C = 1) fitted on the
  support features, or `prototype` — nearest class mean by cosine similarity (Snell et al., 2017);
- metric: query accuracy averaged over episodes, with its 95 % confidence half-width
  (1.96 · std / √episodes), in percent. Defaults: 5-way 5-shot, 15 queries, 600 episodes, seed 0.

When a dataset has fewer eligible classes than `way` (the synthetic corpus has 3 shapes) the
episode uses all of them and the metric name says so (`3way_5shot_acc`).
"""
from typing import Dict, Iterator, Tuple

import numpy as np
import torch

from .options import EvalError, FewShotConfig

Episode = Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # support idx, support y, query idx, query y


def eligible_classes(labels: np.ndarray, config: FewShotConfig) -> np.ndarray:
    classes, counts = np.unique(labels, return_counts=True)
    eligible = classes[counts >= config.shot + config.query]
    if len(eligible) < 2:
        raise EvalError(f'few-shot: only {len(eligible)} class(es) have {config.shot} + {config.query} images '
                        f'(shot + query); pass a smaller --fewshot-shot/--fewshot-query or a larger dataset')
    return eligible


def episodes(labels: np.ndarray, config: FewShotConfig) -> Iterator[Episode]:
    """The episodes of the protocol; labels inside an episode are 0 … way-1 in the order classes were drawn."""
    eligible = eligible_classes(labels, config)
    way = min(config.way, len(eligible))
    by_class = {c: np.flatnonzero(labels == c) for c in eligible}
    for e in range(config.episodes):
        rng = np.random.default_rng([config.seed, e])
        chosen = rng.choice(eligible, size=way, replace=False)
        support, query = [], []
        for c in chosen:
            picked = rng.choice(by_class[c], size=config.shot + config.query, replace=False)
            support.append(picked[:config.shot])
            query.append(picked[config.shot:])
        yield (np.concatenate(support), np.repeat(np.arange(way), config.shot),
               np.concatenate(query), np.repeat(np.arange(way), config.query))


def predict(support: np.ndarray, support_y: np.ndarray, query: np.ndarray, classifier: str) -> np.ndarray:
    """Labels of the query features (Q, D) from the support features (S, D), all L2-normalised."""
    if classifier == 'prototype':
        way = int(support_y.max()) + 1
        prototypes = np.stack([support[support_y == c].mean(0) for c in range(way)])  # (way, D)
        prototypes /= np.linalg.norm(prototypes, axis=1, keepdims=True).clip(min=1e-12)
        return (query @ prototypes.T).argmax(1)
    from sklearn.linear_model import LogisticRegression
    return LogisticRegression(C=1.0, max_iter=1000).fit(support, support_y).predict(query)


def evaluate(features: torch.Tensor, labels: torch.Tensor, config: FewShotConfig = FewShotConfig(),
             progress=None) -> Dict[str, float]:
    """Mean query accuracy over the episodes and its 95 % half-width, both in percent."""
    features = torch.nn.functional.normalize(features.float(), dim=-1).numpy()
    labels = np.asarray(labels)
    way = min(config.way, len(eligible_classes(labels, config)))
    accuracies = []
    for i, (s, sy, q, qy) in enumerate(episodes(labels, config)):
        accuracies.append(100.0 * float((predict(features[s], sy, features[q], config.classifier) == qy).mean()))
        if progress and config.episodes >= 100 and (i + 1) % (config.episodes // 4) == 0:
            progress(f'    few-shot episodes {i + 1}/{config.episodes}')
    accuracies = np.array(accuracies)
    name = f'{way}way_{config.shot}shot'
    return {f'{name}_acc': float(accuracies.mean()),
            f'{name}_ci95': float(1.96 * accuracies.std() / np.sqrt(len(accuracies)))}
