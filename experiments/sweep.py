"""Run a sweep (``configs/sweeps/*.py``) sequentially and resumably; tabulate and map the results.

    python -m experiments.sweep --sweep configs/sweeps/stability.py --out_dir DIR [--shard i/n]
        [--workers N] [--override key=value ...] [--report_only]

Every run's config is built and validated before the first run starts; a bad sweep file or
field stops the command with exit 2 and one line naming the run. Each run trains into
``DIR/<run id>`` via ``postnorm.sweep.record.run_once``: finished runs are skipped, partial ones
resume from their latest checkpoint, a run stopped by a non-finite step is recorded as
``nonfinite`` (a diverged cell of the map). Run ids name the fields the sweep varies, so
dropping a value or varying one more field renames runs; a run uses the directory in DIR
that holds a run of its config (its own id's first), so renamed runs are not trained again.
``--shard i/n`` runs every n-th run of the plan starting at i, so n hosts sharing DIR split
the sweep; ``--workers N`` trains a shard's runs in N processes pinned to disjoint CPU sets of
the host (``postnorm.sweep.workers``). Every invocation then rewrites the table and the map from all
finished runs found in DIR:

* ``summary.json`` / ``summary.md``: per run its id, its swept and ``--override`` fields as its
  config.json has them, the status (``stale`` for a result of another config than the sweep
  now plans, as ``--report_only`` can find), final train loss (mean of the last three logged
  steps), L_freq, collapsed yes/no and collapse step (``postnorm.analysis.collapse``; finished runs
  only), the steps skipped as non-finite (``train.nonfinite=skip``), the rollbacks, and the
  training time over all of the run's invocations. ``--override`` may not set
  a field the run ids name (those the sweep varies; all its fields if it varies none);
* ``stability_map.png``: per norm placement a depth x lr grid coloured by final loss / L_freq,
  collapsed cells marked C in a red frame, diverged cells marked x, missing ones left blank;
  drawn when the sweep varies depth and lr, and nothing but them and the norm placement.
"""

import os

import jax
import matplotlib
import ml_collections
import numpy as np
from absl import app, flags, logging

from postnorm.analysis.figures import save_figure
from postnorm.analysis.tables import cell, markdown_table
from postnorm.config import ConfigError, config_data, config_digest
from postnorm.config.args import ConfigArgError, field_path, parse_flags
from postnorm.data import DataError, load_data
from postnorm.errors import exit_on_error
from postnorm.files import dumps, make_output_dir, write_bytes_atomic, write_json_atomic
from postnorm.runtime.allocator import use_allocator
from postnorm.sweep.plan import (
    RunSpec,
    SweepError,
    build_config,
    id_keys,
    parse_shard,
    plan_file,
    shard,
    varying_keys,
)
from postnorm.sweep.record import is_finished, planned_digests, read_result, run_logged
from postnorm.sweep.workers import check_workers, run_pinned
from postnorm.train.validate import check_config
from postnorm.workdir.config_record import (
    WorkdirConfigError,
    config_with_later_defaults,
    read_run_config,
)

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

flags.DEFINE_string("sweep", None, "Sweep file, e.g. configs/sweeps/stability.py[:smoke].")
flags.DEFINE_string("out_dir", None, "Directory for the runs, the table and the map.")
flags.DEFINE_string("shard", "0/1", "i/n: run every n-th run of the plan, starting at i.")
flags.DEFINE_list("override", [], "key=value overrides applied to every run after the sweep's.")
flags.DEFINE_bool("report_only", False, "Only rewrite the table and map from finished runs.")
flags.DEFINE_integer("workers", 1, "Train this shard's runs in this many CPU-pinned processes.")
FLAGS = flags.FLAGS

MAP_AXES = ("model.n_layers", "opt.lr", "model.norm")  # rows, columns, panels


def field_value(config: dict, path: str) -> object:
    """The value of the dotted field ``path`` (``model.n_layers``) of a config's JSON data;
    None when the config has no such field (a run recorded before the field existed)."""
    node = config
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def recorded_or_planned_config(workdir: str, planned: ml_collections.ConfigDict) -> dict:
    """A run's config as JSON data: the ``config.json`` it ran with, if it has started and the
    file reads, else ``planned`` (the sweep's overrides, then ``--override``)."""
    try:
        recorded = read_run_config(workdir)
    except WorkdirConfigError as err:
        logging.warning("%s; the summary uses the planned config", err)
        recorded = None
    return config_data(planned) if recorded is None else recorded


def varied_fields(specs: list[RunSpec]) -> list[str]:
    """The dotted paths of the sweep's fields that differ between its runs."""
    return [field_path(k) for k in varying_keys([dict(s.overrides) for s in specs])]


