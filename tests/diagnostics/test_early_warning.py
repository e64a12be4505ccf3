"""The collapse early-warning monitor: its levels on synthetic steps with a known answer, the
rule it shares with the offline detector, its lead time there, the live monitor's rebuild on a
resume, a training run's logged readings against the replay, and the replay command, over run
directories and over a sweep's archive."""

import json
import subprocess
import sys

import numpy as np
import pytest

from postnorm.analysis import collapse as offline
from postnorm.analysis.collapse import detect_collapse, replay_monitor
from postnorm.config import base_config
from postnorm.diagnostics import early_warning
from postnorm.diagnostics.early_warning import MonitorRule, MonitorState, assess, monitor_rule_from
from postnorm.files import write_json_atomic
from postnorm.train.loop import train_and_evaluate
from postnorm.train.reporter import Monitor
from postnorm.workdir.config_record import read_run_config, write_run_config
from postnorm.workdir.metrics import read_metrics
from tests.analysis.test_collapse import records
from tests.reliability_helpers import REPO, tiny_config, write_corpus

HIGH, LOW = [0.995] * 3 + [0.5], [0.995] + [0.5] * 3  # 3 of 4 layers alike; 1 of 4
TWO = MonitorRule(persistence=2)


def test_levels_none_watch_and_warn():
    state = MonitorState()
    alarm, state = assess(10, [0.2, 0.5, 0.9, 0.98], 8.0, 5.0, state, TWO)
    assert (alarm.level, alarm.layers, state.streak) == (0, (), 0)
    alarm, state = assess(20, HIGH, 5.5, 5.0, state, TWO)  # alike, but not yet for two steps
    assert (alarm.name, alarm.layers, state.streak, state.first_watch) == ("watch", (0, 1, 2),
                                                                              1, 20)
    assert "layers 0-2 have tsim >= 0.99" in alarm.reason
    alarm, state = assess(30, HIGH, 5.5, 5.0, state, TWO)
    assert (alarm.name, state.first_warn, alarm.fraction) == ("warn", 30, 0.75)
    assert "3 of 4 layers have tsim >= 0.99 for 2 diagnostic steps" in alarm.reason
    alarm, state = assess(40, LOW, 5.5, 5.0, state, TWO)  # the streak breaks: back to watch
    assert (alarm.name, state.streak, state.first_warn) == ("watch", 0, 30)


def test_a_transient_spike_or_a_loss_far_from_the_floor_stays_at_watch():
    state = MonitorState()
    for step, tsim in ((10, HIGH), (20, HIGH), (30, LOW), (40, HIGH), (50, LOW)):  # < 3 in a row
        alarm, state = assess(step, tsim, 5.1, 5.0, state)
        assert alarm.level == 1
    for step in (50, 60, 70):  # alike for three steps, the loss 30% above its floor
        alarm, state = assess(step, HIGH, 6.5, 5.0, state)
        assert alarm.level == 1
    assert state.first_warn is None
    rule = MonitorRule(persistence=3, warn_loss_rtol=0.35)
    levels = []
    state = MonitorState()
    for step in (50, 60, 70):
        alarm, state = assess(step, HIGH, 6.5, 5.0, state, rule)
        levels.append(alarm.level)
    assert levels == [1, 1, 2]


def test_the_monitor_and_the_detector_share_one_rule():
    assert offline.CollapseRule is early_warning.CollapseRule
    assert offline.DEFAULT_RULE is early_warning.DEFAULT_MONITOR.collapse
    assert monitor_rule_from(None) == early_warning.DEFAULT_MONITOR
    assert monitor_rule_from({"warn_persistence": 3, "warn_loss_rtol": 0.1}) == MonitorRule(
        persistence=3, warn_loss_rtol=0.1)


