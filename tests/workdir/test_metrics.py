"""A damaged or missing metrics.jsonl is a clear error that names the file and line and loses
nothing; the read-only modes (plots, report) say so without creating anything."""

import errno
import json
import math
import os
import subprocess
import sys

import pytest

from postnorm import files
from postnorm.analysis.figures import plots_after_training
from postnorm.files import from_text, write_json_atomic
from postnorm.train import loop, reporter
from postnorm.train.loop import train_and_evaluate
from postnorm.workdir.metrics import (
    MetricsFileError,
    MetricsWriteError,
    MetricWriter,
    read_jsonl,
    truncate_jsonl,
)
from tests.reliability_helpers import (
    REPO,
    read_losses,
    run_main,
    tensorboard_scalars,
    tiny_config,
    write_corpus,
)

GOOD = b'{"step": 1, "a": 1}\n{"step": 2, "a": 2}\n'


@pytest.mark.parametrize(("damage", "line", "reason"), [
    (b'{"step": 1, "a": 1}\nnot json\n{"step": 2, "a": 2}\n', 2, "Expecting value"),
    (GOOD + b"\x82\x00\xff junk\n", 3, "can't decode byte 0x82"),
    (GOOD + b'{"loss": 3.0}\n', 3, "no integer 'step'"),
    (GOOD + b"[1, 2]\n", 3, "no integer 'step'"),
    (b'{"step": 1, "train/loss": "abc"}\n' + GOOD, 1, "train/loss is 'abc', not a number"),
    (GOOD + b'{"step": 3, "a": [1]}\n', 3, r"a is \[1\], not a number"),
])
def test_a_damaged_line_is_named_and_the_file_is_left_as_it_was(tmp_path, damage, line, reason):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(damage)
    for read in (lambda: read_jsonl(str(path)), lambda: truncate_jsonl(str(path), 1)):
        with pytest.raises(MetricsFileError, match=f"{path} line {line} is not a step's JSON "
                                                   f"record \\(.*{reason}.*delete that line"):
            read()
        assert path.read_bytes() == damage


def test_a_torn_last_line_and_blank_lines_are_not_records(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1, "a": 1}\n\n{"step": 2, "a": 2}\n{"step": 3, "a"')
    assert read_jsonl(str(path)) == [{"step": 1, "a": 1}, {"step": 2, "a": 2}]


def test_a_missing_file_says_to_train_first(tmp_path):
    with pytest.raises(MetricsFileError, match="does not exist: nothing has been logged there"):
        read_jsonl(str(tmp_path / "run" / "metrics.jsonl"))


@pytest.mark.parametrize("mode", ["plots", "report"])
def test_plots_and_report_of_a_workdir_without_metrics_exit_2_and_create_nothing(tmp_path, mode):
    workdir = tmp_path / "typo"
    result = run_main("--config", "configs/default.py", f"--mode={mode}", "--workdir",
                      str(workdir), cache_dir=None)
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"postnorm: error: {workdir}/metrics.jsonl does not exist" in result.stderr
    assert "Traceback" not in result.stderr and not workdir.exists()


def test_an_empty_workdir_flag_is_a_usage_error():
    result = run_main("--config", "configs/default.py", "--workdir", " ", cache_dir=None)
    assert result.returncode == 1
    assert "--workdir is required for --mode=train (a directory path)" in result.stderr


@pytest.mark.slow
def test_plots_that_cannot_be_written_do_not_fail_a_finished_run(tmp_path, caplog):
    """The run is complete and checkpointed; the error is logged with the command to redo it."""
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "plots").write_text("a file where the plots directory goes")
    config = tiny_config(write_corpus(tmp_path / "corpus"), tmp_path / "tfds", train__steps=2)
    train_and_evaluate(config, str(workdir))
    plots_after_training(str(workdir))  # as main.py and the sweep do
    assert sorted(read_losses(workdir)) == [1, 2] and (workdir / "checkpoints" / "2").is_dir()
    assert "its plots could not be written" in caplog.text
    assert f"--mode=plots --workdir {workdir}" in caplog.text


def test_an_unreadable_file_is_named(tmp_path):
    (tmp_path / "metrics.jsonl").mkdir()
    with pytest.raises(MetricsFileError, match=r"metrics.jsonl cannot be read \(.*Is a directory"):
        read_jsonl(str(tmp_path / "metrics.jsonl"))


def test_plots_that_cannot_be_written_exit_2_in_plots_mode(tmp_path):
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "metrics.jsonl").write_bytes(b'{"step": 1, "train/loss": 5.0}\n')
    (workdir / "plots").write_text("a file where the plots directory goes")
    result = run_main("--config", "configs/default.py", "--mode=plots", "--workdir",
                      str(workdir), cache_dir=None)
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"postnorm: error: --mode=plots could not write under {workdir}" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_reopened_writer_keeps_the_old_events_and_hides_the_repeated_steps(tmp_path):
    """A resume or rollback after step 2 rewrites steps 3 and 4: TensorBoard shows each step
    once, with the new values (the second writer opens within the same second as the first,
    which must not erase its file)."""
    first = MetricWriter(str(tmp_path))
    for step in (1, 2, 3, 4):
        first.write_scalars(step, {"train/loss": float(step)})
    first.close()
    second = MetricWriter(str(tmp_path), after_step=2)
    for step in (3, 4):
        second.write_scalars(step, {"train/loss": 10.0 * step})
    second.close()
    assert tensorboard_scalars(tmp_path, "train/loss") == {1: [1.0], 2: [2.0], 3: [30.0],
                                                           4: [40.0]}


