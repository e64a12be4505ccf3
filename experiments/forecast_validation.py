"""Fit the collapse forecast on archived runs and validate it: leave one method out, leave one
depth out, beside two baselines; and the monitor's lead time against the onset step.

    python -m experiments.forecast_validation
        [--archive results/leaderboard/runs,results/protocol/runs,results/forecast_blind/runs]
        [--out_dir results/figures/forecast]
        [--frozen results/figures/forecast/frozen_model.json] [--freeze]

Trains nothing. Writes to --out_dir: ``model.json`` (the step-0 models fitted on every run: what
``experiments.forecast`` and ``main.py`` read), ``validation.json`` (every run's held-out
probabilities, the scores, the runs the forecast gets wrong and why, the monitor's leads),
``validation.md`` (the same as tables) and ``calibration.png``. Forecasts compared
(``postnorm.analysis.forecast``): the step-0 forecast (theory and config), the same with the
diagnostics of the first 30 steps, depth and learning rate alone (logistic models on the same
folds, each fitted by ``fc.fit_selected`` on the training fold alone, and the step-0 forecast's
four ``fc.VARIANTS`` each on its own), and the early-warning monitor as archived (its first warn
by step 30, and by the end of the run: a confirmation; scored on the runs with its replay, the
leaderboard's measured runs). Method names are read from each record's config
(``configs.sweeps.protocol.method_label``), never listed here. The step-0 forecast's scores are
also given per archive: all runs' held-out probabilities scored on each archive's runs. The
frozen forecast at ``--frozen`` (``postnorm.analysis.forecast_frozen``) is scored blind on the
runs that finished after it was frozen; ``--freeze`` freezes this fit there. About 2 min on a busy
2-core CPU for the archive of late 2026 (about 430 runs).
"""

import os
import time

import matplotlib
import numpy as np
from absl import app, flags

from configs.sweeps import forecast_blind, protocol
from postnorm.analysis import forecast as fc
from postnorm.analysis.figures import save_figure
from postnorm.analysis.forecast_frozen import (
    BOOTSTRAP_REPS,
    VERDICT_MIN_RUNS,
    blind_test,
    check_unfrozen,
    freeze,
    read_frozen,
)
from postnorm.analysis.tables import cell, markdown_table
from postnorm.analysis.warning_replay import intervals_between
from postnorm.diagnostics.early_warning import DEFAULT_RULE
from postnorm.errors import UserError, exit_on_error
from postnorm.files import make_output_dir, write_bytes_atomic, write_json_atomic
from postnorm.sweep.archive import read_archive

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

flags.DEFINE_list("archive", ["results/leaderboard/runs", "results/protocol/runs",
                             "results/forecast_blind/runs"],
                  "Sweep archives whose runs are read.")
flags.DEFINE_string("out_dir", "results/figures/forecast", "Directory for the outputs.")
flags.DEFINE_string("frozen", "results/figures/forecast/frozen_model.json",
                    "A frozen forecast (postnorm.analysis.forecast_frozen), scored blind on the "
                    "runs that finished after it was frozen; none there: no blind test.")
flags.DEFINE_bool("freeze", False, "Write this fit, frozen now, to --frozen (refused where a "
                  "frozen forecast is: replacing it would restart its blind test).")
FLAGS = flags.FLAGS

SCHEMES = {"leave one method out": "method", "leave one depth out": "layers"}
FORECASTS = {"step 0 (theory + config)": fc.STEP0,
             f"first {fc.EARLY_STEPS} steps' diagnostics": fc.EARLY,
             "depth + lr alone": fc.BASELINE}
CALIBRATION_MIN_RUNS = 10
CALIBRATION_TOL = 0.1


class NoArchivedRunsError(UserError):
    """No archived run with a verdict was found."""


