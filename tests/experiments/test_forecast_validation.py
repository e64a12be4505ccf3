"""The forecast's validation over several archives: protocol records carry the leaderboard's
method names, each archive's runs are counted from its records, and the committed report's
per-archive numbers are its own runs'."""

import json
import shutil
import subprocess
import sys

import pytest

from configs.sweeps import leaderboard, protocol
from postnorm.sweep.archive import read_archive
from postnorm.sweep.plan import RunSpec, build_config
from tests.analysis.test_forecast import ARCHIVE, FORECAST_DIR, _independent_auc
from tests.reliability_helpers import REPO

# Run in a subprocess: experiments.forecast_validation defines absl flags that
# experiments.sweep (imported by other tests) defines too.
COUNT_ARCHIVES = """
import json, sys
from experiments import forecast_validation as fv
archives = sys.argv[1:]
rows, skipped = fv.archived_rows(archives)
stopped = fv.stopped_rows(archives)
print(json.dumps({"skipped": skipped, "counts": fv.archive_counts(rows, stopped, archives)}))
"""


def _record_config(overrides: dict) -> dict:
    """The config a sweep run of ``overrides`` records (``experiments.sweep``'s build)."""
    return build_config(protocol.BASE_CONFIG, RunSpec("", tuple(overrides.items()))).to_dict()


@pytest.mark.parametrize("method", protocol.BRACKET_METHODS)
def test_a_protocol_run_carries_its_leaderboard_method_name(method):
    clipped = _record_config(protocol._bracket_run(method, 1e-3))
    unclipped = _record_config(protocol._bracket_run(method, 1e-3, 0.0))
    assert clipped["opt"]["clip_norm"] == (0.1 if method == "b2t" else protocol.CLIP)
    assert protocol.method_label(clipped) == method
    # unclipped, B2T holds the fields of the leaderboard's unclipped rescaled B2T
    expected = "b2t_rescaled_noclip" if method == "b2t" else method
    assert protocol.method_label(unclipped) == expected


def test_archived_records_keep_their_method_names():
    for entry in read_archive(str(ARCHIVE)):
        assert protocol.method_label(entry["config"]) == leaderboard.method_label(entry["config"])
    for entry in read_archive(protocol.ARCHIVE):  # the protocol's run ids name their method
        assert entry["run_id"].startswith(protocol.method_label(entry["config"]) + "_layers")


def test_each_archives_runs_are_counted_from_its_records(tmp_path):
    measured, unmeasured = tmp_path / "measured", tmp_path / "unmeasured"
    measured.mkdir()
    unmeasured.mkdir()
    paths = sorted(ARCHIVE.glob("*_layers48_lr0.003_warmup20_seed0.json"))[:6]
    for path in paths[:3]:
        shutil.copy(path, measured / path.name)
    for path in paths[3:]:
        entry = json.loads(path.read_text()) | {"measures": None}
        (unmeasured / path.name).write_text(json.dumps(entry))
    stopped = next(e for e in read_archive(str(ARCHIVE)) if e["result"]["status"] != "done")
    (unmeasured / "stopped.json").write_text(json.dumps(stopped))
    archives = [str(measured), str(unmeasured)]
    result = subprocess.run([sys.executable, "-c", COUNT_ARCHIVES, *archives], cwd=REPO,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    counted = json.loads(result.stdout)
    counts = counted["counts"]
    assert not counted["skipped"]
    for directory, monitored in ((measured, True), (unmeasured, False)):
        entries = [json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))]
        done = [e for e in entries if e["result"]["status"] == "done"]
        assert counts[str(directory)] == {
            "runs": len(done), "collapsed": sum(e["result"]["collapse"]["collapsed"] for e in done),
            "nonfinite": sum(e["result"]["status"] == "nonfinite" for e in entries),
            "at_the_floor": sum((e["measures"]["fresh_loss_over_lfreq"] if monitored else
                                 e["result"]["final_eval_loss"] / e["result"]["eval_floor"])
                                >= 0.95 for e in done),
            "floor_from_fresh_batches": len(done) if monitored else 0,
            "floor_from_held_out_loss": 0 if monitored else len(done),
            "monitored": len(done) if monitored else 0}


def test_the_committed_report_scores_each_archive_on_its_own_runs():
    report = json.loads((FORECAST_DIR / "validation.json").read_text())
    runs = report["per_run"]
    assert sum(c["runs"] for c in report["archives"].values()) == report["runs"] == len(runs)
    for archive, counts in report["archives"].items():
        mine = [r for r in runs if r["archive"] == archive]
        assert counts["runs"] == len(mine)
        assert counts["collapsed"] == sum(r["collapsed"] for r in mine)
        assert counts["monitored"] == sum(r["monitored"] for r in mine)
    text = (FORECAST_DIR / "validation.md").read_text()
    for scheme, result in report["schemes"].items():
        name = "step 0 (theory + config)"
        for archive, scores in result["step0_by_archive"].items():
            mine = [r for r in runs if r["archive"] == archive]
            assert scores["auc"] == pytest.approx(_independent_auc(
                [r["collapsed"] for r in mine], [r["p_collapse"][scheme][name] for r in mine]),
                rel=1e-9, nan_ok=True)
            assert f"| `{archive}` ({len(mine)}) | {scores['auc']:.3f} |" in text
        monitored = [r for r in runs if r["monitored"]]
        confirmation = result["collapse"]["monitor: warned by the last step (a confirmation)"]
        assert confirmation["auc"] == pytest.approx(_independent_auc(
            [r["collapsed"] for r in monitored], [r["first_warn"] is not None for r in monitored]),
            rel=1e-9)


VERDICT_LINES = """
import json, sys
import numpy as np
from experiments import forecast_validation as fv
from postnorm.analysis.forecast_frozen import against_baseline
y = np.arange(12) % 2 == 0
scored = against_baseline(y, np.where(y, 0.9, 0.1), np.full(12, 0.5))
one_class = against_baseline(np.zeros(12, bool), np.full(12, 0.2), np.full(12, 0.3))
by_archive = {"sweep": scored, "other": scored, "none_collapsed": one_class}
print(json.dumps([fv.against_baseline_lines(by_archive, {"archive": "sweep", "runs": 40,
                                                          "ended": ended})
                  for ended in (39, 40)]))
"""


def test_the_blind_verdict_is_interim_until_the_registered_sweep_has_ended():
    result = subprocess.run([sys.executable, "-c", VERDICT_LINES], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    interim, final = (dict((line.split(" | ")[0].strip("| `"), line) for line in lines
                           if line.startswith("| `")) for lines in json.loads(result.stdout))
    assert interim["sweep"].endswith("| interim: better (39 of 40 runs ended) |")
    assert final["sweep"].endswith("| better (registered) |")
    assert final["other"].endswith("| better (rule applied after the runs) |")
    assert "| – [–, –] |" in final["none_collapsed"]  # no AUC without a collapse

