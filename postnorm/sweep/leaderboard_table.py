"""The leaderboard's tables from its runs' rows (the sweep summary's rows with each run's
method, cell and measures): one entry per cell (method, depth, lr, warmup) aggregated over
seeds, one verdict per method over the cells where Post-Norm collapses, and their markdown."""

from collections.abc import Sequence

import numpy as np

from postnorm.analysis.paired import MARGIN_NATS, paired_gap
from postnorm.analysis.tables import cell, markdown_table
from postnorm.diagnostics.early_warning import DEFAULT_RULE

CELL = ("method", "layers", "lr", "warmup")


def cell_key(row: dict) -> tuple:
    return tuple(row[k] for k in CELL)


def _mean_sd(values: list[float]) -> str:
    if not values:
        return "–"
    return f"{np.mean(values):.3f} ± {np.std(values):.3f}" if len(values) > 1 else \
        f"{values[0]:.3f}"


def aggregate(rows: list[dict], order: Sequence[str],
              costs: dict[str, dict] | None = None) -> list[dict]:
    """One entry per cell, methods in ``order``: the runs planned and how each ended, their
    measures, and the method's cost (``costs``: per method its ``step_time_vs_post`` and
    ``peak_memory_vs_post``; None where not benchmarked)."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault(cell_key(row), []).append(row)

    def fresh(runs: list[dict]) -> list[float]:
        return [r["fresh_loss_over_lfreq"] for r in runs if r.get("fresh_loss_over_lfreq")]

    out = []
    for key in sorted(groups, key=lambda k: (list(order).index(k[0]), *k[1:])):
        runs = groups[key]
        done = [r for r in runs if r["status"] == "done"]
        pre = groups.get(("pre", *key[1:]), [])
        post_all = groups.get(("post", *key[1:]), [])
        post = [r for r in post_all if r["status"] == "done"]
        # every planned Post seed finished and none collapsed
        post_safe = bool(post) and len(post) == len(post_all) and not any(
            r.get("collapsed") for r in post)
        leads = [r["warn_lead"] for r in done if r.get("warn_lead") is not None]
        out.append({
            **dict(zip(CELL, key, strict=True)), "planned": len(runs),
            "status": {s: sum(r["status"] == s for r in runs)
                       for s in sorted({r["status"] for r in runs})},
            "done": len(done), "collapsed": sum(bool(r.get("collapsed")) for r in done),
            "fresh_loss_over_lfreq": fresh(done),
            "gap_to_pre": (float(np.mean(fresh(done)) - np.mean(fresh(pre)))
                           if fresh(done) and fresh(pre) else None),
            "gap_to_post": (float(np.mean(fresh(done)) - np.mean(fresh(post)))
                            if post_safe and fresh(done) and fresh(post) else None),
            "min_c": min((r["min_c"] for r in done if r.get("min_c") is not None),
                         default=None),
            "dldx_first_over_last_early": [r["dldx_first_over_last_early"] for r in done
                                           if r.get("dldx_first_over_last_early") is not None],
            "update_norm_early": [r["update_norm_early"] for r in done
                                  if r.get("update_norm_early") is not None],
            "warn_lead": leads,
            "false_alarms": sum(bool(r.get("false_alarm")) for r in done),
            "wall_s": [r["wall_s"] for r in done if r.get("wall_s")],
            "step_time_vs_post": (costs or {}).get(key[0], {}).get("step_time_vs_post"),
            "peak_memory_vs_post": (costs or {}).get(key[0], {}).get("peak_memory_vs_post"),
            "runs": [r["workdir"] for r in runs],
        })
    return out


GOAL_GAP = 0.05  # the architecture issue's bar: within this of Pre-Norm's loss / L_freq
# a run "at the floor": its fresh-batch loss within the collapse rule's band of L_freq
AT_FLOOR = 1.0 - DEFAULT_RULE.loss_rtol


def method_verdicts(entries: list[dict]) -> list[dict]:
    """Per method, over the cells where some Post-Norm seed collapsed: its runs there and how
    they ended, whether it prevented the collapse, its loss / L_freq range and largest gap to
    Pre-Norm, how many of its runs there ended at the unigram floor (loss / L_freq at least
    ``AT_FLOOR``, collapsed or not), whether it meets the goal (prevented, and every cell
    within ``GOAL_GAP`` of Pre-Norm), and its cost.

    A verdict is final (``yes``, ``no``) only when nothing missing can change it: ``no`` as soon
    as one of its runs there collapsed or stopped on a non-finite step (prevented) or, over
    complete cells, a gap exceeds the bar (goal); ``yes`` only when every planned run of the
    method, of Pre-Norm in those cells and of Post-Norm in all the method's cells (which decide
    where it is judged) has finished. Until then ``so far`` (nothing against it yet), ``not so
    far`` (the goal is missed on the runs so far) or ``–`` (no run to judge)."""
    post = [e for e in entries if e["method"] == "post"]
    post_collapses = {cell_key(e)[1:] for e in post if e["collapsed"]}
    pre = {cell_key(e)[1:]: e for e in entries if e["method"] == "pre"}
    out = []
    for method in dict.fromkeys(e["method"] for e in entries):
        everywhere = [e for e in entries if e["method"] == method]
        mine = [e for e in everywhere if cell_key(e)[1:] in post_collapses]
        planned, done = sum(e["planned"] for e in mine), sum(e["done"] for e in mine)
        collapsed = sum(e["collapsed"] for e in mine)
        nonfinite = sum(e["status"].get("nonfinite", 0) for e in mine)
        gaps = [e["gap_to_pre"] for e in mine if e["gap_to_pre"] is not None]
        losses = [v for e in mine for v in e["fresh_loss_over_lfreq"]]
        cells = {cell_key(e)[1:] for e in everywhere}
        complete = (done == planned and len(gaps) == len(mine)
                    and all(_finished(e) for e in post if cell_key(e)[1:] in cells)
                    and all(c in pre and _finished(pre[c]) for c in {cell_key(e)[1:]
                                                                      for e in mine}))
        if collapsed or nonfinite:
            prevented = "no"
        elif not done:
            prevented = "–"
        else:
            prevented = "yes" if complete else "so far"
        within = None if not gaps else max(gaps) <= GOAL_GAP
        if prevented == "no":
            goal = "no"
        elif prevented == "–" or within is None:
            goal = "–"
        elif complete:
            goal = "yes" if within else "no"
        else:
            goal = "so far" if within else "not so far"
        costs = everywhere[0]
        out.append({
            "method": method, "cells": len(mine), "planned": planned, "done": done,
            "collapsed": collapsed, "nonfinite": nonfinite, "prevented": prevented,
            "fresh_loss_over_lfreq_range": [min(losses), max(losses)] if losses else None,
            "largest_gap_to_pre": max(gaps) if gaps else None,
            "at_floor": sum(v >= AT_FLOOR for v in losses), "meets_goal": goal,
            "step_time_vs_post": costs.get("step_time_vs_post"),
            "peak_memory_vs_post": costs.get("peak_memory_vs_post")})
    return out


def _finished(entry: dict) -> bool:
    """Every planned run of the cell ended (done or non-finite)."""
    return entry["done"] + entry["status"].get("nonfinite", 0) == entry["planned"]


def verdicts_markdown(verdicts: list[dict], fresh_batches: int) -> str:
    header = ["method", "cells where post collapses", "runs done", "collapsed", "non-finite",
              "prevented the collapse", f"loss / L_freq ({fresh_batches} fresh batches)",
              f"at the floor (≥ {AT_FLOOR:g} × L_freq)",
              "largest gap to pre", f"goal: prevented, within {GOAL_GAP} of pre",
              "step time / post", "peak memory / post"]
    rows = [[v["method"], str(v["cells"]), f"{v['done']}/{v['planned']}",
             f"{v['collapsed']}/{v['done']}", str(v["nonfinite"]), v["prevented"],
             ("–" if v["fresh_loss_over_lfreq_range"] is None else
              "{:.3f}–{:.3f}".format(*v["fresh_loss_over_lfreq_range"])),
             f"{v['at_floor']}/{v['done']}",
             cell(v["largest_gap_to_pre"], "+.3f"), v["meets_goal"],
             cell(v["step_time_vs_post"], ".3f"), cell(v["peak_memory_vs_post"], ".4f")]
            for v in verdicts]
    return "\n".join(markdown_table(header, rows)) + "\n"


def _status_cell(entry: dict) -> str:
    """How the cell's runs ended: ``done/planned``, then any other ending by name."""
    others = ", ".join(f"{n} {s}" for s, n in entry["status"].items() if s != "done" and n)
    return f"{entry['done']}/{entry['planned']}" + (f" ({others})" if others else "")


