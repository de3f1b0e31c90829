"""The interval both demos put around each accuracy: Wilson's score interval at CONFIDENCE, from scipy."""
from typing import Tuple

CONFIDENCE = 0.95  # of the interval around each accuracy in the demos' tables


def wilson(hits: int, n: int) -> Tuple[float, float]:
    """The Wilson score interval (CONFIDENCE) of hits out of n, in percent (Python floats: results.json holds them)."""
    from scipy.stats import binomtest  # scipy.stats takes seconds to import: not for a --help
    ci = binomtest(hits, n).proportion_ci(CONFIDENCE, method='wilson')
    return 100 * float(ci.low), 100 * float(ci.high)
