"""The long-horizon protocol: verdicts past the 300-step screen (docs/PROTOCOL.md).

    python -m experiments.sweep --sweep configs/sweeps/protocol.py:calibration \\
        --out_dir runs/protocol --archive results/protocol/runs --workers 2

Every run clips the global gradient norm at ``CLIP`` (the source papers all clip), warms up
over ``WARMUP_FRACTION`` of its steps, then decays by the default cosine, and is scored on
``EVAL_BATCHES`` held-out batches of the validation split (never trained on) every
``EVAL_EVERY`` steps. Per-layer diagnostics run every 10 steps over the first 300 (the
300-step screen's resolution, where collapse sets in) and every ``DIAG_EVERY`` after.

Variant ``calibration``: Post-Norm against Pre-Norm at 12 layers, where neither collapses at 300
steps, for ``LONG_STEPS`` steps (about 0.9 epochs of the embedded corpus's 6.8M training tokens
at batch 16 x 128), lr {1e-3, 3e-3, 1e-2}, seeds 0-2: does the toy reproduce the literature's
ordering (Post-Norm, when it trains, at least as good as Pre-Norm)?
"""

BASE_CONFIG = "configs/default.py"

LONG_STEPS = 3000
WARMUP_FRACTION = 0.05
CLIP = 1.0
EVAL_EVERY = 250
EVAL_BATCHES = 32
DIAG_EVERY = 50
SEEDS = (0, 1, 2)
CALIBRATION_LRS = (1e-3, 3e-3, 1e-2)


def protocol(steps: int, warmup_fraction: float = WARMUP_FRACTION,
             clip: float = CLIP) -> dict[str, object]:
    """The fields every protocol run of ``steps`` steps sets."""
    return {"train.steps": steps, "opt.warmup_steps": round(warmup_fraction * steps),
            "opt.clip_norm": clip, "train.eval_every": min(EVAL_EVERY, steps),
            "train.eval_batches": EVAL_BATCHES, "diag.every": DIAG_EVERY,
            "diag.dense_every": 10, "diag.dense_until": 300,
            "train.ckpt_every": 500, "train.keep_ckpts": 2}


def run_name(overrides: dict[str, object]) -> str:
    """A run's id, e.g. ``post_layers12_lr0.001_steps3000_seed0``."""
    return (f"{overrides['model.norm']}_layers{overrides['model.n_layers']}"
            f"_lr{overrides['opt.lr']!r}_steps{overrides['train.steps']}_seed{overrides['seed']}")


def _calibration() -> list[dict[str, object]]:
    return [{"model.norm": norm, "model.n_layers": 12, "opt.lr": lr, "seed": seed,
             **protocol(LONG_STEPS)}
            for seed in SEEDS for lr in CALIBRATION_LRS for norm in ("post", "pre")]


def get_sweep(arg: str | None = None) -> list[dict[str, object]]:
    """One dict of config overrides per run of the variant ``arg``."""
    if arg == "calibration":
        return _calibration()
    raise ValueError(f"unknown sweep variant {arg!r}; known: calibration")