def archived_rows(archives: list[str]) -> tuple[list[dict], list[str]]:
    """The archived runs with a verdict as the forecast reads them (with their archive, method,
    depth, lr, warmup and seed), and those whose config the forecast cannot read (each with
    why)."""
    rows, skipped = [], []
    for directory in archives:
        for entry in read_archive(directory):
            try:
                row = fc.archive_row(entry)
            except fc.ForecastError as err:
                skipped.append(f"{entry['run_id']}: {err}")
                continue
            if row is not None:
                config = entry["config"]
                rows.append(row | {"archive": directory,
                                   "finished_at": entry["result"]["finished_at"],
                                   "method": protocol.method_label(config),
                                   "layers": config["model"]["n_layers"],
                                   "lr": config["opt"]["lr"],
                                   "warmup": config["opt"]["warmup_steps"],
                                   "seed": config["seed"]})
    if not rows:
        raise NoArchivedRunsError(f"no finished run with a verdict in "
                                  f"--archive={','.join(archives)}")
    return rows, skipped


def stopped_rows(archives: list[str]) -> list[dict]:
    """The archived runs stopped on a non-finite step (no verdict), each with its archive,
    ``finished_at`` and step-0 inputs (none where the forecast cannot read its config)."""
    rows = []
    for directory in archives:
        for entry in read_archive(directory):
            if entry["result"].get("status") == "nonfinite":
                try:
                    inputs = fc.step0_inputs(entry["config"])
                except fc.ForecastError:
                    inputs = None
                rows.append({"run_id": entry["run_id"], "archive": directory, "early": {},
                             "finished_at": entry["result"]["finished_at"], "inputs": inputs})
    return rows


def archive_counts(rows: list[dict], stopped: list[dict],
                   archives: list[str]) -> dict[str, dict]:
    """Per archive: its runs read, collapsed, at the floor (by which loss) and monitored, and
    its runs stopped on a non-finite step (``stopped_rows``)."""
    counts = {}
    for directory in archives:
        mine = [r for r in rows if r["archive"] == directory]
        counts[directory] = {
            "runs": len(mine), "collapsed": sum(r["collapsed"] for r in mine),
            "nonfinite": sum(r["archive"] == directory for r in stopped),
            "at_the_floor": sum(r["floor"] for r in mine),
            "floor_from_fresh_batches": sum(r["floor_loss"] == "fresh" for r in mine),
            "floor_from_held_out_loss": sum(r["floor_loss"] == "eval" for r in mine),
            "monitored": sum(r["monitored"] for r in mine)}
    return counts


def scores(y_N, p_N) -> dict:
    table = fc.calibration(y_N, p_N)
    checked = [b for b in table if b["runs"] >= CALIBRATION_MIN_RUNS]
    missed = [b for b in checked if abs(b["mean_p"] - b["observed"]) > CALIBRATION_TOL]
    return {"auc": fc.auc(y_N, p_N), "brier": fc.brier(y_N, p_N), "calibration": table,
            "calibrated": not missed, "deciles_checked": len(checked),
            "deciles_missed": len(missed)}


def chance_calibrated(p_N: np.ndarray, draws: int = 2000, seed: int = 0) -> float:
    """The probability that the calibration check passes if the stated probabilities were
    exactly right and the runs independent: outcomes drawn from p_N itself, Monte Carlo."""
    y_DxN = np.random.default_rng(seed).random((draws, len(p_N))) < np.asarray(p_N)[None]
    return float(np.mean([scores(y_N, p_N)["calibrated"] for y_N in y_DxN]))


def seed_split_brier(rows: list[dict]) -> float:
    """The least Brier score any forecast from the inputs can reach: each run forecast at the
    collapse rate of the runs with exactly its inputs (cells whose seeds split cost r(1 - r))."""
    keys = [tuple(sorted(r["inputs"].items())) for r in rows]
    rate = {k: np.mean([r["collapsed"] for r, kr in zip(rows, keys, strict=True) if kr == k])
            for k in set(keys)}
    return float(np.mean([rate[k] * (1 - rate[k]) for k in keys]))


