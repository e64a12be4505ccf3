"""Replay the collapse early-warning monitor over recorded runs: lead time and false alarms.

    python -m experiments.early_warning --runs DIR[,DIR...] [--out FILE.md] [--json FILE]
    python -m experiments.early_warning --runs_under runs/leaderboard   # every run below it
    python -m experiments.early_warning --runs_under runs/leaderboard --warn_persistence 2
    python -m experiments.early_warning --archive docs/leaderboard/runs   # a sweep's archive

For each run (a directory with ``metrics.jsonl``) it replays the monitor
(``postnorm.diagnostics.early_warning``) over the recorded diagnostic steps, as the live monitor
reads them, and sets its first watch and first warn beside the collapse detector's verdict on the
same records. Lead time = collapse step - first warn (in steps and in diagnostic intervals) on a
collapsing run; a warn on a run that did not collapse is a false alarm. Prints one JSON line per
run and a markdown table of the finished runs with the totals (written to ``--out`` when given).

An archived run (``postnorm.sweep.archive``; its directory may be gone) is read from its record
instead: its first warn as measured when it was archived, under the default rule, beside the
detector's verdict in its ``result.json``. Its first watch is not recorded, and another rule
(``--warn_persistence``, ``--warn_loss_rtol``) cannot be replayed on it.
"""

import dataclasses
import json

from absl import app, flags, logging

from configs.sweeps.leaderboard import method_label
from postnorm.analysis.collapse import detect_collapse, replay_monitor
from postnorm.analysis.tables import cell, markdown_table
from postnorm.diagnostics.early_warning import DEFAULT_MONITOR, MonitorRule
from postnorm.errors import UserError, exit_on_error
from postnorm.files import write_bytes_atomic, write_json_atomic
from postnorm.sweep.archive import read_archive
from postnorm.workdir.config_record import recorded_config
from postnorm.workdir.metrics import find_runs, read_metrics

flags.DEFINE_list("runs", [], "Run directories.")
flags.DEFINE_list("runs_under", [], "Directories whose every run (a metrics.jsonl below them) is "
                  "replayed.")
flags.DEFINE_list("archive", [], "Sweep archives (postnorm.sweep.archive) whose every run's "
                  "record is read: the runs' directories are not needed.")
flags.DEFINE_integer("warn_persistence", None, "The monitor's monitor.warn_persistence "
                     "(default: the config default).", lower_bound=1)
flags.DEFINE_float("warn_loss_rtol", None, "The monitor's monitor.warn_loss_rtol (default: the "
                   "config default).", lower_bound=0)
flags.DEFINE_string("out", None, "Write the markdown table here.")
flags.DEFINE_string("json", None, "Write every run's row here as JSON.")
FLAGS = flags.FLAGS


class NoRunsError(UserError):
    """No run directory was given or found."""


class ArchivedRuleError(UserError):
    """Another monitor rule than the default, asked of archived runs."""


def intervals_between(diag_steps: list[int], start: int, end: int) -> int:
    """Diagnostic intervals from step ``start`` to step ``end`` (negative when ``end`` comes
    first), counted over the run's diagnostic steps, whose spacing may vary (diag.dense_*)."""
    low, high = sorted((start, end))
    count = sum(low < s <= high for s in diag_steps)
    return count if end >= start else -count


def verdict_row(workdir: str, finished: bool, config: dict, collapse: dict,
                first_watch: int | None, first_warn: int | None, warn_reason: str) -> dict:
    """One run's row: the detector's verdict (``Collapse.to_json()``) and the monitor's first
    watch and warn, with the lead time and whether it is a miss or a false alarm."""
    collapsed = bool(collapse["collapsed"])
    lead = (collapse["collapse_step"] - first_warn
            if collapsed and first_warn is not None else None)
    lead_intervals = (None if lead is None else
                      intervals_between(collapse["diag_steps"], first_warn,
                                        collapse["collapse_step"]))
    return {
        "workdir": workdir, "finished": finished, "method": method_label(config),
        "n_layers": config["model"]["n_layers"], "lr": config["opt"]["lr"],
        "warmup_steps": config["opt"]["warmup_steps"], "seed": config["seed"],
        "collapsed": collapsed, "collapse_step": collapse["collapse_step"],
        "onset_step": collapse["onset_step"], "first_watch": first_watch,
        "first_warn": first_warn, "lead_steps": lead, "lead_intervals": lead_intervals,
        "missed": collapsed and (lead is None or lead <= 0),
        "false_alarm": not collapsed and first_warn is not None, "warn_reason": warn_reason,
    }


