"""Seed-paired gaps from scipy alone, the independent computation every interval the docs
state is checked against (``postnorm.analysis.paired`` computes them from the t quantiles)."""

import numpy as np
from scipy import stats


def scipy_gap(d: np.ndarray, margin: float, alpha: float = 0.05) -> tuple[float, float, float,
                                                                          str]:
    """The 95% t interval of the mean of the per-seed differences ``d``, the TOST p-value (the
    larger of the two one-sided t-tests' p against -margin and +margin) and the verdict:
    equivalent, else better or worse where the interval excludes 0, else inconclusive."""
    low, high = stats.t.interval(0.95, len(d) - 1, loc=d.mean(), scale=stats.sem(d))
    p_low = stats.ttest_1samp(d, -margin, alternative="greater").pvalue
    p_high = stats.ttest_1samp(d, margin, alternative="less").pvalue
    tost = max(p_low, p_high)
    verdict = ("equivalent" if tost < alpha else "better" if high < 0 else "worse" if low > 0
               else "inconclusive")
    return float(low), float(high), float(tost), verdict
