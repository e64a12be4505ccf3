"""main.py killed with SIGKILL resumes bit for bit; on SIGTERM it checkpoints and exits 0.

Each test runs main.py in a subprocess on one CPU device, interrupts it once metrics.jsonl
shows step 6 (and, for SIGKILL, a checkpoint is finalized), reruns the same command, and
compares every step's loss with an uninterrupted run of the same config: exactly, since CPU
runs are deterministic.
"""

import re
import signal

import numpy as np
import pytest

from postnorm.runtime.preemption import Preempted, PreemptionWatch
from postnorm.train.loop import train_and_evaluate
from postnorm.workdir.metrics import truncate_jsonl
from tests.reliability_helpers import (
    config_flag,
    finalized_steps,
    jax_cache_dir,
    read_losses,
    read_records,
    run_main,
    start_main,
    tensorboard_scalars,
    tiny_config,
    wait_for_step,
    write_corpus,
)

STEPS = 30


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The --config flag, compilation cache and per-step losses of an uninterrupted run."""
    root = tmp_path_factory.mktemp("resume")
    config = config_flag(write_corpus(root / "corpus"), root / "tfds", train__steps=STEPS,
                         train__ckpt_every=4)
    cache = jax_cache_dir(tmp_path_factory)
    result = run_main("--config", config, "--workdir", str(root / "reference"), cache_dir=cache)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = read_losses(root / "reference")
    assert sorted(losses) == list(range(1, STEPS + 1))
    return config, cache, losses


def _rerun_and_compare(config: str, cache, workdir, expected: dict[int, float],
                       resume_step: int | None = None) -> int:
    """Reruns the command to the end; returns the step it resumed from."""
    result = run_main("--config", config, "--workdir", str(workdir), cache_dir=cache)
    assert result.returncode == 0, result.stderr[-3000:]
    resumed = re.search(r"resumed from the checkpoint at step (\d+)", result.stderr)
    assert resumed, result.stderr[-3000:]
    if resume_step is not None:
        assert int(resumed.group(1)) == resume_step
    steps = [r["step"] for r in read_records(workdir) if "train/loss" in r]
    assert steps == list(range(1, STEPS + 1))  # repeated steps were dropped, then rewritten
    assert read_losses(workdir) == expected  # every step, bit for bit
    shown = tensorboard_scalars(workdir, "train/loss")  # TensorBoard: each step once
    assert shown == {step: [np.float32(loss)] for step, loss in expected.items()}
    return int(resumed.group(1))


@pytest.mark.slow
def test_sigkill_mid_run_then_rerun_reproduces_every_loss(reference, tmp_path):
    config, cache, expected = reference
    workdir, log = tmp_path / "run", tmp_path / "log.txt"
    process = start_main("--config", config, "--workdir", str(workdir), log=log, cache_dir=cache)
    wait_for_step(process, workdir, 6, log, checkpointed=True)
    process.send_signal(signal.SIGKILL)
    assert process.wait(timeout=60) == -signal.SIGKILL
    killed_after = max(read_losses(workdir))
    assert killed_after < STEPS, "the run finished before it was killed"

    resumed = _rerun_and_compare(config, cache, workdir, expected)
    assert 4 <= resumed <= killed_after


@pytest.mark.slow
@pytest.mark.parametrize(("signum", "status", "reason"), [
    (signal.SIGTERM, 0, "preempted"), (signal.SIGINT, 130, r"interrupted \(Ctrl-C\)")],
    ids=["sigterm", "ctrl-c"])
def test_sigterm_or_ctrl_c_saves_flushes_and_stops_then_resumes(reference, tmp_path, signum,
                                                                status, reason):
    """SIGTERM exits 0; Ctrl-C (SIGINT) exits 130."""
    config, cache, expected = reference
    workdir, log = tmp_path / "run", tmp_path / "log.txt"
    process = start_main("--config", config, "--workdir", str(workdir), log=log, cache_dir=cache)
    wait_for_step(process, workdir, 6, log)
    process.send_signal(signum)
    assert process.wait(timeout=120) == status, log.read_text()[-3000:]
    stopped = re.search(f"postnorm: {reason} at step (\\d+): checkpoint saved in (\\S+); rerun",
                        log.read_text())
    assert stopped, log.read_text()[-3000:]
    step = int(stopped.group(1))
    assert 6 <= step < STEPS and stopped.group(2) == str(workdir / "checkpoints")
    assert (workdir / "checkpoints" / str(step) / "commit_success.txt").exists()
    assert sorted(read_losses(workdir)) == list(range(1, step + 1))  # flushed up to the stop

    _rerun_and_compare(config, cache, workdir, expected, resume_step=step)


def test_truncating_metrics_drops_a_line_torn_by_a_kill(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "a": 1}\n{"step": 2, "a": 2}\n{"step": 3, "a"')
    truncate_jsonl(str(path), 2)
    assert path.read_text() == '{"step": 1, "a": 1}\n{"step": 2, "a": 2}\n'


@pytest.mark.slow
def test_eval_beside_a_live_trainer_leaves_both_intact(tmp_path, tmp_path_factory):
    """--mode=eval, repeated, on the workdir of a run that saves every step and keeps two:
    each eval restores a step, and the trainer (whose in-flight saves and deleted steps the
    evals see) goes on and, stopped by SIGTERM once three evals have run beside it, saves
    and exits as a preempted run does, every logged step once."""
    config = config_flag(write_corpus(tmp_path / "corpus"), tmp_path / "tfds", train__steps=300,
                         train__ckpt_every=1, train__keep_ckpts=2, train__log_every=10,
                         train__eval_every=1000, diag__every=1000)
    cache, workdir, log = jax_cache_dir(tmp_path_factory), tmp_path / "run", tmp_path / "train.log"
    trainer = start_main("--config", config, "--workdir", str(workdir), log=log, cache_dir=cache)
    wait_for_step(trainer, workdir, 10, log, checkpointed=True)
    beside = []  # evals that started and ended while the trainer ran
    while trainer.poll() is None and len(beside) < 3:
        result = run_main("--config", config, "--workdir", str(workdir), "--mode=eval",
                          cache_dir=cache)
        assert result.returncode == 0, result.stderr[-3000:]
        assert re.search(r"eval of the checkpoint at step \d+: loss", result.stderr)
        if trainer.poll() is None:
            beside.append(result)
    assert len(beside) == 3, "the trainer finished before three evals did: lengthen the run"
    trainer.send_signal(signal.SIGTERM)
    assert trainer.wait(timeout=300) == 0, log.read_text()[-3000:]
    stop = re.search(r"postnorm: preempted at step (\d+): checkpoint saved", log.read_text())
    assert stop, log.read_text()[-3000:]
    assert int(stop.group(1)) in finalized_steps(workdir)
    logged = [r["step"] for r in read_records(workdir) if "train/loss" in r]
    assert logged == sorted(set(logged)) and 10 < logged[-1] <= int(stop.group(1))


@pytest.mark.slow
def test_a_second_trainer_of_the_same_workdir_is_refused(tmp_path, tmp_path_factory):
    """The same command started again while the first run trains exits 2 naming that run;
    the first goes on and logs every step once.

    The first run is far longer than the test (a fixed length finished before the second
    command started on a fast CPU), and is preempted once the second has been refused.
    """
    config = config_flag(write_corpus(tmp_path / "corpus"), tmp_path / "tfds",
                         train__steps=1_000_000)
    cache, workdir, log = jax_cache_dir(tmp_path_factory), tmp_path / "run", tmp_path / "first.log"
    first = start_main("--config", config, "--workdir", str(workdir), log=log, cache_dir=cache)
    wait_for_step(first, workdir, 6, log)
    second = run_main("--config", config, "--workdir", str(workdir), cache_dir=cache)
    assert second.returncode == 2, second.stderr[-3000:]
    assert first.poll() is None, log.read_text()[-3000:]
    assert (f"postnorm: error: {workdir} is in use by another training run (process "
            f"{first.pid} on ") in second.stderr
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=300) == 0, log.read_text()[-3000:]
    stop = re.search(r"postnorm: preempted at step (\d+): checkpoint saved", log.read_text())
    assert stop, log.read_text()[-3000:]
    logged = [r["step"] for r in read_records(workdir) if "train/loss" in r]
    assert logged == list(range(1, int(stop.group(1)) + 1))


@pytest.mark.slow
def test_a_stop_asked_for_during_the_last_step_finishes_the_run(tmp_path, monkeypatch):
    """A SIGTERM that lands during the last step is not a preemption: the run is complete."""
    monkeypatch.setattr(PreemptionWatch, "should_stop", lambda self, step: True)
    corpus = write_corpus(tmp_path / "corpus")
    one_step = tiny_config(corpus, tmp_path / "tfds", train__steps=1)
    final = train_and_evaluate(one_step, str(tmp_path / "one"))  # returns: no Preempted
    assert "eval/loss" in final and (tmp_path / "one" / "checkpoints" / "1").is_dir()
    two_steps = tiny_config(corpus, tmp_path / "tfds", train__steps=2)
    with pytest.raises(Preempted, match="preempted at step 1"):
        train_and_evaluate(two_steps, str(tmp_path / "two"))