def run_row(workdir: str, rule: MonitorRule = DEFAULT_MONITOR) -> dict:
    """The monitor's replay (under ``rule``) and the detector's verdict on one run."""
    records = read_metrics(workdir)
    config = recorded_config(workdir)
    alarms, state = replay_monitor(records, rule)
    return verdict_row(workdir, max(r["step"] for r in records) >= config["train"]["steps"],
                       config, detect_collapse(records).to_json(), state.first_watch,
                       state.first_warn, next((a.reason for a in alarms if a.level == 2), ""))


def archived_row(archive_dir: str, entry: dict) -> dict:
    """An archived run's row, from its record: finished when it ended ``done`` with its
    measures taken (a run stopped on a non-finite step has neither verdict nor warn)."""
    result, measures = entry["result"], entry.get("measures")
    finished = result["status"] == "done" and measures is not None and "collapse" in result
    collapse = result["collapse"] if finished else {"collapsed": False, "collapse_step": None,
                                                    "onset_step": None, "diag_steps": []}
    return verdict_row(f"{archive_dir}/{entry['run_id']}.json", finished, entry["config"],
                       collapse, None, measures["first_warn"] if finished else None, "")


def markdown(rows: list[dict], rule: MonitorRule = DEFAULT_MONITOR) -> str:
    header = ["method", "layers", "lr", "warmup", "seed", "collapsed", "collapse step",
              "first watch", "first warn", "lead (steps)", "lead (intervals)", "false alarm"]
    body = [[r["method"], str(r["n_layers"]),
             cell(r["lr"]), str(r["warmup_steps"]), str(r["seed"]),
             "yes" if r["collapsed"] else "no", cell(r["collapse_step"]), cell(r["first_watch"]),
             cell(r["first_warn"]), cell(r["lead_steps"]), cell(r["lead_intervals"], ".3g"),
             "yes" if r["false_alarm"] else ""] for r in rows]
    collapsing = [r for r in rows if r["collapsed"]]
    quiet = [r for r in rows if not r["collapsed"]]
    leads = sorted(r["lead_steps"] for r in collapsing if r["lead_steps"] is not None)
    totals = (f"\n{len(collapsing)} collapsing runs: {sum(not r['missed'] for r in collapsing)} "
              f"warned before the collapse step, lead time "
              f"{f'{leads[0]}-{leads[-1]} steps' if leads else 'none'}; "
              f"{len(quiet)} runs that did not collapse: "
              f"{sum(r['false_alarm'] for r in quiet)} false alarms (warn). Rule: tsim >= "
              f"{rule.collapse.tsim_threshold} in >= {rule.collapse.layer_fraction:.0%} of the "
              f"layers for {rule.persistence} diagnostic steps, loss within "
              f"{rule.warn_loss_rtol:.0%} of its floor.\n")
    return "\n".join(markdown_table(header, body)) + "\n" + totals


def main(argv: list[str]) -> None:
    del argv
    runs = [*FLAGS.runs, *find_runs(FLAGS.runs_under)]
    archived = [(d, e) for d in FLAGS.archive for e in read_archive(d)]
    if not runs and not archived:
        raise NoRunsError("no run to replay: give --runs DIR[,DIR...], --runs_under DIR (a "
                          "directory with runs that wrote metrics.jsonl below it) or --archive "
                          "DIR (a sweep's archive of run records)")
    if archived and (FLAGS.warn_persistence is not None or FLAGS.warn_loss_rtol is not None):
        raise ArchivedRuleError("--warn_persistence and --warn_loss_rtol need the runs' "
                                "records: an archive holds each run's first warn under the "
                                "default rule only; give the run directories with --runs or "
                                "--runs_under")
    rule = dataclasses.replace(
        DEFAULT_MONITOR,
        **({} if FLAGS.warn_persistence is None else {"persistence": FLAGS.warn_persistence}),
        **({} if FLAGS.warn_loss_rtol is None else {"warn_loss_rtol": FLAGS.warn_loss_rtol}))
    rows = ([run_row(workdir, rule) for workdir in runs]
            + [archived_row(directory, entry) for directory, entry in archived])
    for row in rows:
        print(json.dumps(row))
    if unfinished := [r["workdir"] for r in rows if not r["finished"]]:
        logging.warning("%d runs have not finished (not at train.steps, or stopped on a non-finite "
                        "step) and are left out of the table: %s",
                        len(unfinished), ", ".join(unfinished))
    rows = sorted((r for r in rows if r["finished"]),
                  key=lambda r: (r["method"], r["n_layers"], r["lr"], r["warmup_steps"], r["seed"]))
    table = markdown(rows, rule)
    print(table)
    if FLAGS.out:
        write_bytes_atomic(FLAGS.out, table.encode())
    if FLAGS.json:
        write_json_atomic(FLAGS.json, {"runs": rows})


if __name__ == "__main__":
    app.run(exit_on_error(main))
