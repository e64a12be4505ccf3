"""The early-warning monitor as a detector over recorded runs: one row per run with the
collapse detector's verdict, the monitor's first watch and warn, the lead time and whether the
run is a miss or a false alarm, from a run directory (its records replayed) or from a sweep
archive's record (its verdict and first warn as measured when archived); and their table."""

from collections.abc import Callable

from postnorm.analysis.collapse import detect_collapse, replay_monitor
from postnorm.analysis.tables import cell, markdown_table
from postnorm.diagnostics.early_warning import DEFAULT_MONITOR, MonitorRule
from postnorm.workdir.config_record import recorded_config
from postnorm.workdir.metrics import read_metrics

Label = Callable[[dict], str]  # a run's method name from its config data


def intervals_between(diag_steps: list[int], start: int, end: int) -> int:
    """Diagnostic intervals from step ``start`` to step ``end`` (negative when ``end`` comes
    first), counted over the run's diagnostic steps, whose spacing may vary (diag.dense_*)."""
    low, high = sorted((start, end))
    count = sum(low < s <= high for s in diag_steps)
    return count if end >= start else -count


def verdict_row(workdir: str, finished: bool, config: dict, method: str, collapse: dict,
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
        "workdir": workdir, "finished": finished, "method": method,
        "n_layers": config["model"]["n_layers"], "lr": config["opt"]["lr"],
        "warmup_steps": config["opt"]["warmup_steps"], "seed": config["seed"],
        "collapsed": collapsed, "collapse_step": collapse["collapse_step"],
        "onset_step": collapse["onset_step"], "first_watch": first_watch,
        "first_warn": first_warn, "lead_steps": lead, "lead_intervals": lead_intervals,
        "missed": collapsed and (lead is None or lead <= 0),
        "false_alarm": not collapsed and first_warn is not None, "warn_reason": warn_reason,
    }


def run_row(workdir: str, label: Label, rule: MonitorRule = DEFAULT_MONITOR) -> dict:
    """The monitor's replay (under ``rule``) and the detector's verdict on one run; its method
    is ``label(config)``."""
    records = read_metrics(workdir)
    config = recorded_config(workdir)
    alarms, state = replay_monitor(records, rule)
    return verdict_row(workdir, max(r["step"] for r in records) >= config["train"]["steps"],
                       config, label(config), detect_collapse(records).to_json(),
                       state.first_watch,
                       state.first_warn, next((a.reason for a in alarms if a.level == 2), ""))


def archived_row(archive_dir: str, entry: dict, label: Label) -> dict:
    """An archived run's row, from its record: finished when it ended ``done`` with its
    measures taken (``unmeasured``: archived without them; a run stopped on a non-finite step
    has neither verdict nor warn)."""
    result, measures = entry["result"], entry.get("measures") or {}
    finished = (result["status"] == "done" and "first_warn" in measures
                and "collapse" in result)
    collapse = result["collapse"] if finished else {"collapsed": False, "collapse_step": None,
                                                    "onset_step": None, "diag_steps": []}
    row = verdict_row(f"{archive_dir}/{entry['run_id']}.json", finished, entry["config"],
                      label(entry["config"]), collapse, None,
                      measures["first_warn"] if finished else None, "")
    row["unmeasured"] = result["status"] == "done" and not finished
    return row


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
