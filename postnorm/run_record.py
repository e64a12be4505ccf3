"""Run a config in a workdir once: skip it when finished, resume it when partial, record the result.

A run is **finished** when ``<workdir>/result.json`` (written atomically, last) exists, was
written for the same config (sha256 of its canonical JSON; process settings such as
``runtime.allocator`` are not part of it), and either ended with status
``done`` while the newest finalized checkpoint is at ``train.steps``, or ended with status
``nonfinite`` (a NaN/Inf step stopped it under ``train.nonfinite=abort``: rerunning would repeat
it). Anything else is rerun through the trainer, which resumes from the latest checkpoint.
A workdir whose ``config.json`` holds a different config is refused rather than overwritten
(``postnorm.run_config.check_run_config``).
"""

import json
import os
import time
from collections.abc import Callable

import ml_collections
from absl import logging

from postnorm.collapse import DEFAULT_RULE, CollapseRule, detect_collapse
from postnorm.data.files import write_json_atomic
from postnorm.nonfinite import NonFiniteError
from postnorm.plots import read_metrics
from postnorm.run_config import check_run_config, config_digest, latest_checkpoint_step
from postnorm.run_summary import summarize
from postnorm.train import train_and_evaluate

RESULT_NAME = "result.json"
TrainFn = Callable[[ml_collections.ConfigDict, str], object]


def read_result(workdir: str) -> dict | None:
    path = os.path.join(workdir, RESULT_NAME)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def is_finished(workdir: str, config: ml_collections.ConfigDict) -> bool:
    """See the module docstring."""
    result = read_result(workdir)
    if result is None or result.get("config_digest") != config_digest(config):
        return False
    if result["status"] == "nonfinite":
        return True
    return result["status"] == "done" and latest_checkpoint_step(workdir) == config.train.steps


def run_metrics_summary(workdir: str, rule: CollapseRule = DEFAULT_RULE) -> dict:
    """Loss against L_freq (``run_summary.summarize``) and the collapse detection of a run."""
    records = read_metrics(workdir)  # holds a train step
    out: dict = summarize(workdir, early_layers=rule.early_layers)
    if any(k.startswith("diag/tsim_attn/") for r in records for k in r):
        out["collapse"] = detect_collapse(records, rule).to_json()
    skipped = [r["train/skipped_steps"] for r in records if "train/skipped_steps" in r]
    out["skipped_steps"] = int(skipped[-1]) if skipped else 0
    return out


def run_once(config: ml_collections.ConfigDict, workdir: str, *,
             train_fn: TrainFn = train_and_evaluate, rule: CollapseRule = DEFAULT_RULE) -> dict:
    """Train ``config`` in ``workdir`` unless finished; returns the run's result record.

    ``train_fn(config, workdir)`` trains and resumes (``postnorm.train.train_and_evaluate``).
    ``Preempted`` and every error other than ``NonFiniteError`` propagate without a record.
    """
    if is_finished(workdir, config):
        return read_result(workdir)
    check_run_config(workdir, config)
    os.makedirs(workdir, exist_ok=True)
    resumed_from = latest_checkpoint_step(workdir)
    start = time.perf_counter()
    status, error = "done", None
    try:
        train_fn(config, workdir)
    except NonFiniteError as err:
        status, error = "nonfinite", str(err)
    result = {
        "workdir": os.path.abspath(workdir),
        "status": status,
        "error": error,
        "config_digest": config_digest(config),
        "train_steps": config.train.steps,
        "resumed_from_step": resumed_from,
        "wall_s": time.perf_counter() - start,
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    if os.path.exists(os.path.join(workdir, "metrics.jsonl")):
        result.update(run_metrics_summary(workdir, rule))
        result["workdir"] = os.path.abspath(workdir)
    write_json_atomic(os.path.join(workdir, RESULT_NAME), result)
    return result


def run_logged(config: ml_collections.ConfigDict, workdir: str, label: str) -> str:
    """``run_once``, then a log line with ``label``, the run's status and its wall time."""
    start = time.perf_counter()
    result = run_once(config, workdir)
    logging.info("%s: %s, %.0f s", label, result["status"], time.perf_counter() - start)
    return result["status"]
