"""The frozen forecast's blind test: scored by hand on exactly the runs archived after it was
frozen; the committed frozen forecast is the fit on the runs it names, all archived before it."""

import json
import subprocess
import sys

import numpy as np
import pytest

from configs.sweeps import protocol
from postnorm.analysis import forecast as fc
from postnorm.analysis.forecast_frozen import (
    FrozenForecastError,
    blind_test,
    frozen,
    read_frozen,
)
from postnorm.sweep.archive import read_archive
from tests.analysis.test_forecast import FORECAST_DIR, _independent_auc
from tests.reliability_helpers import REPO

FROZEN = FORECAST_DIR / "frozen_model.json"
ARCHIVES = ("results/leaderboard/runs", "results/protocol/runs")


def _by_hand(model: dict, inputs: dict) -> float:
    """The logistic model's probability, written out: 1 / (1 + exp(-(b + sum w (x - m) / s)))."""
    score = model["bias"] + sum(w * (inputs[n] - m) / s for n, m, s, w in zip(
        model["names"], model["mean"], model["scale"], model["weights"], strict=True))
    return 1.0 / (1.0 + np.exp(-score))


def _linear(rng) -> dict:
    return fc.Linear(fc.STEP0, tuple(rng.normal(size=len(fc.STEP0))),
                     tuple(rng.uniform(0.5, 2, len(fc.STEP0))),
                     tuple(rng.normal(size=len(fc.STEP0))), float(rng.normal())).to_json()


def test_the_blind_test_scores_only_the_runs_archived_after_the_freeze():
    rng = np.random.default_rng(0)
    models = frozen({"collapse": _linear(rng), "floor": _linear(rng), "log_onset": _linear(rng),
                     "range": {}, "run_ids": ["fitted0", "fitted1"]}, "2026-01-02T00:00:00")
    rows = [{"run_id": run_id, "archived_at": at, "early": {},
             "inputs": dict(zip(fc.STEP0, rng.normal(size=len(fc.STEP0)), strict=True)),
             "collapsed": bool(rng.random() < 0.5), "floor": bool(rng.random() < 0.5)}
            for run_id, at in [("fitted0", "2026-01-01T00:00:00"),
                               ("fitted1", "2026-01-03T00:00:00"),  # fitted: never blind
                               ("early", "2026-01-01T12:00:00")]  # not fitted, yet seen
            + [(f"new{i}", f"2026-01-0{3 + i % 5}T00:00:00") for i in range(12)]]
    result = blind_test(models, rows)
    blind = rows[3:]
    assert [r["run_id"] for r in result["per_run"]] == [r["run_id"] for r in blind]
    assert (result["runs"], result["unseen_before_freeze"], result["fitted_runs"]) == (12, 1, 2)
    for target, key in (("collapse", "collapsed"), ("floor", "floor")):
        p = [_by_hand(models[target], r["inputs"]) for r in blind]
        y = [r[key] for r in blind]
        np.testing.assert_allclose([r[f"p_{target}"] for r in result["per_run"]], p, rtol=1e-12)
        assert result[target]["auc"] == pytest.approx(_independent_auc(y, p), rel=1e-12)
        assert result[target]["brier"] == pytest.approx(np.mean((np.array(p) - y) ** 2))
        assert result[target]["positives"] == sum(y)
    assert blind_test(models, rows[:3])["runs"] == 0


def test_a_frozen_forecast_of_other_inputs_or_none_is_refused_with_the_fix(tmp_path):
    rng = np.random.default_rng(1)
    other = _linear(rng) | {"names": list(fc.STEP0[:-1]) + ["an_old_input"]}
    path = tmp_path / "frozen.json"
    path.write_text(json.dumps(frozen({"collapse": other, "floor": other, "log_onset": other,
                                       "range": {}, "run_ids": []}, "2026-01-01T00:00:00")))
    with pytest.raises(FrozenForecastError, match="an_old_input.*--freeze"):
        read_frozen(str(path))
    path.write_text(json.dumps({"collapse": other}))
    with pytest.raises(FrozenForecastError, match=f"{path}.*no floor.*--freeze"):
        read_frozen(str(path))


FREEZE_TWICE = """
import sys
from experiments import forecast_validation as fv
fv.freeze(sys.argv[1], {"run_ids": []})
try:
    fv.freeze(sys.argv[1], {"run_ids": ["changed"]})
except fv.FreezeError as err:
    print(err)
"""


def test_freeze_never_replaces_a_frozen_forecast(tmp_path):
    # in a subprocess: experiments.forecast_validation's absl flags clash with other commands'
    path = tmp_path / "sub" / "frozen.json"
    result = subprocess.run([sys.executable, "-c", FREEZE_TWICE, str(path)], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert str(path) in result.stdout and "move it aside" in result.stdout
    assert json.loads(path.read_text())["run_ids"] == []


@pytest.mark.slow
def test_the_committed_frozen_forecast_is_the_fit_on_the_runs_it_names_all_before_it():
    """Refitting on the archived runs it names gives the frozen models exactly; every one was
    archived before it was frozen; the committed report's blind test is the frozen models on
    every later run, by hand."""
    models = read_frozen(str(FROZEN))
    rows = [row | {"archived_at": entry["archived_at"],
                   "method": protocol.method_label(entry["config"])}
            for archive in ARCHIVES for entry in read_archive(str(REPO / archive))
            if (row := fc.archive_row(entry)) is not None]
    fitted = [r for r in rows if r["run_id"] in set(models["run_ids"])]
    assert len(fitted) == len(models["run_ids"])
    assert all(r["archived_at"] < models["frozen_at"] for r in fitted)
    refit = fc.fit_forecast(fitted, [r["method"] for r in fitted])
    for key in ("collapse", "floor", "log_onset", "selection", "range", "runs", "run_ids"):
        assert refit[key] == models[key], key
    later = {r["run_id"]: r for r in rows if r["archived_at"] > models["frozen_at"]}
    report = json.loads((FORECAST_DIR / "validation.json").read_text())["blind"]
    assert sorted(r["run_id"] for r in report["per_run"]) == sorted(later)
    for run in report["per_run"]:
        assert run["p_collapse"] == pytest.approx(
            _by_hand(models["collapse"], later[run["run_id"]]["inputs"]), rel=1e-9)
        assert run["collapsed"] == later[run["run_id"]]["collapsed"]
