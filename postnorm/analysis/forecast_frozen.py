"""A frozen step-0 forecast scored on the runs that finished after it was frozen: a blind test.

The held-out scores of ``experiments.forecast_validation`` refit the forecast inside each fold,
but its inputs and fitting rule were chosen by people who had seen the archive. A frozen
forecast is a ``model.json`` (``fit_forecast``, with the ids of its runs) written once with the
time it was frozen and never refitted; the runs that finished after that time test it blind.
Times are as the records keep them (``finished_at``: the host's local time): the freeze and the
runs must share a time zone, as the project's hosts do (UTC).
"""

import datetime
import json
import os
import time

import numpy as np
from numpy.typing import ArrayLike

from postnorm.analysis import forecast as fc
from postnorm.errors import UserError
from postnorm.files import make_output_dir, write_json_atomic

FROZEN_KEYS = ("collapse", "floor", "log_onset", "range", "run_ids", "frozen_at")
TIME_FORMAT = "%Y-%m-%dT%H:%M:%S"  # the records' ``finished_at``
BOOTSTRAP_REPS = 4000
BOOTSTRAP_SEED = 0
VERDICT_MIN_RUNS = 10  # fewer blind runs in an archive: no verdict against depth and rate


class FrozenForecastError(UserError):
    """A frozen forecast that cannot be read or scored, or that would be replaced."""


def check_unfrozen(path: str) -> None:
    """Refuse to freeze at ``path`` where a frozen forecast is."""
    if os.path.exists(path):
        raise FrozenForecastError(
            f"--freeze: {path} holds a frozen forecast, whose blind test a new one would "
            "restart; move it aside first, or give another --frozen")


def freeze(path: str, models: dict) -> None:
    """``models`` (``fit_forecast``'s) frozen now, written to ``path``, which must hold none."""
    check_unfrozen(path)
    make_output_dir(os.path.dirname(os.path.abspath(path)), "--frozen's directory")
    write_json_atomic(path, models | {"frozen_at": time.strftime(TIME_FORMAT)})


def read_frozen(path: str) -> dict:
    """The frozen forecast at ``path``, checked to read the forecast's own inputs."""
    fix = f"move {path} aside, then freeze the current forecast with --freeze"
    try:
        with open(path) as f:
            models = json.load(f)
        if missing := [k for k in FROZEN_KEYS if k not in models]:
            raise KeyError(f"no {', '.join(missing)}")
        datetime.datetime.strptime(models["frozen_at"], TIME_FORMAT)
        names = {k: tuple(fc.Linear.from_json(models[k]).names) for k in ("collapse", "floor")}
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise FrozenForecastError(f"--frozen={path} is not a frozen forecast "
                                  f"({type(err).__name__}: {err}); {fix}") from err
    for target, read in names.items():
        if read != fc.STEP0:
            raise FrozenForecastError(
                f"--frozen={path}: its {target} model reads the inputs {list(read)}, the "
                f"forecast {list(fc.STEP0)}, so it cannot be scored; {fix} (its blind test "
                "starts again)")
    return models


def baseline_model(models: dict, rows: list[dict]) -> fc.Linear:
    """Depth and rate alone (``fc.BASELINE``) for collapse, fitted by the forecast's rule
    (``fit_selected``, inner folds by method) on the rows of the runs ``models`` was fitted on,
    which must all be in ``rows``."""
    fitted_ids = set(models["run_ids"])
    fitted = [r for r in rows if r["run_id"] in fitted_ids]
    if len(fitted) < len(fitted_ids):
        raise FrozenForecastError(
            f"{len(fitted_ids) - len(fitted)} of the {len(fitted_ids)} runs the frozen forecast "
            "was fitted on are not in --archive, so depth and rate alone cannot be fitted on the "
            "same runs: give every archive it was fitted on, or --frozen='' for no blind test")
    folds = fc.Folds(fc.design(fitted, fc.BASELINE), [r["collapsed"] for r in fitted],
                     [{("inner", r["method"])} for r in fitted], fc.BASELINE)
    return fc.fit_selected(folds)[0]


def bootstrap_intervals(y_N: ArrayLike, p_N: ArrayLike, q_N: ArrayLike,
                        reps: int = BOOTSTRAP_REPS,
                        seed: int = BOOTSTRAP_SEED) -> dict[str, list[float]]:
    """95% percentile intervals over the runs resampled with replacement: the AUC and Brier
    score of ``p_N``, and its Brier score minus that of ``q_N`` on the same runs (paired). A
    resample of one outcome has no AUC and is left out of the AUC's interval."""
    y_N, p_N, q_N = (np.asarray(a, np.float64) for a in (y_N, p_N, q_N))
    index_RxN = np.random.default_rng(seed).integers(0, len(y_N), (reps, len(y_N)))
    stats = {"auc": [fc.auc(y_N[i], p_N[i]) for i in index_RxN],
             "brier": [fc.brier(y_N[i], p_N[i]) for i in index_RxN],
             "brier_minus_baseline": [fc.brier(y_N[i], p_N[i]) - fc.brier(y_N[i], q_N[i])
                                      for i in index_RxN]}
    return {k: [float(v) for v in np.nanpercentile(np.array(s), [2.5, 97.5])] if
            np.isfinite(s).any() else [float("nan")] * 2 for k, s in stats.items()}