def why_wrong(row: dict, p: float, fold: dict, rows: list[dict]) -> str:
    """Why a run's held-out step-0 forecast is on the wrong side of 1/2."""
    reasons = []
    same = [r["collapsed"] for r in rows if r["inputs"] == row["inputs"]]
    if 0 < sum(same) < len(same):
        reasons.append(f"its seeds split: {sum(same)} of {len(same)} runs with the same inputs "
                       "collapsed")
    model = fc.Linear.from_json(fold["model"])
    unseen = [n for n, m, s in zip(model.names, model.mean, model.scale, strict=True)
              if s == 1.0 and row["inputs"].get(n, 0.0) != m]
    if unseen:
        reasons.append(f"{', '.join(unseen)} never varied in the training fold (weight 0)")
    contributions = model.contributions(fc.design([row], fc.STEP0)[0])
    toward = 1 if p >= 0.5 else -1
    top = sorted((v for v in contributions.items() if v[1] * toward > 0),
                 key=lambda v: -abs(v[1]))[:2]
    if top:
        reasons.append("pushed by " + ", ".join(f"{n} ({v:+.2f})" for n, v in top))
    return "; ".join(reasons)


def monitor_leads(rows: list[dict]) -> list[dict]:
    """Per run with an onset, the monitor's first warn against the onset and the collapse
    step, in steps and diagnostic intervals (positive: the warn came first)."""
    out = []
    for r in rows:
        if r["onset_step"] is None or not r["monitored"]:
            continue
        warn = r["first_warn"]
        out.append({
            "run_id": r["run_id"], "method": r["method"], "collapsed": r["collapsed"],
            "onset_step": r["onset_step"], "collapse_step": r["collapse_step"],
            "first_warn": warn,
            "lead_to_onset_intervals": (None if warn is None else
                                        intervals_between(r["diag_steps"], warn, r["onset_step"])),
            "lead_to_collapse_intervals": (None if warn is None or not r["collapsed"] else
                                           intervals_between(r["diag_steps"], warn,
                                                             r["collapse_step"]))})
    return out


def blind_sweep_status(rows: list[dict], stopped: list[dict], archives: list[str]) -> dict:
    """The registered blind sweep's archive (``configs/sweeps/forecast_blind.py``) among
    ``archives``, if read, and how many of its drawn runs have ended (with a verdict or
    stopped): its verdict is final once all have."""
    mine = [a for a in archives if os.path.abspath(a) == os.path.abspath(forecast_blind.ARCHIVE)]
    ended = {r["run_id"] for r in rows + stopped if r["archive"] in mine}
    return {"archive": mine[0] if mine else None, "runs": forecast_blind.RUNS,
            "ended": len(ended & set(forecast_blind.registered_ids()))}


