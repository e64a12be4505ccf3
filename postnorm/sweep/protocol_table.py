"""The long-horizon protocol's tables (docs/PROTOCOL.md) from its runs' rows: one row per
planned run, as ``experiments.protocol`` builds them from the plan and the archive, with
``variant``, ``method``, ``lr``, ``clipped``, ``seed``, ``status`` (``missing`` until the run is
archived), ``loss`` (the held-out loss at the last step; None unless done), ``collapsed``,
``wall_s`` and ``train_steps``.

Gaps are seed-paired (``postnorm.analysis.paired``): a method against the reference of its cell,
the better (lower mean held-out loss) of Pre-Norm and a stably trained Post-Norm (every seed
finished, none collapsed) over the seeds both finished.
"""

import math
from collections.abc import Sequence

import numpy as np

from postnorm.analysis.paired import MARGIN_NATS, paired_gap
from postnorm.analysis.tables import markdown_table
from postnorm.sweep.leaderboard_table import AT_FLOOR

REFERENCES = ("pre", "post")


def _losses(rows: list[dict]) -> dict[int, float]:
    return {r["seed"]: r["loss"] for r in rows if r["status"] == "done"}


def _group(rows: list[dict], *keys: str) -> dict[tuple, list[dict]]:
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(tuple(r[k] for k in keys), []).append(r)
    return groups


def _cell_text(row: dict | None) -> str:
    if row is None or row["status"] == "missing":
        return "–"
    if row["status"] != "done":
        return "✗"
    return f"{row['loss']:.3f}" + (" C" if row["collapsed"] else "")


def trains(row: dict) -> bool:
    """The run finished without a collapse and left the floor: its held-out loss is under
    ``AT_FLOOR`` x L_freq."""
    return row["status"] == "done" and not row["collapsed"] and \
        row["loss"] < AT_FLOOR * row["lfreq"]


def fails(row: dict) -> bool:
    """The finished run collapsed, or the run was stopped (a non-finite step)."""
    return row["status"] != "done" or bool(row["collapsed"])


def half_decade(rate: float, up: bool) -> float:
    """The rate half a decade above (or below) ``rate``, to one significant digit."""
    return float(f"{rate * 10 ** (0.5 if up else -0.5):.1g}")


def long_run_choice(runs: list[dict]) -> dict:
    """The rate a method's long runs take from its bracket (its runs at one clipping): among the
    rates below its smallest failing one (``fails``), the lowest held-out loss of those that
    ``trains`` (``basis`` "trains"); where none trains, the largest of them (``basis``
    "stable": at the floor the screen cannot rank rates, and the fastest rate the method
    survives is the nearest to one that trains). ``grow``: the half-decade to try next while
    the choice sits at an open edge of the grid (a training optimum at the lowest rate, or at
    the highest with no failure above it; every rate failing; no failure and none training).
    ``best_lr`` is None until every rate has ended and nothing is left to grow."""
    runs = sorted(runs, key=lambda r: r["lr"])
    if any(r["status"] == "missing" for r in runs):
        return {"best_lr": None, "basis": None, "grow": None}
    failing = [i for i, r in enumerate(runs) if fails(r)]
    below = runs[:failing[0]] if failing else runs
    trained = [r for r in below if trains(r)]
    if not below:
        grow = half_decade(runs[0]["lr"], up=False)
    elif trained:
        best = min(trained, key=lambda r: r["loss"])
        grow = (half_decade(best["lr"], up=False) if best is runs[0] else
                half_decade(best["lr"], up=True) if best is runs[-1] else None)
    else:
        best = below[-1]
        grow = half_decade(best["lr"], up=True) if best is runs[-1] else None
    if grow is not None:
        return {"best_lr": None, "basis": None, "grow": grow}
    return {"best_lr": best["lr"], "basis": "trains" if trained else "stable", "grow": None}


