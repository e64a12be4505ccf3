"""The long-horizon protocol: verdicts past the 300-step screen (docs/PROTOCOL.md).

    python -m experiments.sweep --sweep configs/sweeps/protocol.py:calibration \\
        --out_dir runs/protocol --archive results/protocol/runs --workers 2

Every run clips the global gradient norm at ``CLIP`` (the source papers all clip), warms up
over ``WARMUP_FRACTION`` of its steps, then decays by the default cosine, and is scored on
``EVAL_BATCHES`` held-out batches of the validation split (never trained on) every
``EVAL_EVERY`` steps. Per-layer diagnostics run every 10 steps over the first 300 (the
300-step screen's resolution, where collapse sets in) and every ``DIAG_EVERY`` after.

Variant ``bracket``: the learning-rate bracket at the screen's horizon (300 steps, 48 layers,
seed 0): Pre-Norm, Post-Norm with a long warmup (a third of the steps) and every method that
prevented the collapse on the 300-step board or is a published baseline in its published form
(``BRACKET_METHODS``), at the half-decade rates ``BRACKET_LRS``, clipped at ``CLIP``. A method's
own clipping (B2T's 0.1) is part of the method and stays in the bracket. Variant ``stress``: the
same runs at ``BRACKET_LRS`` without clipping (the stress test), run after the survival runs,
which depend on the bracket alone.

The bracket grows by itself: a method's long runs take the rate of its lowest clipped held-out
loss among the rates below its first failing one (collapse or non-finite) that train (under
0.95 x L_freq), or, where none trains, the largest rate below the first failing one
(``postnorm.sweep.protocol_table.long_run_choice``); while that choice sits at an open edge of
the grid, the next half-decade beyond it is planned (``bracket_rates``).

Variant ``long_bracket``: a method of ``SURVIVAL_METHODS`` that trains at no rate in 300 steps
(it stays at the floor, or collapses) has no optimum there to find, so it is bracketed again
at the survival horizon (``LONG_BRACKET_STEPS`` = ``LONG_STEPS``) at ``LONG_BRACKET_LRS``,
clipped, seed 0, growing by the same rule; its long runs take that bracket's rate
(``long_run_rate``), and the bracket's run at that rate is its seed-0 survival run. A shorter
bracket does not stand in for it: B2T stayed at the floor for 1,000 steps at lr 1e-3, yet its
3,000-step run at that rate trained far below the floor (those records stay in the archive).

Variant ``survival``: 48 layers, ``LONG_STEPS`` steps, seeds 0-2, each of ``SURVIVAL_METHODS``
at its long-run rate from the clipped bracket (or the long bracket), planned once that rate is
settled (Post-Norm with the bracket's long warmup): which 300-step verdicts survive ten times
more training?

Variant ``width``: one width step, d = 128 (head dim 32) at 48 layers for ``WIDTH_STEPS`` steps,
seeds 0-1: Post, Pre and the two methods of ``SURVIVAL_METHODS`` with the lowest mean held-out
loss in the survival runs, each at its d = 64 long-run rate (not tuned again), planned once every
survival run is archived.

What is cut, and why (sized to about 1.5 days of the 2-core host at ~0.9 s per 48-layer step
and ~0.3 s per 12-layer step): the bracket runs seed 0 only and 300 steps; the stress test
(unclipped) only at the base rates; the long bracket starts from three rates, not five, and
runs only for the methods the 300-step bracket cannot rank: at the survival horizon it costs two
3,000-step runs per method beyond the seed-0 survival run it includes (50-100 min each on this
host, two at a time), which takes the plan past 1.5 days; survival covers the published
baselines and the methods that prevented the collapse, not the ones that collapsed on the
screen; the width step is 1,000 steps and two seeds.

Variant ``calibration``: Post-Norm against Pre-Norm at 12 layers, where neither collapses at 300
steps, for ``LONG_STEPS`` steps (about 0.9 epochs of the embedded corpus's 6.8M training tokens
at batch 16 x 128), lr {1e-3, 3e-3, 1e-2}, seeds 0-2: does the toy reproduce the literature's
ordering (Post-Norm, when it trains, at least as good as Pre-Norm)?
"""

import dataclasses
import math
import os

import ml_collections

from configs.sweeps import leaderboard
from configs.sweeps.leaderboard import ALL_METHODS, METHOD_FIELDS
from postnorm.sweep.archive import archive_path, check_id_free, read_entry
from postnorm.sweep.plan import RunSpec, build_config
from postnorm.sweep.protocol_table import half_decade, long_run_choice
from postnorm.sweep.record import planned_digests

BASE_CONFIG = "configs/default.py"

