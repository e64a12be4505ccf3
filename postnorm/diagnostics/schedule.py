"""Which steps run the diagnostic step: step 1, every ``diag.dense_every`` steps up to
``diag.dense_until``, and every ``diag.every`` steps throughout.

A dense early phase resolves a collapse's transition window (tens of steps at the default
config) without paying for per-layer statistics every few steps of a long run.
"""

import ml_collections


def is_diagnostic_step(step: int, diag: ml_collections.ConfigDict | dict) -> bool:
    """Whether ``step`` (1-based) is a diagnostic step under the ``diag`` section."""
    dense = step <= diag.get("dense_until", 0) and step % diag.get("dense_every", 1) == 0
    return step == 1 or dense or step % diag["every"] == 0


def diagnostic_steps(total: int, diag: ml_collections.ConfigDict | dict) -> list[int]:
    """Every diagnostic step of a ``total``-step run, in order."""
    return [step for step in range(1, total + 1) if is_diagnostic_step(step, diag)]
