"""Run a sweep (``configs/sweeps/*.py``) sequentially and resumably; tabulate and map the results.

    python -m experiments.sweep --sweep configs/sweeps/stability.py --out_dir DIR [--shard i/n]
        [--workers N] [--override key=value ...] [--report_only] [--archive A]
        [--fresh_batches N] [--skip_archived A2,...]
    python -m experiments.sweep --out_dir DIR --from_summary

Every run's config is built and validated before the first run starts; a bad sweep file or
field stops the command with exit 2 and one line naming the run. Each run trains into
``DIR/<run id>`` via ``postnorm.sweep.record.run_once``: finished runs are skipped, partial ones
resume from their latest checkpoint, a run stopped by a non-finite step is recorded as
``nonfinite`` (a diverged cell of the map). Run ids name the fields the sweep varies, so
dropping a value or varying one more field renames runs; a run uses the directory in DIR
that holds a run of its config (its own id's first), so renamed runs are not trained again.
With ``--archive`` and no ``--shard``, once the plan's runs end the sweep file is read again
and the runs it adds are trained too, until it adds none: a plan read from the archive grows as
its runs are recorded (``configs/sweeps/protocol.py``'s brackets). Under ``--shard i/n`` a run
added would move others between shards, so each host reads the plan once: rerun the shards to
train what it adds.
``--shard i/n`` runs every n-th run of the plan starting at i, so n hosts sharing DIR split
the sweep; ``--workers N`` trains a shard's runs in N processes pinned to disjoint CPU sets of
the host (``postnorm.sweep.workers``). As each run ends the log gives the shard's progress:
runs finished, running and left, and an ETA from the finished runs' measured times
(``postnorm.sweep.progress``). Every invocation then rewrites the table and the map from all
finished runs found in DIR:

* ``summary.json`` / ``summary.md``: per run its id, its swept and ``--override`` fields as its
  config.json has them, the status (``stale`` for a result of another config than the sweep
  now plans, as ``--report_only`` can find), final train loss (mean of the last three logged
  steps), L_freq, collapsed yes/no and collapse step (``postnorm.analysis.collapse``; finished runs
  only), the steps skipped as non-finite (``train.nonfinite=skip``), the rollbacks, and the
  training time over all of the run's invocations. ``--override`` may not set
  a field the run ids name (those the sweep varies; all its fields if it varies none);
* with ``--archive A``: each run's record in ``A/<run id>.json`` as it ends (and those of
  runs finished earlier in DIR), to commit; a run recorded there is not trained again, and the
  table and the map read it from there when DIR lacks it (``postnorm.sweep.archive``); with
  ``--fresh_batches N`` too, each finished run is measured on its final checkpoint before its
  record is written, as the leaderboard measures its runs
  (``postnorm.analysis.run_measures``: the cross-entropy on the next N training batches over
  L_freq, min c, the early layers' gradient fall and update norm, the monitor's first warn), so
  the record keeps them once the run's directory is gone; ``--skip_archived A2,...`` leaves
  out the runs whose config another sweep's archive records (the training-time groups share
  runs with the leaderboard; ``experiments.training_methods`` reads both archives);
* ``stability_map.png``: per norm placement a depth x lr grid coloured by final loss / L_freq,
  collapsed cells marked C in a red frame, diverged cells marked x, missing ones left blank;
  drawn when the sweep varies depth and lr, and nothing but them and the norm placement;
* ``pivot.md``: the map as a table (``postnorm.sweep.summary.pivot_table``), drawn with it.

``--from_summary`` reads neither the sweep nor its runs: it rewrites ``pivot.md`` from
``DIR/summary.json`` alone (as committed, without the run directories).
"""

import functools
import json
import os
from typing import NamedTuple

import ml_collections
from absl import app, flags, logging

