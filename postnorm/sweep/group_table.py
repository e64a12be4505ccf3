"""A grouped sweep's table from its archives: per setting (a run id without its seed) the seeds
finished, how many collapsed, the loss on fresh batches against the setting's control (the same
norm, depth, optimizer and learning rate with no remedy), seed by seed, and what the remedy
itself recorded (the objective's parts, the monitor's actions).

A grouped sweep file (``configs/sweeps/training_methods.py``) defines ``GROUPS`` (name -> runs),
``FIELDS`` (every field a run sets, at its value without a remedy) and a ``controls`` variant;
a run is its setting's control when every field outside ``CONTROL_FIELDS`` and the seed is at
its ``FIELDS`` value."""

import re

import ml_collections
import numpy as np

from postnorm.analysis.tables import cell, markdown_table
from postnorm.errors import UserError
from postnorm.sweep.archive import first_records
from postnorm.sweep.plan import RunSpec, build_config

CONTROL_FIELDS = ("model.norm", "model.n_layers", "opt.optimizer", "opt.lr", "opt.weight_decay")
_SEED = re.compile(r"_seed\d+$")


class GroupTableError(UserError, ValueError):
    """A sweep file or archive the table cannot read (the message names it)."""


def check_sweep(path: str, module: object) -> None:
    """Refuses a sweep file without ``GROUPS`` and ``FIELDS`` holding the control fields and
    the seed."""
    groups, fields = getattr(module, "GROUPS", None), getattr(module, "FIELDS", None)
    if not isinstance(groups, dict) or not isinstance(fields, dict):
        raise GroupTableError(f"--sweep: {path} defines no GROUPS dict (group -> runs) and "
                              "FIELDS dict (each field a run sets, at its value without a "
                              "remedy), as configs/sweeps/training_methods.py does")
    if missing := [k for k in (*CONTROL_FIELDS, "seed") if k not in fields]:
        raise GroupTableError(f"--sweep: {path}'s FIELDS lacks {missing}: every run must set "
                              "them, so that its control and seed are known")


def find_records(base_config: str, specs: list[RunSpec],
                 archives: list[str]) -> tuple[list[ml_collections.ConfigDict],
                                                list[dict | None]]:
    """The runs' configs, and per run its record in the first of ``archives`` that holds its
    config, or None (``archive.first_records``)."""
    configs = [build_config(base_config, spec) for spec in specs]
    return configs, first_records(archives, configs, "--archive")


def run_row(group: str, spec: RunSpec, config: ml_collections.ConfigDict,
            record: dict | None, defaults: dict[str, object]) -> dict:
    """One run's figures from its archive record (status ``missing`` without one);
    ``defaults``: the sweep's ``FIELDS``."""
    overrides = dict(spec.overrides)
    row = {"group": group, "run_id": spec.run_id, "setting": _SEED.sub("", spec.run_id),
           "seed": int(overrides["seed"]),
           "control": [overrides[k] for k in CONTROL_FIELDS],
           "plain": all(v == defaults.get(k) for k, v in overrides.items()
                        if k not in (*CONTROL_FIELDS, "seed")),
           "status": "missing"}
    if record is None:
        return row
    result, measures = record["result"], record.get("measures") or {}
    collapse = result.get("collapse") or {}
    acting = config.monitor.action != "none"
    row.update(status=result["status"], archived_as=f"{record['archive']}/{record['run_id']}",
               collapsed=collapse.get("collapsed") if result["status"] == "done" else None,
               alike_at_end=result.get("fraction_of_layers_tsim_ge_0.99"),
               fresh_batches=measures.get("fresh_batches"),
               fresh_loss_over_lfreq=measures.get("fresh_loss_over_lfreq"),
               min_c=measures.get("min_c"), first_warn=measures.get("first_warn"),
               update_norm_early=measures.get("update_norm_early"),
               final_train_parts=result.get("final_train_parts"),
               monitor_actions=result.get("monitor_actions") if acting else None)
    return row


def fresh_batches_of(rows: list[dict]) -> int | None:
    """The fresh-batch count every measured run was measured on; a mixture is refused."""
    counts = {r["fresh_batches"] for r in rows if r.get("fresh_batches")}
    if len(counts) > 1:
        raise GroupTableError(f"the records were measured on different numbers of fresh "
                              f"batches ({sorted(counts)}): measure them alike "
                              "(experiments.sweep --fresh_batches N --archive A)")
    return counts.pop() if counts else None


