"""Sweep planning and sharding (postnorm.sweep.plan), the run-once logic that makes sweeps resumable
(postnorm.sweep.record), and the sweep's table and map (experiments.sweep)."""

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from absl import app

from configs.default import get_config
from experiments import sweep as sweep_cli
from postnorm.errors import NonFiniteError
from postnorm.files import OutputDirError, dumps
from postnorm.runtime.preemption import Preempted
from postnorm.sweep import plan as sweep
from postnorm.sweep import record as run_record
from postnorm.sweep import runner as sweep_runner
from postnorm.sweep import summary as sweep_summary
from postnorm.train.loop import train_and_evaluate
from postnorm.train.programs import resolve_attention
from postnorm.workdir import config_record as run_config
from postnorm.workdir.metrics import layer_key
from tests.reliability_helpers import REPO, third_party_info

STABILITY = "configs/sweeps/stability.py"
STABILITY_BASE = "configs/default.py"


def test_stability_plan_is_the_full_grid_with_stable_readable_ids():
    base, specs = sweep.plan_file(STABILITY)
    assert base == "configs/default.py"
    assert len(specs) == 3 * 3 * 2
    assert len({s.run_id for s in specs}) == 18
    cells = {(s.override("model.n_layers"), s.override("opt.lr"), s.override("model.norm"))
             for s in specs}
    assert cells == {(d, lr, n) for d in (12, 24, 48) for lr in (3e-4, 1e-3, 3e-3)
                     for n in ("post", "pre")}
    assert all(s.override("train.steps") == 300 for s in specs)
    assert specs[0].run_id == "n_layers=12_norm=post_lr=0.0003"  # fixed keys stay out of ids
    assert [s.run_id for s in sweep.plan_file(STABILITY)[1]] == [s.run_id for s in specs]


def test_shards_partition_the_plan():
    _, specs = sweep.plan_file(STABILITY)
    shards = [sweep.shard(specs, i, 4) for i in range(4)]
    ids = [s.run_id for part in shards for s in part]
    assert sorted(ids) == sorted(s.run_id for s in specs) and len(ids) == len(set(ids))
    assert sweep.parse_shard(" 1/4 ") == (1, 4)
    for bad in ("4/4", "-1/2", "1", "a/b"):
        with pytest.raises(ValueError, match="shard"):
            sweep.parse_shard(bad)


def test_a_sweep_files_run_name_gives_the_ids_made_safe_and_unique():
    grid = [{"opt.lr": 1e-3, "seed": 0}, {"opt.lr": 1e-3, "seed": 1}]
    specs = sweep.plan(grid, lambda o: f"lr {o['opt.lr']}/{o['seed']}")
    assert [s.run_id for s in specs] == ["lr-0.001-0", "lr-0.001-1"]
    with pytest.raises(ValueError, match="repeats"):
        sweep.plan(grid, lambda o: "same")
    _, blocked = sweep.plan_file("configs/sweeps/leaderboard.py:blocked")
    assert blocked[0].run_id == "post_layers48_lr0.003_warmup20_seed0_blocked"


def test_plan_rejects_uneven_entries_and_repeats():
    with pytest.raises(ValueError, match="same keys"):
        sweep.plan([{"opt.lr": 1e-3}, {"model.n_layers": 2}])
    with pytest.raises(ValueError, match="repeats"):
        sweep.plan([{"opt.lr": 1e-3, "seed": 0}, {"opt.lr": 1e-3, "seed": 0},
                    {"opt.lr": 2e-3, "seed": 0}])


def test_build_config_applies_the_overrides_then_the_extra_ones():
    base, specs = sweep.plan_file(STABILITY + ":smoke")
    spec = specs[-1]
    config = sweep.build_config(base, spec, {"train.log_every": "5"})
    assert (config.model.n_layers, config.opt.lr, config.model.norm) == (4, 3e-3, "pre")
    assert (config.train.steps, config.diag.every, config.train.log_every) == (20, 5, 5)


class RecordingTrainer:
    """Stands in for train_and_evaluate: records its calls and leaves what the trainer leaves
    (config.json, metrics.jsonl, checkpoints/<step>/), stopping early when ``stop_at`` is set."""

    def __init__(self, stop_at: int | None = None, nonfinite: bool = False,
                 losses: list[float] | None = None):
        self.calls, self.stop_at, self.nonfinite = [], stop_at, nonfinite
        self.losses = losses  # per step, from step 1; NaN counts as a skipped step

    def __call__(self, config, workdir):
        self.calls.append(workdir)
        with open(os.path.join(workdir, "config.json"), "w") as f:  # the kernel auto chose
            f.write(resolve_attention(config).to_json_best_effort(indent=2))
        last = self.stop_at or config.train.steps
        with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
            for step in range(1, last + 1):
                loss = self.losses[step - 1] if self.losses else 9.0 / step + 5.0
                record = {"step": step, "train/loss": loss, "train/lfreq": 5.0}
                if self.losses:
                    record["train/skipped_steps"] = int(np.isnan(self.losses[:step]).sum())
                for layer in range(config.model.n_layers):
                    record[layer_key("diag/tsim_attn", layer, config.model.n_layers)] = 0.5
                f.write(dumps(record) + "\n")  # as MetricWriter writes NaN
        os.makedirs(os.path.join(workdir, "checkpoints", str(last)), exist_ok=True)
        if self.nonfinite:
            raise NonFiniteError("step 3 has a non-finite loss")


