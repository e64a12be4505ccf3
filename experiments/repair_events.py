"""The repair-event table of a sweep's archive: per method, the runs that went alike early and how
many were repaired by the end (the rule: ``postnorm.analysis.repair_events``). Trains nothing.

    python -m experiments.repair_events --archive results/leaderboard/runs \\
        --out results/leaderboard/repair_events

Writes ``<out>.md`` (the table and the rule) and ``<out>.json`` (the rule, the per-method counts
and every run's row: its largest fraction of layers alike from the rule's first step on, its
fraction at the end, and its verdict), and prints the table.
"""

from absl import app, flags

from configs.sweeps.leaderboard import ALL_METHODS, method_label
from postnorm.analysis.repair_events import event_rows, markdown, method_counts, rule_json
from postnorm.errors import UserError, exit_on_error
from postnorm.files import write_bytes_atomic, write_json_atomic
from postnorm.sweep.archive import read_archive

flags.DEFINE_string("archive", "results/leaderboard/runs", "A sweep's archive of run records "
                    "(postnorm.sweep.archive).")
flags.DEFINE_string("out", "results/leaderboard/repair_events", "Write <out>.md and <out>.json.")
FLAGS = flags.FLAGS


class NoRunsError(UserError):
    """The archive holds no run record."""


def write_tables(archive_dir: str, out: str) -> str:
    """Tabulate ``archive_dir``'s runs into ``<out>.md`` and ``<out>.json``; returns the
    markdown."""
    entries = read_archive(archive_dir)  # sorted by run id
    if not entries:
        raise NoRunsError(f"--archive {archive_dir} holds no run record: give a sweep's archive "
                          "(a directory of <run id>.json records, postnorm.sweep.archive)")
    rows, left_out = event_rows(entries, method_label)
    methods = [*ALL_METHODS, *sorted({r["method"] for r in rows} - set(ALL_METHODS))]
    counts = method_counts(rows, methods)
    table = markdown(counts, left_out)
    write_bytes_atomic(f"{out}.md", table.encode())
    write_json_atomic(f"{out}.json", {"rule": rule_json(), "methods": counts, "runs": rows,
                                      "left_out": left_out})
    return table


def main(argv: list[str]) -> None:
    del argv
    print(write_tables(FLAGS.archive, FLAGS.out))


if __name__ == "__main__":
    app.run(exit_on_error(main))