def validate(rows: list[dict], stopped: list[dict], archives: list[str]) -> dict:
    y_N = np.array([r["collapsed"] for r in rows])
    floor_N = np.array([r["floor"] for r in rows])
    monitored_N = np.array([r["monitored"] for r in rows])
    archive_N = np.array([r["archive"] for r in rows])
    per_run = [{k: r[k] for k in ("run_id", "archive", "method", "layers", "lr", "warmup",
                                  "seed", "collapsed", "floor", "floor_loss", "onset_step",
                                  "monitored", "first_warn")}
               | {"p_collapse": {}, "p_floor": {}, "onset_predicted": {}} for r in rows]
    schemes = {}
    methods = [r["method"] for r in rows]
    for scheme, key in SCHEMES.items():
        groups = [r[key] for r in rows]
        result: dict = {"collapse": {}, "variants": {}, "wrong": []}
        for name, names in FORECASTS.items():
            p_N, p_VxN, folds = fc.held_out(fc.design(rows, names), y_N, groups, methods, names)
            result["collapse"][name] = scores(y_N, p_N)
            result["variants"][name] = {v: scores(y_N, p) for v, p in p_VxN.items()}
            for run, p in zip(per_run, p_N, strict=True):
                run["p_collapse"].setdefault(scheme, {})[name] = float(p)
            if names == fc.STEP0:
                result["step0_by_archive"] = {
                    directory: scores(y_N[archive_N == directory], p_N[archive_N == directory])
                    for directory in archives if (archive_N == directory).any()}
                result["chance_calibrated_if_exact"] = chance_calibrated(p_N)
                result["selection"] = [{"held_out": f["held_out"]} | f["selection"]
                                       for f in folds]
                by_group = {f["held_out"]: f for f in folds}
                result["wrong"] = [
                    {"run_id": r["run_id"], "method": r["method"], "p_collapse": float(p),
                     "collapsed": r["collapsed"],
                     "why": why_wrong(r, float(p), by_group[g], rows)}
                    for r, p, g in zip(rows, p_N, groups, strict=True)
                    if (p >= 0.5) != r["collapsed"]]
        for horizon, label in ((fc.EARLY_STEPS, f"monitor: warned by step {fc.EARLY_STEPS}"),
                               (None, "monitor: warned by the last step (a confirmation)")):
            warned = np.array([r["first_warn"] is not None
                               and (horizon is None or r["first_warn"] <= horizon)
                               for r in rows], np.float64)
            result["collapse"][label] = scores(y_N[monitored_N], warned[monitored_N])
        p_floor, _, _ = fc.held_out(fc.design(rows, fc.STEP0), floor_N, groups, methods,
                                    fc.STEP0)
        result["floor"] = scores(floor_N, p_floor)
        for run, p in zip(per_run, p_floor, strict=True):
            run["p_floor"][scheme] = float(p)
        onsets = fc.held_out_onsets(rows, groups)
        p_step0 = np.array([run["p_collapse"][scheme]["step 0 (theory + config)"]
                            for run in per_run])
        close, stated = [], []
        for r, run, onset, p in zip(rows, per_run, onsets, p_step0, strict=True):
            run["onset_predicted"][scheme] = onset
            if r["collapsed"]:
                near = abs(intervals_between(r["diag_steps"], onset, r["onset_step"])) <= 1
                close.append(near)
                stated.append(near and p >= 0.5)
        result["onset"] = {"collapsing_runs": len(close), "within_one_interval": int(sum(close)),
                           "stated_and_within_one_interval": int(sum(stated))}
        schemes[scheme] = result
    return {"runs": len(rows), "collapsed": int(y_N.sum()), "at_the_floor": int(floor_N.sum()),
            "monitored": int(monitored_N.sum()),
            "archives": archive_counts(rows, stopped, archives),
            "seed_split_brier": seed_split_brier(rows),
            "rule": {"tsim_threshold": DEFAULT_RULE.tsim_threshold,
                     "layer_fraction": DEFAULT_RULE.layer_fraction,
                     "floor_ratio": fc.FLOOR_RATIO, "l2": fc.L2, "l2_grid": list(fc.L2_GRID),
                     "variants": {v: {"inner_l2": a, "platt": b}
                                  for v, (a, b) in fc.VARIANTS.items()},
                     "calibration_min_runs": CALIBRATION_MIN_RUNS,
                     "calibration_tolerance": CALIBRATION_TOL},
            "schemes": schemes, "monitor_leads": monitor_leads(rows), "per_run": per_run}


def lead_summary(leads: list[dict]) -> list[list[str]]:
    """Rows: collapsing runs by the monitor's lead to the onset, in diagnostic intervals."""
    collapsing = [r for r in leads if r["collapsed"]]
    values = sorted({r["lead_to_onset_intervals"] for r in collapsing}, key=lambda v: (v is None,
                                                                                     v or 0))
    return [[cell(v) if v is not None else "never warned",
             str(sum(r["lead_to_onset_intervals"] == v for r in collapsing))] for v in values]