def small_config(steps: int = 4):
    return get_config(f"layers=2,steps={steps}")


def test_a_finished_run_is_skipped_and_a_partial_one_resumed(tmp_path):
    config, workdir = small_config(), str(tmp_path / "run")
    partial = RecordingTrainer(stop_at=2)
    os.makedirs(workdir)
    partial(config, workdir)  # a run killed after its step-2 checkpoint: no result.json
    assert not run_record.is_finished(workdir, config)
    trainer = RecordingTrainer()
    result = run_record.run_once(config, workdir, train_fn=trainer)
    assert trainer.calls == [workdir] and result["resumed_from_step"] == 2
    assert result["status"] == "done" and result["final_step"] == 4
    assert result["collapse"]["collapsed"] is False
    assert run_record.is_finished(workdir, config)
    again = run_record.run_once(config, workdir, train_fn=trainer)
    assert trainer.calls == [workdir] and again == result  # skipped: re-read
    os.rmdir(os.path.join(workdir, "checkpoints", "4"))  # the final checkpoint is gone
    assert not run_record.is_finished(workdir, config)
    run_record.run_once(config, workdir, train_fn=trainer)
    assert trainer.calls == [workdir, workdir]


def test_a_different_config_is_neither_finished_nor_overwritten(tmp_path):
    workdir = str(tmp_path / "run")
    run_record.run_once(small_config(), workdir, train_fn=RecordingTrainer())
    other = small_config(steps=6)
    assert not run_record.is_finished(workdir, other)
    with pytest.raises(ValueError, match="different config"):
        run_record.run_once(other, workdir, train_fn=RecordingTrainer())


def test_process_settings_do_not_change_the_run(tmp_path):
    workdir = str(tmp_path / "run")
    trainer = RecordingTrainer()
    run_record.run_once(small_config(), workdir, train_fn=trainer)
    other_allocator = small_config()
    other_allocator.runtime.allocator = "system"
    assert run_record.is_finished(workdir, other_allocator)
    # A run recorded before the runtime section existed is the same run too.
    path = os.path.join(workdir, "config.json")
    with open(path) as f:
        recorded = json.load(f)
    del recorded["runtime"]
    with open(path, "w") as f:
        json.dump(recorded, f)
    run_config.check_run_config(workdir, other_allocator)
    run_record.run_once(other_allocator, workdir, train_fn=trainer)
    assert trainer.calls == [workdir]


def test_a_nonfinite_run_is_recorded_and_not_retried(tmp_path):
    config, workdir = small_config(), str(tmp_path / "run")
    trainer = RecordingTrainer(stop_at=3, nonfinite=True)
    result = run_record.run_once(config, workdir, train_fn=trainer)
    assert result["status"] == "nonfinite" and "non-finite" in result["error"]
    assert result["skipped_steps"] is None  # it stopped at its first non-finite step
    run_record.run_once(config, workdir, train_fn=trainer)
    assert len(trainer.calls) == 1


@pytest.mark.parametrize("text", ["{", "[]", '{"status": "done"}'])
def test_a_damaged_result_is_named_and_deleting_it_records_the_run_again(tmp_path, text):
    config, workdir = small_config(), str(tmp_path / "run")
    trainer = RecordingTrainer()
    first = run_record.run_once(config, workdir, train_fn=trainer)
    path = os.path.join(workdir, "result.json")
    with open(path, "w") as f:
        f.write(text)
    for call in (lambda: run_record.is_finished(workdir, config),
                 lambda: run_record.run_once(config, workdir, train_fn=trainer)):
        with pytest.raises(run_record.RunRecordError,
                           match=rf"^{re.escape(path)} is damaged \(.+\); delete it and rerun"):
            call()
    assert trainer.calls == [workdir]  # refused before training
    os.remove(path)
    again = run_record.run_once(config, workdir, train_fn=trainer)
    assert trainer.calls == [workdir, workdir] and again["final_step"] == first["final_step"]
    assert run_record.is_finished(workdir, config)


