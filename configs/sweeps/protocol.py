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
(``BRACKET_METHODS``), at the half-decade rates ``BRACKET_LRS``, clipped at ``CLIP`` first; the
same without clipping (the stress test) after. A method's own clipping (B2T's 0.1) is part of
the method and stays in the clipped half.

Variant ``calibration``: Post-Norm against Pre-Norm at 12 layers, where neither collapses at 300
steps, for ``LONG_STEPS`` steps (about 0.9 epochs of the embedded corpus's 6.8M training tokens
at batch 16 x 128), lr {1e-3, 3e-3, 1e-2}, seeds 0-2: does the toy reproduce the literature's
ordering (Post-Norm, when it trains, at least as good as Pre-Norm)?
"""

from configs.sweeps.leaderboard import ALL_METHODS, METHOD_FIELDS

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
BRACKET_METHODS = ("pre", "post", "mixln", "sandwich", "periln", "post_budget_scale",
                   "post_budget_penalty", "adaptive_two_way", "b2t", "deepnorm", "admin")


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


def _method(method: str) -> dict[str, object]:
    """The method's fields, every other method field at its default but the protocol's."""
    defaults = {k: v for k, v in METHOD_FIELDS.items() if k not in PROTOCOL_FIELDS}
    return {**defaults, **ALL_METHODS[method]}


def _bracket() -> list[dict[str, object]]:
    def run(method: str, lr: float, clip: float) -> dict[str, object]:
        warmup = LONG_WARMUP_FRACTION if method == "post" else WARMUP_FRACTION
        fields = {**protocol(SCREEN_STEPS, warmup), **_method(method),
                  "model.n_layers": 48, "opt.lr": lr, "seed": 0}
        return {**fields, "opt.clip_norm": clip} if clip != CLIP else fields
    return [run(method, lr, clip) for clip in (CLIP, 0.0) for method in BRACKET_METHODS
            for lr in BRACKET_LRS]


def _calibration() -> list[dict[str, object]]:
    return [{"model.norm": norm, "model.n_layers": 12, "opt.lr": lr, "seed": seed,
             **protocol(LONG_STEPS)}
            for seed in SEEDS for lr in CALIBRATION_LRS for norm in ("post", "pre")]


def get_sweep(arg: str | None = None) -> list[dict[str, object]]:
    """One dict of config overrides per run of the variant ``arg``."""
    if arg == "calibration":
        return _calibration()
    if arg == "bracket":
        return _bracket()
    raise ValueError(f"unknown sweep variant {arg!r}; known: bracket, calibration")
