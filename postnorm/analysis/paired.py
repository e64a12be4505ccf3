"""Seed-paired comparisons of a method's loss with a reference's: the gap's 95% interval, the
two one-sided tests (TOST) of equivalence against a margin stated before the runs, and a verdict.

For seeds s shared by both, d_s = loss(method, s) - loss(reference, s) (lower is better). With
n pairs, mean m and standard error se = sd(d) / sqrt(n), the 95% interval is
m -+ t_{0.975, n-1} se. Equivalence within the margin M holds when both one-sided tests reject
at ``ALPHA``: (m + M) / se > t_{1-ALPHA, n-1} and (M - m) / se > t_{1-ALPHA, n-1}, i.e. the
90% interval lies inside (-M, M). The verdict, in this order: ``equivalent`` (TOST holds: the
gap is smaller than the margin, which was declared practically irrelevant), ``better`` (the 95%
interval lies below 0), ``worse`` (above 0), else ``inconclusive``.
"""

import math
from collections.abc import Mapping

from scipy import special

# Stated before the long-horizon runs (docs/PROTOCOL.md): two losses within this many nats per
# token are practically the same model; about 1% of the corpus's L_freq (5.87 nats).
MARGIN_NATS = 0.05
ALPHA = 0.05


def t_quantile(p: float, dof: int) -> float:
    """The p-quantile of Student's t with ``dof`` degrees of freedom."""
    return float(special.stdtrit(dof, p))


def t_sf(x: float, dof: int) -> float:
    """P(T > x) for Student's t with ``dof`` degrees of freedom."""
    return float(special.stdtr(dof, -x))


def paired_gap(method: Mapping[int, float], reference: Mapping[int, float],
               margin: float = MARGIN_NATS) -> dict:
    """The seed-paired gap of ``method``'s losses over ``reference``'s ({seed: loss}, in nats)
    on the seeds both hold: its mean, 95% interval, TOST p-value and verdict. With fewer than
    two pairs, or no spread, only the mean (interval and tests None, verdict inconclusive)."""
    seeds = sorted(set(method) & set(reference))
    d = [method[s] - reference[s] for s in seeds]
    n = len(d)
    out = {"seeds": seeds, "n": n, "mean": sum(d) / n if n else None, "ci95": None,
           "tost_p": None, "margin": margin, "verdict": "inconclusive"}
    if n < 2:
        return out
    mean = out["mean"]
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
    if sd == 0:
        return out
    se = sd / math.sqrt(n)
    half = t_quantile(0.975, n - 1) * se
    tost_p = max(t_sf((mean + margin) / se, n - 1), t_sf((margin - mean) / se, n - 1))
    out.update(ci95=[mean - half, mean + half], tost_p=tost_p)
    if tost_p < ALPHA:
        out["verdict"] = "equivalent"
    elif mean + half < 0:
        out["verdict"] = "better"
    elif mean - half > 0:
        out["verdict"] = "worse"
    return out