STEPS = [1, 10, 20, 30, 40, 50, 60, 70]
# 4 layers: layer 3 alike from step 20; layers 2-3 (half) from step 30
TSIM = [[0.1, 0.2, 0.3, 0.5, 0.6, 0.7, 0.7, 0.7],
        [0.1, 0.3, 0.5, 0.8, 0.9, 0.95, 0.95, 0.95],
        [0.2, 0.5, 0.9, 0.995, 0.999, 0.999, 0.999, 0.999],
        [0.3, 0.9, 0.991, 0.999, 0.9999, 0.9999, 0.9999, 0.9999]]
LOSS = [9.0, 8.0, 7.0, 6.0, 5.6, 5.2, 5.1, 5.05]  # L_freq 5.0: within 25% from step 40, 5% from 50


def test_the_replay_warns_before_the_detector_calls_the_collapse():
    recs = records(STEPS, TSIM, LOSS)
    found = detect_collapse(recs, offline.CollapseRule(loss_smoothing=1))
    rule = MonitorRule(collapse=offline.CollapseRule(loss_smoothing=1), persistence=2)
    alarms, state = replay_monitor(recs, rule)
    assert found.collapse_step == 50 and found.onset_step == 20
    assert [a.level for a in alarms] == [0, 0, 1, 1, 2, 2, 2, 2]
    assert (state.first_watch, state.first_warn) == (found.onset_step, 40)
    until, _ = replay_monitor(recs, rule, until_step=30)
    assert until == alarms[:4]


def test_the_live_monitor_rebuilt_on_a_resume_reads_on_as_an_uninterrupted_one():
    """A restart after step 30 (a pending streak) rebuilds the state from the records kept, and
    the next readings equal the uninterrupted monitor's."""
    rule = MonitorRule(collapse=offline.CollapseRule(loss_smoothing=2), persistence=2)
    recs = records(STEPS, TSIM, LOSS)

    def feed(monitor: Monitor, steps: list[int]) -> list:
        readings = []
        for column, step in enumerate(STEPS):
            if step in steps:
                monitor.log_train(step, LOSS[column], 5.0)
                readings.append(monitor.read(step, np.asarray(TSIM)[:, column]))
        return readings

    uninterrupted = feed(Monitor(rule, []), STEPS)
    kept = [r for r in recs if r["step"] <= 30]
    resumed = Monitor(rule, kept)
    assert resumed.state.streak == 1  # layers 2-3 alike at step 30: one step of two
    assert feed(resumed, STEPS[4:]) == uninterrupted[4:]
    assert uninterrupted[4].level == 2  # the pending streak completed after the resume


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("monitor")
    config = tiny_config(write_corpus(tmp / "corpus"), tmp / "tfds", train__steps=12,
                         diag__every=3, train__log_every=2)
    workdir = tmp / "run"
    train_and_evaluate(config, str(workdir))
    return workdir


def test_a_runs_logged_readings_equal_the_replay_of_its_records(trained_run):
    recs = read_metrics(str(trained_run))
    logged = {r["step"]: r["monitor/level"] for r in recs if "monitor/level" in r}
    diag_steps = sorted(r["step"] for r in recs if any(k.startswith("diag/tsim_attn/")
                                                       for k in r))
    assert sorted(logged) == diag_steps == [1, 3, 6, 9, 12]
    alarms, _ = replay_monitor(recs)
    assert {a.step: a.level for a in alarms} == logged