def aggregate(rows: list[dict]) -> list[dict]:
    """One entry per (group, setting), in the rows' order: how its planned runs ended,
    collapsed, and per planned seed (None where not done) the layers alike at the end, the
    fresh loss / L_freq, D at the end, the monitor's actions and first warn; the gap of the
    fresh loss to the control's run of the same seed, averaged over the seeds both finished
    (a paired difference)."""
    controls: dict[tuple, dict[int, float]] = {}
    for row in rows:
        if row["plain"] and row.get("fresh_loss_over_lfreq") is not None:
            controls.setdefault(tuple(row["control"]), {}).setdefault(
                row["seed"], row["fresh_loss_over_lfreq"])
    groups: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["group"], row["setting"]), []).append(row)
    out = []
    for (group, setting), runs in groups.items():
        runs = sorted(runs, key=lambda r: r["seed"])
        done = [r for r in runs if r["status"] == "done"]
        fresh = {r["seed"]: r["fresh_loss_over_lfreq"] for r in done
                 if r.get("fresh_loss_over_lfreq") is not None}
        control = controls.get(tuple(runs[0]["control"]), {})
        paired = [fresh[s] - control[s] for s in sorted(fresh) if s in control]

        def per_seed(value, runs=runs) -> list:
            return [value(r) if r["status"] == "done" else None for r in runs]

        out.append({
            "group": group, "setting": setting, "seeds": [r["seed"] for r in runs],
            "planned": len(runs), "done": len(done),
            "status": {s: sum(r["status"] == s for r in runs)
                       for s in sorted({r["status"] for r in runs})},
            "collapsed": sum(bool(r.get("collapsed")) for r in done),
            "alike_at_end": per_seed(lambda r: r.get("alike_at_end")),
            "fresh_loss_over_lfreq": per_seed(lambda r: r.get("fresh_loss_over_lfreq")),
            "fresh_mean": float(np.mean(list(fresh.values()))) if fresh else None,
            "fresh_sd": float(np.std(list(fresh.values()))) if len(fresh) > 1 else None,
            "gap_to_control": None if runs[0]["plain"] or not paired else float(np.mean(paired)),
            "paired_seeds": len(paired),
            "final_diversity": per_seed(
                lambda r: (r.get("final_train_parts") or {}).get("diversity")),
            "monitor_actions": per_seed(lambda r: None if r.get("monitor_actions") is None
                                        else len(r["monitor_actions"])),
            "first_warn": per_seed(lambda r: r.get("first_warn")),
            "min_c": min((r["min_c"] for r in done if r.get("min_c") is not None),
                         default=None),
            "runs": [r["run_id"] for r in runs],
        })
    return out


def _per_seed(values: list, spec: str) -> str:
    """One cell per planned seed, "–" where a run is not done or did not record the value;
    "–" alone where none did."""
    if all(v is None for v in values):
        return "–"
    return ", ".join(cell(v, spec) for v in values)


def _runs_cell(entry: dict) -> str:
    status = entry["status"]
    notes = [f"{status[s]} {label}" for s, label in (("missing", "not run yet"),
                                                     ("nonfinite", "non-finite"))
             if status.get(s)]
    return f"{entry['done']}/{entry['planned']}" + (f" ({', '.join(notes)})" if notes else "")


def markdown(entries: list[dict], fresh_batches: int | None) -> str:
    """The table, one row per setting; per-seed cells list the planned seeds in order."""
    header = ["group", "setting", "seeds", "runs done", "collapsed", "layers alike at the end",
              f"loss / L_freq ({fresh_batches or '–'} fresh batches)", "mean ± sd",
              "gap to its control (paired seeds)", "D at the end (train)",
              "monitor actions", "first warn (step)", "min c"]
    body = []
    for e in entries:
        body.append([
            e["group"], f"`{e['setting']}`", ", ".join(map(str, e["seeds"])), _runs_cell(e),
            f"{e['collapsed']}/{e['done']}",
            _per_seed([None if a is None else f"{a:.0%}" for a in e["alike_at_end"]], ""),
            _per_seed(e["fresh_loss_over_lfreq"], ".3f"),
            "–" if e["fresh_mean"] is None else (
                f"{e['fresh_mean']:.3f}" + ("" if e["fresh_sd"] is None
                                            else f" ± {e['fresh_sd']:.3f}")),
            "–" if e["gap_to_control"] is None
            else f"{e['gap_to_control']:+.3f} ({e['paired_seeds']})",
            _per_seed(e["final_diversity"], ".3f"), _per_seed(e["monitor_actions"], ""),
            _per_seed(e["first_warn"], ""), cell(e["min_c"], ".3f")])
    return "\n".join(markdown_table(header, body)) + "\n"
