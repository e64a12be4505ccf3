"""The sweep archive: a finished run's record written, read back and matched to its planned
config only; a damaged file is refused with its name; a sweep records each run as it ends and
trains no archived run again, and its table reads the archived runs."""

import json
import os
import shutil

import pytest

from postnorm.config import base_config, config_digest
from postnorm.files import write_json_atomic
from postnorm.sweep import archive as sweep_archive
from postnorm.sweep import plan as sweep
from postnorm.sweep import record as run_record
from postnorm.sweep import runner as sweep_runner
from postnorm.sweep import summary as sweep_summary
from postnorm.sweep.archive import (
    ArchiveError,
    archive_finished,
    archive_path,
    archive_run,
    archived_runs,
    read_archive,
)
from postnorm.workdir.config_record import write_run_config
from postnorm.workdir.layout import Workdir
from tests.sweep.test_plan import STABILITY, RecordingTrainer


def finished_run(workdir, config, status="done") -> None:
    """A workdir as ``record.run_once`` leaves it (config and result; no checkpoint needed)."""
    workdir.mkdir()
    write_run_config(str(workdir), config)
    write_json_atomic(Workdir(str(workdir)).result, {
        "workdir": str(workdir), "status": status, "config_digest": config_digest(config),
        "final_train_loss": 5.0, "wall_s": 12.0})


def test_a_record_round_trips_and_matches_only_its_config(tmp_path):
    config, other = base_config(), base_config()
    other.opt.lr = 3e-3
    finished_run(tmp_path / "run", config)
    entry = archive_run(str(tmp_path / "archive"), "post_lr0.001", str(tmp_path / "run"),
                        {"fresh_loss_over_lfreq": 1.02})
    assert "workdir" not in entry["result"]  # no machine's path in a committed file
    (back,) = read_archive(str(tmp_path / "archive"))
    assert back["result"] == entry["result"] and back["measures"] == entry["measures"]
    assert back["config"]["opt"]["lr"] == config.opt.lr
    assert [e and e["run_id"] for e in archived_runs(str(tmp_path / "archive"),
                                                     [other, config])] == [None, "post_lr0.001"]
    assert archived_runs(None, [config]) == [None]
    assert archived_runs(str(tmp_path / "absent"), [config]) == [None]


def test_an_unfinished_run_is_not_archived(tmp_path):
    (tmp_path / "run").mkdir()
    with pytest.raises(ArchiveError, match="no finished run"):
        archive_run(str(tmp_path / "archive"), "r", str(tmp_path / "run"))


@pytest.mark.parametrize("text", ["{not json", json.dumps({"config": {}, "result": {}}),
                                  json.dumps([1, 2])])
def test_a_damaged_record_is_refused_with_its_name(tmp_path, text):
    (tmp_path / "archive").mkdir()
    (tmp_path / "archive" / "post_seed0.json").write_text(text)
    with pytest.raises(ArchiveError, match="post_seed0.json") as err:
        read_archive(str(tmp_path / "archive"))
    assert "delete it and the run trains again" in str(err.value)


def test_a_sweep_archives_each_run_as_it_ends_and_trains_no_archived_run_again(
        tmp_path, monkeypatch):
    base, specs = sweep.plan_file(STABILITY)
    specs = specs[:4]
    configs = [sweep.build_config(base, spec, {"train.steps": "4"}) for spec in specs]
    trained = []

    def run_logged(config, workdir, label):  # the sweep's trainer, with a recording stand-in
        trained.append(label)
        trainer = RecordingTrainer(nonfinite=len(trained) == 3)
        return run_record.run_once(config, workdir, train_fn=trainer)["status"]

    monkeypatch.setattr(sweep_archive, "run_logged", run_logged)
    archive = str(tmp_path / "archive")

    def measure(workdir):
        return {"measured": os.path.basename(workdir)}

    first = [str(tmp_path / "first" / s.run_id) for s in specs]
    sweep_runner.run_sweep(specs[:3], configs[:3], first[:3], archive=archive, measure=measure)
    entries = {e["run_id"]: e for e in read_archive(archive)}
    assert sorted(entries) == sorted(s.run_id for s in specs[:3]) and len(trained) == 3
    assert [entries[s.run_id]["measures"] for s in specs[:3]] == [
        {"measured": specs[0].run_id}, {"measured": specs[1].run_id}, None]  # 3rd: nonfinite
    # A new directory with the same archive: the archived runs are not trained again, and the
    # table reads them from the archive.
    second = [str(tmp_path / "second" / s.run_id) for s in specs]
    sweep_runner.run_sweep(specs, configs, second, archive=archive, measure=measure)
    assert len(trained) == 4  # only the fourth run
    rows = sweep_summary.write_summary(base, specs, str(tmp_path / "second"), {"steps": "4"},
                                       second, archived_runs(archive, configs))
    assert [r["status"] for r in rows] == ["done", "done", "nonfinite", "done"]
    assert [bool(r.get("archived")) for r in rows] == [True, True, True, False]
    assert rows[0]["final_train_loss"] == entries[specs[0].run_id]["result"]["final_train_loss"]
    # a directory holding a result of another config does not hide the archived run
    stale = sweep.build_config(base, specs[0], {"train.steps": "5"})
    shutil.rmtree(second[0], ignore_errors=True)
    run_record.run_once(stale, second[0], train_fn=RecordingTrainer())
    rows = sweep_summary.write_summary(base, specs, str(tmp_path / "second"), {"steps": "4"},
                                       second, archived_runs(archive, configs))
    assert (rows[0]["status"], rows[0].get("archived")) == ("done", True)
    # A run finished before the archive was given is recorded by ``archive_finished``.
    os.remove(archive_path(archive, specs[0].run_id))
    assert archive_finished(archive, [s.run_id for s in specs], configs, first) == 1
    assert archived_runs(archive, configs)[0]["run_id"] == specs[0].run_id


