"""The collapse leaderboard's plans: every method that may prevent Post-Norm's collapse, on the
default CPU config (48 layers, d=64, d_ff=192, n=128, batch 16, the embedded corpus, 300 steps)
at the two peak learning rates where Post-Norm collapses (1e-3 and 3e-3), three seeds each
(docs/LEADERBOARD.md; the methods: docs/METHODS.md). A 300-step run is an early-speed screen.

    python -m experiments.leaderboard --out_dir runs/leaderboard \\
        --archive results/leaderboard/runs --sweep configs/sweeps/leaderboard.py:grid --workers 2

The default plan is every method of ``METHODS`` at 48 layers, warmup 20 steps; ``--methods``
keeps some of them. Each plan runs seed 0 of every cell first, then seed 1, then seed 2, so a
partial sweep already compares every method. A run's id names its method and cell
(``run_name``); a run is found by its config, so a run finished under one plan counts for all.

``adaptive_own_profile`` (the control of the two-way controller: the final lambda profile of the
``adaptive_two_way`` run of the same lr and seed, fixed from step 0) is planned once that run is
in the leaderboard's archive (``ARCHIVE``); a second pass of the same command trains it.

Variant ``grid``: the default plan, plus depth 12 and 24 at warmup 20 and warmup 100 at 24 and 48
layers for post, pre and ``FOCUS``, and 96 layers at lr 1e-3, seed 0, for ``DEPTH_METHODS``.
What it cuts, and why: methods that collapsed at 48 layers get no other depth or warmup (only
the four that prevented the collapse on all six 48-layer runs and learned past the floor are in
``FOCUS``); at (12, 1e-3), where nothing collapses, one seed; no warmup 100 at 12 layers. Sized
for the 2-core host with ``--workers 2``: about 5 worker-minutes per 48-layer run (training and
measuring), 2 at 12 layers, 4 at 24 and 11 at 96. A host with more cores shards it
(``--shard i/n``).

Variant ``blocked``: every method once (lr 3e-3, seed 0) with the blocked attention kernel, the
check that each trains without a non-finite step on both kernels.
"""

import json
import os

from configs.default import get_config
from postnorm.model.placements import profile_text

BASE_CONFIG = "configs/default.py"

# A published method under its own name runs as its paper and released code define it; a variant
# carries a name that says how it differs.
METHODS: dict[str, dict[str, object]] = {
    "post": {"model.norm": "post"},
    "pre": {"model.norm": "pre"},
    # DeepNet's init: Xavier normal, beta on W_V, W_O and the FFN (gain 1 on W_Q, W_K)
    "deepnorm": {"model.norm": "deepnorm", "model.init": "xavier_normal"},
    "deepnorm_torch_init": {"model.norm": "deepnorm"},  # beta on the torch_default draw
    "mixln": {"model.norm": "mixln"},
    "sandwich": {"model.norm": "sandwich"},
    "periln": {"model.norm": "periln"},
    # B2T's released code: every layer matrix x L^(-1/2) with the connection on, and gradient
    # clipping at 0.1 (its README's training command)
    "b2t": {"model.norm": "b2t", "model.b2t_rescaled_init": True, "opt.clip_norm": 0.1},
    "b2t_unscaled_noclip": {"model.norm": "b2t"},
    "b2t_rescaled_noclip": {"model.norm": "b2t", "model.b2t_rescaled_init": True},
    "admin": {"model.norm": "admin"},  # omega from a profiling pass at init
    "post_qk_norm": {"model.norm": "post", "model.qk_norm": True},
    "post_similarity_init": {"model.norm": "post", "model.init_tsim_target": 0.5},
    "post_budget_scale": {"model.norm": "post", "model.residual_budget": "scale"},
    "post_budget_penalty": {"model.norm": "post", "model.residual_budget": "penalty"},
    # lambda moved by c of the Post norm's input: one way, towards Pre-Norm
    "adaptive": {"model.norm": "adaptive"},
    # lambda moved by the backward gain across each sublayer, which clears at Pre-Norm
    "adaptive_two_way": {"model.norm": "adaptive", "train.placement_signal": "two_way"},
    "adaptive_fixed_half": {"model.norm": "adaptive", "model.adaptive_initial_mix": 0.5,
                            "train.placement_controller": False},
    # the training-time methods (configs/sweeps/training_methods.py studies each further)
    "post_grad_repair": {"model.norm": "post", "train.grad_repair": True},
    "post_diversity": {"model.norm": "post", "opt.diversity_weight": 0.1},
    "post_z_loss": {"model.norm": "post", "opt.z_loss": 1e-4},
    "post_monitor_rollback": {"model.norm": "post", "monitor.action": "lr_scale",
                              "monitor.rollback": True, "train.ckpt_every": 10},
}
# A method whose runs are planned from another run's record: a non-empty model.adaptive_profile
# marks it (``method_of``), the profile being the final one of the same cell's two-way run.
OWN_PROFILE = {"adaptive_own_profile": {"model.norm": "adaptive",
                                        "train.placement_controller": False}}