from postnorm.analysis.run_measures import run_measures
from postnorm.config.args import field_path, parse_flags
from postnorm.errors import exit_on_error
from postnorm.files import dumps, from_text, make_output_dir
from postnorm.runtime.allocator import use_allocator
from postnorm.sweep.archive import Measure, archive_finished, archived_runs, first_records
from postnorm.sweep.plan import (
    RunSpec,
    build_config,
    id_keys,
    parse_shard,
    plan_file,
    shard,
)
from postnorm.sweep.runner import (
    planned_configs,
    run_sweep,
    run_until_settled,
    run_workdirs,
)
from postnorm.sweep.summary import MAP_AXES, write_pivot, write_summary
from postnorm.sweep.workers import check_workers

flags.DEFINE_string("sweep", None, "Sweep file, e.g. configs/sweeps/stability.py[:smoke].")
flags.DEFINE_string("out_dir", None, "Directory for the runs, the table and the map.")
flags.DEFINE_string("shard", "0/1", "i/n: run every n-th run of the plan, starting at i.")
flags.DEFINE_list("override", [], "key=value overrides applied to every run after the sweep's.")
flags.DEFINE_bool("report_only", False, "Only rewrite the table and map from finished runs.")
flags.DEFINE_integer("workers", 1, "Train this shard's runs in this many CPU-pinned processes.")
flags.DEFINE_string("archive", None, "Directory of the sweep's archive (postnorm.sweep.archive): "
                    "one JSON record per finished run, written as each ends; runs recorded "
                    "there are not trained again and the table reads them from there.")
flags.DEFINE_integer("fresh_batches", 0, "With --archive: measure each finished run on this "
                     "many training batches after its last step (and the leaderboard's other "
                     "measures) into its record; 0: no measures.", lower_bound=0)
flags.DEFINE_list("skip_archived", [], "Other sweeps' archives: a run whose config one of them "
                  "records is not trained here (its record stays there; tables that read both "
                  "archives, such as experiments.training_methods, find it).")
flags.DEFINE_bool("from_summary", False, "Read only --out_dir's summary.json (no --sweep, no "
                  "runs): rewrite pivot.md from it.")
FLAGS = flags.FLAGS


def check_overrides(specs: list[RunSpec], extra: dict[str, str]) -> None:
    """``--override`` may set any field but those the run ids name (the fields the sweep
    varies, or all its fields when it varies none): runs would then train a value other than
    their id says, and runs with different ids would be identical. ``runtime.*`` (one per
    process) may not be a sweep field."""
    swept = {field_path(k) for k, _ in specs[0].overrides}
    named = {field_path(k) for k in id_keys([dict(s.overrides) for s in specs])}
    if clash := sorted(named & {field_path(k) for k in extra}):
        raise app.UsageError(f"--override sets {clash}, which the sweep varies or its run ids "
                             "name; change the sweep file instead")
    if runtime := sorted(k for k in swept if k.startswith("runtime.")):
        raise app.UsageError(f"the sweep sets {runtime}: runtime.* is one per process; set it "
                             "for every run with --override (runtime.allocator=X) instead")


def process_allocator(base_config: str, specs: list[RunSpec], extra: dict[str, str]) -> str:
    """``runtime.allocator`` of the sweep's configs (the same for every run)."""
    return build_config(base_config, specs[0], extra).runtime.allocator


class SweepPlan(NamedTuple):
    """The sweep file's plan as read now, every config built and checked."""

    base_config: str
    specs: list[RunSpec]
    configs: list[ml_collections.ConfigDict]
    elsewhere: list[dict | None]  # per run, its record in a --skip_archived archive, or None


def read_plan(extra: dict[str, str]) -> SweepPlan:
    base_config, specs = plan_file(FLAGS.sweep)
    check_overrides(specs, extra)
    configs = planned_configs(base_config, specs, extra)
    return SweepPlan(base_config, specs, configs,
                     first_records(FLAGS.skip_archived, configs, "--skip_archived"))


def current_plan(extra: dict[str, str], archive: str | None,
                 measure: Measure | None) -> tuple[SweepPlan, list[str]]:
    """``read_plan`` and each run's workdir, once the runs finished in ``--out_dir`` but not in
    the archive (trained before ``--archive`` was given) are recorded there; read again if any
    was, since a plan may be read from the archive."""
    for _ in range(2):
        plan = read_plan(extra)
        workdirs = run_workdirs(FLAGS.out_dir, plan.specs, plan.configs)
        here = [i for i, record in enumerate(plan.elsewhere) if record is None]
        if archive is None or not archive_finished(
                archive, [plan.specs[i].run_id for i in here], [plan.configs[i] for i in here],
                [workdirs[i] for i in here], measure,
                lambda measures: measures.get("fresh_batches") != FLAGS.fresh_batches):
            break
    return plan, workdirs


