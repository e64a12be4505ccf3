"""Stability map: depth {12, 24, 48} x peak lr {3e-4, 1e-3, 3e-3} x norm {post, pre} on the
default CPU config (d=64, 4 heads, d_ff=192, n=128, batch 16, embedded corpus), 300 steps each,
so the (48, 1e-3) cells repeat ``configs/default.py:post`` and ``:pre`` (docs/RESULTS.md).

    python -m experiments.sweep --sweep configs/sweeps/stability.py --out_dir runs/stability

Cost estimate on the 2-core machine, uncontended: a step costs about 1.6 s / 48 layers
= 0.033 s per layer (docs/RESULTS.md), the diagnostic step every 10 steps about 10% more.
Summed over the grid, 3 lrs x 2 norms x (12 + 24 + 48) layers x 300 steps x 0.033 s x 1.1 = 1.7 h,
plus about 1 min of compilation, data and checkpoint overhead per run (18 runs), so about 2 h
in one process, or about 1 h per host with ``--shard i/2`` on two hosts.

Variant ``smoke``: depth {2, 4} x lr {1e-3, 3e-3} x norm, 20 steps, logs and diagnostics every 5
steps:
a check of the runner, not a result.
"""

import itertools

BASE_CONFIG = "configs/default.py"

DEPTHS = (12, 24, 48)
LRS = (3e-4, 1e-3, 3e-3)
NORMS = ("post", "pre")


def _grid(depths, lrs, norms, fixed: dict[str, object]) -> list[dict[str, object]]:
    return [{"model.n_layers": depth, "opt.lr": lr, "model.norm": norm, **fixed}
            for depth, lr, norm in itertools.product(depths, lrs, norms)]


def get_sweep(arg: str | None = None) -> list[dict[str, object]]:
    """One dict of config overrides per run; ``arg`` ``"smoke"`` gives the tiny check."""
    if arg in (None, ""):
        return _grid(DEPTHS, LRS, NORMS, {"train.steps": 300})
    if arg == "smoke":
        return _grid((2, 4), (1e-3, 3e-3), NORMS,
                     {"train.steps": 20, "diag.every": 5, "train.log_every": 5,
                      "train.eval_every": 20})
    raise ValueError(f"unknown sweep variant {arg!r}; known: smoke")