def markdown(entries: list[dict], fresh_batches: int) -> str:
    header = ["method", "layers", "lr", "warmup", "runs done", "collapsed",
              f"loss / L_freq ({fresh_batches} fresh batches)", "gap to pre",
              "gap to post (where post does not collapse)", "min c",
              "early ‖∂L/∂X‖ first / last", "early update norm", "warn lead (steps)",
              "false alarms", "train s", "step time / post", "peak memory / post"]
    rows = [[e["method"], str(e["layers"]), f"{e['lr']:g}", str(e["warmup"]), _status_cell(e),
             f"{e['collapsed']}/{e['done']}", _mean_sd(e["fresh_loss_over_lfreq"]),
             cell(e["gap_to_pre"], "+.3f"), cell(e["gap_to_post"], "+.3f"),
             cell(e["min_c"], ".3f"),
             cell([float(v) for v in e["dldx_first_over_last_early"]] or None, ".3g"),
             cell([float(v) for v in e["update_norm_early"]] or None, ".3g"),
             cell([int(v) for v in e["warn_lead"]] or None), str(e["false_alarms"]),
             cell(float(np.mean(e["wall_s"])) if e["wall_s"] else None, ".0f"),
             cell(e["step_time_vs_post"], ".3f"), cell(e["peak_memory_vs_post"], ".4f")]
            for e in entries]
    return "\n".join(markdown_table(header, rows)) + "\n"


