"""The repair-event table: the rule on its edges, the committed table against a plain recount of
the leaderboard archive's records, and its regeneration and its place in docs/RESULTS.md."""

import json
import subprocess
import sys

import pytest

from configs.sweeps.leaderboard import method_label
from postnorm.analysis.repair_events import (
    ALIKE_FRACTION,
    FROM_STEP,
    REPAIRED_FRACTION,
    repair_event,
)
from tests.committed import assert_json_matches, assert_text_matches
from tests.reliability_helpers import REPO, subprocess_env


def run_command(*args: str) -> subprocess.CompletedProcess:
    """experiments.repair_events in its own process (its absl flags stay out of this one)."""
    return subprocess.run([sys.executable, "-m", "experiments.repair_events", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env=subprocess_env(None))

ARCHIVE = REPO / "results" / "leaderboard" / "runs"
COMMITTED = REPO / "results" / "leaderboard" / "repair_events"


@pytest.mark.parametrize("steps,fractions,went_alike,repaired", [
    ([1, 30, 40, 300], [0.0, 0.9, 0.4, 0.05], True, True),  # the threshold itself counts
    ([1, 30, 40, 300], [0.0, 0.9, 0.39, 0.0], False, False),  # a spike before FROM_STEP: no
    ([1, 40, 200, 300], [0.0, 0.1, 0.5, 0.1], True, False),  # 10% at the end: stayed
    ([1, 40, 300], [0.0, 0.6, 0.6], True, False),
    ([1, 10, 20], [0.0, 0.9, 0.0], False, False),  # no step from FROM_STEP on
])
def test_the_rule_on_its_edges(steps, fractions, went_alike, repaired):
    assert (FROM_STEP, ALIKE_FRACTION, REPAIRED_FRACTION) == (40, 0.4, 0.1)
    event = repair_event(steps, fractions)
    assert (event["went_alike"], event["repaired"]) == (went_alike, repaired)
    assert event["final_alike"] == fractions[-1]
    assert event["peak_alike_from_step"] == (None if steps[-1] < FROM_STEP else
                                             max(fractions[steps.index(FROM_STEP):]))


def test_the_committed_table_is_the_archive_recounted():
    """Every record read with json and counted in a loop of its own; floats within
    ``tests.committed.REL_TOL``, counts exactly."""
    counts, runs = {}, []
    for path in sorted(ARCHIVE.glob("*.json")):
        record = json.loads(path.read_text())
        collapse = record["result"]["collapse"]
        peak, final = None, collapse["fraction_collapsed"][-1]
        for step, fraction in zip(collapse["diag_steps"], collapse["fraction_collapsed"],
                                  strict=True):
            if step >= 40 and (peak is None or fraction > peak):
                peak = fraction
        went = peak is not None and peak >= 0.4
        repaired = went and final < 0.1
        method = method_label(record["config"])
        row = counts.setdefault(method, {"method": method, "runs": 0, "went_alike": 0,
                                         "repaired": 0, "stayed": 0})
        row["runs"] += 1
        row["went_alike"] += went
        row["repaired"] += repaired
        row["stayed"] += went and not repaired
        runs.append((record["run_id"], method, peak, final, went, repaired))
    committed = json.loads(COMMITTED.with_suffix(".json").read_text())
    assert committed["left_out"] == []
    assert committed["rule"] == {"tsim_threshold": 0.99, "from_step": 40,
                                 "alike_fraction": 0.4, "repaired_fraction": 0.1}
    assert_json_matches(sorted(committed["methods"], key=lambda c: c["method"]),
                        sorted(counts.values(), key=lambda c: c["method"]))
    assert_json_matches([[r["run_id"], r["method"], r["peak_alike_from_step"],
                          r["final_alike"], r["went_alike"], r["repaired"]]
                         for r in committed["runs"]], [list(r) for r in runs])


def test_the_committed_files_are_regenerated_and_the_results_show_the_table(tmp_path):
    result = run_command(f"--archive={ARCHIVE}", f"--out={tmp_path / 'repair_events'}")
    assert result.returncode == 0, result.stderr[-3000:]
    table = (tmp_path / "repair_events.md").read_text()
    assert_text_matches(table, COMMITTED.with_suffix(".md").read_text())
    assert_json_matches(json.loads((tmp_path / "repair_events.json").read_text()),
                        json.loads(COMMITTED.with_suffix(".json").read_text()))
    doc = (REPO / "docs" / "RESULTS.md").read_text()
    table_lines = [line for line in table.splitlines() if line.startswith("|")]
    start = doc.index(table_lines[0])
    assert doc[start:].splitlines()[:len(table_lines)] == table_lines


def test_an_empty_archive_is_refused(tmp_path):
    (tmp_path / "none").mkdir()
    result = run_command(f"--archive={tmp_path / 'none'}", f"--out={tmp_path / 'out'}")
    assert result.returncode == 2 and "holds no run record" in result.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["none"]
