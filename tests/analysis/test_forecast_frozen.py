"""The frozen forecast's blind test: scored by hand on exactly the runs that finished after it
was frozen; the committed frozen forecast is the fit on the runs it names, all finished before."""

import json
import subprocess
import sys

import numpy as np
import pytest
from scipy import stats

from configs.sweeps import protocol
from postnorm.analysis import forecast as fc
from postnorm.analysis.forecast_frozen import (
    FrozenForecastError,
    against_baseline,
    baseline_model,
    blind_test,
    bootstrap_intervals,
    freeze,
    read_frozen,
)
from postnorm.sweep.archive import read_archive
from tests.analysis.test_forecast import FORECAST_DIR, _independent_auc
from tests.committed import assert_json_matches
from tests.reliability_helpers import REPO

FROZEN = FORECAST_DIR / "frozen_model.json"
ARCHIVES = ("results/leaderboard/runs", "results/protocol/runs", "results/forecast_blind/runs")


def _by_hand(model: dict, inputs: dict) -> float:
    """The logistic model's probability, written out: 1 / (1 + exp(-(b + sum w (x - m) / s)))."""
    score = model["bias"] + sum(w * (inputs[n] - m) / s for n, m, s, w in zip(
        model["names"], model["mean"], model["scale"], model["weights"], strict=True))
    return 1.0 / (1.0 + np.exp(-score))


def _linear(rng) -> dict:
    return fc.Linear(fc.STEP0, tuple(rng.normal(size=len(fc.STEP0))),
                     tuple(rng.uniform(0.5, 2, len(fc.STEP0))),
                     tuple(rng.normal(size=len(fc.STEP0))), float(rng.normal())).to_json()


def test_the_blind_test_scores_only_the_runs_that_finished_after_the_freeze():
    rng = np.random.default_rng(0)
    fitted_ids = ["fitted0", "fitted1"] + [f"fit{i}" for i in range(16)]
    models = {"collapse": _linear(rng), "floor": _linear(rng), "log_onset": _linear(rng),
              "range": {}, "run_ids": fitted_ids, "frozen_at": "2026-01-02T00:00:00"}
    rows = [{"run_id": run_id, "finished_at": at, "early": {}, "method": f"m{i % 3}",
             "archive": "a" if i < 10 else "b",
             "inputs": dict(zip(fc.STEP0, rng.normal(size=len(fc.STEP0)), strict=True)),
             "collapsed": bool(rng.random() < 0.5), "floor": bool(rng.random() < 0.5)}
            for i, (run_id, at) in enumerate([("fitted0", "2026-01-01T00:00:00"),
                               ("fitted1", "2026-01-03T00:00:00"),  # fitted: never blind
                               ("early", "2026-01-01T12:00:00"),  # not fitted, yet seen
                               ("at_the_freeze", "2026-01-02T00:00:00")]  # finished by then
            + [(f"new{i}", f"2026-01-0{3 + i % 5}T00:00:00") for i in range(12)])]
    rows += [{"run_id": f"fit{i}", "finished_at": "2026-01-01T00:00:00", "early": {},
              "method": f"m{i % 3}", "archive": "a", "collapsed": bool(i % 2), "floor": False,
              "inputs": dict(zip(fc.STEP0, rng.normal(size=len(fc.STEP0)), strict=True))}
             for i in range(16)]
    stopped = [{"run_id": run_id, "finished_at": at, "early": {}, "archive": "b",
                "inputs": dict(zip(fc.STEP0, rng.normal(size=len(fc.STEP0)), strict=True))}
               for run_id, at in (("diverged_before", "2026-01-01T00:00:00"),
                                  ("diverged_after", "2026-01-04T00:00:00"))]
    result = blind_test(models, rows, stopped)
    blind = rows[4:16]
    assert [r["run_id"] for r in result["stopped"]] == ["diverged_after"]
    assert result["stopped"][0]["p_collapse"] == pytest.approx(
        _by_hand(models["collapse"], stopped[1]["inputs"]), rel=1e-12)
    fitted = [r for r in rows if r["run_id"] in fitted_ids]
    baseline, _ = fc.fit_selected(fc.Folds(
        fc.design(fitted, fc.BASELINE), [r["collapsed"] for r in fitted],
        [{("inner", r["method"])} for r in fitted], fc.BASELINE))
    np.testing.assert_allclose([r["p_baseline"] for r in result["per_run"]],
                               fc.probability(baseline, fc.design(blind, fc.BASELINE)))
    assert [r["run_id"] for r in result["per_run"]] == [r["run_id"] for r in blind]
    assert (result["runs"], result["unseen_before_freeze"], result["fitted_runs"],
            result["frozen_at"]) == (12, 2, 18, "2026-01-02T00:00:00")
    for target, key in (("collapse", "collapsed"), ("floor", "floor")):
        p = [_by_hand(models[target], r["inputs"]) for r in blind]
        y = [r[key] for r in blind]
        np.testing.assert_allclose([r[f"p_{target}"] for r in result["per_run"]], p, rtol=1e-12)
        assert result[target]["auc"] == pytest.approx(_independent_auc(y, p), rel=1e-12)
        assert result[target]["brier"] == pytest.approx(np.mean((np.array(p) - y) ** 2))
        assert result[target]["positives"] == sum(y)
    assert sorted(result["by_archive"]) == ["a", "b"]
    for archive, scored in result["by_archive"].items():
        mine = [(r, run) for r, run in zip(blind, result["per_run"], strict=True)
                if r["archive"] == archive]
        assert scored["runs"] == len(mine)
        assert scored["auc"] == pytest.approx(_independent_auc(
            [r["collapsed"] for r, _ in mine], [run["p_collapse"] for _, run in mine]))
        assert scored["baseline_brier"] == pytest.approx(np.mean(
            [(run["p_baseline"] - r["collapsed"]) ** 2 for r, run in mine]))
    assert blind_test(models, rows[:4] + rows[16:])["runs"] == 0
    with pytest.raises(FrozenForecastError, match=r"\['new0'\] are in more than one archive"):
        blind_test(models, rows + rows[4:5])
    with pytest.raises(FrozenForecastError, match="2 of the 18 runs .* are not in --archive"):
        blind_test(models, rows[2:])


