"""A grouped sweep's table from its archives: per setting (a run id without its seed) the seeds
finished, how many collapsed, the loss on fresh batches against the setting's control (the same
norm, depth, optimizer and learning rate with no remedy), seed by seed, and what the remedy
itself recorded (the objective's parts, the monitor's actions)."""

import re

import numpy as np

from postnorm.analysis.tables import cell, markdown_table
from postnorm.sweep.archive import archived_runs
from postnorm.sweep.plan import RunSpec, build_config

CONTROL_FIELDS = ("model.norm", "model.n_layers", "opt.optimizer", "opt.lr", "opt.weight_decay")
_SEED = re.compile(r"_seed(\d+)$")


def setting_of(run_id: str) -> str:
    """The run id without its ``_seed<k>`` suffix."""
    return _SEED.sub("", run_id)


def seed_of(run_id: str) -> int:
    match = _SEED.search(run_id)
    if match is None:
        raise ValueError(f"run id {run_id!r} names no seed (_seed<k>)")
    return int(match[1])


def find_records(base_config: str, specs: list[RunSpec],
                 archives: list[str]) -> list[dict | None]:
    """Per run, its record in the first of ``archives`` that holds its config, or None."""
    configs = [build_config(base_config, spec) for spec in specs]
    found: list[dict | None] = [None] * len(specs)
    for archive in archives:
        for i, entry in enumerate(archived_runs(archive, configs)):
            if found[i] is None and entry is not None:
                found[i] = {**entry, "archive": archive}
    return found


def run_row(group: str, spec: RunSpec, record: dict | None) -> dict:
    """One run's figures from its archive record (status ``missing`` without one)."""
    overrides = dict(spec.overrides)
    row = {"group": group, "run_id": spec.run_id, "setting": setting_of(spec.run_id),
           "seed": seed_of(spec.run_id),
           "control": tuple(overrides[k] for k in CONTROL_FIELDS), "status": "missing"}
    if record is None:
        return row
    result, measures = record["result"], record.get("measures") or {}
    collapse = result.get("collapse") or {}
    row.update(status=result["status"], archived_as=f"{record['archive']}/{record['run_id']}",
               collapsed=collapse.get("collapsed") if result["status"] == "done" else None,
               alike_at_end=result.get("fraction_of_layers_tsim_ge_0.99"),
               fresh_loss_over_lfreq=measures.get("fresh_loss_over_lfreq"),
               min_c=measures.get("min_c"), first_warn=measures.get("first_warn"),
               update_norm_early=measures.get("update_norm_early"),
               final_train_parts=result.get("final_train_parts"),
               monitor_actions=result.get("monitor_actions"))
    return row


def aggregate(rows: list[dict]) -> list[dict]:
    """One entry per (group, setting), in the rows' order: seeds planned and done, collapsed,
    layers alike at the end, fresh loss / L_freq per seed, and its gap to the control's run of
    the same seed, averaged over the seeds both finished (a paired difference)."""
    controls: dict[tuple, dict[int, float]] = {}
    for row in rows:
        if row.get("fresh_loss_over_lfreq") is not None and _plain(row):
            controls.setdefault(row["control"], {}).setdefault(
                row["seed"], row["fresh_loss_over_lfreq"])
    groups: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["group"], row["setting"]), []).append(row)
    out = []
    for (group, setting), runs in groups.items():
        done = [r for r in runs if r["status"] == "done"]
        fresh = {r["seed"]: r["fresh_loss_over_lfreq"] for r in done
                 if r.get("fresh_loss_over_lfreq") is not None}
        control = controls.get(runs[0]["control"], {})
        paired = [fresh[s] - control[s] for s in sorted(fresh) if s in control]
        out.append({
            "group": group, "setting": setting, "planned": len(runs), "done": len(done),
            "status": {s: sum(r["status"] == s for r in runs)
                       for s in sorted({r["status"] for r in runs})},
            "collapsed": sum(bool(r.get("collapsed")) for r in done),
            "alike_at_end": [r.get("alike_at_end") for r in done],
            "fresh_loss_over_lfreq": [fresh.get(r["seed"]) for r in done],
            "fresh_mean": float(np.mean(list(fresh.values()))) if fresh else None,
            "fresh_sd": float(np.std(list(fresh.values()))) if len(fresh) > 1 else None,
            "gap_to_control": None if _plain(runs[0]) or not paired else float(np.mean(paired)),
            "paired_seeds": len(paired),
            "final_diversity": [(r.get("final_train_parts") or {}).get("diversity")
                                for r in done],
            "monitor_actions": [None if r.get("monitor_actions") is None
                                else len(r["monitor_actions"]) for r in done],
            "first_warn": [r.get("first_warn") for r in done],
            "min_c": min((r["min_c"] for r in done if r.get("min_c") is not None),
                         default=None),
            "runs": [r["run_id"] for r in runs],
        })
    return out


def _plain(row: dict) -> bool:
    """Whether the run changes nothing beyond its control's fields (no remedy)."""
    return row["setting"] == _control_setting(row)


def _control_setting(row: dict) -> str:
    norm, layers, optimizer, lr, _ = row["control"]
    return f"{norm}_layers{layers}_{optimizer}_lr{lr!r}"


def markdown(entries: list[dict], fresh_batches: int) -> str:
    """The table, one row per setting."""
    header = ["group", "setting", "seeds done", "collapsed", "layers alike at the end",
              f"loss / L_freq ({fresh_batches} fresh batches), per seed", "mean ± sd",
              "gap to its control (paired seeds)", "D at the end (train)",
              "monitor actions", "first warn (step)", "min c"]
    body = []
    for e in entries:
        missing = e["planned"] - e["done"]
        body.append([
            e["group"], f"`{e['setting']}`",
            f"{e['done']}/{e['planned']}" + (f" ({missing} not done)" if missing else ""),
            f"{e['collapsed']}/{e['done']}",
            ", ".join("–" if a is None else f"{a:.0%}" for a in e["alike_at_end"]) or "–",
            cell(e["fresh_loss_over_lfreq"], ".3f"),
            "–" if e["fresh_mean"] is None else (
                f"{e['fresh_mean']:.3f}" + ("" if e["fresh_sd"] is None
                                            else f" ± {e['fresh_sd']:.3f}")),
            "–" if e["gap_to_control"] is None
            else f"{e['gap_to_control']:+.3f} ({e['paired_seeds']})",
            cell(e["final_diversity"], ".3f") if any(
                d is not None for d in e["final_diversity"]) else "–",
            cell(e["monitor_actions"]) if any(
                a is not None for a in e["monitor_actions"]) else "–",
            cell(e["first_warn"]), cell(e["min_c"], ".3f")])
    return "\n".join(markdown_table(header, body)) + "\n"
