"""The long-horizon protocol's committed report (results/protocol/) against its archive: the
report-only command regenerates every table from the records alone, and every long-run rate,
interval and equivalence test it states is recomputed here from the records' held-out losses
with scipy (tests/paired_reference.py), not with the code that wrote it."""

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from configs.sweeps import protocol
from tests.committed import REL_TOL, assert_json_matches, assert_text_matches
from tests.paired_reference import scipy_gap
from tests.reliability_helpers import REPO, subprocess_env

PROTOCOL = REPO / "results" / "protocol"
TABLES = ("bracket", "calibration", "survival", "width", "unplanned")


def _report() -> dict:
    return json.loads((PROTOCOL / "protocol.json").read_text())


def _loss(run_id: str) -> float | None:
    """A run's held-out loss at its last step, from its record; None unless it finished."""
    path = PROTOCOL / "runs" / f"{run_id}.json"
    if not path.exists():
        return None
    result = json.loads(path.read_text())["result"]
    return result["final_eval_loss"] if result["status"] == "done" else None


def test_the_report_only_command_regenerates_every_table_from_the_archive(tmp_path):
    shutil.copy(PROTOCOL / "corpus.json", tmp_path / "corpus.json")
    result = subprocess.run(
        [sys.executable, "-m", "experiments.protocol", f"--out_dir={tmp_path}",
         "--archive=results/protocol/runs"],
        cwd=REPO, capture_output=True, text=True, timeout=600, env=subprocess_env(None))
    assert result.returncode == 0, result.stderr[-3000:]
    for name in TABLES:
        assert_text_matches((tmp_path / f"{name}.md").read_text(),
                            (PROTOCOL / f"{name}.md").read_text())
    assert_json_matches(json.loads((tmp_path / "protocol.json").read_text()), _report())


def test_every_archived_run_is_reported_or_listed_outside_the_plan():
    """The plan's archived runs are in the tables; the others are listed as outside it, and
    each is a survival method's run of an earlier plan: a long bracket of another horizon than
    the survival runs', or a survival run whose method's long-run rate is not its rate
    (re-chosen, or not settled)."""
    report = _report()
    archived = {p.stem for p in (PROTOCOL / "runs").glob("*.json")}
    planned = {run.run_id for variant in protocol.VARIANTS
               for run in protocol.planned_runs(variant, str(PROTOCOL / "runs"))}
    reported = {run_id for e in report["bracket"] for run_id in e["runs"].values()}
    reported |= {i for e in report["calibration"] for runs in e["runs"].values()
                 for i in runs.values()}
    for variant in ("survival", "width"):
        reported |= {i for e in report[variant] for i in e["runs"].values()}
    assert archived & planned <= reported
    assert sorted(r["run_id"] for r in report["unplanned"]) == sorted(archived - planned)
    survival_lr = {e["method"]: e["lr"] for e in report["survival"]}
    for run_id in archived - planned:
        config = json.loads((PROTOCOL / "runs" / f"{run_id}.json").read_text())["config"]
        method = protocol.method_label(config)
        assert method in protocol.SURVIVAL_METHODS, run_id
        assert config["model"]["n_layers"] == 48 and config["seed"] in protocol.SEEDS, run_id
        if config["train"]["steps"] != protocol.LONG_STEPS:  # a bracket of another horizon
            assert config["train"]["steps"] != protocol.SCREEN_STEPS, run_id
            assert config["model"]["d_model"] != protocol.WIDTH_D_MODEL, run_id
            assert config["seed"] == 0 and config["opt"]["clip_norm"] > 0, run_id
        else:
            assert survival_lr.get(method) != config["opt"]["lr"], run_id


def test_the_docs_include_the_generated_tables():
    """PROTOCOL.md includes the calibration and width tables and the runs outside the plan
    verbatim, LEADERBOARD.md opens with the survival table."""
    protocol_doc = (REPO / "docs" / "PROTOCOL.md").read_text()
    for name in ("calibration", "width", "unplanned"):
        assert (PROTOCOL / f"{name}.md").read_text().strip() in protocol_doc, name
    leaderboard = (REPO / "docs" / "LEADERBOARD.md").read_text()
    survival = (PROTOCOL / "survival.md").read_text().strip()
    assert survival in leaderboard.split("## The 300-step screen")[0]


def _trains(run_id: str) -> bool:
    path = PROTOCOL / "runs" / f"{run_id}.json"
    if not path.exists():
        return False
    result = json.loads(path.read_text())["result"]
    return (result["status"] == "done" and not result["collapse"]["collapsed"]
            and result["final_eval_loss"] < 0.95 * result["lfreq"])


