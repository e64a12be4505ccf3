"""The collapse leaderboard: every method that may prevent Post-Norm's collapse, on the default CPU
config (48 layers, d=64, d_ff=192, n=128, batch 16, embedded corpus, 300 steps) at the two peak
learning rates where Post-Norm collapses (1e-3 and 3e-3), three seeds each (docs/METHODS.md).

    python -m experiments.sweep --sweep configs/sweeps/leaderboard.py --out_dir runs/leaderboard \\
        --workers 2
    python -m experiments.leaderboard --out_dir runs/leaderboard   # the table and the figure

The plan runs seed 0 of every method first, then seed 1, then seed 2, so a partial sweep already
compares every method. Variant ``blocked``: every method once (lr 3e-3, seed 0) with the blocked
attention kernel, the check that each trains without a non-finite step on both kernels.
"""

BASE_CONFIG = "configs/default.py"

METHODS: dict[str, dict[str, object]] = {
    "post": {"model.norm": "post"},
    "pre": {"model.norm": "pre"},
    "deepnorm": {"model.norm": "deepnorm"},
    "mixln": {"model.norm": "mixln"},
    "sandwich": {"model.norm": "sandwich"},
    "periln": {"model.norm": "periln"},
    "b2t": {"model.norm": "b2t"},
    "b2t_rescaled": {"model.norm": "b2t", "model.b2t_rescaled_init": True},
    "post_qk_norm": {"model.norm": "post", "model.qk_norm": True},
    "post_similarity_init": {"model.norm": "post", "model.init_tsim_target": 0.5},
    "post_budget_scale": {"model.norm": "post", "model.residual_budget": "scale"},
    "post_budget_penalty": {"model.norm": "post", "model.residual_budget": "penalty"},
    "adaptive": {"model.norm": "adaptive"},
    "adaptive_fixed_half": {"model.norm": "adaptive", "model.adaptive_initial_mix": 0.5,
                            "train.placement_controller": False},
}
# Every field a method sets, at its default elsewhere, so that each run id names its method.
METHOD_FIELDS = {"model.norm": "post", "model.b2t_rescaled_init": False, "model.qk_norm": False,
                 "model.init_tsim_target": 0.0, "model.residual_budget": "none",
                 "model.adaptive_initial_mix": 1.0, "train.placement_controller": True}
LRS = (1e-3, 3e-3)
SEEDS = (0, 1, 2)


def method_of(overrides: dict[str, object]) -> str:
    """The method whose fields a run's overrides hold."""
    for name, fields in METHODS.items():
        if all(overrides.get(k, v) == fields.get(k, v) for k, v in METHOD_FIELDS.items()):
            return name
    raise ValueError(f"no method of the leaderboard sets {overrides}")


def method_label(config: dict) -> str:
    """The leaderboard's name for a recorded run's method (its ``config.json`` data), or its
    ``model.norm``."""
    fields = {}
    for path in METHOD_FIELDS:
        section, name = path.split(".")
        if name in config.get(section, {}):
            fields[path] = config[section][name]
    try:
        return method_of(fields)
    except ValueError:
        return config["model"]["norm"]


def _run(method: str, lr: float, seed: int, **extra: object) -> dict[str, object]:
    return {**METHOD_FIELDS, **METHODS[method], "opt.lr": lr, "seed": seed, **extra}


def get_sweep(arg: str | None = None) -> list[dict[str, object]]:
    """One dict of config overrides per run; ``arg`` ``"blocked"`` gives the kernel check."""
    if arg in (None, ""):
        return [_run(method, lr, seed) for seed in SEEDS for method in METHODS for lr in LRS]
    if arg == "blocked":
        return [_run(method, 3e-3, 0, **{"model.attention": "blocked"}) for method in METHODS]
    raise ValueError(f"unknown sweep variant {arg!r}; known: blocked")
