"""The forensic dump of a non-finite step: ``<workdir>/nonfinite_step_<n>.json``."""

import glob
import json
import os
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from postnorm.diagnostics.taps import TAP_NORM_NAMES
from postnorm.files import dumps, replace_file
from postnorm.model.decoder import SUBLAYERS
from postnorm.workdir.layout import Workdir

# Diagnostic names that are not forward statistics of the residual stream.
_NOT_FORWARD = (*TAP_NORM_NAMES, "param_norm", "grad_norm", "update_norm")


def _sublayer(name: str) -> str:
    """The sublayer a per-layer forward statistic belongs to (attention stats: ``attn_*``)."""
    return "ffn" if name.endswith("_ffn") else "attn"


def first_nonfinite_forward(diagnostics: dict[str, np.ndarray]) -> dict[str, Any] | None:
    """The first (layer, sublayer) in forward order with a non-finite forward statistic."""
    per_layer = {k: np.asarray(v) for k, v in diagnostics.items()
                 if np.ndim(v) == 1 and not k.startswith(_NOT_FORWARD)}
    n_layers = max((len(v) for v in per_layer.values()), default=0)
    for layer in range(n_layers):
        for sublayer in SUBLAYERS:
            bad = sorted(k for k, v in per_layer.items()
                         if _sublayer(k) == sublayer and not np.isfinite(v[layer]))
            if bad:
                return {"layer": layer, "sublayer": sublayer, "nonfinite_stats": bad}
    final = sorted(k for k, v in diagnostics.items()
                   if np.ndim(v) == 0 and not np.isfinite(v) and not k.startswith(_NOT_FORWARD))
    return {"layer": "final", "nonfinite_stats": final} if final else None


def _every_process(value: dict) -> dict[str, dict]:
    """``{"process_<i>-of-<n>": value of process i}``, gathered from every process."""
    n = jax.process_count()
    if n == 1:
        return {"process_0-of-1": value}
    data = np.frombuffer(json.dumps(value).encode(), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.asarray(data.size))).ravel()
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[: data.size] = data
    rows = np.asarray(multihost_utils.process_allgather(padded))
    return {f"process_{i}-of-{n}": json.loads(rows[i, : sizes[i]].tobytes()) for i in range(n)}


def write_nonfinite_dump(workdir: str, step: int, iterator_state: dict,
                         metrics: dict[str, float], diagnostics: dict[str, np.ndarray]) -> str:
    """Writes the dump (process 0; every process must call this) and returns its path."""
    iterator_states = _every_process(iterator_state)
    path = Workdir(workdir).nonfinite_dump(step)
    if jax.process_index() != 0:
        return path
    record = {
        "step": step,
        "loss": float(metrics["train/loss"]),
        "grad_norm": float(metrics["train/grad_norm"]),
        "data_iterator_state_before_batch": iterator_states,
        "first_nonfinite_forward": first_nonfinite_forward(diagnostics),
        "layers_with_nonfinite_gradients": sorted({
            int(layer) for k, v in diagnostics.items() if k.startswith("grad_norm_")
            for layer in np.flatnonzero(~np.isfinite(np.asarray(v)))}),
        # The step's update is never applied, so its update norms would read 0: left out.
        "diagnostics": {k: np.asarray(v, np.float64).tolist() for k, v in diagnostics.items()
                        if not k.startswith("update_norm_")},
    }
    replace_file(path, dumps(record, indent=1).encode())
    return path


def set_aside_dumps(workdir: str) -> list[str]:
    """Move the dumps in ``workdir`` into ``<workdir>/earlier_attempts/`` (kept, not deleted):
    a run starting afresh from step 0 is not the attempt that wrote them. Returns the new
    paths."""
    moved = []
    layout = Workdir(workdir)
    for path in sorted(glob.glob(layout.nonfinite_dumps)):
        target_dir = layout.earlier_attempts
        os.makedirs(target_dir, exist_ok=True)
        stem = os.path.basename(path).removesuffix(".json")
        target, k = os.path.join(target_dir, f"{stem}.json"), 0
        while os.path.exists(target):  # an older attempt's dump of the same step is kept
            k += 1
            target = os.path.join(target_dir, f"{stem}-{k}.json")
        os.rename(path, target)
        moved.append(target)
    return moved
