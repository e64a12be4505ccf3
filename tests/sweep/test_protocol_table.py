"""The long-horizon protocol's tables (postnorm.sweep.protocol_table) on rows made up here:
the bracket's best and largest stable rates, the reference of a cell, and every seed-paired
gap against scipy's t interval and one-sided t-tests of the per-seed differences."""

import numpy as np
import pytest

from postnorm.sweep.protocol_table import (
    bracket_entries,
    bracket_markdown,
    bracket_title,
    calibration_entries,
    compared_entries,
    compared_markdown,
    epochs,
    reference_of,
    step_time_ratios,
)
from tests.paired_reference import scipy_gap


def row(method, seed=0, loss=None, *, lr=1e-3, clipped=True, status="done", collapsed=False,
        wall_s=100.0, train_steps=100, steps=300):
    return {"method": method, "seed": seed, "lr": lr, "clipped": clipped, "steps": steps,
            "status": status,
            "loss": loss if status == "done" else None,
            "collapsed": collapsed if status == "done" else None,
            "run_id": f"{method}_{lr:g}_{clipped}_{seed}", "wall_s": wall_s,
            "train_steps": train_steps, "lfreq": 6.0}


def test_the_bracket_chooses_the_long_run_rate_and_grows_past_an_open_edge():
    """Per method and half: below the first failing rate (collapse or non-finite), the lowest
    loss of the rates that train (finished, no collapse, under 0.95 x L_freq = 5.7 here); where
    none trains, the largest rate below the first failure; the next half-decade while the
    choice sits at an open edge; nothing while a rate is missing."""
    rates = [3e-4, 1e-3, 3e-3, 1e-2, 3e-2]
    rows = ([row("pre", lr=lr, loss=loss)
             for lr, loss in zip(rates, [5.8, 4.5, 4.2, 4.4, 6.0], strict=True)]
            + [row("post", lr=lr, loss=loss, collapsed=lr >= 3e-3)
               for lr, loss in zip(rates, [5.9, 5.0, 5.87, 5.9, 5.9], strict=True)]
            + [row("mixln", lr=lr, loss=loss)
               for lr, loss in zip(rates[:4], [5.7, 4.6, 4.3, 4.1], strict=True)]
            + [row("mixln", lr=3e-2, status="nonfinite")]
            + [row("sandwich", lr=lr, loss=4.0) for lr in rates[:4]]
            + [row("sandwich", lr=3e-2, status="missing")]
            # at the floor everywhere, collapsed from 1e-3 on, a lower loss at 3e-2 collapsed
            + [row("deepnorm", lr=lr, loss=loss, collapsed=lr >= 1e-3)
               for lr, loss in zip(rates, [6.4, 5.75, 5.76, 5.9, 5.74], strict=True)]
            + [row("admin", lr=lr, loss=5.8, collapsed=True) for lr in rates]
            + [row("b2t", lr=lr, loss=6.1) for lr in rates]
            + [row("pre", lr=lr, loss=4.0 + lr, clipped=False) for lr in rates]
            # the long bracket: deepnorm again over 1,000 steps, where it trains
            + [row("deepnorm", lr=lr, loss=loss, steps=1000, collapsed=lr >= 3e-3)
               for lr, loss in zip(rates[:3], [4.3, 3.9, 5.8], strict=True)])
    entries = {(e["method"], e["clipped"], e["steps"]): e for e in bracket_entries(rows)}

    def chosen(method, clipped=True, steps=300):
        e = entries[(method, clipped, steps)]
        return e["best_lr"], e["basis"], e["grow"], e["largest_trained_lr"]

    assert chosen("pre") == (3e-3, "trains", None, 1e-2)  # 6.0 at 3e-2 is at the floor
    assert entries[("pre", True, 300)]["best_loss"] == 4.2
    assert chosen("post") == (1e-3, "trains", None, 1e-3)
    assert chosen("mixln") == (1e-2, "trains", None, 1e-2)  # bounded by the divergence above
    assert chosen("sandwich") == (None, None, None, None)
    assert chosen("deepnorm") == (3e-4, "stable", None, None)  # never the collapsed 5.74
    assert chosen("admin") == (None, None, 9e-5, None)  # every rate fails: try lower
    assert chosen("b2t") == (None, None, 0.09, None)  # none fails, none trains: try higher
    assert chosen("pre", clipped=False) == (None, None, 9e-5, 3e-2)  # optimum at the bottom
    assert chosen("deepnorm", steps=1000) == (1e-3, "trains", None, 1e-3)
    order = ["pre", "post", "mixln", "sandwich", "deepnorm", "admin", "b2t"]
    text = bracket_markdown(list(entries.values()), order, 6.0)
    clipped_half, unclipped_half = text.split("**Unclipped")
    unclipped_half, long_bracket = unclipped_half.split("**Clipped, 1,000 steps")
    assert "at step 1,000" in long_bracket and "at step 300" in unclipped_half
    assert "| deepnorm | 4.300 | 3.900 | 5.800 C | 0.001 | 0.001 |" in long_bracket
    assert "| post | 5.900 | 5.000 | 5.870 C | 5.900 C | 5.900 C | 0.001 | 0.001 |" in clipped_half
    assert "| mixln | 5.700 | 4.600 | 4.300 | 4.100 | ✗ | 0.01 | 0.01 |" in clipped_half
    assert "| sandwich | 4.000 | 4.000 | 4.000 | 4.000 | – | – | – |" in clipped_half
    assert "| deepnorm | 6.400 | 5.750 C | 5.760 C | 5.900 C | 5.740 C | 0.0003 (stable) | – |" \
        in clipped_half
    assert "| pre | 4.000 | 4.001 | 4.003 | 4.010 | 4.030 | – (next: 9e-05) | 0.03 |" in \
        unclipped_half
    assert bracket_title(False, 1000, 300).startswith("Unclipped, 1,000 steps")
    assert bracket_title(False, 300, 300).startswith("Unclipped")
    assert bracket_title(True, 300, 300).startswith("Clipped")


