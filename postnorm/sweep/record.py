"""Run a config in a workdir once: skip it when finished, resume it when partial, record it."""

import contextlib
import json
import os
import time
from collections.abc import Callable

import ml_collections
import numpy as np
from absl import logging

from postnorm.analysis.collapse import DEFAULT_RULE, CollapseRule, detect_collapse
from postnorm.analysis.figures import plots_after_training
from postnorm.analysis.summary import summarize
from postnorm.config.identity import (
    config_data,
    config_digest,
    earlier_versions,
    flatten_fields,
)
from postnorm.config.schema import base_config
from postnorm.errors import NonFiniteError
from postnorm.files import FileWriteError, from_text, make_output_dir, write_json_atomic
from postnorm.model.attention_choice import AUTO
from postnorm.model.layers import ATTENTION_KERNELS
from postnorm.train.loop import train_and_evaluate
from postnorm.train.losses import TERM_NAMES
from postnorm.train.monitor_actions import recorded_actions
from postnorm.train.placement_control import final_profile
from postnorm.workdir.config_record import check_run_config
from postnorm.workdir.layout import Workdir, WorkdirError, latest_checkpoint_step
from postnorm.workdir.metrics import read_metrics

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
    return _read_record(Workdir(workdir).result, ("status", "config_digest"),
                        "the run is then checked against its checkpoints, resumed if they fall "
                        "short of train.steps, and its result recorded again")


def planned_digests(config: ml_collections.ConfigDict) -> set[str]:
    """The config digests a record of ``config``'s run may carry: its own and that of each
    earlier schema's record of the same run (``identity.earlier_versions``), and under
    ``model.attention=auto`` those of each such config naming each kernel (a run recorded
    before ``auto`` was the default named its kernel)."""
    data = config_data(config)
    defaults = flatten_fields(config_data(base_config()))
    versions = [data, *earlier_versions(data, defaults)]
    if config.model.attention == AUTO:
        versions += [{**v, "model": {**v["model"], "attention": kernel}}
                     for v in list(versions) for kernel in ATTENTION_KERNELS]
    return {config_digest(v) for v in versions}


def is_finished(workdir: str, config: ml_collections.ConfigDict) -> bool:
    """Whether the run needs nothing more: docs/INTERNALS.md, ``sweep/record.py``."""
    result = read_result(workdir)
    if result is None or result["config_digest"] not in planned_digests(config):
        return False
    if result["status"] == "nonfinite":
        return True
    return result["status"] == "done" and latest_checkpoint_step(workdir) == config.train.steps


def run_metrics_summary(workdir: str, rule: CollapseRule = DEFAULT_RULE, tail: int = 3) -> dict:
    """Loss against L_freq (``run_summary.summarize``, over the last ``tail`` train steps), the
    collapse detection, the objective's parts, the monitor's actions in effect of a run
    (each as ``monitor_actions.json`` has it, with the count of its layers at tsim >= 0.99 in
    place of their list) and, with a lambda profile (``model.norm=adaptive``), the one it ended
    with: ``final_post_mix``, [n_layers][attention, FFN]."""
    records = read_metrics(workdir)  # holds a train step
    out: dict = summarize(workdir, early_layers=rule.early_layers, tail=tail)
    if any(k.startswith("diag/tsim_attn/") for r in records for k in r):
        out["collapse"] = detect_collapse(records, rule).to_json()
    for key in ("skipped_steps", "rollbacks"):
        values = [r[f"train/{key}"] for r in records if f"train/{key}" in r]
        out[key] = int(values[-1]) if values else 0
    out["final_train_parts"] = objective_parts(records, tail)
    out["monitor_actions"] = [{k: v for k, v in entry.items() if k != "layers"}
                              | {"layers_alike": len(entry["layers"])}
                              for entry in recorded_actions(workdir)]
    profile_Lx2 = final_profile(records)
    if profile_Lx2 is not None:
        out["final_post_mix"] = profile_Lx2.tolist()
    return out


def objective_parts(records: list[dict], tail: int) -> dict[str, float]:
    """Each part of the objective (``train/ce`` and the terms of ``losses.TERM_NAMES``) where
    the run logged parts: its mean over the last ``tail`` train steps that logged it."""
    parts = {}
    for name in ("ce", *TERM_NAMES):
        values = [r[f"train/{name}"] for r in records if f"train/{name}" in r]
        if values:
            parts[name] = float(np.mean(values[-tail:]))
    return parts


def _recorded_train_s(workdir: str, config: ml_collections.ConfigDict) -> float:
    """The time ``config``'s run has spent in ``workdir`` over its earlier invocations
    (``<workdir>/wall_time.json``); a total recorded for another config (a workdir that
    started afresh), or by a version that recorded no config digest, is not carried over."""
    recorded = _read_record(Workdir(workdir).wall_time, ("train_s",),
                            "the run's recorded wall time then restarts at that invocation")
    if recorded is None or recorded.get("config_digest") not in planned_digests(config):
        return 0.0
    return float(recorded["train_s"])


def _record_train_s(workdir: str, config: ml_collections.ConfigDict, total: float) -> None:
    """Records ``total`` as the time ``config``'s run has spent in ``workdir``."""
    write_json_atomic(Workdir(workdir).wall_time,
                      {"train_s": total, "config_digest": config_digest(config)})


def run_once(config: ml_collections.ConfigDict, workdir: str, *,
             train_fn: TrainFn = train_and_evaluate, rule: CollapseRule = DEFAULT_RULE) -> dict:
    """Train ``config`` in ``workdir`` unless finished; returns the run's result record.

    ``train_fn(config, workdir)`` trains and resumes (``postnorm.train.loop.train_and_evaluate``);
    the run's figures are drawn after it.
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
        with contextlib.suppress(FileWriteError, OSError):  # a full disk fails this write too
            _record_train_s(workdir, config, earlier_s + time.perf_counter() - start)
        raise
    wall_s = earlier_s + time.perf_counter() - start
    _record_train_s(workdir, config, wall_s)
    if status == "done":
        plots_after_training(workdir)  # the trainer draws none
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
    if os.path.exists(Workdir(workdir).metrics):
        result.update(run_metrics_summary(workdir, rule))
        result["workdir"] = os.path.abspath(workdir)
    if status == "nonfinite":  # the records after the step that stopped it were dropped
        result["skipped_steps"] = None
    write_json_atomic(Workdir(workdir).result, result)
    return result


def run_logged(config: ml_collections.ConfigDict, workdir: str, label: str) -> str:
    """``run_once``, then a log line with ``label``, the run's status and its wall time."""
    start = time.perf_counter()
    result = run_once(config, workdir)
    logging.info("%s: %s, %.0f s", label, result["status"], time.perf_counter() - start)
    return result["status"]
