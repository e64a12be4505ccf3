"""A sweep's progress (postnorm.sweep.progress): the ETA from the measured training and measuring
times, by run shape or scaled by FLOPs, worked by hand, and a run's FLOPs from the model's; a
sweep logs it as each run ends, with the measuring time its archive records; the pinned
workers report each job that returns."""

import os
import re
import time

import ml_collections
import pytest
from absl import logging

from postnorm.config.schema import base_config
from postnorm.model import ModelSpec
from postnorm.model.flops import train_flops_per_token
from postnorm.sweep import archive as sweep_archive
from postnorm.sweep import plan as sweep
from postnorm.sweep import record as run_record
from postnorm.sweep import runner as sweep_runner
from postnorm.sweep.archive import read_archive
from postnorm.sweep.progress import (
    RunShape,
    SweepProgress,
    duration,
    plan_progress,
    run_times,
)
from postnorm.sweep.workers import run_pinned
from tests.sweep.test_plan import STABILITY, RecordingTrainer


def config(layers: int, steps: int = 300, d_model: int = 64,
           tokenizer: str = "sentencepiece") -> ml_collections.ConfigDict:
    cfg = base_config()
    cfg.model.n_layers, cfg.model.d_model, cfg.model.d_ff = layers, d_model, 3 * d_model
    cfg.train.steps, cfg.data.tokenizer = steps, tokenizer
    return cfg


def shape(layers: int, steps: int = 300, d_model: int = 64) -> RunShape:
    return RunShape.of(config(layers, steps, d_model))


@pytest.mark.parametrize("tokenizer", ["sentencepiece", "byte"])
def test_a_runs_flops_are_its_steps_tokens_and_the_models_flops_per_token(tokenizer):
    cfg = config(12, steps=7, d_model=32, tokenizer=tokenizer)
    vocab = 257 if tokenizer == "byte" else cfg.data.vocab_size
    spec = ModelSpec.from_config(cfg.model.to_dict() | {"attention": "einsum"},
                                 vocab_size=vocab, max_len=cfg.data.seq_len)
    tokens = 7 * cfg.data.batch_size * cfg.data.seq_len
    assert RunShape.of(cfg).flops == tokens * train_flops_per_token(spec, cfg.data.seq_len)
    # the architecture does not change the count; the steps, depth and width do
    same = config(12, steps=7, d_model=32, tokenizer=tokenizer)
    same.model.norm = "pre"
    assert RunShape.of(same) == RunShape.of(cfg)
    assert len({RunShape.of(cfg), shape(12), shape(24), shape(12, steps=3000),
                shape(12, d_model=128)}) == 5


def test_the_eta_takes_each_shapes_times_or_scales_them_by_flops():
    progress = SweepProgress(total=10, workers=2)
    assert progress.line([shape(12), shape(12)]) == "0 of 10 runs finished, 2 left"
    progress.add_finished(shape(12), 100.0, 30.0)
    progress.add_finished(shape(12), 120.0, None)  # measured before measuring was timed
    progress.add_finished(shape(48), 400.0, None)
    progress.add_finished(shape(48), None, None)  # stopped by a non-finite step: no time
    step_flops = {n: shape(n).flops / 300 for n in (12, 24, 48)}

    def measure(step: float) -> float:  # 30 s at 12 layers, scaled by the FLOPs of a step
        return 30 * step / step_flops[12]

    assert progress.run_estimate(shape(12)) == pytest.approx(140.0)
    assert progress.run_estimate(shape(48)) == pytest.approx(400 + measure(step_flops[48]))
    # 24 layers: the mean time per FLOP of the two shapes timed, times its FLOPs
    per_flop = (110 / shape(12).flops + 400 / shape(48).flops) / 2
    assert progress.run_estimate(shape(24)) == pytest.approx(
        per_flop * shape(24).flops + measure(step_flops[24]))
    # 10x the steps at 48 layers: 10x the training, from the 48-layer runs alone; the same
    # measuring
    assert progress.run_estimate(shape(48, steps=3000)) == pytest.approx(
        4000 + measure(step_flops[48]))
    # twice the width: scaled by the FLOPs from every shape timed
    wide = shape(48, d_model=128)
    assert progress.run_estimate(wide) == pytest.approx(
        per_flop * wide.flops + measure(wide.step_flops))
    # one 48-layer run running (half its estimate), a 24- and a 12-layer run waiting
    estimates = [progress.run_estimate(shape(n)) for n in (48, 24, 12)]
    eta = (0.5 * estimates[0] + estimates[1] + estimates[2]) / 2
    assert progress.line([shape(48), shape(24), shape(12)], running=1) == (
        f"4 of 10 runs finished, 1 running, 2 left; ETA {duration(eta)} with 2 worker(s)")
    # one run left with two workers: the ETA is that run's, not half of it
    assert progress.line([shape(48)]).endswith(f"ETA {duration(estimates[0])} with 2 worker(s)")
    progress.add_failed()
    assert progress.line([shape(12)], running=1) == (
        "4 of 10 runs finished, 1 failed, 1 running, 0 left; ETA 1 min 10 s with 2 worker(s)")
    assert [duration(s) for s in (12.4, 60, 3599.6, 3600 + 52 * 60 + 29)] == [
        "12 s", "1 min 00 s", "1 h 00 min", "1 h 52 min"]


def test_a_run_stopped_by_a_non_finite_step_gives_no_training_time():
    assert run_times({"result": {"status": "done", "wall_s": 9.0}, "measure_s": 2.0}) == (9.0, 2.0)
    assert run_times({"result": {"status": "nonfinite", "wall_s": 1.0}}) == (None, None)