def table_row(spec: RunSpec, config: dict, result: dict | None, fields: list[str],
              digests: set[str]) -> dict:
    """One row of the summary table: the run's ``fields`` (dotted paths) from ``config``, and
    its result. ``status`` is ``missing`` for runs not finished yet, and ``stale`` for a result
    of another config than the planned one (``digests``: ``planned_digests``; the sweep
    changed since it ran).
    ``collapsed`` is given for ``done`` runs only: a stopped run has no final state to judge."""
    row = {"run_id": spec.run_id, **{path: field_value(config, path) for path in fields},
           "status": "missing"}
    if result is None:
        return row
    collapse = result.get("collapse") or {}
    status = result["status"] if result.get("config_digest") in digests else "stale"
    done = status == "done"
    row.update(status=status,
               final_train_loss=result.get("final_train_loss"),
               lfreq=result.get("lfreq"), loss_over_lfreq=result.get("train_loss_over_lfreq"),
               loss_over_floor=result.get("train_loss_over_floor"),
               collapsed=collapse.get("collapsed") if done else None,
               collapse_step=collapse.get("collapse_step") if done else None,
               skipped_steps=result.get("skipped_steps"), rollbacks=result.get("rollbacks"),
               wall_s=result.get("wall_s"))
    return row


def markdown(rows: list[dict], keys: list[str]) -> str:
    columns = ["run_id", *keys, "status", "final_train_loss", "lfreq", "loss_over_lfreq",
               "loss_over_floor", "collapsed", "collapse_step", "skipped_steps", "rollbacks",
               "wall_s"]
    table = markdown_table(columns, [[cell(row.get(c)) for c in columns] for row in rows])
    return "\n".join(table) + "\n"


def colour_range(rows: list[dict]) -> tuple[float, float]:
    """The map's colour range: the finite final loss / L_freq of the ``done`` runs."""
    ratios = [r["loss_over_lfreq"] for r in rows if r["status"] == "done"
              and r.get("loss_over_lfreq") is not None and np.isfinite(r["loss_over_lfreq"])]
    return (min(ratios), max(ratios)) if ratios else (0.0, 1.0)


def stability_map(rows: list[dict], path: str, axes: tuple[str, str, str] = MAP_AXES) -> str:
    """Per value of axes[2], an axes[0] x axes[1] grid coloured by final loss / L_freq."""
    row_key, col_key, panel_key = axes
    row_vals = sorted({r[row_key] for r in rows})
    col_vals = sorted({r[col_key] for r in rows})
    panels = sorted({r[panel_key] for r in rows})
    vmin, vmax = colour_range(rows)
    fig, axs = plt.subplots(1, len(panels), figsize=(4.2 * len(panels) + 1, 3.8), squeeze=False)
    for ax, panel in zip(axs[0], panels, strict=True):
        grid = np.full((len(row_vals), len(col_vals)), np.nan)
        cells = {(r[row_key], r[col_key]): r for r in rows if r[panel_key] == panel}
        for (rv, cv), r in cells.items():
            i, j = row_vals.index(rv), col_vals.index(cv)
            if r.get("loss_over_lfreq") is not None and r["status"] == "done":
                grid[i, j] = r["loss_over_lfreq"]
            label = {"nonfinite": "x", "missing": ""}.get(r["status"], "")
            dark = False
            if r["status"] == "done":
                label = (f"{grid[i, j]:.3f}" + ("\nC" if r.get("collapsed") else "")
                         + (f"\n{r['skipped_steps']} skipped" if r.get("skipped_steps") else ""))
                dark = (grid[i, j] - vmin) / max(vmax - vmin, 1e-12) > 0.5  # viridis_r
            if r["status"] == "done" and r.get("collapsed"):
                ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, ec="red", lw=2))
            ax.text(j, i, label, ha="center", va="center", fontsize=9,
                    color="white" if dark else "black")
        image = ax.imshow(grid, origin="lower", cmap="viridis_r", vmin=vmin, vmax=vmax,
                          aspect="auto")
        ax.set_xticks(range(len(col_vals)), [f"{v:g}" for v in col_vals])
        ax.set_yticks(range(len(row_vals)), [str(v) for v in row_vals])
        ax.set_xlabel(col_key)
        ax.set_ylabel(row_key)
        ax.set_title(f"{panel_key} = {panel}", fontsize=10)
    fig.colorbar(image, ax=axs[0].tolist(), label="final train loss / L_freq")
    fig.suptitle("C (red frame): collapsed by the postnorm.analysis.collapse rule; x: stopped by a "
                 "non-finite step; 'k skipped': non-finite steps skipped; blank: not run yet "
                 "(or run with another config)", fontsize=9)
    save_figure(fig, path, dpi=100, bbox_inches="tight")
    return path


