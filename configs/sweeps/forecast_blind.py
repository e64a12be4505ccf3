"""A blind test of the collapse forecast: configs drawn at random, planned before any is run.

    python -m experiments.sweep --sweep configs/sweeps/forecast_blind.py \\
        --out_dir runs/forecast_blind --archive results/forecast_blind/runs --workers 2

The forecast's held-out scores (``experiments.forecast_validation``) refit it in every fold, but
its inputs and fitting rule were chosen by people who had seen the archive, and the archive's
runs sit on a grid (two rates, two warmups, four depths on the leaderboard; half-decade rates at
48 layers in the protocol). The frozen forecast's blind test so far holds protocol runs near
cells it was fitted on. This sweep draws ``RUNS`` configs off that grid, from a distribution
fixed here before any of them ran (its commit is the registration; ``registered_ids.txt`` beside
the archive lists the draw, and a test holds the plan to it):

* method: uniform over ``DRAWN_METHODS``, the leaderboard's methods (every published baseline as
  published, its variants, the project's methods), all but ``adaptive_own_profile``, which
  needs another run's profile;
* depth: uniform over ``LAYERS``; width: the default config's (d = 64);
* learning rate: log-uniform on ``LR_RANGE``; warmup: a fraction of the steps, log-uniform on
  ``WARMUP_RANGE``, then the default cosine;
* clipping: at the protocol's ``CLIP`` or none, each with probability 1/2, unless the method
  sets it: B2T as published clips at 0.1, and a method named ``_noclip`` never clips;
* ``STEPS`` steps (the screen's horizon, where the archive's collapses set in), evaluated and
  diagnosed as the protocol's runs are (``protocol.protocol``); a training seed drawn from
  ``SEED_RANGE``, so no run repeats an archived seed.

The draw uses Python's ``random.Random(DRAW_SEED)`` and only its ``random()`` (stable across
Python versions). Cost: about 2 hours of the 2-core host with two workers (the draw holds 50
runs' worth of 48-layer steps; 300 of them take about 4 minutes a worker).

What is tested, stated before the runs (``postnorm.analysis.forecast_frozen.blind_test``, in
``validation.md``'s "Blind" section, this archive's runs apart), once every drawn run has ended
(before then the report marks its figures interim): the frozen forecast
(``results/figures/forecast/frozen_model.json``) on every run of this sweep with a verdict, its
collapse AUC and Brier score with 95% bootstrap intervals over runs; beside it depth and rate
alone, fitted by the same rule on the runs the frozen forecast was fitted on. The forecast beats
depth and rate alone blind where the paired 95% interval of its Brier score minus theirs lies
below 0, is worse where it lies above, and is not shown better where it holds 0. A run stopped on
a non-finite step has no verdict: such runs are not scored, but counted and listed with the
forecast's probability of collapse beside each. Neither the forecast's inputs nor its fitting
rule change before these runs are scored.
"""

import math
import os
import random

from configs.sweeps import protocol

BASE_CONFIG = protocol.BASE_CONFIG

DRAW_SEED = 20261207
RUNS = 40
STEPS = protocol.SCREEN_STEPS
LAYERS = (24, 48, 96)
LR_RANGE = (3e-4, 3e-2)
WARMUP_RANGE = (0.02, 0.4)
CLIP = protocol.CLIP
SEED_RANGE = (1_000, 1_000_000)
DRAWN_METHODS = ("post", "pre", "deepnorm", "deepnorm_torch_init", "mixln", "sandwich", "periln",
                 "b2t", "b2t_unscaled_noclip", "b2t_rescaled_noclip", "admin", "post_qk_norm",
                 "post_similarity_init", "post_budget_scale", "post_budget_penalty", "adaptive",
                 "adaptive_two_way", "adaptive_fixed_half", "post_grad_repair", "post_diversity",
                 "post_z_loss", "post_monitor_rollback")
RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "results", "forecast_blind")
ARCHIVE = os.path.join(RESULTS, "runs")
REGISTERED_IDS = os.path.join(RESULTS, "registered_ids.txt")


def _log_uniform(u: float, low: float, high: float) -> float:
    return math.exp(math.log(low) + u * (math.log(high) - math.log(low)))


def _pick(u: float, options: tuple) -> object:
    return options[min(int(u * len(options)), len(options) - 1)]


def drawn_run(rng: random.Random) -> tuple[str, dict[str, object]]:
    """One draw: the method and the run's config overrides (the rate to 3 significant digits,
    so that the id names it exactly)."""
    method = _pick(rng.random(), DRAWN_METHODS)
    layers = _pick(rng.random(), LAYERS)
    lr = float(f"{_log_uniform(rng.random(), *LR_RANGE):.3g}")
    warmup_fraction = _log_uniform(rng.random(), *WARMUP_RANGE)
    clip = CLIP if rng.random() < 0.5 and not method.endswith("_noclip") else 0.0
    seed = SEED_RANGE[0] + int(rng.random() * (SEED_RANGE[1] - SEED_RANGE[0]))
    return method, {**protocol.protocol(STEPS, warmup_fraction, clip),
                    **protocol.method_overrides(method),
                    "model.n_layers": layers, "opt.lr": lr, "seed": seed}


def planned_runs() -> list[tuple[str, dict[str, object]]]:
    """The ``RUNS`` draws, in order: (method, overrides)."""
    rng = random.Random(DRAW_SEED)
    return [drawn_run(rng) for _ in range(RUNS)]


def run_name(overrides: dict[str, object]) -> str:
    """A run's id, e.g. ``blind_post_layers48_lr0.00412_warmup37_noclip_seed52817``."""
    return (f"blind_{protocol.method_of(overrides)}_layers{overrides['model.n_layers']}"
            f"_lr{overrides['opt.lr']!r}_warmup{overrides['opt.warmup_steps']}"
            + ("_noclip" if overrides["opt.clip_norm"] == 0 else "")
            + f"_seed{overrides['seed']}")


def registered_ids() -> list[str]:
    """The run ids of the draw as registered (``REGISTERED_IDS``)."""
    with open(REGISTERED_IDS) as f:
        return f.read().split()


def get_sweep(arg: str | None = None) -> list[dict[str, object]]:
    """One dict of config overrides per drawn run (the sweep takes no argument)."""
    if arg:
        raise ValueError(f"configs/sweeps/forecast_blind.py takes no variant, got {arg!r}")
    return [overrides for _, overrides in planned_runs()]
