"""Two CPU processes (``jax.distributed`` via main.py's flags) train, are preempted, resume,
and match a single-process run on the same global batches.

Each process reads its own document shard (``process_shard``: documents i, i + 2, ...), so a
plain single-process run would see different batches. The reference instead builds the global
batch the way the two-process run lays it out on the data axis: process 0's 4 rows, then
process 1's, from ``train_iterator(process_index=i, process_count=2)``.
"""

import json
import re
import signal
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from postnorm.data import load_data
from postnorm.data.lfreq import frequency_floor
from postnorm.diagnostics.schedule import is_diagnostic_step
from postnorm.model import ModelSpec
from postnorm.runtime.mesh import batch_sharding, make_mesh
from postnorm.train.losses import Loss
from postnorm.train.optim import make_optimizer
from postnorm.train.programs import compile_steps
from tests.reliability_helpers import (
    REPO,
    config_flag,
    jax_cache_dir,
    read_losses,
    read_records,
    run_main,
    subprocess_env,
    tiny_config,
    wait_for_step,
    write_corpus,
)

STEPS = 120  # the SIGTERM lands while the run is at most a second in
# Checkpoints and evals only at the end, and the diagnostic step only at step 1.
FIELDS = {"train__steps": STEPS, "train__ckpt_every": 1000, "train__eval_every": 1000,
          "diag__every": 1000}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _launch(flag: str, workdir, cache, logs, *args: str) -> list[subprocess.Popen]:
    address = f"localhost:{_free_port()}"
    processes = []
    for i, log in enumerate(logs):
        with open(log, "w") as out:
            processes.append(subprocess.Popen(
                [sys.executable, "main.py", "--config", flag, "--workdir", str(workdir),
                 "--coordinator_address", address, "--num_processes", "2",
                 "--process_id", str(i), *args],
                cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=subprocess_env(cache)))
    return processes


def _wait(processes, logs) -> None:
    for process, log in zip(processes, logs, strict=True):
        assert process.wait(timeout=300) == 0, log.read_text()[-3000:]


def _concatenated(parts: list[dict[str, np.ndarray]], mesh) -> dict[str, jax.Array]:
    """Process 0's rows, then process 1's: the global batch of the two-process run."""
    return {k: jax.device_put(np.concatenate([p[k] for p in parts]), batch_sharding(mesh))
            for k in parts[0]}


def _reference_losses(config) -> tuple[dict[int, float], float, dict[int, float]]:
    """One process's train losses on the two processes' concatenated batches, on a mesh of 2
    of this pytest process's 8 CPU devices (the shape of the two-process mesh), the final
    state's eval loss on the concatenated eval batches (each process's half of the batch
    size, from its own validation shard), and each concatenated batch's frequency floor."""
    data = load_data(config.data, seed=config.seed)
    spec = ModelSpec.from_config(config.model, vocab_size=data.tokenizer.vocab_size,
                                 max_len=config.data.seq_len)
    tx, schedule = make_optimizer(config.opt, config.train.steps)
    mesh = make_mesh(config.mesh, jax.devices()[:2])
    steps = compile_steps(spec, tx, schedule, mesh, Loss())
    shards = [data.train_iterator(batch_size=4, seed=config.seed, process_index=i,
                                  process_count=2) for i in range(2)]
    state, losses, floors = steps.init(config.seed), {}, {}
    for step in range(1, STEPS + 1):
        parts = [next(shard) for shard in shards]
        floors[step] = frequency_floor(np.concatenate([p["targets"] for p in parts]),
                                       data.unigram_counts)
        batch = _concatenated(parts, mesh)
        if is_diagnostic_step(step, config.diag):  # as main.py chooses the step
            state, metrics, _ = steps.diag(state, batch)
        else:
            state, metrics = steps.train(state, batch)
        losses[step] = float(metrics["train/loss"])
    evals = [data.eval_batches(batch_size=4, num_batches=config.train.eval_batches,
                               process_index=i, process_count=2) for i in range(2)]
    eval_loss = np.mean([float(steps.evaluate(state, _concatenated(list(parts), mesh)))
                         for parts in zip(*evals, strict=True)])
    return losses, float(eval_loss), floors