def planned_configs(base_config: str, specs: list[RunSpec],
                    extra: dict[str, str]) -> list[ml_collections.ConfigDict]:
    """Every run's config, each validated (``check_config``) before any run starts; an error
    names the run. Two runs of the same config are refused (e.g. ``lr=1`` and ``lr=1.0``)."""
    configs, seen = [], {}
    for number, spec in enumerate(specs, 1):
        try:
            config = build_config(base_config, spec, extra)
            check_config(config, device_count=jax.device_count(),
                         process_count=jax.process_count())
        except (ConfigArgError, ConfigError, DataError) as err:
            raise SweepError(f"sweep run {number}/{len(specs)} ({spec.run_id}): {err}") from err
        if (twin := seen.setdefault(config_digest(config), spec.run_id)) != spec.run_id:
            raise SweepError(f"sweep runs {twin} and {spec.run_id} have the same config: "
                             "drop one of them from the sweep")
        configs.append(config)
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


def run_sweep(specs: list[RunSpec], configs: list[ml_collections.ConfigDict],
              workdirs: list[str], workers: int = 1) -> None:
    """Train (or skip) every run of ``specs``: in order, or in ``workers`` pinned processes,
    which take the runs with the most layer-steps first so that no long run starts last."""
    jobs = []
    for number, (spec, config, workdir) in enumerate(zip(specs, configs, workdirs, strict=True),
                                                     1):
        label = f"run {number}/{len(specs)} {spec.run_id}"
        if is_finished(workdir, config):
            logging.info("%s: already finished", label)
        else:
            jobs.append((config, workdir, label))
    if jobs and workers > 1:
        load_data(jobs[0][0].data, seed=jobs[0][0].seed)  # build the shared caches once
        jobs.sort(key=lambda job: job[0].model.n_layers * job[0].train.steps, reverse=True)
    run_pinned(run_logged, jobs, workers)


def write_summary(base_config: str, specs: list[RunSpec], out_dir: str,
                  extra: dict[str, str], workdirs: list[str] | None = None) -> list[dict]:
    """Table (JSON, markdown) and map of every run of the plan found finished in ``out_dir``
    (in ``workdirs``, default ``run_workdirs``).

    Each row reports the sweep's fields, the ``--override`` fields (``extra``) and the map's
    axes as the run's own config.json has them (as planned for runs not started)."""
    fields = list(dict.fromkeys([field_path(k) for k, _ in specs[0].overrides]
                                + [field_path(k) for k in extra] + list(MAP_AXES)))
    configs = [build_config(base_config, spec, extra) for spec in specs]
    workdirs = workdirs or run_workdirs(out_dir, specs, configs)
    rows = []
    for spec, planned, workdir in zip(specs, configs, workdirs, strict=True):
        config = recorded_or_planned_config(workdir, planned)
        rows.append(table_row(spec, config, read_result(workdir), fields,
                              planned_digests(planned)))
        rows[-1]["workdir"] = os.path.relpath(workdir, out_dir)
    keys = [k for k in fields if len({str(row[k]) for row in rows}) > 1]
    write_json_atomic(os.path.join(out_dir, "summary.json"), rows)
    write_bytes_atomic(os.path.join(out_dir, "summary.md"), markdown(rows, keys).encode())
    map_path = os.path.join(out_dir, "stability_map.png")
    varied = set(varied_fields(specs))
    if set(MAP_AXES[:2]) <= varied <= set(MAP_AXES):
        stability_map(rows, map_path)
    else:
        logging.info("no stability map: it needs a sweep over %s and %s (and optionally %s) "
                     "only; this one varies %s", *MAP_AXES, sorted(varied))
        if os.path.exists(map_path):
            os.remove(map_path)
    return rows


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


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if FLAGS.sweep is None or FLAGS.out_dir is None:
        raise app.UsageError("--sweep and --out_dir are required")
    if bad := [item for item in FLAGS.override if "=" not in item]:
        raise app.UsageError(f"--override {bad}: expected key=value, e.g. train.steps=20")
    check_workers(FLAGS.workers)
    base_config, specs = plan_file(FLAGS.sweep)
    index, count = parse_shard(FLAGS.shard)
    extra = dict(item.split("=", 1) for item in FLAGS.override)
    check_overrides(specs, extra)
    configs = planned_configs(base_config, specs, extra)
    use_allocator(process_allocator(base_config, specs, extra))  # may re-execute this command
    make_output_dir(FLAGS.out_dir, "--out_dir")
    workdirs = run_workdirs(FLAGS.out_dir, specs, configs)
    if not FLAGS.report_only:
        mine = shard(list(range(len(specs))), index, count)
        run_sweep([specs[i] for i in mine], [configs[i] for i in mine],
                  [workdirs[i] for i in mine], FLAGS.workers)
    rows = write_summary(base_config, specs, FLAGS.out_dir, extra, workdirs)
    print(dumps(rows, indent=1))


if __name__ == "__main__":
    app.run(exit_on_error(main), flags_parser=parse_flags)