def bracket_entries(rows: list[dict]) -> list[dict]:
    """Per method and bracket (clipped or not, and its steps): the held-out loss at each rate,
    the long runs' rate (``long_run_choice``; ``settled`` once nothing is left to grow) and the
    largest rate at which the run ``trains``."""
    out = []
    for (method, clipped, steps), runs in _group(rows, "method", "clipped", "steps").items():
        runs = sorted(runs, key=lambda r: r["lr"])
        done = all(r["status"] != "missing" for r in runs)
        choice = long_run_choice(runs)
        best = next((r for r in runs if r["lr"] == choice["best_lr"]), None)
        trained = [r["lr"] for r in runs if trains(r)]
        out.append({
            "method": method, "clipped": clipped, "steps": steps,
            "rates": [r["lr"] for r in runs],
            "runs": {f"{r['lr']:g}": r["run_id"] for r in runs},
            "loss": [r["loss"] for r in runs], "collapsed": [r["collapsed"] for r in runs],
            "status": [r["status"] for r in runs],
            "best_lr": choice["best_lr"], "best_loss": best["loss"] if best else None,
            "basis": choice["basis"], "grow": choice["grow"],
            "largest_trained_lr": max(trained) if done and trained else None})
    return out


def _choice_text(entry: dict) -> str:
    if entry["grow"] is not None:
        return f"– (next: {entry['grow']:g})"
    if entry["best_lr"] is None:
        return "–"
    return f"{entry['best_lr']:g}" + (" (stable)" if entry["basis"] == "stable" else "")


def bracket_title(clipped: bool, steps: int, screen_steps: int) -> str:
    """A bracket's name: clipped or unclipped, and its steps where they are not the screen's."""
    if steps != screen_steps:
        return (f"{'Clipped' if clipped else 'Unclipped'}, {steps:,} steps (the methods that "
                f"train at no rate in {screen_steps:,} steps)")
    return "Clipped at the protocol's 1.0 (B2T at its own 0.1)" if clipped else \
        "Unclipped (the stress test)"


def brackets(entries: list[dict]) -> list[tuple[bool, int]]:
    """The (clipped, steps) brackets of ``entries``: the screen's clipped then unclipped, then
    the longer ones."""
    return sorted({(e["clipped"], e["steps"]) for e in entries},
                  key=lambda b: (b[1], not b[0]))


def bracket_markdown(entries: list[dict], order: Sequence[str], lfreq: float) -> str:
    """One table per bracket (``brackets``): a column per rate tried (``C``: the run collapsed;
    ``✗``: stopped by a non-finite step; ``–``: not run yet), the long runs' rate
    (``long_run_choice``) and the largest rate that trains."""
    parts = []
    screen_steps = min(e["steps"] for e in entries)
    for clipped, steps in brackets(entries):
        half = sorted((e for e in entries if (e["clipped"], e["steps"]) == (clipped, steps)),
                      key=lambda e: list(order).index(e["method"]))
        if not half:
            continue
        rates = sorted({lr for e in half for lr in e["rates"]})
        body = []
        for e in half:
            by_rate = {lr: {"status": s, "loss": loss, "collapsed": c} for lr, s, loss, c in
                       zip(e["rates"], e["status"], e["loss"], e["collapsed"], strict=True)}
            body.append([e["method"], *(_cell_text(by_rate.get(lr)) if lr in by_rate else ""
                                        for lr in rates),
                         _choice_text(e),
                         "–" if e["largest_trained_lr"] is None
                         else f"{e['largest_trained_lr']:g}"])
        title = bracket_title(clipped, steps, screen_steps)
        again = (" (a survival method is then bracketed again over more steps, below)"
                 if clipped and steps == screen_steps and len(brackets(entries)) > 2 else "")
        parts.append(f"**{title}.** Held-out loss (nats) at step {steps:,} by peak learning rate "
                     f"(L_freq {lfreq:.3f}). Long-run rate: the lowest loss among the rates "
                     f"below the first that fails (collapse or non-finite) and that train; "
                     f"(stable): none trains, the largest rate below the first that "
                     f"fails{again}; (next: r): the choice is at an open edge, r is tried "
                     f"next.\n\n"
                     + "\n".join(markdown_table(
                         ["method", *(f"{lr:g}" for lr in rates), "long-run rate",
                          f"largest rate that trains (no collapse, < {AT_FLOOR:g} × L_freq)"],
                         body)))
    return "\n\n".join(parts) + "\n"