def test_a_damaged_wall_time_is_refused_before_training(tmp_path):
    config, workdir = small_config(), str(tmp_path / "run")
    os.makedirs(workdir)
    RecordingTrainer(stop_at=2)(config, workdir)  # a partial run
    path = os.path.join(workdir, "wall_time.json")
    with open(path, "w") as f:
        f.write('{"train_s": 3.0')
    trainer = RecordingTrainer()
    with pytest.raises(run_record.RunRecordError, match=rf"^{re.escape(path)} is damaged .*"
                                                        "recorded wall time then restarts"):
        run_record.run_once(config, workdir, train_fn=trainer)
    assert trainer.calls == [] and not run_record.is_finished(workdir, config)
    os.remove(path)
    assert run_record.run_once(config, workdir, train_fn=trainer)["status"] == "done"


def test_a_wall_time_recorded_without_a_config_digest_restarts_the_total(tmp_path):
    """The format of versions before the digest was recorded: not damaged, not carried over."""
    config, workdir = small_config(), str(tmp_path / "run")
    os.makedirs(workdir)
    with open(os.path.join(workdir, "wall_time.json"), "w") as f:
        f.write('{"train_s": 1000.0}')
    assert run_record.run_once(config, workdir, train_fn=RecordingTrainer())["wall_s"] < 100


def test_a_result_that_cannot_be_read_is_named_with_its_own_fix(tmp_path):
    workdir = tmp_path / "run"
    (workdir / "result.json").mkdir(parents=True)
    with pytest.raises(run_record.RunRecordError, match=r"result.json cannot be read \(Is a "
                                                        r"directory\): make it a readable file"):
        run_record.read_result(str(workdir))


def test_a_run_workdir_that_is_a_file_is_refused_by_name(tmp_path):
    workdir = tmp_path / "run"
    workdir.write_text("kept")
    with pytest.raises(OutputDirError, match=r"^workdir='.*run' cannot be created "
                                             r"or written \(File exists\)"):
        run_record.run_once(small_config(), str(workdir), train_fn=RecordingTrainer())
    assert workdir.read_text() == "kept"


@pytest.mark.parametrize("sweep_file, message", [
    ("BASE_CONFIG = 'configs/nonexistent.py'\ndef get_sweep(arg=None):\n    return []\n",
     "BASE_CONFIG='configs/nonexistent.py' names no config file"),
    ("BASE_CONFIG = 5\ndef get_sweep(arg=None):\n    return []\n",
     "BASE_CONFIG=5 names no config file"),
    ("BASE_CONFIG = 'configs/default.py'\ndef get_sweep():\n    return []\n",
     r"get_sweep cannot take the sweep's argument \(too many positional arguments\); "
     r"define it as get_sweep\(arg=None\)"),
])
def test_a_sweep_file_with_a_bad_base_config_or_get_sweep_is_refused(tmp_path, sweep_file,
                                                                     message):
    path = tmp_path / "my_sweep.py"
    path.write_text(sweep_file)
    with pytest.raises(sweep.SweepError, match=rf"^{re.escape(str(path))}: {message}"):
        sweep.plan_file(f"{path}:smoke")


def test_summary_table_and_stability_map(tmp_path):
    base, specs = sweep.plan_file(STABILITY)
    out_dir = str(tmp_path)
    finished = specs[:3]
    for number, spec in enumerate(finished):
        config = sweep.build_config(base, spec, {"train.steps": "4"})
        trainer = RecordingTrainer(nonfinite=number == 2)
        run_record.run_once(config, os.path.join(out_dir, spec.run_id), train_fn=trainer)
    # Rows report each run's fields from its config.json: the finished runs trained 4 steps,
    # and the override (given by its alias) holds for the runs not started.
    rows = sweep_summary.write_summary(base, specs, out_dir, {"steps": "4"})
    assert [r["status"] for r in rows[:4]] == ["done", "done", "nonfinite", "missing"]
    for spec, row in zip(specs, rows, strict=True):
        assert {k: row[k] for k, _ in spec.overrides} == {**dict(spec.overrides),
                                                           "train.steps": 4}
    # Without the override, the finished runs still report the 4 steps they ran, as stale:
    # the sweep now plans 300 (a --report_only after the sweep changed).
    rows = sweep_summary.write_summary(base, specs, out_dir, {})
    assert [r["train.steps"] for r in rows[:4]] == [4, 4, 4, 300]
    assert [r["status"] for r in rows[:4]] == ["stale", "stale", "stale", "missing"]
    assert rows[0]["collapsed"] is None  # judged for done runs of the planned config only
    assert rows[0]["loss_over_lfreq"] == pytest.approx((9 / 2 + 9 / 3 + 9 / 4) / 3 / 5 + 1)
    table = (tmp_path / "summary.md").read_text()
    # train.steps differs between the runs that ran (4) and those planned (300), so it is shown.
    assert table.splitlines()[0].startswith(
        "| run_id | model.n_layers | model.norm | opt.lr | train.steps | status |")
    assert len(table.splitlines()) == 2 + 18
    assert (tmp_path / "stability_map.png").read_bytes()[:4] == b"\x89PNG"
    # the map as a table: a line per (placement, depth), a cell per lr, each run's status
    pivot = (tmp_path / "pivot.md").read_text().splitlines()
    cells = [c.strip() for line in pivot[2:] for c in line.strip("|").split("|")[1:]]
    assert len(pivot) == 2 + 6 and sorted(cells) == ["missing"] * 15 + ["stale"] * 3