def test_the_bootstrap_intervals_agree_with_scipys_paired_percentile_bootstrap():
    rng = np.random.default_rng(3)
    y = rng.random(60) < 0.4
    p = np.clip(0.4 + 0.3 * (y - 0.4) + rng.normal(0, 0.2, 60), 0.01, 0.99)
    q = np.full(60, 0.4)
    ours = bootstrap_intervals(y, p, q, reps=20000, seed=1)
    statistics = {"auc": lambda y_, p_, q_: _independent_auc(y_.astype(bool), p_),
                  "brier": lambda y_, p_, q_: np.mean((p_ - y_) ** 2),
                  "brier_minus_baseline": lambda y_, p_, q_: np.mean((p_ - y_) ** 2
                                                                     - (q_ - y_) ** 2)}
    for key, statistic in statistics.items():
        theirs = stats.bootstrap((y.astype(float), p, q), statistic, paired=True,
                                 vectorized=False, n_resamples=20000, method="percentile",
                                 rng=2).confidence_interval
        width = theirs.high - theirs.low
        assert ours[key] == pytest.approx([theirs.low, theirs.high], abs=0.05 * width), key


def test_the_registered_verdict_reads_the_brier_differences_interval():
    rng = np.random.default_rng(4)
    y = rng.random(80) < 0.5
    sharp, vague = np.where(y, 0.9, 0.1), np.full(80, 0.5)
    noisy = np.clip(vague + rng.normal(0, 0.02, 80), 0, 1)
    assert against_baseline(y, sharp, vague)["verdict"] == "better"
    assert against_baseline(y, vague, sharp)["verdict"] == "worse"
    assert against_baseline(y, noisy, vague)["verdict"] == "not shown better"
    assert against_baseline(y[:9], sharp[:9], vague[:9])["verdict"] == "too few runs"
    one_class = against_baseline(np.zeros(12, bool), np.full(12, 0.2), np.full(12, 0.3))
    assert np.isnan(one_class["auc"]) and np.isnan(one_class["intervals"]["auc"]).all()
    assert one_class["verdict"] == "better"  # 0.04 < 0.09 on every resample


