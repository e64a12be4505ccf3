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

import contextlib
import json
import os
import time
from collections.abc import Callable

import ml_collections
from absl import logging

from postnorm.collapse import DEFAULT_RULE, CollapseRule, detect_collapse
from postnorm.data import DataError
from postnorm.data.files import write_json_atomic
from postnorm.json_numbers import from_text
from postnorm.nonfinite import NonFiniteError
from postnorm.output_dir import make_output_dir
from postnorm.plots import read_metrics
from postnorm.run_config import (
    WorkdirError,
    check_run_config,
    config_digest,
    latest_checkpoint_step,
)
from postnorm.run_summary import summarize
from postnorm.train import train_and_evaluate

RESULT_NAME = "result.json"
WALL_TIME_NAME = "wall_time.json"
TrainFn = Callable[[ml_collections.ConfigDict, str], object]


class RunRecordError(WorkdirError):
    """A run's ``result.json`` or ``wall_time.json`` that cannot be read."""


def _read_record(path: str, keys: tuple[str, ...], fix: str) -> dict | None:
    """The JSON object at ``path`` with ``keys``, None if there is no file; a file that is
    not such an object raises ``RunRecordError`` naming it and ``fix``."""
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            record = from_text(json.load(f))
    except OSError as err:
        raise RunRecordError(f"{path} cannot be read ({err.strerror or err}): make it a "
                             "readable file") from err
    except ValueError as err:  # JSONDecodeError and UnicodeDecodeError
        why = str(err)
    else:
        missing = [k for k in keys if k not in record] if isinstance(record, dict) else keys
        if not missing:
            return record
        why = f"no {', '.join(missing)}"
    raise RunRecordError(f"{path} is damaged ({why}); delete it and rerun: {fix}")


def read_result(workdir: str) -> dict | None:
    """``<workdir>/result.json``; None before the run finished."""
    return _read_record(os.path.join(workdir, RESULT_NAME), ("status", "config_digest"),
                        "the run is then checked against its checkpoints, resumed if they fall "
                        "short of train.steps, and its result recorded again")


def is_finished(workdir: str, config: ml_collections.ConfigDict) -> bool:
    """See the module docstring."""
    result = read_result(workdir)
    if result is None or result["config_digest"] != config_digest(config):
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
    for key in ("skipped_steps", "rollbacks"):
        values = [r[f"train/{key}"] for r in records if f"train/{key}" in r]
        out[key] = int(values[-1]) if values else 0
    return out


def _recorded_train_s(workdir: str, config: ml_collections.ConfigDict) -> float:
    """The time ``config``'s run has spent in ``workdir`` over its earlier invocations
    (``<workdir>/wall_time.json``); a total recorded for another config (a workdir that
    started afresh), or by a version that recorded no config digest, is not carried over."""
    recorded = _read_record(os.path.join(workdir, WALL_TIME_NAME), ("train_s",),
                            "the run's recorded wall time then restarts at that invocation")
    if recorded is None or recorded.get("config_digest") != config_digest(config):
        return 0.0
    return float(recorded["train_s"])


def _record_train_s(workdir: str, config: ml_collections.ConfigDict, total: float) -> None:
    """Records ``total`` as the time ``config``'s run has spent in ``workdir``."""
    write_json_atomic(os.path.join(workdir, WALL_TIME_NAME),
                      {"train_s": total, "config_digest": config_digest(config)})


def run_once(config: ml_collections.ConfigDict, workdir: str, *,
             train_fn: TrainFn = train_and_evaluate, rule: CollapseRule = DEFAULT_RULE) -> dict:
    """Train ``config`` in ``workdir`` unless finished; returns the run's result record.

    ``train_fn(config, workdir)`` trains and resumes (``postnorm.train.train_and_evaluate``).
    ``Preempted`` and every error other than ``NonFiniteError`` propagate without a record.
    ``wall_s`` is the time of every invocation that trained the run, preempted and failed ones
    included. A run stopped by a non-finite step has ``skipped_steps`` None: it stopped at the
    first one.
    """
    if is_finished(workdir, config):
        return read_result(workdir)
    check_run_config(workdir, config)
    make_output_dir(workdir, "workdir")
    earlier_s = _recorded_train_s(workdir, config)  # a damaged record: refused before training
    resumed_from = latest_checkpoint_step(workdir)
    start = time.perf_counter()
    status, error = "done", None
    try:
        train_fn(config, workdir)
    except NonFiniteError as err:
        status, error = "nonfinite", str(err)
    except BaseException:  # preempted and failed invocations count too; their error wins
        with contextlib.suppress(DataError, OSError):  # a full disk fails this write too
            _record_train_s(workdir, config, earlier_s + time.perf_counter() - start)
        raise
    wall_s = earlier_s + time.perf_counter() - start
    _record_train_s(workdir, config, wall_s)
    result = {
        "workdir": os.path.abspath(workdir),
        "status": status,
        "error": error,
        "config_digest": config_digest(config),
        "train_steps": config.train.steps,
        "resumed_from_step": resumed_from,
        "wall_s": wall_s,
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    if os.path.exists(os.path.join(workdir, "metrics.jsonl")):
        result.update(run_metrics_summary(workdir, rule))
        result["workdir"] = os.path.abspath(workdir)
    if status == "nonfinite":  # the records after the step that stopped it were dropped
        result["skipped_steps"] = None
    write_json_atomic(os.path.join(workdir, RESULT_NAME), result)
    return result


def run_logged(config: ml_collections.ConfigDict, workdir: str, label: str) -> str:
    """``run_once``, then a log line with ``label``, the run's status and its wall time."""
    start = time.perf_counter()
    result = run_once(config, workdir)
    logging.info("%s: %s, %.0f s", label, result["status"], time.perf_counter() - start)
    return result["status"]