def _failed(run_id: str) -> bool:
    result = json.loads((PROTOCOL / "runs" / f"{run_id}.json").read_text())["result"]
    return result["status"] != "done" or result["collapse"]["collapsed"]


def test_each_long_run_rate_is_recomputed_from_the_records():
    """The rate below the first failing one (collapse or non-finite) with the lowest loss among
    those that train, else the largest below the first failure; and the largest rate that
    trains (no collapse, held-out loss under 0.95 x L_freq)."""
    for entry in _report()["bracket"]:
        runs = sorted((float(lr), i) for lr, i in entry["runs"].items())
        finished = all((PROTOCOL / "runs" / f"{i}.json").exists() for _, i in runs)
        trained = [lr for lr, i in runs if _trains(i)]
        assert entry["largest_trained_lr"] == (max(trained) if finished and trained else None)
        if entry["best_lr"] is None:
            assert not finished or entry["grow"] is not None
            continue
        stable = []
        for lr, run_id in runs:
            if _failed(run_id):
                break
            stable.append((lr, run_id))
        training = [(_loss(i), lr) for lr, i in stable if _trains(i)]
        expected = min(training)[1] if training else stable[-1][0]
        assert entry["best_lr"] == pytest.approx(expected, rel=1e-12)
        assert entry["basis"] == ("trains" if training else "stable")
        # settled: not at an open edge of the grid
        assert expected != runs[0][0] or not training
        assert expected != runs[-1][0]


def test_each_survival_rate_is_its_brackets_choice():
    """The 300-step clipped bracket's rate where some rate trains there, else the rate of the
    longer clipped bracket the method then gets."""
    report = _report()
    clipped = {(e["method"], e["steps"]): e for e in report["bracket"] if e["clipped"]}
    for entry in report["survival"]:
        screen = clipped[(entry["method"], protocol.SCREEN_STEPS)]
        deciding = screen if screen["basis"] == "trains" else \
            clipped[(entry["method"], protocol.LONG_BRACKET_STEPS)]
        assert deciding["best_lr"] is not None
        assert entry["lr"] == deciding["best_lr"]


def test_the_survival_table_names_the_methods_whose_rate_is_not_settled():
    """The survival methods with no long-run rate yet, and only they, are named as waiting."""
    waiting = [m for m in protocol.SURVIVAL_METHODS
               if protocol.long_run_rate(m, str(PROTOCOL / "runs")) is None]
    text = (PROTOCOL / "survival.md").read_text()
    note = [line for line in text.splitlines() if line.startswith("Not planned yet")]
    if not waiting:
        assert not note
        return
    assert note == [f"Not planned yet (long-run rate not settled; see the bracket): "
                    f"{', '.join(waiting)}."]


def _check_gap(gap: dict, method_runs: dict[str, str], reference_runs: dict[str, str]) -> None:
    method = {int(s): _loss(i) for s, i in method_runs.items()}
    reference = {int(s): _loss(i) for s, i in reference_runs.items()}
    seeds = sorted(s for s in method if method[s] is not None and reference.get(s) is not None)
    assert gap["seeds"] == seeds
    d = np.array([method[s] - reference[s] for s in seeds])
    assert gap["mean"] == pytest.approx(d.mean(), rel=REL_TOL)
    if len(d) < 2:
        assert gap["ci95"] is None and gap["verdict"] == "inconclusive"
        return
    low, high, tost, verdict = scipy_gap(d, gap["margin"])
    assert gap["ci95"] == pytest.approx([low, high], rel=1e-9)
    assert gap["tost_p"] == pytest.approx(tost, rel=1e-9)
    assert gap["verdict"] == verdict


def test_every_interval_and_test_is_recomputed_from_the_records():
    report = _report()
    checked = 0
    for entry in report["calibration"]:
        if entry["gap"]["mean"] is not None:
            _check_gap(entry["gap"], entry["runs"]["post"], entry["runs"]["pre"])
            checked += 1
    for variant in ("survival", "width"):
        by_method = {e["method"]: e for e in report[variant]}
        for entry in report[variant]:
            if entry["gap"] is not None and entry["gap"]["mean"] is not None:
                _check_gap(entry["gap"], entry["runs"], by_method[entry["reference"]]["runs"])
                checked += 1
    stated = sum(e["gap"]["mean"] is not None for e in report["calibration"]) + sum(
        e["gap"] is not None and e["gap"]["mean"] is not None
        for v in ("survival", "width") for e in report[v])
    assert checked == stated