def profile_summary(profile_Lx2: Sequence[Sequence[float]]) -> dict:
    """A final lambda profile ([n_layers][attention, FFN], 1: Post-Norm, 0: Pre-Norm) in
    numbers: the mean lambda per sublayer kind, the sublayers at Post (lambda >= 0.99), at Pre
    (<= 0.01) and in between, and the first layer with a sublayer at Pre (None: none)."""
    mix_Lx2 = np.asarray(profile_Lx2, dtype=float)
    at_pre = mix_Lx2 <= 0.01
    at_post = mix_Lx2 >= 0.99
    layers_at_pre = np.flatnonzero(at_pre.any(axis=1))
    return {"mean_attn": float(mix_Lx2[:, 0].mean()), "mean_ffn": float(mix_Lx2[:, 1].mean()),
            "at_post": int(at_post.sum()), "at_pre": int(at_pre.sum()),
            "between": int((~at_post & ~at_pre).sum()),
            "first_layer_at_pre": int(layers_at_pre[0]) if layers_at_pre.size else None}


def profiles_markdown(rows: list[dict]) -> str:
    """One line per run that recorded its final lambda profile (``final_post_mix``): the cell,
    the seed, its ``profile_summary`` and the loss it ended with."""
    runs = sorted((r for r in rows if r.get("final_post_mix")),
                  key=lambda r: (*cell_key(r), r["seed"]))
    body = []
    for r in runs:
        s = profile_summary(r["final_post_mix"])
        body.append([r["method"], str(r["layers"]), f"{r['lr']:g}", str(r["warmup"]),
                     str(r["seed"]), f"{s['mean_attn']:.3f}", f"{s['mean_ffn']:.3f}",
                     f"{s['at_post']}/{s['at_pre']}/{s['between']}",
                     cell(s["first_layer_at_pre"]), cell(r.get("fresh_loss_over_lfreq"), ".3f"),
                     cell(r.get("collapsed"))])
    header = ["method", "layers", "lr", "warmup", "seed", "mean λ, attention", "mean λ, FFN",
              "sublayers at Post / at Pre / between", "first layer with a sublayer at Pre",
              "loss / L_freq", "collapsed"]
    return "\n".join(markdown_table(header, body)) + "\n"


def paired_gaps(rows: list[dict]) -> list[dict]:
    """Per cell with at least two seeds finished by both the method and Pre-Norm: the
    seed-paired gap of the method's fresh-batch loss (nats) over Pre-Norm's, its 95% interval and
    its verdict against ``paired.MARGIN_NATS`` (``postnorm.analysis.paired``)."""
    loss: dict[tuple, dict[int, float]] = {}
    for r in rows:
        if r.get("status") == "done" and r.get("fresh_loss") is not None:
            loss.setdefault(cell_key(r), {})[r["seed"]] = r["fresh_loss"]
    out = []
    for key, by_seed in loss.items():
        reference = loss.get(("pre", *key[1:]))
        if key[0] == "pre" or reference is None or len(set(by_seed) & set(reference)) < 2:
            continue
        out.append({**dict(zip(CELL, key, strict=True)), **paired_gap(by_seed, reference)})
    return out


def paired_markdown(gaps: list[dict], order: Sequence[str]) -> str:
    """``paired_gaps`` as a table, methods in ``order``, then depth, lr and warmup."""
    body = []
    for g in sorted(gaps, key=lambda g: (list(order).index(g["method"]), g["layers"], g["lr"],
                                         g["warmup"])):
        ci = "–" if g["ci95"] is None else f"[{g['ci95'][0]:+.3f}, {g['ci95'][1]:+.3f}]"
        body.append([g["method"], str(g["layers"]), f"{g['lr']:g}", str(g["warmup"]),
                     str(g["n"]), f"{g['mean']:+.3f}", ci, g["verdict"]])
    margin = gaps[0]["margin"] if gaps else MARGIN_NATS
    header = ["method", "layers", "lr", "warmup", "seeds paired", "gap to pre (nats)",
              "95% interval", f"verdict (margin {margin:g} nats)"]
    return "\n".join(markdown_table(header, body)) + "\n"