@pytest.mark.slow
def test_two_processes_preempt_resume_and_match_one_process(tmp_path, tmp_path_factory):
    corpus = write_corpus(tmp_path / "corpus", num_docs=80)  # 2 validation docs: one per process
    flag = config_flag(corpus, tmp_path / "tfds", **FIELDS)
    cache, workdir = jax_cache_dir(tmp_path_factory), tmp_path / "run"

    logs = [tmp_path / f"first_{i}.txt" for i in range(2)]
    processes = _launch(flag, workdir, cache, logs)
    wait_for_step(processes[0], workdir, 2, logs[0])
    processes[1].send_signal(signal.SIGTERM)  # the notice reaches one process only
    _wait(processes, logs)
    stops = {int(m) for log in logs for m in
             re.findall(r"postnorm: preempted at step (\d+): checkpoint saved", log.read_text())}
    assert len(stops) == 1, [log.read_text()[-2000:] for log in logs]  # both, same step
    stop = stops.pop()
    assert 2 <= stop < STEPS, "the run finished before the preemption notice took effect"
    assert (workdir / "checkpoints" / str(stop) / "data" / "process_1-of-2.json").exists()

    logs = [tmp_path / f"resumed_{i}.txt" for i in range(2)]
    _wait(_launch(flag, workdir, cache, logs), logs)
    for log in logs:
        assert f"resumed from the checkpoint at step {stop}" in log.read_text()

    got = read_losses(workdir)
    assert sorted(got) == list(range(1, STEPS + 1))
    final_eval = [r["eval/loss"] for r in read_records(workdir) if "eval/loss" in r]

    # Both processes restore the final checkpoint for --mode=eval (the reader agrees on the
    # steps it lists) and get the run's own final eval loss.
    logs = [tmp_path / f"eval_{i}.txt" for i in range(2)]
    _wait(_launch(flag, workdir, cache, logs, "--mode=eval"), logs)
    for log in logs:
        assert (f"eval of the checkpoint at step {STEPS}: loss {final_eval[-1]:.4f}"
                in log.read_text())
    # One process evaluates it too (it reads no data position); it cannot resume it, as the
    # data positions are per process, and says so instead of calling the files damaged.
    single = run_main("--config", flag, "--workdir", str(workdir), "--mode=eval",
                      cache_dir=cache)
    assert single.returncode == 0, single.stderr[-3000:]
    assert f"eval of the checkpoint at step {STEPS}: loss" in single.stderr
    single = run_main("--config", flag, "--workdir", str(workdir), cache_dir=cache)
    assert single.returncode == 2, single.stderr[-3000:]
    assert (f"postnorm: error: checkpoint step {STEPS} in {workdir}/checkpoints was written by "
            "2 processes and this run has 1: each process resumes its own share of the data, "
            "so resume it with 2 processes") in single.stderr
    assert not list((workdir / "checkpoints").glob("*.corrupt*"))  # nothing was set aside

    want, want_eval, want_floors = _reference_losses(tiny_config(corpus, tmp_path / "tfds",
                                                                 **FIELDS))
    # On one machine the two agree bit for bit; allclose leaves room for collective order.
    np.testing.assert_allclose([got[s] for s in sorted(got)], [want[s] for s in sorted(got)],
                               rtol=1e-6)
    np.testing.assert_allclose(final_eval[-1], want_eval, rtol=1e-6)
    floors = {r["step"]: r["train/freq_floor"] for r in read_records(workdir)
              if "train/freq_floor" in r}
    assert len(floors) >= 2  # the floor of the global batch, not of one process's share
    np.testing.assert_allclose([floors[s] for s in sorted(floors)],
                               [want_floors[s] for s in sorted(floors)], rtol=1e-6)  # float32


@pytest.mark.slow
@pytest.mark.parametrize("flags,message", [
    (["--num_processes", "2"], "give all three or none"),
    (["--coordinator_address", "localhost:1", "--num_processes", "2", "--process_id", "2"],
     r"--process_id=2 must be in \[0, --num_processes=2\)"),
])
def test_distributed_flags_are_checked(tmp_path, flags, message):
    result = subprocess.run(
        [sys.executable, "main.py", "--config", "configs/default.py", "--workdir",
         str(tmp_path / "run"), *flags], cwd=REPO, capture_output=True, text=True, timeout=120,
        env=subprocess_env(tmp_path / "cache"))
    assert result.returncode == 1 and re.search(message, result.stderr), result.stderr[-2000:]
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_damaged_metrics_file_stops_both_processes_with_exit_2(tmp_path, tmp_path_factory):
    """Only process 0 reads metrics.jsonl; process 1 must not go on into the first collective
    alone (it would wait there until the coordinator times out)."""
    corpus = write_corpus(tmp_path / "corpus", num_docs=80)
    flag = config_flag(corpus, tmp_path / "tfds", **FIELDS)
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "metrics.jsonl").write_text('{"step": 1}\nnot json\n')
    logs = [tmp_path / f"process_{i}.txt" for i in range(2)]
    processes = _launch(flag, workdir, jax_cache_dir(tmp_path_factory), logs)
    codes = [p.wait(timeout=240) for p in processes]
    texts = [log.read_text() for log in logs]
    assert codes == [2, 2], [t[-2000:] for t in texts]
    assert f"postnorm: error: {workdir}/metrics.jsonl line 2 is not a step's JSON" in texts[0]
    assert "postnorm: error: another process found the workdir unusable" in texts[1]


