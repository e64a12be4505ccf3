"""Replay the collapse early-warning monitor over recorded runs: lead time and false alarms.

    python -m experiments.early_warning --runs DIR[,DIR...] [--out FILE.md] [--json FILE]
    python -m experiments.early_warning --runs_under runs/leaderboard   # every run below it
    python -m experiments.early_warning --runs_under runs/leaderboard --warn_persistence 2
    python -m experiments.early_warning --archive results/leaderboard/runs   # a sweep's archive

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
from postnorm.analysis.warning_replay import archived_row, markdown, run_row
from postnorm.diagnostics.early_warning import DEFAULT_MONITOR
from postnorm.errors import UserError, exit_on_error
from postnorm.files import write_bytes_atomic, write_json_atomic
from postnorm.sweep.archive import read_archive
from postnorm.sweep.record import read_result
from postnorm.workdir.metrics import find_runs

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
    # a run given both as a directory and in an archive counts once, as its directory
    replayed = {(read_result(w) or {}).get("config_digest") for w in runs}
    rows = ([run_row(workdir, method_label, rule) for workdir in runs]
            + [archived_row(directory, entry, method_label) for directory, entry in archived
               if entry["result"]["config_digest"] not in replayed])
    for row in rows:
        print(json.dumps(row))
    if unmeasured := [r["workdir"] for r in rows if r.get("unmeasured")]:
        logging.warning("%d archived runs were recorded without measures (a sweep run without "
                        "--fresh_batches) and are left out of the table: %s; give their run "
                        "directories instead", len(unmeasured), ", ".join(unmeasured))
    if unfinished := [r["workdir"] for r in rows if not r["finished"] and not r.get("unmeasured")]:
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
