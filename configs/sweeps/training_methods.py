"""The training-time remedies on the default CPU config (48 layers, d=64, d_ff=192, n=128,
batch 16, embedded corpus, 300 steps, lr 1e-3 unless stated): gradient repair, the
frequency-loss regulariser, the z-loss and the early-warning monitor's actions
(docs/METHODS.md). Post-Norm and Pre-Norm without any of them at lr 1e-3, seeds 0-2, are the
leaderboard's runs (configs/sweeps/leaderboard.py), the controls.

    python -m experiments.sweep --sweep configs/sweeps/training_methods.py \\
        --out_dir runs/training_methods --archive results/training_methods/runs --workers 2 \\
        --fresh_batches 512 --skip_archived results/leaderboard/runs
    python -m experiments.training_methods --out_dir results/figures/training_methods

Groups (variant ``<group>`` runs one alone):

* ``repair``: Post-Norm with and without gradient repair, with AdamW (lr 1e-3) and with the
  SGD-with-momentum control (lr 0.1, momentum 0.9, weight decay 1e-4: with the decay in the
  momentum, weights shrink by lr wd / (1 - momentum) = 1e-4 of themselves per step, as under
  AdamW's lr wd = 1e-4; at the default 0.1 they would shrink by 10% per step), seed 0;
* ``depth96``: 96-layer Post-Norm with and without repair (the paper claims 100+ layers);
* ``regulariser``: the position-diversity regulariser at weights 0.1 and 0.3 on Post- and
  Pre-Norm, seeds 0-2;
* ``z_loss``: Post-Norm with z-loss 1e-4, seeds 0-2;
* ``monitor``: Post-Norm with the monitor's lr_scale, layer_lr and clip actions, each after a
  rollback to the checkpoint before the warn, seeds 0-2 (checkpoints every 10 steps, so that a
  rollback returns to just before the warn).

Variant ``controls`` (not among the groups: they are the leaderboard's runs) names Post- and
Pre-Norm without any remedy at lr 1e-3, seeds 0-2, for the table of
``python -m experiments.training_methods``, which finds each run by its config in the archives.
"""

BASE_CONFIG = "configs/default.py"

# Every field a run sets, at its default elsewhere, so that each run id names what it changes.
FIELDS = {"model.norm": "post", "model.n_layers": 48, "opt.lr": 1e-3, "opt.optimizer": "adamw",
          "opt.weight_decay": 0.1,
          "train.grad_repair": False, "opt.diversity_weight": 0.0, "opt.z_loss": 0.0,
          "monitor.action": "none", "monitor.rollback": False, "train.ckpt_every": 100,
          "seed": 0}
SEEDS = (0, 1, 2)


def _run(**changes: object) -> dict[str, object]:
    return {**FIELDS, **{k.replace("__", "."): v for k, v in changes.items()}}


GROUPS = {
    "repair": [_run(train__grad_repair=repair, opt__optimizer=optimizer, opt__lr=lr,
                    opt__weight_decay=decay)
               for optimizer, lr, decay in (("adamw", 1e-3, 0.1), ("sgd", 0.1, 1e-4))
               for repair in (False, True)],
    "depth96": [_run(model__n_layers=96, train__grad_repair=repair) for repair in (False, True)],
    "regulariser": [_run(model__norm=norm, opt__diversity_weight=weight, seed=seed)
                    for seed in SEEDS for norm in ("post", "pre") for weight in (0.1, 0.3)],
    "z_loss": [_run(opt__z_loss=1e-4, seed=seed) for seed in SEEDS],
    "monitor": [_run(monitor__action=action, monitor__rollback=True, train__ckpt_every=10,
                     seed=seed)
                for seed in SEEDS for action in ("lr_scale", "layer_lr", "clip")],
}


CONTROLS = [_run(model__norm=norm, seed=seed) for seed in SEEDS for norm in ("post", "pre")]


def run_name(overrides: dict[str, object]) -> str:
    """A run's id: what it changes, e.g. ``post_layers48_adamw_lr0.001_repair_seed0`` or
    ``post_layers48_adamw_lr0.001_monitor-clip-rollback_seed2`` (the same under every variant,
    so a run's archive record keeps its name)."""
    changes = [
        *(["repair"] if overrides["train.grad_repair"] else []),
        *([f"diversity{overrides['opt.diversity_weight']!r}"]
          if overrides["opt.diversity_weight"] else []),
        *([f"zloss{overrides['opt.z_loss']!r}"] if overrides["opt.z_loss"] else []),
        *([f"monitor-{overrides['monitor.action']}"
           + ("-rollback" if overrides["monitor.rollback"] else "")]
          if overrides["monitor.action"] != "none" else []),
    ]
    return "_".join([overrides["model.norm"], f"layers{overrides['model.n_layers']}",
                     overrides["opt.optimizer"], f"lr{overrides['opt.lr']!r}", *changes,
                     f"seed{overrides['seed']}"])


def get_sweep(arg: str | None = None) -> list[dict[str, object]]:
    """One dict of config overrides per run: every group, or the group ``arg``."""
    if arg in (None, ""):
        return [run for runs in GROUPS.values() for run in runs]
    if arg in GROUPS:
        return GROUPS[arg]
    if arg == "controls":
        return CONTROLS
    raise ValueError(f"unknown sweep variant {arg!r}; known: {', '.join(GROUPS)}, controls")
