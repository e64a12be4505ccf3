"""The measures of one finished run that the leaderboard tabulates (``experiments.leaderboard``),
taken on its final checkpoint and its records, cached in the workdir."""

import json
import os

import numpy as np

from postnorm.analysis.collapse import DEFAULT_RULE, detect_collapse, replay_monitor
from postnorm.analysis.thm38 import next_batches_loss
from postnorm.files import write_json_atomic
from postnorm.train.experiment import restore_run
from postnorm.workdir.config_record import recorded_config
from postnorm.workdir.layout import latest_checkpoint_step
from postnorm.workdir.metrics import layer_series, read_metrics

CACHE = "leaderboard.json"


def cached_measures(workdir: str) -> dict | None:
    """The measures ``run_measures`` cached in ``workdir``, or None where it has not run."""
    path = os.path.join(workdir, CACHE)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def run_measures(workdir: str, fresh_batches: int) -> dict:
    """The measures of one finished run (``experiments.leaderboard``'s docstring), cached in
    the workdir by its checkpoint step and the batch count."""
    step = latest_checkpoint_step(workdir)
    path = os.path.join(workdir, CACHE)
    if os.path.exists(path):
        with open(path) as f:
            cached = json.load(f)
        if (cached.get("checkpoint_step") == step and cached.get("fresh_batches") == fresh_batches
                and "first_warn" in cached):
            return cached
    config = recorded_config(workdir)
    exp, state, step, batches = restore_run(config, workdir, "measure", data_position=True)
    fresh = next_batches_loss(exp, state, batches, fresh_batches)
    records = read_metrics(workdir)
    series = layer_series(records)
    early = DEFAULT_RULE.early_layers
    c_min = min(float(np.nanmin(series[f"c_min_{kind}"][1])) for kind in ("attn", "ffn"))
    _, grad_LxS = series["dldx_norm_attn"]
    ratio = grad_LxS[:early, 0] / grad_LxS[:early, -1]
    updates = [series[f"update_norm_{group}"][1][:early, -1] for group in ("attn", "ffn")
               if f"update_norm_{group}" in series]
    collapse = detect_collapse(records)
    first_warn = replay_monitor(records)[1].first_warn
    measures = {
        "checkpoint_step": int(step), "fresh_batches": fresh_batches,
        "fresh_loss": fresh["loss"], "fresh_floor": fresh["floor"], "lfreq": fresh["lfreq"],
        "fresh_loss_over_lfreq": fresh["loss_over_lfreq"],
        "min_c": c_min,
        "dldx_first_over_last_early": float(np.exp(np.mean(np.log(ratio)))),
        "update_norm_early": (float(np.mean(np.sqrt(sum(u**2 for u in updates))))
                              if updates else None),
        "first_warn": first_warn,
        "warn_lead": (collapse.collapse_step - first_warn
                      if collapse.collapsed and first_warn is not None else None),
        "false_alarm": not collapse.collapsed and first_warn is not None,
    }
    write_json_atomic(path, measures)
    return measures