LONG_STEPS = 3000
WARMUP_FRACTION = 0.05
CLIP = 1.0
EVAL_EVERY = 250
EVAL_BATCHES = 32
DIAG_EVERY = 50
# fields the protocol sets for every run, which a method keeps only where it sets them itself
PROTOCOL_FIELDS = ("opt.clip_norm", "train.ckpt_every")
SEEDS = (0, 1, 2)
CALIBRATION_LRS = (1e-3, 3e-3, 1e-2)
SCREEN_STEPS = 300
BRACKET_LRS = (3e-4, 1e-3, 3e-3, 1e-2, 3e-2)
LONG_WARMUP_FRACTION = 1 / 3
LONG_BRACKET_STEPS = LONG_STEPS  # the horizon whose rate it chooses
LONG_BRACKET_LRS = (3e-4, 1e-3, 3e-3)
BASE_RATES = {SCREEN_STEPS: BRACKET_LRS, LONG_BRACKET_STEPS: LONG_BRACKET_LRS}
BRACKET_METHODS = ("pre", "post", "mixln", "sandwich", "periln", "post_budget_scale",
                   "post_budget_penalty", "adaptive", "b2t", "deepnorm", "admin")
SURVIVAL_METHODS = ("post", "pre", "mixln", "sandwich", "periln", "adaptive", "deepnorm", "b2t",
                    "admin")
WIDTH_STEPS = 1000
WIDTH_SEEDS = (0, 1)
WIDTH_D_MODEL = 128  # head dim 32 with the default 4 heads; d_ff = 3 d as in the default
ARCHIVE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "results", "protocol", "runs")


def protocol(steps: int, warmup_fraction: float = WARMUP_FRACTION,
             clip: float = CLIP) -> dict[str, object]:
    """The fields every protocol run of ``steps`` steps sets."""
    return {"train.steps": steps, "opt.warmup_steps": round(warmup_fraction * steps),
            "opt.clip_norm": clip, "train.eval_every": min(EVAL_EVERY, steps),
            "train.eval_batches": EVAL_BATCHES, "diag.every": DIAG_EVERY,
            "diag.dense_every": 10, "diag.dense_until": 300,
            "train.ckpt_every": 500, "train.keep_ckpts": 2}


def run_name(overrides: dict[str, object]) -> str:
    """A run's id, e.g. ``post_layers12_lr0.001_steps3000_seed0``: the leaderboard's method
    name, then the cell; ``_warmup<n>`` where the warmup is not ``WARMUP_FRACTION`` of the
    steps, ``_noclip`` without clipping."""
    steps = overrides["train.steps"]
    warmup = overrides["opt.warmup_steps"]
    return (f"{method_of(overrides)}_layers{overrides['model.n_layers']}"
            f"_lr{overrides['opt.lr']!r}_steps{steps}"
            + (f"_warmup{warmup}" if warmup != round(WARMUP_FRACTION * steps) else "")
            + ("_noclip" if overrides["opt.clip_norm"] == 0 else "")
            + f"_seed{overrides['seed']}")


def method_of(overrides: dict[str, object]) -> str:
    """The leaderboard method a run's overrides hold, the protocol's own fields
    (``PROTOCOL_FIELDS``) aside unless the method sets them (B2T's clipping); of several, the
    one that sets the most fields."""
    def holds(fields: dict[str, object]) -> bool:
        keys = [k for k in METHOD_FIELDS if k not in PROTOCOL_FIELDS or k in fields]
        return all(overrides.get(k, METHOD_FIELDS[k]) == fields.get(k, METHOD_FIELDS[k])
                   for k in keys)
    held = [name for name, fields in ALL_METHODS.items() if holds(fields)]
    if not held:
        raise ValueError(f"no method of the leaderboard sets {overrides}")
    return max(held, key=lambda name: len(ALL_METHODS[name]))


def method_label(config: dict) -> str:
    """The leaderboard's name for a recorded run's method (its ``config.json`` data), from the
    leaderboard's archive or the protocol's: the method whose fields it holds
    (``leaderboard.method_of``), or whose fields it holds but the protocol's own clipping and
    checkpointing (``method_of``: a B2T clipped at 0.1 is ``b2t``, unclipped
    ``b2t_rescaled_noclip``; a Post-Norm of any warmup ``post``), else its ``model.norm``."""
    fields = leaderboard.method_fields(config)
    for method_of_fields in (leaderboard.method_of, method_of):
        try:
            return method_of_fields(fields)
        except ValueError:
            continue
    return config["model"]["norm"]


def method_overrides(method: str) -> dict[str, object]:
    """The method's fields, every other method field at its default but the protocol's."""
    defaults = {k: v for k, v in METHOD_FIELDS.items() if k not in PROTOCOL_FIELDS}
    return {**defaults, **ALL_METHODS[method]}


