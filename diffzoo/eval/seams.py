"""Every place diffzoo reaches into CLIP_benchmark, in one module: the table `SEAMS` (`diffzoo.seam`), applied for
the process by `install()` (idempotent) and undone by `uninstall()`.

- `clip_benchmark.metrics.zeroshot_classification.accuracy` and the linear probe's reference to it:
  CLIP_benchmark 1.6.2 turns a (1,) array into a float, which NumPy 2 refuses ("only
  0-dimensional arrays can be converted to Python scalars"); the replacement computes the same
  top-k accuracies with `.item()`. Checked before it is replaced, so a changed CLIP_benchmark fails
  here by name. Installed on import of `diffzoo.eval.benchmark` and by `python -m diffzoo.clip_benchmark`.
"""
import clip_benchmark
import clip_benchmark.metrics.linear_probe as linear_probe
import clip_benchmark.metrics.zeroshot_classification as zeroshot_classification

from diffzoo import seam
from diffzoo.seam import LibraryChanged, Seam

TESTED_CLIP_BENCHMARK = '1.6.x'


class ClipBenchmarkChanged(LibraryChanged):
    library = f'CLIP_benchmark {getattr(clip_benchmark, "__version__", "?")}'
    tested = f'clip-benchmark {TESTED_CLIP_BENCHMARK}'


def accuracy(output, target, topk=(1,)):
    """Top-k accuracies (fractions) of logits `output` (N, C) for labels `target` (N,), as CLIP_benchmark's."""
    pred = output.topk(max(topk), 1, True, True)[1].t()  # (k, N)
    correct = pred.eq(target.view(1, -1).expand_as(pred))
    return [correct[:k].reshape(-1).float().sum().item() / len(target) for k in topk]


_accuracy = seam.wrapping(lambda original: accuracy)
ACCURACY = ('output', 'target', 'topk')
SEAMS = (
    Seam(zeroshot_classification, 'accuracy', _accuracy, 'CLIP_benchmark turns a (1,) array into a float, which '
         'NumPy 2 refuses: the same top-k accuracies with `.item()`', ACCURACY),
    Seam(linear_probe, 'accuracy', _accuracy, 'the linear probe\'s own reference to that function', ACCURACY),
)


def install() -> None:
    """Apply `SEAMS` for the process (idempotent); a changed CLIP_benchmark fails here, by name."""
    seam.apply(SEAMS, ClipBenchmarkChanged, keep=True)


def uninstall() -> None:
    """CLIP_benchmark's own `accuracy` back."""
    seam.restore(SEAMS)