ARCHIVE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "results", "leaderboard", "runs")
ALL_METHODS = {**METHODS, **OWN_PROFILE}
# Every field a method sets, at its default elsewhere, so that each run id names its method.
METHOD_FIELDS = {"model.norm": "post", "model.b2t_rescaled_init": False, "model.qk_norm": False,
                 "model.init": "torch_default", "opt.clip_norm": 0.0,
                 "train.placement_signal": "post_input_c", "model.adaptive_profile": "",
                 "model.init_tsim_target": 0.0, "model.residual_budget": "none",
                 "model.adaptive_initial_mix": 1.0, "train.placement_controller": True,
                 "train.grad_repair": False, "opt.diversity_weight": 0.0, "opt.z_loss": 0.0,
                 "monitor.action": "none", "monitor.rollback": False, "train.ckpt_every": 100}
LRS = (1e-3, 3e-3)
SEEDS = (0, 1, 2)
WARMUPS = (20, 100)  # short (the default config's) and long, in steps of the 300
FOCUS = ("mixln", "periln", "sandwich", "adaptive")
# the 96-layer runs were trained before DeepNorm and B2T had their published forms
DEPTH_METHODS = ("post", "pre", "deepnorm_torch_init", "mixln", "b2t_unscaled_noclip", "adaptive",
                 "post_grad_repair")
# (layers, lr) cells of warmup 20 with 3 seeds: where Post-Norm collapses or next to one
THREE_SEED_CELLS = {(48, 1e-3), (48, 3e-3), (24, 1e-3), (24, 3e-3), (12, 3e-3)}


def method_of(overrides: dict[str, object]) -> str:
    """The method whose fields a run's overrides hold (a fixed lambda profile: the control
    ``adaptive_own_profile``, whatever its values)."""
    if overrides.get("model.adaptive_profile"):
        overrides = {**overrides, "model.adaptive_profile": ""}
        if method_of(overrides) == "adaptive_own_profile":
            return "adaptive_own_profile"
        raise ValueError(f"no method of the leaderboard sets {overrides} with a fixed profile")
    for name, fields in ALL_METHODS.items():
        if all(overrides.get(k, v) == fields.get(k, v) for k, v in METHOD_FIELDS.items()):
            return name
    raise ValueError(f"no method of the leaderboard sets {overrides}")


def method_fields(config: dict) -> dict[str, object]:
    """The ``METHOD_FIELDS`` a recorded run's config (its ``config.json`` data) holds."""
    return {path: config[path.split(".")[0]][path.split(".")[1]] for path in METHOD_FIELDS
            if path.split(".")[1] in config.get(path.split(".")[0], {})}


def method_label(config: dict) -> str:
    """The leaderboard's name for a recorded run's method (its ``config.json`` data), or its
    ``model.norm``."""
    try:
        return method_of(method_fields(config))
    except ValueError:
        return config["model"]["norm"]