def against_baseline(y_N: ArrayLike, p_N: ArrayLike, q_N: ArrayLike) -> dict:
    """The collapse forecast ``p_N`` beside depth and rate alone ``q_N`` on the same runs, with
    ``bootstrap_intervals`` and the verdict the blind sweep registered: ``better`` where the
    Brier difference's interval lies below 0, ``worse`` above, else ``not shown better``; none
    (``too few runs``) under ``VERDICT_MIN_RUNS`` runs."""
    intervals = bootstrap_intervals(y_N, p_N, q_N)
    low, high = intervals["brier_minus_baseline"]
    verdict = ("too few runs" if len(y_N) < VERDICT_MIN_RUNS else "better" if high < 0
               else "worse" if low > 0 else "not shown better")
    return {"runs": len(y_N), "positives": int(np.sum(y_N)), "auc": fc.auc(y_N, p_N),
            "brier": fc.brier(y_N, p_N), "baseline_auc": fc.auc(y_N, q_N),
            "baseline_brier": fc.brier(y_N, q_N),
            "brier_minus_baseline": fc.brier(y_N, p_N) - fc.brier(y_N, q_N),
            "intervals": intervals, "verdict": verdict}


def blind_test(models: dict, rows: list[dict], stopped: list[dict] = ()) -> dict:
    """``models`` (``read_frozen``) on ``rows`` (``archived_rows``, each with ``finished_at``,
    ``method`` and ``archive``): the probabilities, AUC and Brier score of collapse and of the
    floor on the runs that finished after ``frozen_at``, and per archive the collapse forecast
    against depth and rate alone (``against_baseline``); the runs it was not fitted on that had
    finished by then are counted apart (not blind). ``stopped``: runs without a verdict (each
    with ``run_id``, ``archive``, ``finished_at``, ``inputs``), those after ``frozen_at`` listed
    with their probability of collapse, unscored. Runs are named by id, which must be unique
    across ``rows``."""
    ids = [r["run_id"] for r in rows]
    if twice := sorted({i for i in ids if ids.count(i) > 1}):
        raise FrozenForecastError(f"run ids {twice} are in more than one archive: the frozen "
                                  "forecast names its runs by id; give one of those archives")
    fitted = set(models["run_ids"])
    unseen = [r for r in rows if r["run_id"] not in fitted]
    blind = [r for r in unseen if r["finished_at"] > models["frozen_at"]]
    result = {"frozen_at": models["frozen_at"], "fitted_runs": len(fitted),
              "runs": len(blind), "unseen_before_freeze": len(unseen) - len(blind), "per_run": [],
              "stopped": [{"run_id": r["run_id"], "archive": r["archive"],
                           "finished_at": r["finished_at"],
                           "p_collapse": float(fc.probability(
                               fc.Linear.from_json(models["collapse"]),
                               fc.design([r], fc.STEP0))[0])}
                          for r in stopped if r["finished_at"] > models["frozen_at"]]}
    if not blind:
        return result
    x_NxF = fc.design(blind, fc.STEP0)
    labels = {"collapse": "collapsed", "floor": "floor"}
    p_by_target = {t: fc.probability(fc.Linear.from_json(models[t]), x_NxF) for t in labels}
    for target, key in labels.items():
        y_N = np.array([r[key] for r in blind])
        result[target] = {"positives": int(y_N.sum()), "auc": fc.auc(y_N, p_by_target[target]),
                          "brier": fc.brier(y_N, p_by_target[target])}
    q_N = fc.probability(baseline_model(models, rows), fc.design(blind, fc.BASELINE))
    y_N = np.array([r["collapsed"] for r in blind])
    archive_N = np.array([r["archive"] for r in blind])
    result["by_archive"] = {a: against_baseline(y_N[archive_N == a],
                                                p_by_target["collapse"][archive_N == a],
                                                q_N[archive_N == a])
                            for a in dict.fromkeys(r["archive"] for r in blind)}
    result["per_run"] = [{"run_id": r["run_id"], "archive": r["archive"],
                          "finished_at": r["finished_at"],
                          "p_collapse": float(p_by_target["collapse"][i]),
                          "collapsed": r["collapsed"],
                          "p_baseline": float(q_N[i]),
                          "p_floor": float(p_by_target["floor"][i]), "floor": r["floor"]}
                         for i, r in enumerate(blind)]
    return result
