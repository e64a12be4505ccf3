"""The collapse leaderboard: every method that may prevent Post-Norm's collapse, on the default CPU
config (48 layers, d=64, d_ff=192, n=128, batch 16, embedded corpus, 300 steps) at the two peak
learning rates where Post-Norm collapses (1e-3 and 3e-3), three seeds each (docs/METHODS.md):
the arrangements, the initialisation and the residual budget (14 entries of ``METHODS``), and the
training-time methods, gradient repair, the frequency-loss regulariser, the z-loss and the
monitor's rollback (4 more), 108 runs.

    python -m experiments.leaderboard --out_dir runs/leaderboard --archive docs/leaderboard/runs \\
        --workers 2   # trains, measures and tabulates; docs/LEADERBOARD.md

The plan runs seed 0 of every method first, then seed 1, then seed 2, so a partial sweep already
compares every method. A run's id names its method and cell (``run_name``). Variant ``blocked``:
every method once (lr 3e-3, seed 0) with the blocked attention kernel, the check that each trains
without a non-finite step on both kernels.

Variant ``grid``: the leaderboard's full grid, depth {12, 24, 48} x lr {1e-3, 3e-3} x warmup
{20, 100} steps, plus 96 layers, sized to about 9 hours of the 2-core host with ``--workers 2``
(it contains the 108 runs above; a run is found by its config, so runs finished under either
plan count for both). Measured at 48 layers on the 2-core Intel host with ``--workers 2`` (the
leaderboard's first 72 runs): 237 s of training per run (median; 193-295 s) and 79 s of
measuring (the 512 fresh batches), about 5.3 worker-minutes. At 12 and 24 layers the stability
map's runs took 0.42x and 0.58x their 48-layer time, and 96 layers is taken as 2x; so about
2.2, 3.1 and 10.6 worker-minutes (measured since: 96-layer runs took 498-520 s of training with
the cores to themselves, 2.1-2.2x; 48-layer runs at warmup 100, 255-343 s; 24-layer runs a
median 162 s of training and 60 s of measuring, so about 3.7 worker-minutes; 12-layer runs 91 s
and 37 s, about 2.1 worker-minutes).
What it runs, and what it cuts:

* every method at 48 layers, warmup 20, both lrs, 3 seeds (the 108 runs; about 4.7 h);
* depth 12 and 24 at warmup 20 for post, pre and ``FOCUS`` only: 3 seeds where Post-Norm
  collapses, (24, 3e-3), and next to one, (24, 1e-3) and (12, 3e-3); 1 seed at (12, 1e-3)
  (the stability map, docs/RESULTS.md);
* warmup 100 for post, pre and ``FOCUS`` only, at 24 and 48 layers, both lrs, 3 seeds (each cell
  is next to a warmup-20 cell where Post-Norm collapses or next to one); not at 12 layers,
  where no placement collapses at warmup 20;
* 96 layers at lr 1e-3, warmup 20, 1 seed: post, pre and the methods that claim depth
  (``DEPTH_METHODS``).

That is 60 + 72 + 7 runs beyond the 108, about 540 worker-minutes (4.5 h with ``--workers 2``), and
9.3 h for the whole grid of 247 runs (it took 11 h 50 min of wall time in nine sittings, some of
them sharing the cores with the test suite: docs/LEADERBOARD.md). A host with more cores runs the
whole grid, or shards it with ``--shard i/n``. ``FOCUS`` are the four methods that prevented the
collapse on all six of their runs at 48 layers and learned past the unigram floor
(docs/LEADERBOARD.md): the three published baselines with the smallest largest gap to Pre-Norm's
loss (sandwich and Peri-LN +0.080, Mix-LN +0.103) and the adaptive placement (+0.108), the one
improvement of the paper that prevented it; the residual budgets prevent it only by the rule's
letter (their loss stays at the floor). Chosen when every method that could still prevent the
collapse had its six runs in; the methods with runs left had collapsed on one already.
"""

import json
import os