@pytest.mark.parametrize("module", ["postnorm.analysis.summary", "main"])
def test_a_run_that_has_not_logged_yet_is_a_one_line_error(tmp_path, module):
    """run_summary and --mode=report on a run in its first seconds (metrics.jsonl empty)."""
    (tmp_path / "metrics.jsonl").write_text("")
    args = ([str(tmp_path)] if module != "main"
            else ["--mode=report", "--config", "configs/default.py", "--workdir", str(tmp_path)])
    result = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().endswith(
        f"postnorm: error: {tmp_path}/metrics.jsonl holds no logged train step yet: rerun this "
        "once the run has logged one (every train.log_every steps)")
    assert "Traceback" not in result.stderr


def test_nonfinite_values_are_written_as_text_and_read_back_as_floats(tmp_path):
    """JSON has no NaN or Inf: metrics.jsonl and the summaries write "nan"/"inf" text, which
    strict JSON readers accept, and the project's readers return floats."""
    writer = MetricWriter(str(tmp_path))
    writer.write_scalars(1, {"train/loss": float("nan"), "a": float("inf"), "b": -float("inf"),
                             "c": 2.5})
    writer.close()
    strict = {"parse_constant": lambda c: pytest.fail(f"bare {c}")}
    line = (tmp_path / "metrics.jsonl").read_text()
    assert json.loads(line, **strict) == {"step": 1, "train/loss": "nan", "a": "inf",
                                          "b": "-inf", "c": 2.5}
    (record,) = read_jsonl(str(tmp_path / "metrics.jsonl"))
    assert math.isnan(record["train/loss"]) and record["a"] == math.inf
    assert record["b"] == -math.inf and record["c"] == 2.5

    summary = {"loss": float("nan"), "runs": [{"ratio": float("inf")}, 1.0], "name": "x"}
    write_json_atomic(tmp_path / "summary.json", summary)
    text = (tmp_path / "summary.json").read_text()
    assert json.loads(text, **strict)["runs"][0]["ratio"] == "inf"
    back = from_text(json.loads(text))
    assert math.isnan(back["loss"]) and back["runs"] == [{"ratio": math.inf}, 1.0]


def test_the_step_rate_leaves_out_the_excluded_time(monkeypatch):
    clock = iter([100.0, 105.0, 108.0])
    monkeypatch.setattr(reporter.time, "perf_counter", lambda: next(clock))
    progress = reporter.Progress(total_steps=100, tokens_per_step=10, start_step=0)
    assert progress.report(1, {"train/loss": 1.0, "train/lr": 0.1}, 0.5)[1] is None
    progress.exclude(3.0)  # e.g. an eval and a compile between the two reports
    line, tokens_per_s = progress.report(3, {"train/loss": 1.0, "train/lr": 0.1}, 0.5)
    assert tokens_per_s == pytest.approx(10.0)  # 2 steps in 5 - 3 = 2 s, 10 tokens a step
    assert "ETA 1m37s" in line  # 97 steps at 1 step/s
    line, tokens_per_s = progress.report(4, {"train/loss": 1.0, "train/lr": 0.1}, 0.5)
    assert tokens_per_s == pytest.approx(10 / 3)  # the exclusion held for one interval only


def test_a_damaged_metrics_file_stops_training_before_anything_is_built(tmp_path, monkeypatch):
    def build(*args, **kwargs):
        raise AssertionError("the experiment was built before the metrics file was checked")

    monkeypatch.setattr(loop, "build_experiment", build)
    config = tiny_config(write_corpus(tmp_path / "corpus"), tmp_path / "tfds")
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "metrics.jsonl").write_bytes(b'{"step": 1, "a": 1}\nnot json\n')
    with pytest.raises(MetricsFileError, match="line 2 is not a step's JSON record"):
        train_and_evaluate(config, str(workdir))
    assert (workdir / "metrics.jsonl").read_bytes() == b'{"step": 1, "a": 1}\nnot json\n'


@pytest.mark.parametrize(("code", "fix"), [
    (errno.ENOSPC, "Free space on its file system"),
    (errno.EACCES, "Make it a writable file in a writable directory")])
def test_a_truncation_that_cannot_be_written_is_named_and_leaves_the_file(
        tmp_path, monkeypatch, code, fix):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "a": 1}\n{"step": 2, "a": 2}\n')

    def fail(src, dst):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(files.os, "replace", fail)
    with pytest.raises(MetricsWriteError, match=rf"^Writing {path} failed \(.+\)\. {fix}"):
        truncate_jsonl(str(path), 1)
    assert path.read_text() == '{"step": 1, "a": 1}\n{"step": 2, "a": 2}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # no .tmp left
    truncate_jsonl(str(path), 2)  # nothing to drop: the file is not rewritten at all


def test_a_tensorboard_path_that_is_a_file_is_named_as_a_directory_to_fix(tmp_path):
    (tmp_path / "tensorboard").write_text("not a directory")
    with pytest.raises(MetricsWriteError, match=rf"^Writing {tmp_path / 'tensorboard'} failed "
                                                r"\(.+\)\. Make it a writable directory in"):
        MetricWriter(str(tmp_path))
    assert (tmp_path / "tensorboard").read_text() == "not a directory"


def test_a_writer_that_cannot_write_closes_both_files_and_names_the_event_file(
        tmp_path, monkeypatch):
    writer = MetricWriter(str(tmp_path))
    writer.write_scalars(1, {"train/loss": 2.0})

    def fail():
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    event_file = writer._tb
    monkeypatch.setattr(event_file._records, "flush", fail)
    with pytest.raises(MetricsWriteError, match=rf"^Writing {event_file.path} failed \(No space"):
        writer.flush()
    jsonl = writer._jsonl
    writer.close()  # raises nothing more
    assert jsonl.closed and read_jsonl(str(tmp_path / "metrics.jsonl")) == [
        {"step": 1, "train/loss": 2.0}]