def test_the_replay_command_prints_each_run_and_the_totals(trained_run, tmp_path):
    out = tmp_path / "table.md"
    result = subprocess.run(
        [sys.executable, "-m", "experiments.early_warning", f"--runs={trained_run}",
         f"--out={out}"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    row = json.loads(result.stdout.splitlines()[0])
    assert (row["finished"], row["collapsed"], row["false_alarm"]) == (True, False, False)
    assert row["first_warn"] is None and row["method"] == "post"
    assert "0 collapsing runs" in out.read_text() and "1 runs that did not collapse: 0 false " \
        "alarms" in out.read_text()
    empty = subprocess.run([sys.executable, "-m", "experiments.early_warning"], cwd=REPO,
                           capture_output=True, text=True, timeout=300)
    assert empty.returncode == 2 and "no run to replay: give --runs" in empty.stderr


def synthetic_run(workdir) -> None:
    """A run directory whose records collapse at step 60 (half the layers alike from step 20,
    the loss on its floor from 60) and whose replay warns at step 40."""
    steps = [1, *range(10, 101, 10)]
    tsim = [[0.1] * 11, [0.2] * 11, [0.2, 0.5] + [0.995] * 9, [0.3, 0.9] + [0.999] * 9]
    loss = [9.0, 8.0, 7.0, 6.0, 5.5, 5.2, 5.05, 5.02, 5.01, 5.0, 5.0]
    workdir.mkdir()
    config = base_config()
    config.train.steps = 100
    write_run_config(str(workdir), config)
    (workdir / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in records(steps, tsim, loss)))


def test_an_archived_run_reads_as_its_directory_replayed(tmp_path):
    """The archive's row (the detector's verdict from its result, its first warn from its
    measures) equals the replay of the run's own records, but for what it does not keep."""
    from configs.sweeps.leaderboard import method_label
    from postnorm.analysis.warning_replay import archived_row, run_row

    synthetic_run(tmp_path / "run")
    replayed = run_row(str(tmp_path / "run"), method_label)
    assert (replayed["collapse_step"], replayed["first_warn"], replayed["lead_steps"],
            replayed["lead_intervals"]) == (60, 40, 20, 2)
    entry = {"run_id": "post_seed0", "config": read_run_config(str(tmp_path / "run")),
             "result": {"status": "done", "config_digest": "d", "collapse": detect_collapse(
                 read_metrics(str(tmp_path / "run"))).to_json()},
             "measures": {"first_warn": 40}}
    archived = archived_row("archive", entry, method_label)
    unkept = ("workdir", "first_watch", "warn_reason", "unmeasured")
    assert {k: v for k, v in archived.items() if k not in unkept} == {
        k: v for k, v in replayed.items() if k not in unkept}
    assert archived["workdir"] == "archive/post_seed0.json"
    quiet = archived_row("archive", {**entry, "measures": {"first_warn": 30},
                                     "result": {**entry["result"], "collapse": {
                                         **entry["result"]["collapse"], "collapsed": False,
                                         "collapse_step": None}}}, method_label)
    assert (quiet["false_alarm"], quiet["lead_steps"], quiet["missed"]) == (True, None, False)
    stopped = archived_row("archive", {**entry, "measures": None,
                                       "result": {"status": "nonfinite", "config_digest": "d"}},
                           method_label)
    assert not stopped["finished"] and stopped["first_warn"] is None
    assert not stopped["unmeasured"]
    for measures in (None, {"fresh_batches": 8}):  # archived without the monitor's measure
        unmeasured = archived_row("archive", {**entry, "measures": measures}, method_label)
        assert not unmeasured["finished"] and unmeasured["unmeasured"]


def test_the_replay_command_reads_an_archive_and_refuses_another_rule_on_it(tmp_path):
    synthetic_run(tmp_path / "run")
    collapse = detect_collapse(read_metrics(str(tmp_path / "run"))).to_json()
    (tmp_path / "archive").mkdir()
    write_json_atomic(str(tmp_path / "archive" / "post_seed0.json"), {
        "run_id": "post_seed0", "config": read_run_config(str(tmp_path / "run")),
        "result": {"status": "done", "config_digest": "d", "collapse": collapse},
        "measures": {"first_warn": 40}})
    ran = subprocess.run([sys.executable, "-m", "experiments.early_warning",
                          f"--archive={tmp_path / 'archive'}"], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr
    assert json.loads(ran.stdout.splitlines()[0])["lead_steps"] == 20
    assert "1 collapsing runs: 1 warned before the collapse step, lead time 20-20" in ran.stdout
    refused = subprocess.run([sys.executable, "-m", "experiments.early_warning",
                              f"--archive={tmp_path / 'archive'}", "--warn_persistence=2"],
                             cwd=REPO, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2
    assert "--warn_persistence and --warn_loss_rtol need the runs' records" in refused.stderr