from configs.default import get_config
from postnorm.model.placements import profile_text

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
    # the training-time methods (configs/sweeps/training_methods.py studies each further)
    "post_grad_repair": {"model.norm": "post", "train.grad_repair": True},
    "post_diversity": {"model.norm": "post", "opt.diversity_weight": 0.1},
    "post_z_loss": {"model.norm": "post", "opt.z_loss": 1e-4},
    "post_monitor_rollback": {"model.norm": "post", "monitor.action": "lr_scale",
                              "monitor.rollback": True, "train.ckpt_every": 10},
}
# The methods as revised since the 300-step board (variant ``revised``), trained into their own
# archive until the board is regenerated with them: the published baselines in their published
# form (``b2t_published`` then becomes the B2T row), Admin, and the adaptive placement with the
# two-way controller and its control, the final lambda profile of the same lr and seed fixed from
# step 0 (``adaptive_own_profile``: planned once that run is archived).
REVISED: dict[str, dict[str, object]] = {
    # B2T's released code: every layer matrix x L^(-1/2) with the connection on, and gradient
    # clipping at 0.1 (its README's training command)
    "b2t_published": {"model.norm": "b2t", "model.b2t_rescaled_init": True,
                      "opt.clip_norm": 0.1},
    # DeepNet's init: Xavier normal, beta on W_V, W_O and the FFN (gain 1 on W_Q, W_K)
    "deepnorm_xavier": {"model.norm": "deepnorm", "model.init": "xavier_normal"},
    # Admin: omega from a profiling pass at init
    "admin": {"model.norm": "admin"},
    # lambda moved by the backward gain across each sublayer, which clears at Pre
    "adaptive_two_way": {"model.norm": "adaptive", "train.placement_signal": "two_way"},
    # a non-empty model.adaptive_profile marks it (``method_of``); the profile is the run's
    "adaptive_own_profile": {"model.norm": "adaptive", "train.placement_controller": False},
}
REVISED_ARCHIVE = "results/leaderboard_revised/runs"
ALL_METHODS = {**METHODS, **REVISED}
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
DEPTH_METHODS = ("post", "pre", "deepnorm", "mixln", "b2t", "adaptive", "post_grad_repair")
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


def _grid() -> list[dict[str, object]]:
    """The full grid of the module docstring, seed 0 of every cell first."""
    def cell(method: str, layers: int, lr: float, warmup: int, seed: int) -> dict[str, object]:
        return _run(method, lr, seed, **{"model.n_layers": layers, "opt.warmup_steps": warmup})

    cells = [(method, 48, lr, 20, 3) for method in METHODS for lr in LRS]
    few = ("post", "pre", *FOCUS)
    cells += [(method, layers, lr, 20, 3 if (layers, lr) in THREE_SEED_CELLS else 1)
              for method in few for layers in (12, 24) for lr in LRS]
    cells += [(method, layers, lr, 100, 3) for method in few for layers in (24, 48)
              for lr in LRS]
    cells += [(method, 96, 1e-3, 20, 1) for method in DEPTH_METHODS]
    return [cell(method, layers, lr, warmup, seed) for seed in SEEDS
            for method, layers, lr, warmup, seeds in cells if seed < seeds]


def _revised(archive_dir: str) -> list[dict[str, object]]:
    """The ``REVISED`` methods at 48 layers, warmup 20, both lrs, three seeds; each
    ``adaptive_own_profile`` run once its ``adaptive_two_way`` run is in ``archive_dir``."""
    plan = []
    for seed in SEEDS:
        for method in REVISED:
            for lr in LRS:
                run = _run(method, lr, seed)
                if method == "adaptive_own_profile":
                    two_way = _run("adaptive_two_way", lr, seed)
                    path = os.path.join(archive_dir, f"{run_name(two_way)}.json")
                    if not os.path.exists(path):
                        continue
                    with open(path) as f:
                        final = json.load(f)["result"]["final_post_mix"]
                    run["model.adaptive_profile"] = profile_text(final)
                plan.append(run)
    return plan


def get_sweep(arg: str | None = None) -> list[dict[str, object]]:
    """One dict of config overrides per run; ``arg`` ``"blocked"`` gives the kernel check,
    ``"grid"`` the full grid, ``"revised"`` the ``REVISED`` methods at 48 layers, both lrs,
    three seeds."""
    if arg in (None, ""):
        return [_run(method, lr, seed) for seed in SEEDS for method in METHODS for lr in LRS]
    if arg == "blocked":
        return [_run(method, 3e-3, 0, **{"model.attention": "blocked"}) for method in METHODS]
    if arg == "grid":
        return _grid()
    if arg == "revised":
        return _revised(REVISED_ARCHIVE)
    raise ValueError(f"unknown sweep variant {arg!r}; known: blocked, grid, revised")