def reference_of(by_method: dict[str, list[dict]]) -> str | None:
    """The cell's reference: the better of Pre-Norm and a stably trained Post-Norm by mean
    held-out loss over their finished seeds; None until Pre-Norm has every seed finished."""
    candidates = {}
    for method in REFERENCES:
        runs = by_method.get(method, [])
        finished = bool(runs) and all(r["status"] == "done" for r in runs)
        if finished and not (method == "post" and any(r["collapsed"] for r in runs)):
            candidates[method] = float(np.mean([r["loss"] for r in runs]))
    if "pre" not in candidates:
        return None
    return min(candidates, key=candidates.get)


def compared_entries(rows: list[dict], order: Sequence[str], margin: float = MARGIN_NATS
                     ) -> list[dict]:
    """Per method of one cell (the survival or the width runs): its rate, runs, collapses,
    mean held-out loss and seed-paired gap to the cell's reference (``reference_of``)."""
    by_method = _group(rows, "method")
    by_method = {k[0]: v for k, v in by_method.items()}
    reference = reference_of(by_method)
    out = []
    for method in sorted(by_method, key=list(order).index):
        runs = by_method[method]
        losses = _losses(runs)
        entry = {
            "method": method, "lr": runs[0]["lr"], "planned": len(runs),
            "done": len(losses), "nonfinite": sum(r["status"] == "nonfinite" for r in runs),
            "collapsed": sum(bool(r["collapsed"]) for r in runs if r["status"] == "done"),
            "runs": {str(r["seed"]): r["run_id"] for r in runs},
            "mean_loss": float(np.mean(list(losses.values()))) if losses else None,
            "reference": reference, "gap": None}
        if reference is not None and method != reference:
            entry["gap"] = paired_gap(losses, _losses(by_method[reference]), margin)
        out.append(entry)
    return out


def _gap_cells(gap: dict | None, is_reference: bool) -> list[str]:
    if is_reference:
        return ["(reference)", "", ""]
    if gap is None or gap["mean"] is None:
        return ["–", "–", "–"]
    ci = "–" if gap["ci95"] is None else f"[{gap['ci95'][0]:+.3f}, {gap['ci95'][1]:+.3f}]"
    return [f"{gap['mean']:+.3f}", ci, gap["verdict"]]


def compared_markdown(entries: list[dict], beside: dict[str, dict[str, str]] | None = None
                      ) -> str:
    """``compared_entries`` as a table; ``beside``: more columns, by title, each a text per
    method (the 300-step screen's verdict, the width step's cost)."""
    body = []
    for e in entries:
        runs = f"{e['done']}/{e['planned']}" + (f" ({e['nonfinite']} ✗)" if e["nonfinite"]
                                                 else "")
        mean = "–" if e["mean_loss"] is None else f"{e['mean_loss']:.3f}"
        row = [e["method"], f"{e['lr']:g}", runs, f"{e['collapsed']}/{e['done']}", mean,
               *_gap_cells(e["gap"], e["method"] == e["reference"])]
        row += [column.get(e["method"], "–") for column in (beside or {}).values()]
        body.append(row)
    margin = next((e["gap"]["margin"] for e in entries if e["gap"]), MARGIN_NATS)
    header = ["method", "lr", "runs done", "collapsed", "held-out loss (mean)",
              "gap to reference (nats)", "95% interval",
              f"verdict (margin {margin:g} nats)"]
    header += list(beside or {})
    return "\n".join(markdown_table(header, body)) + "\n"