def test_an_eta_without_measuring_times_says_it_counts_training_only():
    progress = SweepProgress(total=3, workers=1)
    progress.add_finished(shape(48), 3600.0, None)
    assert progress.line([shape(48), shape(48)]) == (
        "1 of 3 runs finished, 2 left; ETA 2 h 00 min with 1 worker(s) "
        "(training only: no finished run records its measuring time)")
    unmeasured = SweepProgress(total=3, workers=1, measured=False)  # a plan that measures none
    unmeasured.add_finished(shape(48), 3600.0, None)
    assert unmeasured.line([shape(48), shape(48)]) == (
        "1 of 3 runs finished, 2 left; ETA 2 h 00 min with 1 worker(s)")


def test_a_plans_line_counts_the_archives_measuring_times():
    configs = [config(n) for n in (24, 24, 48, 24)]
    rows = [{"status": "done", "wall_s": 100.0}, {"status": "done", "wall_s": 140.0},
            {"status": "nonfinite", "wall_s": 5.0}, {"status": "missing"}]
    archived = [{"measure_s": 60.0}, None, {"measure_s": None}, None]
    # the 24-layer run left: 120 s of training and 60 s of measuring
    assert plan_progress(configs, rows, archived, 2) == (
        "3 of 4 runs finished, 1 left; ETA 3 min 00 s with 2 worker(s)")


def test_a_sweep_logs_its_progress_as_each_run_ends_with_the_measuring_time(
        tmp_path, monkeypatch):
    base, specs = sweep.plan_file(STABILITY)
    specs = specs[:3]
    configs = [sweep.build_config(base, spec, {"train.steps": "4"}) for spec in specs]

    def run_logged(config, workdir, label):
        return run_record.run_once(config, workdir, train_fn=RecordingTrainer())["status"]

    def measure(workdir):
        time.sleep(0.2)
        return {"measured": os.path.basename(workdir)}

    lines, fed = [], []
    monkeypatch.setattr(sweep_archive, "run_logged", run_logged)
    monkeypatch.setattr(logging, "info", lambda fmt, *args: lines.append(fmt % args))
    add_finished = SweepProgress.add_finished
    monkeypatch.setattr(SweepProgress, "add_finished",
                        lambda self, *times: fed.append(times) or add_finished(self, *times))
    archive = str(tmp_path / "archive")
    workdirs = [str(tmp_path / s.run_id) for s in specs]
    sweep_runner.run_sweep(specs[:1], configs[:1], workdirs[:1], archive=archive,
                           measure=measure)
    lines.clear()
    fed.clear()
    sweep_runner.run_sweep(specs, configs, workdirs, archive=archive, measure=measure)
    progress = [line for line in lines if line.startswith("the sweep: ")]
    eta = r"; ETA \d+ s with 1 worker\(s\)"
    assert len(progress) == 3 and all(re.fullmatch(pattern, line) for pattern, line in zip([
        "the sweep: 1 of 3 runs finished, 1 running, 1 left" + eta,
        "the sweep: 2 of 3 runs finished, 1 running, 0 left" + eta,
        "the sweep: 3 of 3 runs finished, 0 running, 0 left"], progress, strict=True))
    # the tracker got each run's training time and its measuring time as its record keeps them
    records = {e["run_id"]: e for e in read_archive(archive)}
    assert all(e["measure_s"] >= 0.2 for e in records.values())
    assert sorted(fed) == sorted((RunShape.of(c), records[s.run_id]["result"]["wall_s"],
                                  records[s.run_id]["measure_s"])
                                 for s, c in zip(specs, configs, strict=True))


def test_the_workers_take_the_runs_with_the_most_flops_first(tmp_path, monkeypatch):
    base, specs = sweep.plan_file(STABILITY)
    sizes = [(12, 300, 64), (48, 300, 64), (24, 3000, 64), (48, 300, 128)]
    specs = specs[:len(sizes)]
    configs = [sweep.build_config(base, spec, {
        "model.n_layers": str(n), "train.steps": str(steps), "model.d_model": str(d),
        "model.d_ff": str(3 * d)}) for spec, (n, steps, d) in zip(specs, sizes, strict=True)]
    taken = []
    monkeypatch.setattr(sweep_runner, "load_data", lambda *args, **kwargs: None)
    monkeypatch.setattr(sweep_runner, "run_pinned",
                        lambda fn, jobs, workers, ended: taken.extend(j[0] for j in jobs))
    sweep_runner.run_sweep(specs, configs, [str(tmp_path / s.run_id) for s in specs], workers=2)
    # 24 layers x 3,000 steps, 48 layers at twice the width, then 48 and 12 at d = 64
    assert [(c.model.n_layers, c.train.steps, c.model.d_model) for c in taken] == [
        sizes[2], sizes[3], sizes[1], sizes[0]]


def square(x: int) -> int:
    """Runs in a worker; 3 raises."""
    if x == 3:
        raise ValueError("job 3 fails")
    return x * x


@pytest.mark.parametrize("workers", [1, 2])
def test_the_workers_report_each_job_as_it_ends(workers):
    if workers > len(os.sched_getaffinity(0)):
        pytest.skip("needs two CPUs")
    ended = []
    assert run_pinned(square, [(x,) for x in range(3)], workers,
                      lambda i, returned: ended.append((i, returned))) == [0, 1, 4]
    assert sorted(ended) == [(0, True), (1, True), (2, True)]
    ended.clear()

    def report(index, returned):
        ended.append((index, returned))
        raise OSError("a report that fails")  # logged; the jobs go on

    with pytest.raises(ValueError, match="job 3 fails"):
        run_pinned(square, [(x,) for x in range(5)], workers, report)
    # in-process the failing job stops the loop; in workers every job ends and is reported
    assert sorted(ended) == ([(0, True), (1, True), (2, True)] if workers == 1 else
                             [(0, True), (1, True), (2, True), (3, False), (4, True)])
