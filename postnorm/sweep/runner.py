"""Running a sweep's plan: every run's config validated before the first starts, the
directory each run trains into (found by its config, so renamed runs are not trained again), and
the runs trained in order or in pinned worker processes."""

import functools
import os
from collections.abc import Callable

import jax
import ml_collections
from absl import logging

from postnorm.config import ConfigError, config_data, config_digest
from postnorm.config.args import ConfigArgError
from postnorm.data import DataError, load_data
from postnorm.runtime.console import LOG_LEVELS, most_verbose, set_log_level
from postnorm.sweep.archive import (
    ArchiveError,
    Measure,
    archive_path,
    archived_runs,
    check_id_free,
    read_entry,
    run_and_archive,
)
from postnorm.sweep.plan import RunSpec, SweepError, build_config
from postnorm.sweep.progress import RunShape, SweepProgress, run_times
from postnorm.sweep.record import (
    RunRecordError,
    is_finished,
    planned_digests,
    read_result,
    run_logged,
)
from postnorm.sweep.workers import run_pinned
from postnorm.train.validate import check_config
from postnorm.workdir.config_record import (
    WorkdirConfigError,
    config_with_later_defaults,
    read_run_config,
)


def planned_configs(base_config: str, specs: list[RunSpec],
                    extra: dict[str, str]) -> list[ml_collections.ConfigDict]:
    """Every run's config, each validated (``check_config``) before any run starts; an error
    names the run. Two runs of the same config are refused (e.g. ``lr=1`` and ``lr=1.0``).
    Before JAX starts its backends, the console takes the most verbose ``runtime.log_level``
    of the runs (``set_log_level``), which the worker processes inherit."""
    configs = []
    for number, spec in enumerate(specs, 1):
        try:
            configs.append(build_config(base_config, spec, extra))
        except (ConfigArgError, ConfigError, DataError) as err:
            raise SweepError(f"sweep run {number}/{len(specs)} ({spec.run_id}): {err}") from err
    levels = {config.get("runtime", {}).get("log_level") for config in configs}
    if levels and levels <= set(LOG_LEVELS):  # else check_config names the bad field below
        set_log_level(most_verbose(levels))
    seen = {}
    for number, (spec, config) in enumerate(zip(specs, configs, strict=True), 1):
        try:
            check_config(config, device_count=jax.device_count(),
                         process_count=jax.process_count())
        except (ConfigError, DataError) as err:
            raise SweepError(f"sweep run {number}/{len(specs)} ({spec.run_id}): {err}") from err
        if (twin := seen.setdefault(config_digest(config), spec.run_id)) != spec.run_id:
            raise SweepError(f"sweep runs {twin} and {spec.run_id} have the same config: "
                             "drop one of them from the sweep")
    return configs


def run_digests(recorded: dict) -> set[str]:
    """The digests of the planned configs whose run a recorded ``config.json`` holds: its own
    with the fields it predates at their defaults (``recorded_config``), and, since
    ``model.attention=auto`` is recorded as the kernel it chose, that of the same config with
    ``auto``."""
    data = config_data(config_with_later_defaults(recorded))
    as_auto = {**data, "model": {**data["model"], "attention": "auto"}}
    return {config_digest(recorded), config_digest(data), config_digest(as_auto)}


def _recorded_digests(out_dir: str) -> dict[str, set[str]]:
    """{directory of ``out_dir``: ``run_digests`` of the config it records (empty: none, or
    one that cannot be read)}."""
    digests = {}
    for name in sorted(os.listdir(out_dir)) if os.path.isdir(out_dir) else []:
        path = os.path.join(out_dir, name)
        if os.path.isdir(path):
            try:
                recorded = read_run_config(path)
            except WorkdirConfigError:
                recorded = None
            digests[path] = set() if recorded is None else run_digests(recorded)
    return digests


def run_workdirs(out_dir: str, specs: list[RunSpec],
                 configs: list[ml_collections.ConfigDict]) -> list[str]:
    """Each run's workdir: the directory of ``out_dir`` that records the run's config, its own
    ``out_dir/<run id>`` first; ``out_dir/<run id>`` when none does. Run ids name only what
    the sweep varies, so dropping a value or varying one more field renames runs (and may give
    a run the id an earlier run of another config had): renamed runs use the directories that
    hold their configs. Raises ``SweepError`` when two runs would share a directory."""
    digests = _recorded_digests(out_dir)
    holding: dict[str, str] = {}
    for path, held in digests.items():
        for digest in sorted(held):
            holding.setdefault(digest, path)
    workdirs, users = [], {}
    for spec, config in zip(specs, configs, strict=True):
        own, digest = os.path.join(out_dir, spec.run_id), config_digest(config)
        path = own if digest in digests.get(own, ()) else holding.get(digest, own)
        if path != own:
            logging.info("run %s: its config ran as %s (the sweep's run ids changed); using "
                         "that directory", spec.run_id, path)
        if (other := users.setdefault(path, spec.run_id)) != spec.run_id:
            raise SweepError(f"sweep runs {other} and {spec.run_id} would both use {path}, "
                             f"which holds a run of {other}'s config: move it aside")
        workdirs.append(path)
    return workdirs


