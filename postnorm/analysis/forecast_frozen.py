"""A frozen step-0 forecast scored on the runs recorded after it was frozen: a blind test.

The held-out scores of ``experiments.forecast_validation`` refit the forecast inside each fold,
but its inputs and fitting rule were chosen by people who had seen the archive. A frozen
forecast is a ``model.json`` (``fit_forecast``) written once with the time it was frozen and
never refitted; the runs archived after that time, none of which it was fitted on, test it
blind.
"""

import json

import numpy as np

from postnorm.analysis import forecast as fc
from postnorm.errors import UserError

KEYS = ("collapse", "floor", "log_onset", "range", "run_ids", "frozen_at")


class FrozenForecastError(UserError):
    """A frozen forecast that cannot be read, or that reads other inputs than the forecast."""


def frozen(models: dict, frozen_at: str) -> dict:
    """``models`` (``fit_forecast``'s, with ``run_ids``) frozen at ``frozen_at`` (ISO time)."""
    return models | {"frozen_at": frozen_at}


def read_frozen(path: str) -> dict:
    """The frozen forecast at ``path``, checked to read the forecast's own inputs."""
    try:
        with open(path) as f:
            models = json.load(f)
        if missing := [k for k in KEYS if k not in models]:
            raise KeyError(f"no {', '.join(missing)}")
        names = {k: tuple(fc.Linear.from_json(models[k]).names) for k in ("collapse", "floor")}
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise FrozenForecastError(
            f"--frozen={path} is not a frozen forecast ({type(err).__name__}: {err}); write one "
            "with python -m experiments.forecast_validation --freeze") from err
    if any(n != fc.STEP0 for n in names.values()):
        raise FrozenForecastError(
            f"--frozen={path} reads the inputs {list(names['collapse'])}, the forecast "
            f"{list(fc.STEP0)}: it cannot be scored; move it aside and freeze the current "
            "forecast with --freeze (its blind test starts again)")
    return models


def blind_test(models: dict, rows: list[dict]) -> dict:
    """``models`` (``read_frozen``) on ``rows`` (``archived_rows``, each with ``archived_at``):
    the probabilities, AUC and Brier score of collapse and of the floor on the runs archived
    after ``frozen_at`` that it was not fitted on; the runs it was not fitted on but that were
    archived before it was frozen are counted apart (not blind: they existed when it was
    fitted)."""
    fitted = set(models["run_ids"])
    unseen = [r for r in rows if r["run_id"] not in fitted]
    blind = [r for r in unseen if r["archived_at"] > models["frozen_at"]]
    result = {"frozen_at": models["frozen_at"], "fitted_runs": len(fitted),
              "runs": len(blind), "unseen_before_freeze": len(unseen) - len(blind), "per_run": []}
    if not blind:
        return result
    x_NxF = fc.design(blind, fc.STEP0)
    labels = {"collapse": "collapsed", "floor": "floor"}
    p_TxN = {t: fc.probability(fc.Linear.from_json(models[t]), x_NxF) for t in labels}
    for target, key in labels.items():
        y_N = np.array([r[key] for r in blind])
        result[target] = {"positives": int(y_N.sum()), "auc": fc.auc(y_N, p_TxN[target]),
                          "brier": fc.brier(y_N, p_TxN[target])}
    result["per_run"] = [{"run_id": r["run_id"], "archived_at": r["archived_at"],
                          "p_collapse": float(p_TxN["collapse"][i]), "collapsed": r["collapsed"],
                          "p_floor": float(p_TxN["floor"][i]), "floor": r["floor"]}
                         for i, r in enumerate(blind)]
    return result
