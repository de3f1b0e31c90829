"""Every place diffzoo reaches into CLIP_benchmark, in one module. `install()` is idempotent.

- `clip_benchmark.metrics.zeroshot_classification.accuracy` and the linear probe's reference to it:
  CLIP_benchmark 1.6.2 turns a (1,) array into a float, which NumPy 2 refuses ("only
  0-dimensional arrays can be converted to Python scalars"); the replacement computes the same
  top-k accuracies with `.item()`. Checked before it is replaced, so a changed CLIP_benchmark fails
  here by name. Installed on import of `diffzoo.eval.benchmark` and by `python -m diffzoo.clip_benchmark`.
"""
import functools
import inspect

import clip_benchmark
import clip_benchmark.metrics.linear_probe as linear_probe
import clip_benchmark.metrics.zeroshot_classification as zeroshot_classification

TESTED_CLIP_BENCHMARK = '1.6.x'
_REPLACED = '__diffzoo_original__'


class ClipBenchmarkChanged(RuntimeError):
    pass


def accuracy(output, target, topk=(1,)):
    """Top-k accuracies (fractions) of logits `output` (N, C) for labels `target` (N,), as CLIP_benchmark's."""
    pred = output.topk(max(topk), 1, True, True)[1].t()  # (k, N)
    correct = pred.eq(target.view(1, -1).expand_as(pred))
    return [correct[:k].reshape(-1).float().sum().item() / len(target) for k in topk]


def install() -> None:
    original = getattr(zeroshot_classification.accuracy, _REPLACED, zeroshot_classification.accuracy)
    params = list(inspect.signature(original).parameters)
    if params[:3] != ['output', 'target', 'topk']:
        raise ClipBenchmarkChanged(
            f'CLIP_benchmark {getattr(clip_benchmark, "__version__", "?")}: zeroshot_classification.accuracy'
            f'{tuple(params)} no longer takes (output, target, topk); diffzoo is tested with clip-benchmark '
            f'{TESTED_CLIP_BENCHMARK}')
    replacement = functools.wraps(original)(accuracy)
    setattr(replacement, _REPLACED, original)
    zeroshot_classification.accuracy = linear_probe.accuracy = replacement