def test_the_reference_is_the_better_of_pre_and_a_stably_trained_post():
    pre = [row("pre", s, 4.0 + s / 100) for s in range(3)]
    post = [row("post", s, 3.9 + s / 100) for s in range(3)]
    assert reference_of({"pre": pre, "post": post}) == "post"
    post[1] = row("post", 1, 3.9, collapsed=True)  # one seed collapsed: not stably trained
    assert reference_of({"pre": pre, "post": post}) == "pre"
    worse_post = [row("post", s, 4.5) for s in range(3)]
    assert reference_of({"pre": pre, "post": worse_post}) == "pre"
    assert reference_of({"pre": pre[:2] + [row("pre", 2, status="missing")],
                         "post": worse_post}) is None


def test_each_gap_to_the_reference_is_scipys_paired_t_interval_and_tost():
    """Seed-paired over the seeds both finished (a non-finite seed is left out); the gaps of
    the other reference candidate are against the reference too."""
    margin = 0.05
    pre = {0: 4.10, 1: 4.16, 2: 4.12}
    post = {0: 4.30, 1: 4.35, 2: 4.33}
    periln = {0: 4.11, 1: 4.17, 2: 4.125}
    mixln = {0: 4.40, 1: 4.52, 2: 9.9}
    rows = ([row("pre", s, v) for s, v in pre.items()]
            + [row("post", s, v) for s, v in post.items()]
            + [row("periln", s, v) for s, v in periln.items()]
            + [row("mixln", s, v) for s, v in mixln.items() if s < 2]
            + [row("mixln", 2, status="nonfinite")])
    entries = {e["method"]: e for e in compared_entries(rows, ["post", "pre", "mixln",
                                                               "periln"], margin)}
    assert entries["pre"]["gap"] is None and entries["pre"]["reference"] == "pre"
    for method, losses in (("post", post), ("periln", periln), ("mixln", mixln)):
        seeds = [s for s in (0, 1, 2) if not (method == "mixln" and s == 2)]
        d = np.array([losses[s] - pre[s] for s in seeds])
        low, high, tost, verdict = scipy_gap(d, margin)
        gap = entries[method]["gap"]
        assert gap["seeds"] == seeds and gap["mean"] == pytest.approx(d.mean(), rel=1e-12)
        assert gap["ci95"] == pytest.approx([low, high], rel=1e-9)
        assert gap["tost_p"] == pytest.approx(tost, rel=1e-9)
        assert gap["verdict"] == verdict
    assert entries["periln"]["gap"]["verdict"] == "equivalent"
    assert entries["post"]["gap"]["verdict"] == "worse"
    assert (entries["mixln"]["done"], entries["mixln"]["nonfinite"]) == (2, 1)
    text = compared_markdown(list(entries.values()), {"screen": {"post": "collapsed 3/3"}})
    d = np.array([periln[s] - pre[s] for s in (0, 1, 2)])
    low, high, *_ = scipy_gap(d, margin)
    assert (f"| periln | 0.001 | 3/3 | 0/3 | {np.mean(list(periln.values())):.3f} | "
            f"{d.mean():+.3f} | [{low:+.3f}, {high:+.3f}] | equivalent | – |") in text
    assert "| pre | 0.001 | 3/3 | 0/3 | 4.127 | (reference) |  |  | – |" in text
    assert "| mixln | 0.001 | 2/3 (1 ✗) |" in text


def test_calibration_pairs_post_with_pre_at_each_rate():
    rows = []
    losses = {1e-3: ({0: 4.0, 1: 4.1, 2: 4.05}, {0: 4.2, 1: 4.25, 2: 4.3}),
              3e-3: ({0: 3.9, 1: 3.85, 2: 3.95}, {0: 3.91, 1: 3.86, 2: 3.94})}
    for lr, (post, pre) in losses.items():
        rows += [row("post", s, v, lr=lr) for s, v in post.items()]
        rows += [row("pre", s, v, lr=lr) for s, v in pre.items()]
    for entry in calibration_entries(rows):
        post, pre = losses[entry["lr"]]
        d = np.array([post[s] - pre[s] for s in (0, 1, 2)])
        low, high, tost, verdict = scipy_gap(d, 0.05)
        assert entry["gap"]["ci95"] == pytest.approx([low, high], rel=1e-9)
        assert entry["gap"]["verdict"] == verdict
    assert [e["gap"]["verdict"] for e in calibration_entries(rows)] == ["better", "equivalent"]


def test_step_time_ratio_and_epochs():
    wide = [row("pre", s, 4.0, wall_s=w, train_steps=1000) for s, w in enumerate([400, 500])]
    narrow = [row("pre", s, 4.0, wall_s=w, train_steps=3000) for s, w in enumerate([300, 330,
                                                                                  360])]
    assert step_time_ratios(wide, narrow) == pytest.approx({"pre": 0.45 / 0.11})
    assert epochs(3000, 16, 128, 6_144_000) == pytest.approx(1.0)