def test_the_baseline_is_fitted_on_the_frozen_forecasts_runs_alone():
    rng = np.random.default_rng(5)
    rows = [{"run_id": f"r{i}", "method": f"m{i % 4}", "early": {},
             "inputs": dict(zip(fc.STEP0, rng.normal(size=len(fc.STEP0)), strict=True)),
             "collapsed": bool(rng.random() < 0.5)} for i in range(60)]
    models = {"run_ids": [f"r{i}" for i in range(40)]}
    flipped = rows[:40] + [r | {"collapsed": not r["collapsed"]} for r in rows[40:]]
    x = fc.design(rows, fc.BASELINE)
    np.testing.assert_array_equal(fc.probability(baseline_model(models, rows), x),
                                  fc.probability(baseline_model(models, flipped), x))
    assert baseline_model(models, rows).names == fc.BASELINE


def test_a_frozen_forecast_of_other_inputs_or_none_is_refused_with_the_fix(tmp_path):
    rng = np.random.default_rng(1)
    own, other = _linear(rng), _linear(rng) | {"names": list(fc.STEP0[:-1]) + ["an_old_input"]}
    path = tmp_path / "frozen.json"
    frozen = {"collapse": own, "floor": other, "log_onset": own, "range": {}, "run_ids": [],
              "frozen_at": "2026-01-01T00:00:00"}
    fix = f"move {path} aside, then freeze the current forecast with --freeze"
    for changed, match in (({}, "its floor model reads .*an_old_input"),
                           ({"frozen_at": "yesterday"}, "ValueError: time data 'yesterday'")):
        path.write_text(json.dumps(frozen | changed))
        with pytest.raises(FrozenForecastError, match=match) as raised:
            read_frozen(str(path))
        assert str(raised.value).startswith(f"--frozen={path}") and fix in str(raised.value)
    path.write_text(json.dumps({"collapse": own}))
    with pytest.raises(FrozenForecastError, match="no floor, log_onset, range"):
        read_frozen(str(path))


def test_freeze_never_replaces_a_frozen_forecast(tmp_path):
    path = tmp_path / "sub" / "frozen.json"
    freeze(str(path), {"run_ids": []})
    with pytest.raises(FrozenForecastError, match=f"{path} holds a frozen.*move it aside"):
        freeze(str(path), {"run_ids": ["changed"]})
    assert json.loads(path.read_text())["run_ids"] == []


def test_the_validation_command_refuses_to_freeze_over_one_before_fitting(tmp_path):
    path = tmp_path / "frozen.json"
    path.write_text("{}")
    result = subprocess.run(
        [sys.executable, "-m", "experiments.forecast_validation", "--freeze",
         f"--frozen={path}", f"--archive={tmp_path / 'none'}", f"--out_dir={tmp_path}"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and f"{path} holds a frozen forecast" in result.stderr
    assert path.read_text() == "{}"  # and the missing archive was never read


@pytest.mark.slow
def test_the_committed_frozen_forecast_is_the_fit_on_the_runs_it_names_all_before_it():
    """Refitting on the archived runs it names gives the frozen models; every one had finished
    before it was frozen; the committed report's blind test is the frozen models on every run
    that finished later, by hand."""
    models = read_frozen(str(FROZEN))
    rows = [row | {"finished_at": entry["result"]["finished_at"],
                   "method": protocol.method_label(entry["config"])}
            for archive in ARCHIVES for entry in read_archive(str(REPO / archive))
            if (row := fc.archive_row(entry)) is not None]
    fitted = [r for r in rows if r["run_id"] in set(models["run_ids"])]
    assert len(fitted) == len(models["run_ids"])
    assert all(r["finished_at"] <= models["frozen_at"] for r in fitted)
    refit = fc.fit_forecast(fitted, [r["method"] for r in fitted])
    assert_json_matches(refit, {k: v for k, v in models.items() if k != "frozen_at"})
    later = {r["run_id"]: r for r in rows if r["finished_at"] > models["frozen_at"]}
    report = json.loads((FORECAST_DIR / "validation.json").read_text())["blind"]
    assert sorted(r["run_id"] for r in report["per_run"]) == sorted(later)
    for run in report["per_run"]:
        assert run["p_collapse"] == pytest.approx(
            _by_hand(models["collapse"], later[run["run_id"]]["inputs"]), rel=1e-9)
        assert run["p_floor"] == pytest.approx(
            _by_hand(models["floor"], later[run["run_id"]]["inputs"]), rel=1e-9)
        assert (run["collapsed"], run["floor"]) == tuple(later[run["run_id"]][k]
                                                         for k in ("collapsed", "floor"))
