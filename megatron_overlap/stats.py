"""The benchmarks' one statistic beyond the median: its 95% bootstrap interval."""

from __future__ import annotations

import functools
import warnings


def bootstrap_ci(samples, resamples: int = 20000) -> tuple[float, float]:
    """95% bootstrap interval of the median of `samples` (scipy.stats.bootstrap,
    percentile method, fixed seed).

    Fewer than three samples have no interval: (min, max). Without scipy (the `bench`
    extra) the same (min, max), after one warning."""
    samples = list(samples)
    if not samples:
        raise ValueError("bootstrap_ci needs at least one sample")
    if len(samples) < 3:
        return min(samples), max(samples)
    try:
        import numpy as np
        from scipy.stats import bootstrap
    except ImportError:
        _warn_no_scipy()
        return min(samples), max(samples)
    res = bootstrap((np.asarray(samples),), np.median, n_resamples=resamples,
                    confidence_level=0.95, method="percentile", random_state=0)
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


@functools.lru_cache(maxsize=1)
def _warn_no_scipy() -> None:
    warnings.warn("scipy is not installed (pip install 'megatron-overlap[bench]'): the 95% "
                  "intervals are the samples' (min, max)")