def run_name(overrides: dict[str, object]) -> str:
    """A run's id: its method and cell, e.g. ``post_layers48_lr0.001_warmup20_seed0`` (the
    same under the 108-run plan and the grid, so a run's archive record keeps its name)."""
    base = get_config()
    return (f"{method_of(overrides)}_layers{overrides.get('model.n_layers', base.model.n_layers)}"
            f"_lr{overrides['opt.lr']!r}"
            f"_warmup{overrides.get('opt.warmup_steps', base.opt.warmup_steps)}"
            f"_seed{overrides['seed']}"
            + (f"_{overrides['model.attention']}" if "model.attention" in overrides else ""))


def _run(method: str, lr: float, seed: int, **extra: object) -> dict[str, object]:
    return {**METHOD_FIELDS, **ALL_METHODS[method], "opt.lr": lr, "seed": seed, **extra}


def _value_text(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def method_variants() -> dict[str, str]:
    """Each method's fields as ``key=value,...`` text (as after a config file's colon); the
    own-profile control with the final profile of the archived two-way run at lr 1e-3, seed 0,
    once it is archived."""
    variants = {}
    for name, fields in ALL_METHODS.items():
        fields = dict(fields)
        if name == "adaptive_own_profile":
            planned = own_profile_runs(ARCHIVE, 1e-3, 0)
            if not planned:
                continue
            fields["model.adaptive_profile"] = planned[0]["model.adaptive_profile"]
        variants[name] = ",".join(f"{k}={_value_text(v)}" for k, v in fields.items())
    return variants


def own_profile_runs(archive_dir: str, lr: float, seed: int,
                     **extra: object) -> list[dict[str, object]]:
    """``adaptive_own_profile`` at (lr, seed) if the ``adaptive_two_way`` run of that cell is in
    ``archive_dir``, with that run's final lambda profile; else none."""
    path = os.path.join(archive_dir, f"{run_name(_run('adaptive_two_way', lr, seed))}.json")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        final = json.load(f)["result"]["final_post_mix"]
    return [{**_run("adaptive_own_profile", lr, seed, **extra),
             "model.adaptive_profile": profile_text(final)}]


def _core(**extra: object) -> list[dict[str, object]]:
    """Every method at 48 layers, warmup 20, both lrs, three seeds, seed 0 first (``extra``:
    fields every run sets at their default, for a plan whose other runs set them)."""
    plan = []
    for seed in SEEDS:
        plan += [_run(method, lr, seed, **extra) for method in METHODS for lr in LRS]
        plan += [run for lr in LRS for run in own_profile_runs(ARCHIVE, lr, seed, **extra)]
    return plan


def _grid() -> list[dict[str, object]]:
    """The full grid of the module docstring: the core, then the other cells, seed 0 first."""
    def cell(method: str, layers: int, lr: float, warmup: int, seed: int) -> dict[str, object]:
        return _run(method, lr, seed, **{"model.n_layers": layers, "opt.warmup_steps": warmup})

    few = ("post", "pre", *FOCUS)
    cells = [(method, layers, lr, 20, 3 if (layers, lr) in THREE_SEED_CELLS else 1)
             for method in few for layers in (12, 24) for lr in LRS]
    cells += [(method, layers, lr, 100, 3) for method in few for layers in (24, 48)
              for lr in LRS]
    cells += [(method, 96, 1e-3, 20, 1) for method in DEPTH_METHODS]
    core = _core(**{"model.n_layers": 48, "opt.warmup_steps": 20})
    return core + [cell(method, layers, lr, warmup, seed) for seed in SEEDS
                   for method, layers, lr, warmup, seeds in cells if seed < seeds]


def get_sweep(arg: str | None = None) -> list[dict[str, object]]:
    """One dict of config overrides per run; ``arg`` ``"blocked"`` gives the kernel check,
    ``"grid"`` the full grid."""
    if arg in (None, ""):
        return _core()
    if arg == "blocked":
        return [_run(method, 3e-3, 0, **{"model.attention": "blocked"}) for method in METHODS]
    if arg == "grid":
        return _grid()
    raise ValueError(f"unknown sweep variant {arg!r}; known: blocked, grid")