@dataclasses.dataclass(frozen=True)
class PlannedRun:
    """One run of the protocol's plan: its variant, the protocol's name for its method (B2T's
    unclipped bracket runs are ``b2t``, though their fields are the leaderboard's
    ``b2t_rescaled_noclip``) and its config overrides."""

    variant: str
    method: str
    overrides: dict[str, object]

    @property
    def run_id(self) -> str:
        return run_name(self.overrides)

    @property
    def config(self) -> ml_collections.ConfigDict:
        return planned_config(self.overrides)

    @property
    def lr(self) -> float:
        return self.overrides["opt.lr"]

    @property
    def seed(self) -> int:
        return self.overrides["seed"]

    @property
    def clipped(self) -> bool:
        return self.overrides["opt.clip_norm"] != 0


def _long_run(method: str, lr: float, seed: int, steps: int = LONG_STEPS,
              **extra: object) -> dict[str, object]:
    """A 48-layer run of ``method``: Post-Norm warms up over ``LONG_WARMUP_FRACTION`` of
    its steps, every other method over ``WARMUP_FRACTION``."""
    warmup = LONG_WARMUP_FRACTION if method == "post" else WARMUP_FRACTION
    return {**protocol(steps, warmup), **method_overrides(method), "model.n_layers": 48,
            "opt.lr": lr, "seed": seed, **extra}


def _bracket_run(method: str, lr: float, clip: float = CLIP,
                 steps: int = SCREEN_STEPS) -> dict[str, object]:
    fields = _long_run(method, lr, 0, steps)
    return {**fields, "opt.clip_norm": clip} if clip != CLIP else fields


def planned_config(overrides: dict[str, object]) -> ml_collections.ConfigDict:
    """The config the sweep runs for ``overrides``: ``BASE_CONFIG`` with them set."""
    return build_config(BASE_CONFIG, RunSpec(run_name(overrides), tuple(overrides.items())))


def _archived_result(archive_dir: str, overrides: dict[str, object]) -> dict | None:
    """The ``result`` of the run of ``overrides`` recorded in ``archive_dir``, or None. A record
    under its id of another config (by digest, as the sweep and the report match records) is
    refused (``ArchiveError`` naming the file), as the sweep refuses it."""
    run_id = run_name(overrides)
    path = archive_path(archive_dir, run_id)
    if not os.path.exists(path):
        return None
    check_id_free(archive_dir, run_id, planned_digests(planned_config(overrides)))
    return read_entry(path)["result"]


def archived_losses(archive_dir: str, plan: list[dict[str, object]]) -> dict[str, float]:
    """Held-out loss at the end of each run of ``plan`` recorded in ``archive_dir``, by run id
    (infinite for a run stopped by a non-finite step); runs not recorded are absent."""
    losses = {}
    for overrides in plan:
        result = _archived_result(archive_dir, overrides)
        if result is not None:
            done = result["status"] == "done" and result.get("final_eval_loss") is not None
            losses[run_name(overrides)] = result["final_eval_loss"] if done else math.inf
    return losses


def archived_bracket(method: str, rates: list[float], archive_dir: str,
                     steps: int = SCREEN_STEPS) -> list[dict]:
    """``method``'s clipped bracket runs of ``steps`` steps at ``rates`` as ``long_run_choice``
    reads them, from their records in ``archive_dir`` (``missing`` where there is none)."""
    rows = []
    for lr in rates:
        result = _archived_result(archive_dir, _bracket_run(method, lr, steps=steps)) or {}
        done = result.get("status") == "done"
        rows.append({"lr": lr, "status": result.get("status", "missing"),
                     "loss": result.get("final_eval_loss") if done else None,
                     "collapsed": bool(result["collapse"]["collapsed"]) if done else None,
                     "lfreq": result.get("lfreq")})
    return rows


def _archived_beyond(method: str, archive_dir: str, steps: int,
                     half_decades: int = 4) -> list[float]:
    """The rates of the half-decade ladder past the base rates of the ``steps``-step bracket
    (up to ``half_decades`` each way) at which ``method``'s clipped run is archived."""
    found = []
    for up in (True, False):
        lr = max(BASE_RATES[steps]) if up else min(BASE_RATES[steps])
        for _ in range(half_decades):
            lr = half_decade(lr, up)
            if _archived_result(archive_dir, _bracket_run(method, lr, steps=steps)) is not None:
                found.append(lr)
    return found


def _bracket_choice(method: str, archive_dir: str,
                    steps: int = SCREEN_STEPS) -> tuple[list[float], dict]:
    """The ``steps``-step clipped bracket's rates for ``method`` (its base rates, grown by a
    half-decade while the choice sits at an open edge; rates of an earlier growth already
    archived stay) and its ``long_run_choice``."""
    rates = sorted({*BASE_RATES[steps], *_archived_beyond(method, archive_dir, steps)})
    while True:
        choice = long_run_choice(archived_bracket(method, rates, archive_dir, steps))
        if choice["grow"] is None:
            return rates, choice
        rates = sorted({*rates, choice["grow"]})


