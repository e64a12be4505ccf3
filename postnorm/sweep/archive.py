"""A sweep's archive: one small JSON file per finished run (its config, its ``result.json`` and
any measures taken on its final checkpoint), written as each run ends and meant to be committed.

A plan too long for one sitting, on machines whose run directories do not outlast the sitting,
keeps every run it finished: the runner trains no archived run again, and the tables read an
archived run from its file when its directory is gone. A run is matched to its file by its
config, as to its directory (``record.planned_digests``), so a file of another config is ignored.
"""

import json
import os
import time
from collections.abc import Callable

import ml_collections

from postnorm.errors import UserError
from postnorm.files import from_text, make_output_dir, write_json_atomic
from postnorm.sweep.record import is_finished, planned_digests, read_result, run_logged
from postnorm.workdir.config_record import read_run_config

FINAL = ("done", "nonfinite")
Measure = Callable[[str], dict]


class ArchiveError(UserError, ValueError):
    """An archive file that cannot be read as a run's record."""


def archive_path(archive_dir: str, run_id: str) -> str:
    return os.path.join(archive_dir, f"{run_id}.json")


def archive_run(archive_dir: str, run_id: str, workdir: str,
                measures: dict | None = None, measure_s: float | None = None) -> dict:
    """Write the record of the finished run in ``workdir`` as ``<archive_dir>/<run_id>.json``
    (atomically); returns it. Its ``result`` is ``result.json`` without the machine's path;
    ``measure_s`` is the time taking ``measures`` took (the sweep's ETA counts it)."""
    result = read_result(workdir)
    if result is None or result["status"] not in FINAL:
        raise ArchiveError(f"{workdir} holds no finished run to archive")
    check_id_free(archive_dir, run_id, {result["config_digest"]})
    entry = {"run_id": run_id, "config": read_run_config(workdir),
             "result": {k: v for k, v in result.items() if k != "workdir"},
             "measures": measures, "measure_s": measure_s,
             "archived_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    make_output_dir(archive_dir, "--archive")
    write_json_atomic(archive_path(archive_dir, run_id), entry)
    return entry


def check_id_free(archive_dir: str, run_id: str, digests: set[str]) -> None:
    """Refuses (``ArchiveError``) when ``run_id``'s record in ``archive_dir`` holds a run of
    another config than ``digests`` allow: run ids name only what a plan varies, so a run of
    the same id under ``--override`` would overwrite a committed record."""
    path = archive_path(archive_dir, run_id)
    if os.path.exists(path) and read_entry(path)["result"]["config_digest"] not in digests:
        raise ArchiveError(f"{path} records a run of another config under the id {run_id}: "
                           "give this plan (with its --override) an archive of its own")


def read_entry(path: str) -> dict:
    """The record at ``path``; a file that is not a record raises ``ArchiveError`` naming it."""
    try:
        with open(path) as f:
            entry = from_text(json.load(f))
    except (OSError, ValueError) as err:
        raise ArchiveError(f"{path} cannot be read ({err}): restore it from git, or delete "
                           "it and the run trains again") from err
    if (not isinstance(entry, dict) or not isinstance(entry.get("config"), dict)
            or not isinstance(entry.get("result"), dict)
            or entry["result"].get("status") not in FINAL
            or "config_digest" not in entry["result"]):
        raise ArchiveError(f"{path} is not a run's record (config, and a result with a "
                           f"status of {' or '.join(FINAL)} and a config digest): restore "
                           "it from git, or delete it and the run trains again")
    return entry


def read_archive(archive_dir: str) -> list[dict]:
    """Every record in ``archive_dir`` (none when it does not exist)."""
    if not os.path.isdir(archive_dir):
        return []
    return [read_entry(os.path.join(archive_dir, name))
            for name in sorted(os.listdir(archive_dir)) if name.endswith(".json")]


def archived_runs(archive_dir: str | None,
                  configs: list[ml_collections.ConfigDict]) -> list[dict | None]:
    """Per planned config, the archive's record of its run, or None."""
    entries = read_archive(archive_dir) if archive_dir else []
    by_digest = {e["result"]["config_digest"]: e for e in entries}
    found = []
    for config in configs:
        matches = [by_digest[d] for d in sorted(planned_digests(config)) if d in by_digest]
        found.append(matches[0] if matches else None)
    return found


def first_records(archive_dirs: list[str], configs: list[ml_collections.ConfigDict],
                  flag: str) -> list[dict | None]:
    """Per planned config, the record of its run in the first of ``archive_dirs`` that holds
    one (with ``archive``: that directory), or None; a directory that does not exist is
    refused (``ArchiveError`` naming ``flag``)."""
    found: list[dict | None] = [None] * len(configs)
    for archive_dir in archive_dirs:
        if not os.path.isdir(archive_dir):
            raise ArchiveError(f"{flag}: {archive_dir} is not a directory; give an archive "
                               "written by experiments.sweep or experiments.leaderboard "
                               "--archive")
        found = [f or (entry and {**entry, "archive": archive_dir})
                 for f, entry in zip(found, archived_runs(archive_dir, configs), strict=True)]
    return found


def run_and_archive(archive_dir: str, measure: Measure | None,
                    config: ml_collections.ConfigDict, workdir: str, label: str,
                    run_id: str) -> str:
    """``record.run_logged``, then the run's record into ``archive_dir``, with
    ``measure(workdir)`` of a run that ended ``done``; returns the run's status."""
    status = run_logged(config, workdir, label)
    archive_run(archive_dir, run_id, workdir, *_measures(measure, workdir, status))
    return status


def _measures(measure: Measure | None, workdir: str,
              status: str) -> tuple[dict | None, float | None]:
    """``measure(workdir)`` of a run that ended ``done`` and the seconds it took; Nones
    otherwise or without one."""
    if measure is None or status != "done":
        return None, None
    start = time.perf_counter()
    measures = measure(workdir)
    return measures, time.perf_counter() - start


def archive_finished(archive_dir: str, run_ids: list[str],
                     configs: list[ml_collections.ConfigDict], workdirs: list[str],
                     measure: Measure | None = None,
                     stale: Callable[[dict], bool] | None = None) -> int:
    """Record in ``archive_dir`` every run finished in its workdir and not recorded there yet
    (one trained before the archive was given), and record again a ``done`` one whose
    record's measures are missing or ``stale(measures)``; returns how many it recorded."""
    archived = archived_runs(archive_dir, configs)
    count = 0
    for run_id, config, workdir, entry in zip(run_ids, configs, workdirs, archived,
                                              strict=True):
        if not is_finished(workdir, config):
            continue
        status = read_result(workdir)["status"]
        measures = (entry or {}).get("measures")
        remeasure = (status == "done" and measure is not None
                     and (measures is None or (stale is not None and stale(measures))))
        if entry is None or remeasure:
            archive_run(archive_dir, (entry or {}).get("run_id", run_id), workdir,
                        *_measures(measure, workdir, status))
            count += 1
    return count