def test_a_plan_that_grows_from_the_archive_is_run_until_it_adds_nothing(tmp_path,
                                                                         monkeypatch):
    """A plan of one run, then of two once that one is recorded, trains both and stops once
    reading it again adds nothing; without an archive the plan is read once."""
    base, specs = sweep.plan_file(STABILITY)
    configs = [sweep.build_config(base, spec, {"train.steps": "4"}) for spec in specs[:2]]
    trained = []

    def run_logged(config, workdir, label):
        trained.append(os.path.basename(workdir))
        return run_record.run_once(config, workdir, train_fn=RecordingTrainer())["status"]

    monkeypatch.setattr(sweep_archive, "run_logged", run_logged)
    archive = str(tmp_path / "archive")
    plans = []

    def plan():  # run 0; once it is recorded, run 1 too
        n = 1 + (archived_runs(archive, configs[:1])[0] is not None)
        plans.append(n)
        return specs[:n], configs[:n], [str(tmp_path / s.run_id) for s in specs[:n]]

    lines = []
    monkeypatch.setattr(sweep_runner.logging, "info", lambda fmt, *a: lines.append(fmt % a))
    sweep_runner.run_until_settled(plan, archive=archive)
    assert trained == [s.run_id for s in specs[:2]] and plans == [1, 2, 2]
    # the second round names no finished run again, and its ETA counts the first's time
    second = lines[next(i for i, line in enumerate(lines) if "the plan grew" in line):]
    assert not any("already finished" in line for line in second)
    assert "1 of 2 runs finished, 1 running, 0 left; ETA" in second[1]
    assert sorted(e["run_id"] for e in read_archive(archive)) == sorted(
        s.run_id for s in specs[:2])
    plans.clear()
    monkeypatch.setattr(sweep_runner, "run_sweep", lambda *args, **_: trained.append(args[0]))
    sweep_runner.run_until_settled(plan, archive=None)
    assert plans == [2] and len(trained) == 3


def test_a_record_of_another_config_under_the_same_id_is_never_overwritten(tmp_path):
    config, other = base_config(), base_config()
    other.train.steps = 20  # e.g. the same plan under --override train.steps=20
    finished_run(tmp_path / "run", config)
    finished_run(tmp_path / "smoke", other)
    archive = str(tmp_path / "archive")
    archive_run(archive, "post_seed0", str(tmp_path / "run"))
    with pytest.raises(ArchiveError, match="another config under the id post_seed0"):
        archive_run(archive, "post_seed0", str(tmp_path / "smoke"))
    spec = sweep.RunSpec("post_seed0", (("seed", 0),))
    with pytest.raises(ArchiveError, match="an archive of its own"):  # before training
        sweep_runner.run_sweep([spec], [other], [str(tmp_path / "new")], archive=archive)
    assert read_archive(archive)[0]["result"]["config_digest"] == config_digest(config)


def test_a_record_without_measures_is_measured_again_once_its_run_is_at_hand(
        tmp_path, monkeypatch):
    config = base_config()
    finished_run(tmp_path / "run", config)
    monkeypatch.setattr(sweep_archive, "is_finished", lambda workdir, config: True)
    archive = str(tmp_path / "archive")
    archive_run(archive, "r", str(tmp_path / "run"))  # archived by a sweep without measures

    def measure(workdir):
        return {"fresh_batches": 512}

    args = (archive, ["r"], [config], [str(tmp_path / "run")], measure)
    assert archive_finished(*args) == 1
    assert read_archive(archive)[0]["measures"] == {"fresh_batches": 512}
    assert archive_finished(*args) == 0
    assert archive_finished(*args, lambda m: m["fresh_batches"] != 64) == 1  # stale measures