def calibration_entries(rows: list[dict], margin: float = MARGIN_NATS) -> list[dict]:
    """Per rate: Post-Norm's and Pre-Norm's held-out losses by seed, their collapses, and the
    seed-paired gap of Post-Norm over Pre-Norm."""
    out = []
    for (lr,), runs in sorted(_group(rows, "lr").items()):
        by_method = {k[0]: v for k, v in _group(runs, "method").items()}
        post, pre = by_method.get("post", []), by_method.get("pre", [])
        out.append({
            "lr": lr, "post": _losses(post), "pre": _losses(pre),
            "planned": len(post) + len(pre),
            "post_collapsed": sum(bool(r["collapsed"]) for r in post if r["status"] == "done"),
            "runs": {m: {str(r["seed"]): r["run_id"] for r in v} for m, v in by_method.items()},
            "gap": paired_gap(_losses(post), _losses(pre), margin)})
    return out


def _mean_sd(losses: dict[int, float]) -> str:
    values = list(losses.values())
    if not values:
        return "–"
    return f"{np.mean(values):.3f} ± {np.std(values, ddof=1):.3f}" if len(values) > 1 else \
        f"{values[0]:.3f}"


def calibration_markdown(entries: list[dict]) -> str:
    body = [[f"{e['lr']:g}", f"{len(e['post']) + len(e['pre'])}/{e['planned']}",
             _mean_sd(e["post"]), _mean_sd(e["pre"]), f"{e['post_collapsed']}/{len(e['post'])}",
             *_gap_cells(e["gap"], False)] for e in entries]
    margin = entries[0]["gap"]["margin"] if entries else MARGIN_NATS
    return "\n".join(markdown_table(
        ["lr", "runs done", "Post-Norm (mean ± sd)", "Pre-Norm (mean ± sd)", "Post collapsed",
         "Post − Pre (nats)", "95% interval", f"verdict (margin {margin:g} nats)"], body)) + "\n"


def step_time_ratios(width_rows: list[dict], survival_rows: list[dict]) -> dict[str, float]:
    """Per method of the width step: the median training time per step at d = 128 over that of
    its d = 64 survival runs (same depth, same host)."""
    def per_step(rows: list[dict], method: str) -> list[float]:
        return [r["wall_s"] / r["train_steps"] for r in rows
                if r["method"] == method and r["status"] == "done"]
    out = {}
    for method in {r["method"] for r in width_rows}:
        wide, narrow = per_step(width_rows, method), per_step(survival_rows, method)
        if wide and narrow:
            out[method] = float(np.median(wide) / np.median(narrow))
    return out


def unsettled_markdown(methods: list[str]) -> str:
    """The note under the survival table naming ``methods``, whose runs wait for their
    long-run rate; empty if none."""
    return (f"\nNot planned yet (long-run rate not settled; see the bracket): "
            f"{', '.join(methods)}.\n" if methods else "")


def unplanned_markdown(records: list[dict]) -> str:
    """The archived runs outside the plan (``run_id``, ``loss``, ``collapsed``) as a table."""
    if not records:
        return "Every archived run is in the plan.\n"
    body = [[f"`{r['run_id']}`", "✗" if r["loss"] is None else f"{r['loss']:.3f}",
             "–" if r["collapsed"] is None else ("yes" if r["collapsed"] else "no")]
            for r in records]
    return ("Archived runs outside the current plan, in no table above: runs of an earlier "
            "plan (a bracket of another horizon; a survival run whose method's long-run rate "
            "was chosen again after it ran, or is not settled yet). They stay in the archive "
            "(and in the forecast's data); rerunning the plan does not train them again.\n\n"
            + "\n".join(markdown_table(["run", "held-out loss", "collapsed"], body)) + "\n")


def epochs(steps: int, batch: int, seq_len: int, train_tokens: int) -> float:
    """Passes over the training split a run of ``steps`` batches of ``batch`` x ``seq_len``
    tokens makes."""
    return steps * batch * seq_len / train_tokens


def finite_or_none(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None