def test_a_data_error_on_process_0_stops_both_processes_with_exit_2(tmp_path, tmp_path_factory):
    """Process 0 prepares the data alone; its DataError must not leave process 1 waiting for it
    in a collective."""
    corpus = write_corpus(tmp_path / "corpus", num_docs=80)
    (corpus / "binary.txt").write_bytes(b"text, then \x1f\x8b\x08 gzip bytes")
    flag = config_flag(corpus, tmp_path / "tfds", **FIELDS)
    logs = [tmp_path / f"process_{i}.txt" for i in range(2)]
    processes = _launch(flag, tmp_path / "run", jax_cache_dir(tmp_path_factory), logs)
    codes = [p.wait(timeout=240) for p in processes]
    texts = [log.read_text() for log in logs]
    assert codes == [2, 2], [t[-2000:] for t in texts]
    assert f"postnorm: error: {corpus}/binary.txt (matched by data.text_files) is not UTF-8" \
        in texts[0]
    assert "postnorm: error: another process could not load the data" in texts[1]


@pytest.mark.slow
def test_a_metrics_write_failing_on_process_0_stops_both_processes_with_exit_2(
        tmp_path, tmp_path_factory):
    """Only process 0 writes the metrics; when its disk fills mid-run, process 1 must stop too
    rather than wait for it in the next step's collective."""
    corpus = write_corpus(tmp_path / "corpus", num_docs=80)
    flag = config_flag(corpus, tmp_path / "tfds", **{**FIELDS, "diag__every": 1})
    workdir = tmp_path / "run"
    (workdir / "tensorboard").mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs",
                              str(workdir / "tensorboard")], capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip()}); needs root")
    logs, processes = [tmp_path / f"process_{i}.txt" for i in range(2)], []
    try:
        processes = _launch(flag, workdir, jax_cache_dir(tmp_path_factory), logs)
        codes = [p.wait(timeout=240) for p in processes]
    finally:
        for process in processes:  # hung in a collective: stopped, so the tmpfs can go
            if process.poll() is None:
                process.kill()
                process.wait()
        subprocess.run(["umount", str(workdir / "tensorboard")], check=True)
    texts = [log.read_text() for log in logs]
    assert codes == [2, 2], [t[-2000:] for t in texts]
    assert f"postnorm: error: Writing {workdir}/tensorboard/" in texts[0]
    assert "No space left on device" in texts[0]
    assert ("postnorm: error: process 0 could not write the metrics: its log says why"
            in texts[1])


@pytest.mark.slow
def test_two_processes_run_the_kernel_auto_chose_on_process_0(tmp_path, tmp_path_factory):
    """model.attention=auto: process 0 chooses (timing the kernels), the other takes its
    choice, and the run records it."""
    corpus = write_corpus(tmp_path / "corpus", num_docs=80)
    flag = config_flag(corpus, tmp_path / "tfds",
                       **{**FIELDS, "train__steps": 2, "model__attention": "auto"})
    workdir, logs = tmp_path / "run", [tmp_path / f"auto_{i}.txt" for i in range(2)]
    _wait(_launch(flag, workdir, jax_cache_dir(tmp_path_factory), logs), logs)
    chosen = [re.search(r"model.attention=auto -> (\w+): (.*)", log.read_text()) for log in logs]
    assert chosen[0] and chosen[1], [log.read_text()[-2000:] for log in logs]
    assert chosen[1][1] == chosen[0][1] and chosen[1][2] == "process 0's choice"
    assert chosen[0][2].startswith("the faster on this CPU")
    recorded = json.loads((workdir / "config.json").read_text())
    assert recorded["model"]["attention"] == chosen[0][1]