def markdown(report: dict, models: dict) -> str:
    lines = [f"# The collapse forecast, validated on {report['runs']} archived runs",
             "", f"{report['collapsed']} collapsed (the project's rule); {report['at_the_floor']} "
             f"ended at the floor (loss >= {fc.FLOOR_RATIO} x the frequency floor: on fresh "
             "training batches over L_freq where the run was measured, else its last held-out "
             "loss over its validation batches' floor). Generated by `python -m "
             "experiments.forecast_validation`; every probability below is held out (the run's "
             "method, or its depth, was not in the fit).", ""]
    lines += markdown_table(
        ["archive", "runs", "collapsed", "at the floor", "floor from fresh batches / held-out "
         "loss", "with the monitor's replay", "stopped non-finite (no verdict, not read)"],
        [[f"`{a}`", str(c["runs"]), str(c["collapsed"]), str(c["at_the_floor"]),
          f"{c['floor_from_fresh_batches']} / {c['floor_from_held_out_loss']}",
          str(c["monitored"]), str(c["nonfinite"])] for a, c in report["archives"].items()])
    lines += ["",
             "Each logistic forecast is fitted by the same procedure inside each training fold "
             "(`postnorm.analysis.forecast.fit_selected`): of four variants (the penalty fixed "
             "at 1 or chosen from "
             + "/".join(f"{v:g}" for v in fc.L2_GRID) + " by inner cross-validation; with or "
             "without Platt's map fitted on the inner held-out log-odds) it fits the one whose "
             "leave-one-method-out Brier score within the training runs is lowest. "
             f"Runs with exactly the same inputs whose seeds split bound the Brier score of any "
             f"forecast from the inputs below by {report['seed_split_brier']:.3f}.", ""]
    if report["skipped"]:
        lines += [f"Runs the forecast cannot read, left out ({len(report['skipped'])}): "
                  + "; ".join(report["skipped"]), ""]
    for scheme, result in report["schemes"].items():
        lines += [f"## {scheme.capitalize()}", "", "Collapse by the last step:", ""]
        body = [[name, cell(s["auc"], ".3f"), cell(s["brier"], ".3f"), cell(s["calibrated"])]
                for name, s in result["collapse"].items()]
        lines += markdown_table(["forecast", "AUC", "Brier", "calibrated within "
                                 f"{CALIBRATION_TOL} (deciles of >= {CALIBRATION_MIN_RUNS} runs)"],
                                body)
        lines += ["", f"The monitor's two rows score the {report['monitored']} runs with its "
                  f"replay (the leaderboard's measures); the {report['runs'] - report['monitored']}"
                  " without one count in every other row.", "",
                  "The step-0 forecast's held-out probabilities above, scored on each archive's "
                  "runs alone:", ""]
        by_archive = {f"all {report['runs']}": result["collapse"]["step 0 (theory + config)"]}
        by_archive |= {f"`{a}` ({report['archives'][a]['runs']})": s
                       for a, s in result["step0_by_archive"].items()}
        lines += markdown_table(["runs", "AUC", "Brier"],
                                [[name, cell(s["auc"], ".3f"), cell(s["brier"], ".3f")]
                                 for name, s in by_archive.items()])
        floor = result["floor"]
        lines += ["", f"At the floor, step-0 forecast: AUC {floor['auc']:.3f}, Brier "
                  f"{floor['brier']:.3f}, calibrated: {cell(floor['calibrated'])}.", ""]
        lines += variant_lines(result)
        step0 = result["collapse"]["step 0 (theory + config)"]["calibration"]
        lines += ["Calibration of the step-0 forecast (collapse):", ""]
        lines += markdown_table(
            ["stated p", "runs", "mean stated p", "observed rate", f"within {CALIBRATION_TOL}"],
            [[f"{b['bin'][0]:.1f}-{b['bin'][1]:.1f}", str(b["runs"]), f"{b['mean_p']:.3f}",
              f"{b['observed']:.3f}",
              cell(abs(b["mean_p"] - b["observed"]) <= CALIBRATION_TOL)
              if b["runs"] >= CALIBRATION_MIN_RUNS else "(< 10 runs)"] for b in step0])
        lines += ["", "Were these stated probabilities exactly right (runs independent), every "
                  f"decile of >= {CALIBRATION_MIN_RUNS} runs would land within {CALIBRATION_TOL} "
                  f"with probability {result['chance_calibrated_if_exact']:.2f} (Monte Carlo)."]
        onset = result["onset"]
        lines += ["", f"Onset step (first diagnostic step with half the layers alike), on the "
                  f"{onset['collapsing_runs']} collapsing runs: within one diagnostic interval "
                  f"for {onset['within_one_interval']} "
                  f"({onset['within_one_interval'] / onset['collapsing_runs']:.0%}); stated "
                  f"(p_collapse >= 0.5) and within one interval for "
                  f"{onset['stated_and_within_one_interval']}.", "",
                  f"Runs the step-0 forecast gets wrong ({len(result['wrong'])}):", ""]
        lines += markdown_table(["run", "p_collapse", "collapsed", "why"],
                                [[w["run_id"], f"{w['p_collapse']:.2f}", cell(w["collapsed"]),
                                  w["why"]] for w in result["wrong"]])
        lines.append("")
    lines += blind_lines(report["blind"], report["frozen_path"], report["blind_sweep"])
    lines += ["## The model fitted on every run (`model.json`)", ""]
    for target, label in (("collapse", "Collapse"), ("floor", "Floor")):
        pick = models["selection"][target]
        lines.append(f"{label}: the rule picks `{pick['variant']}` (inner leave-one-method-out "
                     "Brier " + ", ".join(f"{v} {b:.4f}" for v, b in pick["inner_brier"].items())
                     + f"); penalty {pick['l2']:g}, Platt's map a = {pick['platt'][0]:.3f}, "
                     f"b = {pick['platt'][1]:+.3f} (folded into the weights below).")
    lines += ["", "Weights on the standardised inputs (log-odds per standard deviation):", ""]
    names = models["collapse"]["names"]
    lines += markdown_table(
        ["input", "mean", "sd", "collapse", "floor", "log onset"],
        [[n, f"{models['collapse']['mean'][i]:.4g}", f"{models['collapse']['scale'][i]:.4g}"]
         + [f"{models[k]['weights'][i]:+.3f}" for k in ("collapse", "floor", "log_onset")]
         for i, n in enumerate(names)])
    lines += ["", "## The monitor against the onset", "",
              "Per collapsing run, the monitor's first warn (as archived) against the onset step, "
              "in diagnostic intervals (positive: the warn came first):", ""]
    lines += markdown_table(["lead to the onset (intervals)", "collapsing runs"],
                            lead_summary(report["monitor_leads"]))
    quiet = [r for r in report["monitor_leads"] if not r["collapsed"]]
    lines += ["", f"{len(quiet)} runs that did not collapse had an onset too (half the layers "
              f"alike at some diagnostic step); the monitor warned on "
              f"{sum(r['first_warn'] is not None for r in quiet)} of them.", ""]
    return "\n".join(lines)