def test_summary_reads_old_and_damaged_config_files_and_draws_a_map_only_for_its_axes(
        tmp_path):
    base, specs = sweep.plan_file(STABILITY)
    old, damaged = (tmp_path / specs[0].run_id), (tmp_path / specs[1].run_id)
    old.mkdir()
    data = json.loads(sweep.build_config(base, specs[0], {}).to_json_best_effort())
    del data["runtime"]  # recorded before the section existed
    (old / "config.json").write_text(json.dumps(data))
    damaged.mkdir()
    (damaged / "config.json").write_text('{"model": {"n_la')  # a write cut short
    rows = sweep_summary.write_summary(base, specs, str(tmp_path), {"runtime.allocator": "system"})
    assert rows[0]["runtime.allocator"] is None and rows[1]["runtime.allocator"] == "system"
    assert rows[1]["model.n_layers"] == specs[1].override("model.n_layers")
    assert (tmp_path / "stability_map.png").exists()
    # A sweep that also varies the seed has no depth x lr map: a cell would hold two runs.
    seeds = sweep.plan([{**dict(s.overrides), "seed": seed} for s in specs[:4] for seed in (0, 1)])
    rows = sweep_summary.write_summary(base, seeds, str(tmp_path), {})
    assert len(rows) == 8 and not (tmp_path / "stability_map.png").exists()
    assert not (tmp_path / "pivot.md").exists()


@pytest.mark.slow
def test_run_once_with_the_real_trainer_skips_and_resumes(tmp_path):
    """A tiny real run: finished -> skipped; final checkpoint and result removed -> resumed from
    the previous checkpoint to the same final loss."""
    rng = np.random.default_rng(0)
    words = ["the", "norm", "token", "layer", "residual", "collapse", "gradient", "value"]
    for i in range(30):
        (tmp_path / f"doc{i:02d}.txt").write_text(
            "\n".join(" ".join(rng.choice(words, 10)) + "." for _ in range(20)))
    config = get_config("layers=2,steps=12,seq_len=32,batch=8,lr=3e-3")
    config.model.d_model, config.model.n_heads, config.model.d_ff = 32, 4, 64
    config.data.source, config.data.tokenizer = "text_files", "byte"
    config.data.text_files = str(tmp_path / "*.txt")
    config.data.data_dir = str(tmp_path / "tfds")
    config.opt.warmup_steps, config.diag.every = 2, 4
    config.train.ckpt_every, config.train.eval_every, config.train.eval_batches = 4, 12, 1
    config.train.log_every = 1
    calls = []

    def train_fn(cfg, workdir):
        calls.append(workdir)
        return train_and_evaluate(cfg, workdir)

    workdir = str(tmp_path / "run")
    first = run_record.run_once(config, workdir, train_fn=train_fn)
    assert first["status"] == "done" and first["final_step"] == 12 and len(calls) == 1
    assert run_record.run_once(config, workdir, train_fn=train_fn) == first and len(calls) == 1
    shutil.rmtree(os.path.join(workdir, "checkpoints", "12"))
    os.remove(os.path.join(workdir, "result.json"))
    resumed = run_record.run_once(config, workdir, train_fn=train_fn)
    assert len(calls) == 2 and resumed["resumed_from_step"] == 8
    assert resumed["final_train_loss"] == first["final_train_loss"]


def test_the_process_allocator_comes_from_the_config_and_overrides_not_a_sweep_axis():
    _, specs = sweep.plan_file(STABILITY)
    assert sweep_cli.process_allocator(STABILITY_BASE, specs, {}) == "auto"
    assert sweep_cli.process_allocator(
        STABILITY_BASE, specs, {"runtime.allocator": "system"}) == "system"
    axis = sweep.plan([{"runtime.allocator": a, "opt.lr": 1e-3} for a in ("auto", "system")])
    with pytest.raises(app.UsageError, match=r"sets \['runtime.allocator'\].*--override"):
        sweep_cli.check_overrides(axis, {})


@pytest.mark.parametrize("key", ["opt.lr", "lr", "model.norm"])
def test_an_override_of_a_field_the_sweep_varies_is_refused(key):
    _, specs = sweep.plan_file(STABILITY)
    with pytest.raises(app.UsageError, match=r"--override sets \['(opt.lr|model.norm)'\], "
                                             "which the sweep varies"):
        sweep_cli.check_overrides(specs, {key: "post" if key == "model.norm" else "1e-3"})
    sweep_cli.check_overrides(specs, {"steps": "4", "runtime.allocator": "system"})


