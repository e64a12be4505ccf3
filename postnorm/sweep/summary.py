"""A sweep's table (``summary.json``, ``summary.md``) and stability map (``stability_map.png``
and, as a table, ``pivot.md``), from every run of the plan found finished in its directory."""

import os

import matplotlib
import ml_collections
import numpy as np
from absl import logging

from postnorm.analysis.figures import save_figure
from postnorm.analysis.tables import cell, markdown_table
from postnorm.config import config_data
from postnorm.config.args import field_path
from postnorm.files import write_bytes_atomic, write_json_atomic
from postnorm.sweep.plan import RunSpec, build_config, varying_keys
from postnorm.sweep.record import planned_digests, read_result
from postnorm.sweep.runner import run_workdirs
from postnorm.workdir.config_record import WorkdirConfigError, read_run_config

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

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


def pivot_table(rows: list[dict]) -> str:
    """``pivot.md``: the stability map as a table, a line per (placement, depth) and a column per
    lr. A done cell holds its final loss / L_freq, **C** and the collapse step when collapsed;
    another its status ("x" for a non-finite stop); "–" where the plan has no run."""
    row_key, col_key, panel_key = MAP_AXES
    cells = {(r[panel_key], r[row_key], r[col_key]): r for r in rows}
    col_vals = sorted({r[col_key] for r in rows})
    lines = sorted({(r[panel_key], r[row_key]) for r in rows})

    def text(r: dict | None) -> str:
        if r is None or r["status"] not in ("done", "nonfinite"):
            return "–" if r is None else r["status"]
        if r["status"] == "nonfinite":
            return "x"
        value = cell(r.get("loss_over_lfreq"), ".3f")
        if r.get("skipped_steps"):
            value += f" ({r['skipped_steps']} skipped)"
        return f"**C** {value} (step {r['collapse_step']})" if r.get("collapsed") else value

    header = ["final train loss / L_freq (collapsed by the rule: **C**; x: non-finite)",
              *(f"lr {v:g}" for v in col_vals)]
    body = [[f"{panel}, {depth} layers", *(text(cells.get((panel, depth, v))) for v in col_vals)]
            for panel, depth in lines]
    return "\n".join(markdown_table(header, body)) + "\n"


def write_pivot(out_dir: str, rows: list[dict]) -> None:
    write_bytes_atomic(os.path.join(out_dir, "pivot.md"), pivot_table(rows).encode())


def write_summary(base_config: str, specs: list[RunSpec], out_dir: str,
                  extra: dict[str, str], workdirs: list[str] | None = None,
                  archived: list[dict | None] | None = None) -> list[dict]:
    """Table (JSON, markdown) and map of every run of the plan found finished in ``out_dir``
    (in ``workdirs``, default ``run_workdirs``) or, where its directory holds no result of the
    planned config, in ``archived`` (per run, its archive record or None:
    ``archive.archived_runs``); such rows have ``archived`` true.

    Each row reports the sweep's fields, the ``--override`` fields (``extra``) and the map's
    axes as the run's own config.json has them (as planned for runs not started)."""
    fields = list(dict.fromkeys([field_path(k) for k, _ in specs[0].overrides]
                                + [field_path(k) for k in extra] + list(MAP_AXES)))
    configs = [build_config(base_config, spec, extra) for spec in specs]
    workdirs = workdirs or run_workdirs(out_dir, specs, configs)
    archived = archived or [None] * len(specs)
    rows = []
    for spec, planned, workdir, entry in zip(specs, configs, workdirs, archived, strict=True):
        result = read_result(workdir)
        digests = planned_digests(planned)
        if entry is not None and (result is None or result["config_digest"] not in digests):
            rows.append({**table_row(spec, entry["config"], entry["result"], fields, digests),
                         "archived": True})
        else:
            config = recorded_or_planned_config(workdir, planned)
            rows.append(table_row(spec, config, result, fields, digests))
        rows[-1]["workdir"] = os.path.relpath(workdir, out_dir)
    keys = [k for k in fields if len({str(row[k]) for row in rows}) > 1]
    write_json_atomic(os.path.join(out_dir, "summary.json"), rows)
    write_bytes_atomic(os.path.join(out_dir, "summary.md"), markdown(rows, keys).encode())
    map_path = os.path.join(out_dir, "stability_map.png")
    varied = set(varied_fields(specs))
    if set(MAP_AXES[:2]) <= varied <= set(MAP_AXES):
        stability_map(rows, map_path)
        write_pivot(out_dir, rows)
    else:
        logging.info("no stability map: it needs a sweep over %s and %s (and optionally %s) "
                     "only; this one varies %s", *MAP_AXES, sorted(varied))
        for path in (map_path, os.path.join(out_dir, "pivot.md")):
            if os.path.exists(path):
                os.remove(path)
    return rows