def bracket_rates(method: str, archive_dir: str,
                  steps: int = SCREEN_STEPS) -> tuple[list[float], float | None]:
    """The ``steps``-step clipped bracket's rates for ``method`` and the rate it chooses
    (``long_run_choice``; None until it is settled)."""
    rates, choice = _bracket_choice(method, archive_dir, steps)
    return rates, choice["best_lr"]


def needs_long_bracket(method: str, archive_dir: str) -> bool:
    """Whether ``method``'s settled 300-step bracket trains at no rate (its choice is the
    largest stable rate), so that it cannot rank rates."""
    return _bracket_choice(method, archive_dir)[1]["basis"] == "stable"


def long_run_rate(method: str, archive_dir: str) -> float | None:
    """The rate of ``method``'s long runs: its 300-step bracket's choice where some rate trains
    there, else its long bracket's; None until the deciding bracket is settled."""
    screen = _bracket_choice(method, archive_dir)[1]
    if screen["basis"] == "stable":
        return bracket_rates(method, archive_dir, LONG_BRACKET_STEPS)[1]
    return screen["best_lr"]


def _bracket(archive_dir: str) -> list[PlannedRun]:
    return [PlannedRun("bracket", method, _bracket_run(method, lr))
            for method in BRACKET_METHODS for lr in bracket_rates(method, archive_dir)[0]]


def _long_bracket(archive_dir: str) -> list[PlannedRun]:
    return [PlannedRun("long_bracket", method, _bracket_run(method, lr, steps=LONG_BRACKET_STEPS))
            for method in SURVIVAL_METHODS if needs_long_bracket(method, archive_dir)
            for lr in bracket_rates(method, archive_dir, LONG_BRACKET_STEPS)[0]]


def _stress() -> list[PlannedRun]:
    return [PlannedRun("stress", method, _bracket_run(method, lr, 0.0))
            for method in BRACKET_METHODS for lr in BRACKET_LRS]


def _survival(archive_dir: str) -> list[PlannedRun]:
    best = {method: long_run_rate(method, archive_dir) for method in SURVIVAL_METHODS}
    return [PlannedRun("survival", method, _long_run(method, lr, seed))
            for seed in SEEDS for method, lr in best.items() if lr is not None]


def survival_ranking(archive_dir: str) -> list[str] | None:
    """The survival methods but Post and Pre, lowest mean held-out loss first, once every
    survival run is archived; else None."""
    survival = _survival(archive_dir)
    losses = archived_losses(archive_dir, [r.overrides for r in survival])
    if len(survival) < len(SURVIVAL_METHODS) * len(SEEDS) or len(losses) < len(survival):
        return None
    mean_loss = {}
    for run in survival:
        mean_loss.setdefault(run.method, []).append(losses[run.run_id])
    return sorted((m for m in mean_loss if m not in ("post", "pre")),
                  key=lambda m: sum(mean_loss[m]) / len(mean_loss[m]))


def _width(archive_dir: str) -> list[PlannedRun]:
    ranked = survival_ranking(archive_dir)
    if ranked is None:
        return []
    width = {"model.d_model": WIDTH_D_MODEL, "model.d_ff": 3 * WIDTH_D_MODEL}
    return [PlannedRun("width", method, _long_run(method, lr, seed, WIDTH_STEPS, **width))
            for seed in WIDTH_SEEDS for method in ("post", "pre", *ranked[:2])
            for lr in [long_run_rate(method, archive_dir)]]


def _calibration() -> list[PlannedRun]:
    return [PlannedRun("calibration", norm,
                       {"model.norm": norm, "model.n_layers": 12, "opt.lr": lr, "seed": seed,
                        **protocol(LONG_STEPS)})
            for seed in SEEDS for lr in CALIBRATION_LRS for norm in ("post", "pre")]


VARIANTS = ("calibration", "bracket", "long_bracket", "stress", "survival", "width")


def planned_runs(variant: str, archive_dir: str = ARCHIVE) -> list[PlannedRun]:
    """The runs ``variant`` plans now, given the runs recorded in ``archive_dir``."""
    plans = {"calibration": _calibration, "bracket": lambda: _bracket(archive_dir),
             "long_bracket": lambda: _long_bracket(archive_dir), "stress": _stress,
             "survival": lambda: _survival(archive_dir),
             "width": lambda: _width(archive_dir)}
    if variant not in plans:
        raise ValueError(f"unknown sweep variant {variant!r}; known: {', '.join(VARIANTS)}")
    return plans[variant]()


def get_sweep(arg: str | None = None) -> list[dict[str, object]]:
    """One dict of config overrides per run of the variant ``arg``."""
    return [run.overrides for run in planned_runs(arg)]
