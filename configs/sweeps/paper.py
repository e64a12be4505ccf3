"""The paper's setup (``configs/paper.py``: 48 layers, d=512, n=2048, C4) over the two training
choices the paper leaves open and names as collapse's sensitivities: the peak learning rate
{1e-4, 3e-4, 1e-3} x the warmup {200, 2000} steps, Post and Pre, seed 0 (12 runs).

    python -m experiments.sweep --sweep configs/sweeps/paper.py --out_dir runs/paper_sweep \\
        --override data.data_dir=/mnt/tfds,data.tokenizer_path=/path/spm32k.model [--shard i/n]

An accelerator sweep (each run 100k steps of batch 64 x 2048 tokens): not run on this project's
CPU machine. ``configs/paper.py:width48`` is the paper's width that a CPU trains
(``experiments.collapse``, docs/RESULTS.md).
"""

import itertools

BASE_CONFIG = "configs/paper.py"

LRS = (1e-4, 3e-4, 1e-3)
WARMUPS = (200, 2000)
NORMS = ("post", "pre")


def get_sweep(arg: str | None = None) -> list[dict[str, object]]:
    """One dict of config overrides per run."""
    if arg not in (None, ""):
        raise ValueError(f"unknown sweep variant {arg!r}; this sweep has none")
    return [{"opt.lr": lr, "opt.warmup_steps": warmup, "model.norm": norm}
            for lr, warmup, norm in itertools.product(LRS, WARMUPS, NORMS)]
