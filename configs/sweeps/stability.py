"""Stability map: depth {12, 24, 48} x peak lr {3e-4, 1e-3, 3e-3} x norm {post, pre} on the
default CPU config (d=64, 4 heads, d_ff=192, n=128, batch 16, embedded corpus), 300 steps each,
so the (48, 1e-3) cells repeat ``configs/default.py:post`` and ``:pre`` (docs/RESULTS.md).

    python -m experiments.sweep --sweep configs/sweeps/stability.py --out_dir runs/stability

Measured on the 2-core machine with ``--workers 2``: 16 of the runs trained in 67 min, the
other two were reused from the three-seed comparison; the 18 runs' training times sum to
9,619 s, so the whole grid takes about 80 min from scratch (docs/RESULTS.md, stability map).

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