def blind_lines(blind: dict | None, frozen_path: str, sweep: dict) -> list[str]:
    """The frozen forecast's blind test (``forecast_frozen.blind_test``), or that none ran."""
    lines = ["## Blind: the frozen forecast on the runs that finished after it", ""]
    if blind is None:
        return lines + [f"No frozen forecast at `{frozen_path}`: `--freeze` writes one.", ""]
    lines.append(
        f"`{frozen_path}` is the step-0 forecast fitted on {blind['fitted_runs']} runs and "
        f"frozen at {blind['frozen_at']}, never refitted. The held-out scores above refit it in "
        "every fold, but its inputs and fitting rule were chosen by people who had seen those "
        "runs; the runs that finished after it was frozen (with a verdict: not stopped on a "
        f"non-finite step) test it blind. {blind['runs']} so far"
        + (":" if blind["runs"] else "."))
    if blind["runs"]:
        lines += ["", f"Collapse ({blind['collapse']['positives']} of {blind['runs']}): AUC "
                  f"{blind['collapse']['auc']:.3f}, Brier {blind['collapse']['brier']:.3f}. "
                  f"At the floor ({blind['floor']['positives']} of {blind['runs']}): AUC "
                  f"{blind['floor']['auc']:.3f}, Brier {blind['floor']['brier']:.3f}.", ""]
        lines += against_baseline_lines(blind["by_archive"], sweep)
        lines += ["Too few runs for deciles; each is listed:", ""]
        lines += markdown_table(
            ["run", "finished", "p_collapse", "depth + lr alone", "collapsed", "p_floor",
             "at the floor"],
            [[r["run_id"], r["finished_at"], f"{r['p_collapse']:.2f}", f"{r['p_baseline']:.2f}",
              cell(r["collapsed"]), f"{r['p_floor']:.2f}", cell(r["floor"])]
             for r in blind["per_run"]])
    if blind["stopped"]:
        lines += ["", f"{len(blind['stopped'])} blind runs stopped on a non-finite step (no "
                  "verdict, unscored), with the frozen forecast's probability of collapse:", ""]
        lines += markdown_table(["run", "finished", "p_collapse"],
                                [[r["run_id"], r["finished_at"], f"{r['p_collapse']:.2f}"]
                                 for r in blind["stopped"]])
    if blind["unseen_before_freeze"]:
        lines += ["", f"{blind['unseen_before_freeze']} runs it was not fitted on had finished "
                  "before it was frozen: not blind, left out."]
    return lines + [""]


