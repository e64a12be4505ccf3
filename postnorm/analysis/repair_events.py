"""Repair events in recorded runs: which runs went alike early in training, and of those, how
many had their layers apart again by the end.

A layer is **alike** at a diagnostic step when tsim at its attention input is >= the collapse
rule's threshold (``DEFAULT_RULE.tsim_threshold``, 0.99): the run record's per-step
``fraction_collapsed`` (``postnorm.analysis.collapse``, written under ``DEFAULT_RULE`` by
``postnorm.sweep.record``) is the fraction of layers alike. The rule:

* a run **went alike** when at some diagnostic step at or after ``FROM_STEP`` a fraction
  >= ``ALIKE_FRACTION`` of its layers is alike (the steps before are left out: that is where
  Mix-LN, sandwich and Peri-LN show their one- or two-step spikes, steps 20-30 at warmup 20);
* such a run was **repaired** when at its last diagnostic step a fraction < ``REPAIRED_FRACTION``
  of its layers is alike, and **stayed** otherwise.
"""

from collections.abc import Callable, Sequence

from postnorm.analysis.collapse import DEFAULT_RULE
from postnorm.analysis.tables import markdown_table

FROM_STEP = 40  # the first diagnostic step that may count
ALIKE_FRACTION = 0.4  # of the layers alike, at some step from FROM_STEP on: the run went alike
REPAIRED_FRACTION = 0.1  # of the layers alike, under it at the last step: the run was repaired

Label = Callable[[dict], str]  # a run's method name from its config data


def repair_event(diag_steps: Sequence[int], fraction_alike: Sequence[float]) -> dict:
    """One run's event from its diagnostic steps and the fraction of layers alike at each:
    the largest fraction at a step >= ``FROM_STEP`` (None where no step is), the fraction at
    the last step, and whether it went alike and was repaired."""
    from_step = [f for s, f in zip(diag_steps, fraction_alike, strict=True) if s >= FROM_STEP]
    peak = max(from_step) if from_step else None
    went_alike = peak is not None and peak >= ALIKE_FRACTION
    final = float(fraction_alike[-1])
    return {"peak_alike_from_step": peak, "final_alike": final, "went_alike": went_alike,
            "repaired": went_alike and final < REPAIRED_FRACTION}


def event_rows(entries: list[dict], label: Label) -> tuple[list[dict], list[str]]:
    """Each archived run's row (``postnorm.sweep.archive`` records): its id, method
    (``label(config)``), cell and ``repair_event``; and the ids of the runs whose record holds
    no per-step fractions (stopped by a non-finite step), which have no row."""
    rows, left_out = [], []
    for entry in entries:
        collapse = entry["result"].get("collapse")
        if collapse is None:
            left_out.append(entry["run_id"])
            continue
        config = entry["config"]
        rows.append({"run_id": entry["run_id"], "method": label(config),
                     "n_layers": config["model"]["n_layers"], "lr": config["opt"]["lr"],
                     "warmup_steps": config["opt"]["warmup_steps"], "seed": config["seed"],
                     **repair_event(collapse["diag_steps"], collapse["fraction_collapsed"])})
    return rows, left_out


def method_counts(rows: list[dict], methods: Sequence[str]) -> list[dict]:
    """Per method of ``methods`` that has rows, in that order: its runs, those that went alike,
    and of them the repaired and those that stayed."""
    out = []
    for method in methods:
        mine = [r for r in rows if r["method"] == method]
        if not mine:
            continue
        alike = [r for r in mine if r["went_alike"]]
        repaired = sum(r["repaired"] for r in alike)
        out.append({"method": method, "runs": len(mine), "went_alike": len(alike),
                    "repaired": repaired, "stayed": len(alike) - repaired})
    return out


def rule_json() -> dict:
    return {"tsim_threshold": DEFAULT_RULE.tsim_threshold, "from_step": FROM_STEP,
            "alike_fraction": ALIKE_FRACTION, "repaired_fraction": REPAIRED_FRACTION}


def markdown(counts: list[dict], left_out: list[str]) -> str:
    """The per-method table, with the rule under it."""
    header = ["method", "runs", f"went alike (≥ {ALIKE_FRACTION:.0%} at a step ≥ {FROM_STEP})",
              f"repaired (< {REPAIRED_FRACTION:.0%} at the end)", "stayed"]
    body = [[c["method"], str(c["runs"]), str(c["went_alike"]), str(c["repaired"]),
             str(c["stayed"])] for c in counts]
    rule = (f"\nA layer is alike when tsim at its attention input is ≥ "
            f"{DEFAULT_RULE.tsim_threshold} (the collapse rule's threshold). A run went alike "
            f"when at some diagnostic step ≥ {FROM_STEP} at least {ALIKE_FRACTION:.0%} of its "
            f"layers are alike; it was repaired when under {REPAIRED_FRACTION:.0%} are at its "
            f"last diagnostic step, and stayed otherwise "
            f"(`postnorm/analysis/repair_events.py`).\n")
    if left_out:
        rule += (f"\nLeft out, their records holding no per-step fractions (stopped by a "
                 f"non-finite step): {', '.join(left_out)}.\n")
    return "\n".join(markdown_table(header, body)) + "\n" + rule
