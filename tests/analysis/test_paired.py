"""Seed-paired gaps and equivalence tests (postnorm/analysis/paired.py) against independent
computations: Student's t from its density by quadrature, and the intervals' coverage and the
tests' size by Monte Carlo."""

import math

import numpy as np
import pytest
from scipy import integrate

from postnorm.analysis.paired import ALPHA, paired_gap, t_quantile, t_sf


def t_density(x: float, dof: int) -> float:
    return (math.gamma((dof + 1) / 2) / (math.sqrt(dof * math.pi) * math.gamma(dof / 2))
            * (1 + x * x / dof) ** (-(dof + 1) / 2))


@pytest.mark.parametrize("dof", [1, 2, 4, 10])
def test_the_t_tail_and_quantile_match_the_integrated_density(dof):
    for x in (0.5, 1.7, 4.3):
        tail, _ = integrate.quad(t_density, x, np.inf, args=(dof,))
        assert t_sf(x, dof) == pytest.approx(tail, rel=1e-7)
    for p in (0.9, 0.95, 0.975):
        q = t_quantile(p, dof)
        mass, _ = integrate.quad(t_density, -np.inf, q, args=(dof,))
        assert mass == pytest.approx(p, rel=1e-7)


def test_the_gap_interval_by_hand_on_three_seeds():
    method, reference = {0: 4.10, 1: 4.30, 2: 4.05}, {0: 4.00, 1: 4.12, 2: 4.02}
    d = np.array([0.10, 0.18, 0.03])
    gap = paired_gap(method, reference)
    se = d.std(ddof=1) / math.sqrt(3)
    assert gap["mean"] == pytest.approx(d.mean(), rel=1e-12)
    assert gap["ci95"] == pytest.approx([d.mean() - t_quantile(0.975, 2) * se,
                                         d.mean() + t_quantile(0.975, 2) * se], rel=1e-12)
    assert gap["seeds"] == [0, 1, 2]


def test_only_shared_seeds_pair_and_too_few_pairs_decide_nothing():
    gap = paired_gap({0: 1.0, 1: 2.0, 5: 9.0}, {0: 0.5, 2: 7.0})
    assert gap["n"] == 1 and gap["ci95"] is None and gap["verdict"] == "inconclusive"


def test_verdicts_follow_the_intervals():
    ref = {s: 4.0 + 0.1 * s for s in range(5)}
    shifted = {s: v + off for (s, v), off in zip(ref.items(), (0.001, -0.002, 0.0, 0.002, -0.001),
                                                 strict=True)}
    assert paired_gap(shifted, ref)["verdict"] == "equivalent"
    worse = {s: v + 0.3 + 0.01 * (s % 2) for s, v in ref.items()}
    assert paired_gap(worse, ref)["verdict"] == "worse"
    better = {s: v - 0.3 - 0.01 * (s % 2) for s, v in ref.items()}
    assert paired_gap(better, ref)["verdict"] == "better"
    noisy = {s: v + (0.5 if s % 2 else -0.5) for s, v in ref.items()}
    assert paired_gap(noisy, ref)["verdict"] == "inconclusive"


def test_coverage_and_the_equivalence_tests_size_by_monte_carlo():
    """Normal gaps, 3 seeds: the 95% interval covers the true mean 95% of the time, and at a true
    gap exactly on the margin TOST calls equivalence at most ALPHA of the time."""
    rng = np.random.default_rng(0)
    trials, true_gap, sd, margin = 4000, 0.03, 0.04, 0.05
    covered = equivalent_at_margin = 0
    for _ in range(trials):
        d = rng.normal(true_gap, sd, 3)
        gap = paired_gap(dict(enumerate(d)), dict.fromkeys(range(3), 0.0), margin)
        covered += gap["ci95"][0] <= true_gap <= gap["ci95"][1]
        d_edge = rng.normal(margin, sd, 3)
        edge = paired_gap(dict(enumerate(d_edge)), dict.fromkeys(range(3), 0.0), margin)
        equivalent_at_margin += edge["tost_p"] < ALPHA
    assert abs(covered / trials - 0.95) < 0.012
    assert equivalent_at_margin / trials < ALPHA + 0.012