def against_baseline_lines(by_archive: dict, sweep: dict) -> list[str]:
    """Per archive, the frozen collapse forecast against depth and rate alone on its blind
    runs, with bootstrap intervals and the verdict: registered for the blind sweep's archive
    (``blind_sweep_status``; interim until all its runs have ended), after the runs elsewhere."""
    def number(value: float, spec: str) -> str:
        return "–" if np.isnan(value) else format(value, spec)

    def interval(s: dict, key: str, spec: str) -> str:
        low, high = s["intervals"][key]
        return f"{number(s[key], spec)} [{number(low, spec)}, {number(high, spec)}]"

    def verdict(archive: str, s: dict) -> str:
        if archive != sweep["archive"]:
            return f"{s['verdict']} (rule applied after the runs)"
        if sweep["ended"] < sweep["runs"]:
            return f"interim: {s['verdict']} ({sweep['ended']} of {sweep['runs']} runs ended)"
        return f"{s['verdict']} (registered)"
    rows = [[f"`{a}`", str(s["runs"]), str(s["positives"]), interval(s, "auc", ".3f"),
             interval(s, "brier", ".3f"), number(s["baseline_auc"], ".3f"),
             number(s["baseline_brier"], ".3f"), interval(s, "brier_minus_baseline", "+.3f"),
             verdict(a, s)] for a, s in by_archive.items()]
    return (["Per archive, the frozen collapse forecast against depth and rate alone (fitted by "
             "the same rule on the runs the frozen forecast was fitted on); 95% intervals from "
             f"{BOOTSTRAP_REPS} bootstrap resamples of the runs; the verdict by the rule "
             "`configs/sweeps/forecast_blind.py` registered before its runs (better: the "
             "Brier difference's interval below 0; worse: above 0; else not shown better; "
             f"none under {VERDICT_MIN_RUNS} runs):", ""]
            + markdown_table(["archive", "runs", "collapsed", "AUC [95%]", "Brier [95%]",
                              "depth + lr: AUC", "depth + lr: Brier",
                              "Brier difference [95%]", "verdict"], rows) + [""])


