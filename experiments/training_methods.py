"""The training-time remedies' table, from the archives of their runs and of their controls.

    python -m experiments.training_methods --out_dir results/figures/training_methods

For every group of ``configs/sweeps/training_methods.py`` and its ``controls`` (Post- and
Pre-Norm with no remedy, the leaderboard's runs), finds each planned run by its config in the
archives (``--archive``, first match wins) and tabulates per setting: the seeds finished, how
many collapsed (the project's rule), the fraction of layers at tsim >= 0.99 at the end, the
cross-entropy on the fresh batches after the last step over L_freq per seed, its gap to the
control's run of the same seed (same norm, depth, optimizer and lr, no remedy; mean over the
seeds both finished), the position diversity D at the end of training where the objective
logged it, the monitor's actions in effect at the end where the record lists them, the
monitor's first warn and min c (``postnorm.sweep.group_table``). Per-seed cells list the planned
seeds in order, "–" for a run not done; a run not trained yet or stopped by a non-finite step is
counted as such. Writes ``summary.json`` and ``summary.md`` to --out_dir.
"""

import os

from absl import app, flags

from postnorm.config.args import load_module
from postnorm.errors import UserError, exit_on_error
from postnorm.files import make_output_dir, write_bytes_atomic, write_json_atomic
from postnorm.sweep.group_table import (
    aggregate,
    check_sweep,
    find_records,
    fresh_batches_of,
    markdown,
    run_row,
)
from postnorm.sweep.plan import plan_file, split_arg

flags.DEFINE_string("sweep", "configs/sweeps/training_methods.py", "The grouped sweep file: "
                    "it defines GROUPS, FIELDS and a variant ``controls``.")
flags.DEFINE_list("archive", ["results/training_methods/runs", "results/leaderboard/runs"],
                  "Archives to find the runs in, first match first.")
flags.DEFINE_string("out_dir", None, "Directory for summary.json and summary.md.")
FLAGS = flags.FLAGS


class NoRecordsError(UserError):
    """No planned run is in the archives."""


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if FLAGS.out_dir is None:
        raise app.UsageError("--out_dir is required")
    path = split_arg(FLAGS.sweep)[0]
    plan_file(path)  # names a missing or malformed sweep file
    module = load_module(path)
    check_sweep(path, module)
    rows = []
    for group in [*module.GROUPS, "controls"]:
        base, specs = plan_file(f"{path}:{group}")
        configs, records = find_records(base, specs, FLAGS.archive)
        rows += [run_row(group, spec, config, record, module.FIELDS)
                 for spec, config, record in zip(specs, configs, records, strict=True)]
    if not any(r["status"] != "missing" for r in rows):
        raise NoRecordsError(f"no run of {path} is in --archive={','.join(FLAGS.archive)}: "
                             "train them with experiments.sweep --archive first")
    entries = aggregate(rows)
    table = markdown(entries, fresh_batches_of(rows))
    out_dir = make_output_dir(os.path.abspath(FLAGS.out_dir), "--out_dir")
    write_json_atomic(os.path.join(out_dir, "summary.json"),
                      {"archives": FLAGS.archive, "settings": entries, "runs": rows})
    write_bytes_atomic(os.path.join(out_dir, "summary.md"), table.encode())
    print(table)


if __name__ == "__main__":
    app.run(exit_on_error(main))