def shard_plan(extra: dict[str, str], index: int, count: int, archive: str | None,
               measure: Measure | None) -> tuple[list, list, list]:
    """The specs, configs and workdirs of the runs the plan now gives shard ``index`` of
    ``count``, less those another sweep's archive records (``--skip_archived``)."""
    plan, workdirs = current_plan(extra, archive, measure)
    mine = shard(list(range(len(plan.specs))), index, count)
    if skipped := [plan.specs[i].run_id for i in mine if plan.elsewhere[i] is not None]:
        logging.info("--skip_archived records %d runs, not trained here: %s", len(skipped),
                     ", ".join(skipped))
    mine = [i for i in mine if plan.elsewhere[i] is None]
    return ([plan.specs[i] for i in mine], [plan.configs[i] for i in mine],
            [workdirs[i] for i in mine])


def pivot_from_summary(out_dir: str) -> None:
    """``out_dir/pivot.md`` from ``out_dir/summary.json``: one run per map cell required."""
    path = os.path.join(out_dir, "summary.json")
    if not os.path.exists(path):
        raise app.UsageError(f"--from_summary reads {path}, which does not exist")
    with open(path) as f:
        rows = from_text(json.load(f))
    cells = [tuple(row.get(axis) for axis in MAP_AXES) for row in rows]
    if None in {v for c in cells for v in c} or len(set(cells)) < len(cells):
        raise app.UsageError(f"{path}: no pivot: it needs one run per {', '.join(MAP_AXES)}")
    write_pivot(out_dir, rows)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if FLAGS.from_summary:
        if FLAGS.out_dir is None:
            raise app.UsageError("--from_summary rewrites --out_dir's pivot.md: give --out_dir")
        pivot_from_summary(FLAGS.out_dir)
        return
    if FLAGS.sweep is None or FLAGS.out_dir is None:
        raise app.UsageError("--sweep and --out_dir are required")
    if bad := [item for item in FLAGS.override if "=" not in item]:
        raise app.UsageError(f"--override {bad}: expected key=value, e.g. train.steps=20")
    if FLAGS.fresh_batches and not FLAGS.archive:
        raise app.UsageError("--fresh_batches measures runs into their --archive records: give "
                             "--archive too")
    check_workers(FLAGS.workers)
    index, count = parse_shard(FLAGS.shard)
    extra = dict(item.split("=", 1) for item in FLAGS.override)
    first = read_plan(extra)  # every config checked before anything is written
    use_allocator(process_allocator(first.base_config, first.specs, extra))  # may re-execute
    make_output_dir(FLAGS.out_dir, "--out_dir")
    archive = make_output_dir(FLAGS.archive, "--archive") if FLAGS.archive else None
    measure = (functools.partial(run_measures, fresh_batches=FLAGS.fresh_batches)
               if FLAGS.fresh_batches else None)
    this_shard = functools.partial(shard_plan, extra, index, count, archive, measure)
    if not FLAGS.report_only and count == 1:
        run_until_settled(this_shard, FLAGS.workers, archive=archive, measure=measure)
    elif not FLAGS.report_only:  # a grown plan would move runs between shards: read it once
        run_sweep(*this_shard(), FLAGS.workers, archive=archive, measure=measure)
    plan, workdirs = current_plan(extra, archive, measure)
    # a run skipped for another archive's record is tabulated from that record
    rows = write_summary(plan.base_config, plan.specs, FLAGS.out_dir, extra, workdirs,
                         [own or other for own, other in zip(archived_runs(archive, plan.configs),
                                                              plan.elsewhere, strict=True)])
    print(dumps(rows, indent=1))


if __name__ == "__main__":
    app.run(exit_on_error(main), flags_parser=parse_flags)