def test_a_one_run_sweep_refuses_an_override_of_a_field_its_run_id_names():
    specs = sweep.plan([{"opt.lr": 1e-3, "model.n_layers": 4}])
    assert specs[0].run_id == "n_layers=4_lr=0.001"  # the id names both fields
    with pytest.raises(app.UsageError, match=r"--override sets \['opt.lr'\]"):
        sweep_cli.check_overrides(specs, {"lr": "3e-3"})
    sweep_cli.check_overrides(specs, {"steps": "4"})


@pytest.mark.parametrize("override", [[], ["--override", "runtime.allocator=system"]])
def test_the_sweep_command_writes_the_report(tmp_path, override):
    as_a_user = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}  # JAX logs probes
    result = subprocess.run(
        [sys.executable, "-m", "experiments.sweep", "--sweep", f"{STABILITY}:smoke",
         "--out_dir", str(tmp_path), "--report_only", *override],
        cwd=REPO, capture_output=True, text=True, timeout=300, env=as_a_user)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads((tmp_path / "summary.json").read_text())
    assert len(rows) == 8 and {row["status"] for row in rows} == {"missing"}
    # the runs' runtime.log_level (warning) holds from the start: no library's INFO lines
    assert not third_party_info(result.stderr.splitlines()), result.stderr[-3000:]


GROWING = """
import os

BASE_CONFIG = "configs/default.py"
ARCHIVE = {archive!r}


def run_name(overrides):
    return f"seed{{overrides['seed']}}"


def get_sweep(arg=None):  # seed 0; once it is recorded, seed 1 too
    grown = os.path.exists(os.path.join(ARCHIVE, "seed0.json"))
    return [{{"model.n_layers": 2, "train.steps": 2, "train.eval_every": 2, "seed": seed}}
            for seed in ((0, 1) if grown else (0,))]
"""


