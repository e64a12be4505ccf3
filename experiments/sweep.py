"""Run a sweep (``configs/sweeps/*.py``) sequentially and resumably; tabulate and map the results.

    python -m experiments.sweep --sweep configs/sweeps/stability.py --out_dir DIR [--shard i/n]
        [--workers N] [--override key=value ...] [--report_only]

Each run trains into ``DIR/<run id>`` via ``postnorm.run_record.run_once``: finished runs are
skipped, partial ones resume from their latest checkpoint, a run stopped by a non-finite step is
recorded as ``nonfinite`` (a diverged cell of the map). ``--shard i/n`` runs every n-th run of the
plan starting at i, so n hosts sharing DIR split the sweep; ``--workers N`` trains a shard's runs
in N processes pinned to disjoint CPU sets of the host (``postnorm.workers``). Every invocation
then rewrites the table and the map from all finished runs found in DIR:

* ``summary.json`` / ``summary.md``: per run its swept and ``--override`` fields as its
  config.json has them, the status, final train loss (mean of the last three logged steps),
  L_freq, collapsed yes/no and collapse step (``postnorm.collapse``). ``--override`` may not set
  a field the run ids name (those the sweep varies; all its fields if it varies none);
* ``stability_map.png``: per norm placement a depth x lr grid coloured by final loss / L_freq,
  collapsed cells marked C in a red frame, diverged cells marked x, missing ones left blank;
  drawn when the sweep varies depth and lr, and nothing but them and the norm placement.
"""

import json
import os

import matplotlib
import ml_collections
import numpy as np
from absl import app, flags, logging

from postnorm.allocator import use_allocator
from postnorm.config_args import field_path, parse_flags
from postnorm.data import load_data
from postnorm.data.files import write_json_atomic
from postnorm.run_config import WorkdirConfigError, config_data, read_run_config
from postnorm.run_record import is_finished, read_result, run_logged
from postnorm.sweep import (
    RunSpec,
    build_config,
    id_keys,
    parse_shard,
    plan_file,
    shard,
    varying_keys,
)
from postnorm.user_errors import exit_2_on_user_error
from postnorm.workers import run_pinned

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


def table_row(spec: RunSpec, config: dict, result: dict | None, fields: list[str]) -> dict:
    """One row of the summary table: the run's ``fields`` (dotted paths) from ``config``, and
    its result; ``status`` is ``missing`` for runs not finished yet."""
    row = {"run_id": spec.run_id, **{path: field_value(config, path) for path in fields},
           "status": "missing"}
    if result is None:
        return row
    collapse = result.get("collapse") or {}
    row.update(status=result["status"], final_train_loss=result.get("final_train_loss"),
               lfreq=result.get("lfreq"), loss_over_lfreq=result.get("train_loss_over_lfreq"),
               loss_over_floor=result.get("train_loss_over_floor"),
               collapsed=collapse.get("collapsed"), collapse_step=collapse.get("collapse_step"),
               wall_s=result.get("wall_s"))
    return row


def markdown(rows: list[dict], keys: list[str]) -> str:
    def fmt(value) -> str:
        if value is None:
            return "–"
        if isinstance(value, bool):
            return "yes" if value else "no"
        return f"{value:.4g}" if isinstance(value, float) else str(value)

    columns = keys + ["status", "final_train_loss", "lfreq", "loss_over_lfreq",
                      "loss_over_floor", "collapsed",
                      "collapse_step", "wall_s"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def stability_map(rows: list[dict], path: str, axes: tuple[str, str, str] = MAP_AXES) -> str:
    """Per value of axes[2], an axes[0] x axes[1] grid coloured by final loss / L_freq."""
    row_key, col_key, panel_key = axes
    row_vals = sorted({r[row_key] for r in rows})
    col_vals = sorted({r[col_key] for r in rows})
    panels = sorted({r[panel_key] for r in rows})
    ratios = [r["loss_over_lfreq"] for r in rows if r.get("loss_over_lfreq") is not None]
    vmin, vmax = (min(ratios), max(ratios)) if ratios else (0.0, 1.0)
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
                label = f"{grid[i, j]:.3f}" + ("\nC" if r.get("collapsed") else "")
                dark = (grid[i, j] - vmin) / max(vmax - vmin, 1e-12) > 0.5  # viridis_r
            if r.get("collapsed"):
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
    fig.suptitle("C (red frame): collapsed by the postnorm.collapse rule; x: stopped by a "
                 "non-finite step; blank: not run yet", fontsize=9)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


def run_sweep(base_config: str, specs: list[RunSpec], out_dir: str,
              extra: dict[str, str], workers: int = 1) -> None:
    """Train (or skip) every run of ``specs``: in order, or in ``workers`` pinned processes,
    which take the runs with the most layer-steps first so that no long run starts last."""
    jobs = []
    for number, spec in enumerate(specs, 1):
        config = build_config(base_config, spec, extra)
        workdir = os.path.join(out_dir, spec.run_id)
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
                  extra: dict[str, str]) -> list[dict]:
    """Table (JSON, markdown) and map of every run of the plan found finished in ``out_dir``.

    Each row reports the sweep's fields, the ``--override`` fields (``extra``) and the map's
    axes as the run's own config.json has them (as planned for runs not started)."""
    fields = list(dict.fromkeys([field_path(k) for k, _ in specs[0].overrides]
                                + [field_path(k) for k in extra] + list(MAP_AXES)))
    rows = []
    for spec in specs:
        workdir = os.path.join(out_dir, spec.run_id)
        config = recorded_or_planned_config(workdir, build_config(base_config, spec, extra))
        rows.append(table_row(spec, config, read_result(workdir), fields))
    keys = [k for k in fields if len({str(row[k]) for row in rows}) > 1]
    write_json_atomic(os.path.join(out_dir, "summary.json"), rows)
    with open(os.path.join(out_dir, "summary.md"), "w") as f:
        f.write(markdown(rows, keys))
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
                             "with --override runtime.allocator=X instead")


def process_allocator(base_config: str, specs: list[RunSpec], extra: dict[str, str]) -> str:
    """``runtime.allocator`` of the sweep's configs (the same for every run)."""
    return build_config(base_config, specs[0], extra).runtime.allocator


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if FLAGS.sweep is None or FLAGS.out_dir is None:
        raise app.UsageError("--sweep and --out_dir are required")
    base_config, specs = plan_file(FLAGS.sweep)
    index, count = parse_shard(FLAGS.shard)
    extra = dict(item.split("=", 1) for item in FLAGS.override)
    check_overrides(specs, extra)
    use_allocator(process_allocator(base_config, specs, extra))  # may re-execute this command
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    if not FLAGS.report_only:
        run_sweep(base_config, shard(specs, index, count), FLAGS.out_dir, extra, FLAGS.workers)
    rows = write_summary(base_config, specs, FLAGS.out_dir, extra)
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    app.run(exit_2_on_user_error(main), flags_parser=parse_flags)