Plan = Callable[[], tuple[list[RunSpec], list[ml_collections.ConfigDict], list[str]]]


def run_until_settled(plan: Plan, workers: int = 1, archive: str | None = None,
                      measure: Measure | None = None) -> None:
    """Train the runs of ``plan()`` (specs, configs, workdirs) with ``run_sweep``; with
    ``archive``, call ``plan()`` again and train what it adds, until it adds no config
    planned before (a plan read from the archive grows as its runs are recorded). A later
    round names no finished run again; its progress and ETA count them."""
    specs, configs, workdirs = plan()
    planned: set[str] = set()
    while True:
        run_sweep(specs, configs, workdirs, workers, archive, measure,
                  log_finished=not planned)
        planned |= {config_digest(config_data(config)) for config in configs}
        if archive is None:
            return
        specs, configs, workdirs = plan()
        added = [spec.run_id for spec, config in zip(specs, configs, strict=True)
                 if config_digest(config_data(config)) not in planned]
        if not added:
            return
        logging.info("the plan grew by %d run(s) from the runs recorded in %s: %s",
                     len(added), archive, ", ".join(added))


def run_sweep(specs: list[RunSpec], configs: list[ml_collections.ConfigDict],
              workdirs: list[str], workers: int = 1, archive: str | None = None,
              measure: Measure | None = None, log_finished: bool = True) -> None:
    """Train (or skip) every run of ``specs``: in order, or in ``workers`` pinned processes,
    which take the runs with the most FLOPs first so that no long run starts last. First
    and as each run ends it logs the progress of these runs (``SweepProgress``; under
    ``--shard``, the shard's).

    With ``archive`` (``postnorm.sweep.archive``), a run recorded there is not trained, and each
    run that ends is recorded there (with ``measure(workdir)`` when it ended ``done``).
    ``log_finished``: name each run finished before (else only the progress counts it)."""
    archived = archived_runs(archive, configs)
    for spec, config, entry in zip(specs, configs, archived, strict=True):
        if archive is not None and entry is None:  # before any run trains
            check_id_free(archive, spec.run_id, planned_digests(config))
    progress = SweepProgress(len(specs), workers, measured=measure is not None)
    jobs, shapes = [], []
    for number, (spec, config, workdir, entry) in enumerate(
            zip(specs, configs, workdirs, archived, strict=True), 1):
        label = f"run {number}/{len(specs)} {spec.run_id}"
        if entry is not None:
            if log_finished:
                logging.info("%s: already finished (%s, archived in %s)", label,
                             entry["result"]["status"], archive)
            progress.add_finished(RunShape.of(config), *run_times(entry))
        elif is_finished(workdir, config):
            if log_finished:
                logging.info("%s: already finished", label)
            progress.add_finished(RunShape.of(config),
                                  *run_times({"result": read_result(workdir)}))
        else:
            jobs.append((config, workdir, label, spec.run_id))
            shapes.append(RunShape.of(config))
    if jobs and workers > 1:
        load_data(jobs[0][0].data, seed=jobs[0][0].seed)  # build the shared caches once
        order = sorted(range(len(jobs)), key=lambda i: shapes[i].flops, reverse=True)
        jobs, shapes = [jobs[i] for i in order], [shapes[i] for i in order]
    left = list(shapes)

    def log_progress() -> None:
        logging.info("the sweep: %s", progress.line(left, min(workers, len(left))))

    def ended(index: int, returned: bool) -> None:
        _, workdir, _, run_id = jobs[index]
        left.remove(shapes[index])
        if returned:
            progress.add_finished(shapes[index], *_ended_run_times(workdir, archive, run_id))
        else:
            progress.add_failed()
        log_progress()

    log_progress()

    if archive is None:
        run_pinned(run_logged, [job[:3] for job in jobs], workers, ended)
    else:
        run_pinned(functools.partial(run_and_archive, archive, measure), jobs, workers, ended)


def _ended_run_times(workdir: str, archive: str | None,
                     run_id: str) -> tuple[float | None, float | None]:
    """``run_times`` of a run that just ended: from its archive record, or its result."""
    try:
        record = (read_entry(archive_path(archive, run_id)) if archive
                  else {"result": read_result(workdir) or {}})
    except (ArchiveError, RunRecordError) as err:
        logging.warning("the sweep's ETA leaves out a run's time: %s", err)
        return None, None
    return run_times(record)