def variant_lines(result: dict) -> list[str]:
    """The step-0 collapse forecast's variants, each fitted inside every training fold, and
    which one the rule picked in how many folds."""
    name = "step 0 (theory + config)"
    rows = [[f"`{v}`", cell(s["auc"], ".3f"), cell(s["brier"], ".3f"),
             f"{s['deciles_missed']} of {s['deciles_checked']}"]
            for v, s in result["variants"][name].items()]
    chosen = result["collapse"][name]
    rows.append(["the rule's pick per fold (the forecast)", cell(chosen["auc"], ".3f"),
                 cell(chosen["brier"], ".3f"),
                 f"{chosen['deciles_missed']} of {chosen['deciles_checked']}"])
    picks = [f["variant"] for f in result["selection"]]
    counts = ", ".join(f"`{v}` in {picks.count(v)}" for v in fc.VARIANTS if v in picks)
    return (["Step-0 collapse forecast by fitting variant (penalty from inner cross-validation "
             "or fixed at 1; Platt's map on inner held-out log-odds or none; all fitted inside "
             "the training fold):", ""]
            + markdown_table(["variant", "AUC", "Brier", "deciles off by > "
                              f"{CALIBRATION_TOL} (of those with >= {CALIBRATION_MIN_RUNS} runs)"],
                             rows)
            + ["", f"The rule picked {counts} of the {len(picks)} folds.", ""])


def plot_calibration(report: dict, path: str) -> None:
    fig, axes = plt.subplots(1, len(report["schemes"]), figsize=(5.2 * len(report["schemes"]), 4.6))
    for ax, (scheme, result) in zip(np.atleast_1d(axes), report["schemes"].items(), strict=True):
        ax.plot([0, 1], [0, 1], color="grey", lw=1, ls=":")
        for name in FORECASTS:
            bins = result["collapse"][name]["calibration"]
            ax.plot([b["mean_p"] for b in bins], [b["observed"] for b in bins], marker="o",
                    label=f"{name} (AUC {result['collapse'][name]['auc']:.3f})")
        ax.set(xlabel="stated probability of collapse (decile mean)",
               ylabel="observed collapse rate", title=scheme, xlim=(0, 1), ylim=(0, 1))
        ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


def main(argv: list[str]) -> None:
    del argv
    start = time.perf_counter()
    out_dir = make_output_dir(os.path.abspath(FLAGS.out_dir), "--out_dir")
    if FLAGS.freeze:
        check_unfrozen(FLAGS.frozen)  # before the fit
    rows, skipped = archived_rows(FLAGS.archive)
    stopped = stopped_rows(FLAGS.archive)
    models = fc.fit_forecast(rows, [r["method"] for r in rows])
    if FLAGS.freeze:
        freeze(FLAGS.frozen, models)
    blind = (blind_test(read_frozen(FLAGS.frozen), rows,
                        [r for r in stopped if r["inputs"] is not None])
             if os.path.exists(FLAGS.frozen) else None)
    report = validate(rows, stopped, FLAGS.archive) | {
        "skipped": skipped, "frozen_path": FLAGS.frozen, "blind": blind,
        "blind_sweep": blind_sweep_status(rows, stopped, FLAGS.archive)}
    write_json_atomic(os.path.join(out_dir, "model.json"), models)
    write_json_atomic(os.path.join(out_dir, "validation.json"), report)
    table = markdown(report, models)
    write_bytes_atomic(os.path.join(out_dir, "validation.md"), table.encode())
    plot_calibration(report, os.path.join(out_dir, "calibration.png"))
    print(table)
    print(f"{len(rows)} runs, {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    app.run(exit_on_error(main))