@pytest.mark.slow
@pytest.mark.parametrize("case", ["one host", "a shard of two", "trained before the archive"])
def test_the_sweep_command_trains_what_its_plan_adds_as_runs_are_recorded(tmp_path, case):
    """A plan read from the archive grows by a run once its first run is recorded: one host
    trains both and tabulates both, also when the first was trained before ``--archive`` was
    given (recorded before the plan is read again); a shard of several reads the plan once."""
    archive = tmp_path / "archive"
    sweep_file = tmp_path / "growing.py"
    sweep_file.write_text(GROWING.format(archive=str(archive)))

    def sweep_command(*args):
        result = subprocess.run(
            [sys.executable, "-m", "experiments.sweep", "--sweep", str(sweep_file),
             "--out_dir", str(tmp_path / "runs"), *args],
            cwd=REPO, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stderr

    if case == "trained before the archive":
        sweep_command()
        assert not archive.exists()
    shard = "0/2" if case == "a shard of two" else "0/1"
    stderr = sweep_command("--archive", str(archive), "--shard", shard)
    recorded = sorted(p.stem for p in archive.glob("*.json"))
    rows = json.loads((tmp_path / "runs" / "summary.json").read_text())
    if case == "a shard of two":
        assert recorded == ["seed0"] and "the plan grew" not in stderr
        assert [(r["run_id"], r["status"]) for r in rows] == [("seed0", "done"),
                                                              ("seed1", "missing")]
        return
    assert recorded == ["seed0", "seed1"]
    assert ("the plan grew by 1 run(s)" in stderr) == (case == "one host")
    assert [(r["run_id"], r["status"]) for r in rows] == [("seed0", "done"), ("seed1", "done")]


def test_the_sweep_command_stops_with_exit_2_on_a_workdir_of_another_config(tmp_path):
    _, specs = sweep.plan_file(f"{STABILITY}:smoke")
    workdir = tmp_path / specs[0].run_id
    (workdir / "checkpoints" / "4").mkdir(parents=True)
    run_config.write_run_config(str(workdir), get_config("layers=3"))
    result = subprocess.run(
        [sys.executable, "-m", "experiments.sweep", "--sweep", f"{STABILITY}:smoke",
         "--out_dir", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"postnorm: error: {workdir} holds a run of a different config" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_run_that_skipped_steps_is_reported_with_its_skips_and_nan_loss(tmp_path):
    """NaN losses (written as "nan", as MetricWriter does) are read back as floats: the
    summary, result.json and the table show them and the skipped steps, not an error."""
    base, specs = sweep.plan_file(STABILITY)
    nan = float("nan")
    trainers = [RecordingTrainer(), RecordingTrainer(losses=[6.0, nan, 5.5, nan]),
                RecordingTrainer(losses=[6.0, 5.8, 5.6, 5.4])]
    for spec, trainer in zip(specs, trainers, strict=False):
        config = sweep.build_config(base, spec, {"train.steps": "4"})
        run_record.run_once(config, str(tmp_path / spec.run_id), train_fn=trainer)
    skipped = run_record.read_result(str(tmp_path / specs[1].run_id))
    assert skipped["status"] == "done" and skipped["skipped_steps"] == 2
    assert np.isnan(skipped["final_train_loss"])  # the mean of the last three holds a NaN
    raw = (tmp_path / specs[1].run_id / "result.json").read_text()
    json.loads(raw, parse_constant=lambda c: pytest.fail(f"bare {c} in result.json"))
    rows = sweep_summary.write_summary(base, specs, str(tmp_path), {"steps": "4"})
    assert [(r["status"], r["skipped_steps"]) for r in rows[:3]] == [
        ("done", 0), ("done", 2), ("done", 0)]
    assert sweep_summary.colour_range(rows) == pytest.approx(
        sorted([rows[0]["loss_over_lfreq"], rows[2]["loss_over_lfreq"]]))
    json.loads((tmp_path / "summary.json").read_text(),
               parse_constant=lambda c: pytest.fail(f"bare {c} in summary.json"))
    assert (tmp_path / "stability_map.png").read_bytes()[:4] == b"\x89PNG"


def test_the_pivot_marks_collapse_skipped_steps_stops_and_unplanned_cells():
    def row(norm, layers, lr, status, **result):
        return {"model.norm": norm, "model.n_layers": layers, "opt.lr": lr, "status": status,
                **result}

    rows = [row("post", 24, 1e-3, "nonfinite"),
            row("post", 12, 3e-3, "done", loss_over_lfreq=1.2, collapsed=False, skipped_steps=2),
            row("post", 12, 1e-3, "done", loss_over_lfreq=0.98765, collapsed=True,
                collapse_step=210, skipped_steps=0)]
    assert sweep_summary.pivot_table(rows).splitlines() == [
        "| final train loss / L_freq (collapsed by the rule: **C**; x: non-finite) | lr 0.001 "
        "| lr 0.003 |", "|---|---|---|",
        "| post, 12 layers | **C** 0.988 (step 210) | 1.200 (2 skipped) |",
        "| post, 24 layers | x | – |"]


def test_the_colour_range_ignores_stopped_runs_whatever_their_order():
    rows = [{"status": "nonfinite", "loss_over_lfreq": float("nan")},
            {"status": "done", "loss_over_lfreq": 1.2},
            {"status": "done", "loss_over_lfreq": 1.5},
            {"status": "stale", "loss_over_lfreq": 9.0}, {"status": "missing"}]
    assert sweep_summary.colour_range(rows) == (1.2, 1.5)
    assert sweep_summary.colour_range(rows[:1]) == (0.0, 1.0)


def test_wall_time_sums_every_invocation_including_a_preempted_one(tmp_path):
    config, workdir = small_config(), str(tmp_path / "run")

    def preempted(cfg, wd):
        RecordingTrainer(stop_at=2)(cfg, wd)
        time.sleep(0.3)
        raise Preempted(2, wd)

    with pytest.raises(Preempted):
        run_record.run_once(config, workdir, train_fn=preempted)
    result = run_record.run_once(config, workdir, train_fn=RecordingTrainer())
    assert result["resumed_from_step"] == 2 and result["wall_s"] >= 0.3
    # A workdir that starts afresh with another config (no checkpoint) starts a new total.
    other, fresh = small_config(steps=6), str(tmp_path / "fresh")

    def preempted_early(cfg, wd):
        time.sleep(1.5)  # well above a loaded host's time for the run below
        raise Preempted(0, wd)

    with pytest.raises(Preempted):
        run_record.run_once(config, fresh, train_fn=preempted_early)
    assert run_record.run_once(other, fresh, train_fn=RecordingTrainer())["wall_s"] < 1.5


@pytest.mark.parametrize("grid, message", [
    ([], "non-empty list"),
    ([{"opt.lr": 1e-3}, ("opt.lr", 2e-3)], "sweep entry 1 is"),
    ([{"opt.lr": 1e-3}, {"model.n_layers": 2}], "same keys"),
])
def test_a_bad_grid_is_a_sweep_error_naming_the_entry(grid, message):
    with pytest.raises(sweep.SweepError, match=message):
        sweep.plan(grid)


def test_numpy_values_and_exponents_give_plain_ids():
    specs = sweep.plan([{"opt.lr": lr} for lr in np.array([1e-3, 1e30, 1e-30])])
    assert [s.run_id for s in specs] == ["lr=0.001", "lr=1e30", "lr=1e-30"]
    paths = sweep.plan([{"data.text_files": p} for p in ("/d/c++/*.txt", "/d/c/*.txt")])
    assert len({s.run_id for s in paths}) == 2
    assert type(specs[0].override("opt.lr")) is float
    config = sweep.build_config(STABILITY_BASE, specs[0])
    assert config.opt.lr == 1e-3


def test_every_run_is_checked_before_any_starts_and_an_error_names_it():
    base, specs = sweep.plan_file(STABILITY + ":smoke")
    assert len(sweep_runner.planned_configs(base, specs, {})) == 8
    bad = sweep.plan([{"model.norm": norm} for norm in ("post", "rezero")])
    with pytest.raises(sweep.SweepError,
                       match=r"sweep run 2/2 \(norm=rezero\): model.norm='rezero'"):
        sweep_runner.planned_configs(base, bad, {})
    typo = sweep.plan([{"model.nrom": "post"}])
    with pytest.raises(sweep.SweepError, match=r"sweep run 1/1 .*model.nrom"):
        sweep_runner.planned_configs(base, typo, {})
    twins = sweep.plan([{"opt.lr": lr} for lr in (1, 1.0)])
    with pytest.raises(sweep.SweepError, match="lr=1 and lr=1.0 have the same config"):
        sweep_runner.planned_configs(base, twins, {})


def test_renamed_runs_use_the_directories_of_their_configs(tmp_path):
    """Dropping an lr from a depth x lr sweep renames its runs (the lr is no longer varied):
    they are the runs already in out_dir, found by their configs."""
    base = STABILITY_BASE + ":layers=2,steps=4"
    grid = [{"model.n_layers": n, "opt.lr": lr} for n in (2, 3) for lr in (1e-3, 3e-3)]
    specs = sweep.plan(grid)
    configs = sweep_runner.planned_configs(base, specs, {})
    for spec, config in zip(specs, configs, strict=True):
        run_record.run_once(config, str(tmp_path / spec.run_id), train_fn=RecordingTrainer())
    fewer = sweep.plan([g for g in grid if g["opt.lr"] == 1e-3])
    assert [s.run_id for s in fewer] == ["n_layers=2", "n_layers=3"]
    fewer_configs = sweep_runner.planned_configs(base, fewer, {})
    workdirs = sweep_runner.run_workdirs(str(tmp_path), fewer, fewer_configs)
    assert workdirs == [str(tmp_path / f"n_layers={n}_lr=0.001") for n in (2, 3)]
    assert all(run_record.is_finished(w, c)
               for w, c in zip(workdirs, fewer_configs, strict=True))
    rows = sweep_summary.write_summary(base, fewer, str(tmp_path), {})
    assert [(r["status"], r["workdir"]) for r in rows] == [
        ("done", "n_layers=2_lr=0.001"), ("done", "n_layers=3_lr=0.001")]
    # Train those under their new ids too, then plan the other lr alone: its ids are the
    # same again, but the directories of those ids hold lr=0.001; the lr=0.003 runs are found.
    for config, spec in zip(fewer_configs, fewer, strict=True):
        run_record.run_once(config, str(tmp_path / spec.run_id), train_fn=RecordingTrainer())
    other = sweep.plan([g for g in grid if g["opt.lr"] == 3e-3])
    assert [s.run_id for s in other] == ["n_layers=2", "n_layers=3"]
    workdirs = sweep_runner.run_workdirs(str(tmp_path), other,
                                      sweep_runner.planned_configs(base, other, {}))
    assert workdirs == [str(tmp_path / f"n_layers={n}_lr=0.003") for n in (2, 3)]
    # A run whose own directory holds the config another run uses is refused, not shared.
    clash = sweep.plan([{"model.n_layers": 2, "opt.lr": 1e-3, "seed": 0},
                        {"model.n_layers": 2, "opt.lr": 3e-3, "seed": 1}])
    os.rename(tmp_path / "n_layers=2_lr=0.001", tmp_path / clash[1].run_id)
    with pytest.raises(sweep.SweepError, match="would both use"):
        sweep_runner.run_workdirs(str(tmp_path), clash,
                                  sweep_runner.planned_configs(base, clash, {}))


@pytest.mark.parametrize("sweep_file, message", [
    ("BASE_CONFIG = 'configs/default.py'\n", "does not define get_sweep"),
    ("BASE_CONFIG = 'configs/default.py'\ndef get_sweep(arg=None):\n"
     "    return [{'model.norm': n} for n in ('post', 'rezero')]\n",
     r"sweep run 2/2 \(norm=rezero\)"),
])
def test_the_sweep_command_refuses_a_bad_sweep_file_in_one_line(tmp_path, sweep_file, message):
    path = tmp_path / "my_sweep.py"
    path.write_text(sweep_file)
    result = subprocess.run(
        [sys.executable, "-m", "experiments.sweep", "--sweep", str(path),
         "--out_dir", str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True,
        timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert re.search(f"postnorm: error: .*{message}", result.stderr)
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()


@pytest.mark.parametrize("sweep_file,runs", [("configs/sweeps/leaderboard.py", 138),
                                             ("configs/sweeps/training_methods.py", 30)])
def test_the_committed_method_sweeps_pass_the_check_before_any_run(sweep_file, runs):
    base, specs = sweep.plan_file(sweep_file)
    assert len(sweep_runner.planned_configs(base, specs, {})) == runs


def test_a_training_methods_run_keeps_its_id_under_every_variant():
    """A group run alone names its runs as the whole plan does (so its archive records and run
    directories are found by either)."""
    from configs.sweeps.training_methods import GROUPS

    whole = {s.run_id: s.overrides for s in
             sweep.plan_file("configs/sweeps/training_methods.py")[1]}
    for group in GROUPS:
        for spec in sweep.plan_file(f"configs/sweeps/training_methods.py:{group}")[1]:
            assert whole[spec.run_id] == spec.overrides
    assert "post_layers96_adamw_lr0.001_repair_seed0" in whole


def test_the_leaderboard_grid_holds_the_core_and_gives_each_cell_its_seeds():
    """The grid variant's configs include every config of the core plan (so runs finished under
    either count for both), and each cell has the seeds its docstring states: 48 layers, both
    lrs, 3 seeds for every method and for the own-profile control of each archived two-way
    run; 139 more for FOCUS and DEPTH_METHODS."""
    from configs.sweeps import leaderboard
    from postnorm.config.identity import config_digest

    base, grid = sweep.plan_file("configs/sweeps/leaderboard.py:grid")
    grid_digests = {config_digest(c) for c in sweep_runner.planned_configs(base, grid, {})}
    core_digests = {config_digest(c) for c in sweep_runner.planned_configs(
        *sweep.plan_file("configs/sweeps/leaderboard.py"), {})}
    own_profile = len(list(Path(leaderboard.ARCHIVE).glob("adaptive_two_way_layers48_*.json")))
    core = 6 * len(leaderboard.METHODS) + own_profile
    assert len(grid) == len(grid_digests) == core + 139 and core_digests <= grid_digests
    assert len(core_digests) == core
    core_ids = {s.run_id for s in sweep.plan_file("configs/sweeps/leaderboard.py")[1]}
    assert core_ids <= {s.run_id for s in grid}  # a run keeps its id (and archive record)
    assert "post_grad_repair_layers96_lr0.001_warmup20_seed0" in {s.run_id for s in grid}
    seeds = {}
    for spec in grid:
        o = dict(spec.overrides)
        key = (leaderboard.method_of(o), o["model.n_layers"], o["opt.lr"], o["opt.warmup_steps"])
        seeds.setdefault(key, set()).add(o["seed"])
    assert seeds[("post", 12, 1e-3, 20)] == {0} and seeds[("pre", 96, 1e-3, 20)] == {0}
    assert seeds[("sandwich", 24, 3e-3, 100)] == {0, 1, 2}
    assert all(len(s) == 3 for (method, layers, _, _), s in seeds.items() if layers == 48)
    assert {m for m, layers, _, _ in seeds if layers == 96} == set(leaderboard.DEPTH_METHODS)
    assert {m for m, layers, _, _ in seeds if layers in (12, 24)} == {"post", "pre",
                                                                      *leaderboard.FOCUS}
    assert not any(layers == 12 and warmup == 100 for _, layers, _, warmup in seeds)


def test_the_paper_sweep_is_lr_by_warmup_by_norm_and_asks_for_c4_first(tmp_path):
    """The accelerator sweep's grid, refused in one message naming the data where C4 is not
    prepared."""
    base, specs = sweep.plan_file("configs/sweeps/paper.py")
    grid = {(s.override("opt.lr"), s.override("opt.warmup_steps"), s.override("model.norm"))
            for s in specs}
    assert len(specs) == len(grid) == 12 and base == "configs/paper.py"
    assert {lr for lr, _, _ in grid} == {1e-4, 3e-4, 1e-3}
    assert {w for _, w, _ in grid} == {200, 2000}
    with pytest.raises(sweep.SweepError, match=r"sweep run 1/12 .*no prepared c4/en:3.0.1"):
        sweep_runner.planned_configs(base, specs, {"data.data_dir": str(tmp_path)})


def test_a_result_recorded_by_an_earlier_schema_is_still_the_planned_run():
    """A run recorded before fields were added (their defaults computing what it computed)
    carries the digest of its config without them: it is the planned run, unless the plan sets
    one of the later fields away from its default."""
    from postnorm.config.identity import FIELDS_ADDED, config_data, config_digest

    config = get_config("model.attention=cpu")
    data = config_data(config)

    def without(fields) -> dict:
        older = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
        for field in fields:
            section, name = field.split(".")
            older[section].pop(name)
        return {k: v for k, v in older.items() if v != {}}

    versions = [without(sum(FIELDS_ADDED[since:], ())) for since in range(len(FIELDS_ADDED))]
    before_all, before_monitor = versions[0], versions[1]
    assert "qk_norm" not in before_all["model"] and "monitor" not in before_monitor
    digests = run_record.planned_digests(config)
    assert {config_digest(version) for version in versions} <= digests
    changed = get_config("model.attention=cpu,opt.z_loss=1e-4")
    assert config_digest(before_monitor) not in run_record.planned_digests(changed)
    for version in versions:
        assert sweep_runner.run_digests(version) & digests
