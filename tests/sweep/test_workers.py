"""Pinned worker processes (postnorm.sweep.workers): CPU groups, per-process affinity, and stopping
on request (a run's own preemption, SIGTERM to the parent, Ctrl-C to the process group)."""

import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from absl import logging

from postnorm.errors import Stopped
from postnorm.runtime.preemption import Preempted, PreemptionWatch
from postnorm.sweep.workers import cpu_groups, run_pinned
from tests.reliability_helpers import REPO

PARENT = """
import sys
from absl import app
from postnorm.errors import exit_on_error
from postnorm.sweep.workers import run_pinned
from tests.sweep.test_workers import watched_job

def main(argv):
    print(run_pinned(watched_job, [(i, argv[1]) for i in range(4)], 2))

app.run(exit_on_error(main))
"""


def affinity_and_square(x: int) -> tuple[list[int], int, int]:
    """Runs in a worker: its CPU set, its pid and a result."""
    return sorted(os.sched_getaffinity(0)), os.getpid(), x * x


def test_cpu_groups_split_evenly_and_disjointly():
    assert cpu_groups(2, range(5)) == [[0, 1], [2, 3, 4]]
    assert cpu_groups(3, [7, 1, 4]) == [[1], [4], [7]]
    groups = cpu_groups(4, range(16))
    assert [len(g) for g in groups] == [4] * 4 and sorted(sum(groups, [])) == list(range(16))
    with pytest.raises(ValueError, match="workers=3 must be between 1 and the 2 CPUs"):
        cpu_groups(3, [0, 1])


def test_workers_are_pinned_to_disjoint_cpus_and_return_in_job_order():
    workers = min(2, len(os.sched_getaffinity(0)))
    results = run_pinned(affinity_and_square, [(x,) for x in range(6)], workers)
    assert [r[2] for r in results] == [x * x for x in range(6)]
    by_pid = {pid: tuple(cpus) for cpus, pid, _ in results}
    if workers == 1:
        assert list(by_pid) == [os.getpid()]
        return
    assert os.getpid() not in by_pid
    assert set(by_pid.values()) <= {tuple(g) for g in cpu_groups(workers)}
    assert len(set(by_pid.values())) == len(by_pid)  # no two processes share a group


def preempted_or_square(x: int) -> int:
    """Runs in a worker: job 0 stops as a preempted run does, once the other jobs (instant)
    have ended: a stop keeps jobs that have not started from starting."""
    if x == 0:
        time.sleep(1.5)
        raise Preempted(7, "/runs/zero/checkpoints")
    return x * x


def watched_job(index: int, directory: str) -> int:
    """Runs in a worker: a stand-in for a training run, stepping until its PreemptionWatch
    says stop (then raising Preempted, as the trainer does) or two minutes pass. It announces
    itself only once its watch is installed, and atomically (the test reads the pid file as soon
    as it appears)."""
    watch = PreemptionWatch(0)
    announcement = Path(directory, f".started_{index}.tmp")
    announcement.write_text(str(os.getpid()))
    announcement.rename(Path(directory, f"started_{index}"))
    try:
        for step in range(2400):
            if watch.should_stop(step):
                raise Preempted(step, directory, interrupted=watch.interrupted)
            time.sleep(0.05)
    finally:
        watch.close()
    return index


def test_preempted_pickles_whole():
    """A worker's Preempted reaches the parent pickled: every field must survive."""
    stop = pickle.loads(pickle.dumps(Preempted(7, "/runs/a/checkpoints", interrupted=True)))
    assert (type(stop), stop.step, stop.checkpoint_dir, stop.interrupted) == (
        Preempted, 7, "/runs/a/checkpoints", True)
    assert str(stop) == ("interrupted (Ctrl-C) at step 7: checkpoint saved in /runs/a/checkpoints;"
                         " rerun the same command to resume")


def test_a_preempted_job_is_reported_and_the_others_finish():
    """Its Preempted crosses the process boundary (it pickles) without breaking the pool."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs")
    with pytest.raises(Stopped, match=r"stopped on request with 1 of 3 runs unfinished") as err:
        run_pinned(preempted_or_square, [(0,), (1,), (2,)], 2)
    assert not err.value.interrupted


@pytest.mark.parametrize(("signum", "target", "status"), [
    (signal.SIGTERM, "parent", 0),       # a scheduler stopping the sweep's process
    (signal.SIGINT, "group", 130),       # Ctrl-C in the terminal: every process gets it
], ids=["sigterm-parent", "ctrl-c-group"])
def test_a_signal_stops_the_running_jobs_and_starts_no_more(tmp_path, signum, target, status):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs")
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path)], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("started_*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    workers = [int(p.read_text()) for p in tmp_path.glob("started_*")]
    assert len(workers) == 2, parent.communicate(timeout=60)
    if target == "parent":
        parent.send_signal(signum)
    else:
        os.killpg(parent.pid, signum)
    _, stderr = parent.communicate(timeout=60)
    assert parent.returncode == status, stderr[-3000:]
    assert ("postnorm: stopped on request with 4 of 4 runs unfinished (each one started saved "
            "a checkpoint); rerun the same command to resume") in stderr
    assert "Traceback" not in stderr
    assert sorted(p.name for p in tmp_path.glob("started_*")) == ["started_0", "started_1"]
    for pid in workers:  # the workers ended with the parent: none left behind
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


EARLY = """
import os, signal, sys, threading, time
from absl import app
from postnorm.errors import exit_on_error
from postnorm.sweep.workers import run_pinned
from tests.sweep.test_workers import watched_job

def main(argv):
    threading.Timer(float(argv[2]), lambda: os.kill(os.getpid(), signal.SIGTERM)).start()
    print(run_pinned(watched_job, [(i, argv[1]) for i in range(4)], 2))

if __name__ == "__main__":
    app.run(exit_on_error(main))
"""


@pytest.mark.parametrize("delay", [0.05, 0.5])
def test_a_signal_while_the_workers_start_stops_cleanly(tmp_path, delay):
    """SIGTERM before the workers can handle it (still importing): no worker dies of it, no
    job starts, and the parent stops in one line instead of hanging."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs")
    script = tmp_path / "early.py"
    script.write_text(EARLY)
    result = subprocess.run([sys.executable, str(script), str(tmp_path), str(delay)], cwd=REPO,
                            capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "postnorm: stopped on request with 4 of 4 runs unfinished" in result.stderr
    assert not list(tmp_path.glob("started_*")) and "Traceback" not in result.stderr


LATE = """
import os, signal
from absl import app
from postnorm.errors import exit_on_error
from postnorm.sweep.workers import run_pinned
from tests.sweep.test_workers import affinity_and_square

def main(argv):
    ended = []
    def on_done(index, returned):  # SIGTERM once the last job has ended, before the pool closes
        ended.append(index)
        if len(ended) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
    print(run_pinned(affinity_and_square, [(1,), (2,)], 2, on_done))

app.run(exit_on_error(main))
"""


def test_a_signal_after_the_last_job_ended_still_stops_the_caller():
    """A stop asked for while the pool closes is not dropped: the caller (a sweep that would
    plan again) gets Stopped."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs")
    result = subprocess.run([sys.executable, "-c", LATE], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "postnorm: stopped on request once all 2 runs had ended" in result.stderr
    assert "Traceback" not in result.stderr and not result.stdout


def logging_job(index: int) -> int:
    """Runs in a worker: an INFO line, as a training run logs its progress, and a DEBUG one."""
    logging.info("job %d logs progress", index)
    logging.debug("job %d logs details", index)
    return index


LOGGING_PARENT = """
from absl import app
from postnorm.sweep.workers import run_pinned
from tests.sweep.test_workers import logging_job

app.run(lambda argv: print(run_pinned(logging_job, [(0,), (1,)], 2)))
"""


@pytest.mark.parametrize("verbosity, shown", [
    ([], ["progress"]),  # absl's default under app.run: INFO
    (["--verbosity=1"], ["progress", "details"]),
    (["--verbosity=-1"], []),  # warnings only
])
def test_the_workers_log_at_the_parents_verbosity(verbosity, shown):
    result = subprocess.run([sys.executable, "-c", LOGGING_PARENT, *verbosity], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[0, 1]" in result.stdout
    for index in (0, 1):
        for what in ("progress", "details"):
            assert (f"job {index} logs {what}" in result.stderr) == (what in shown), what


LEVEL_PARENT = """
from absl import app
from postnorm.runtime.console import set_log_level
from postnorm.sweep.workers import run_pinned
from tests.sweep.test_workers import logging_job

def main(argv):
    set_log_level(argv[1])
    print(run_pinned(logging_job, [(0,), (1,)], 2))

app.run(main)
"""


@pytest.mark.parametrize("level, shown", [("warning", False), ("info", True)])
def test_the_workers_show_other_libraries_lines_at_the_parents_log_level(level, shown):
    """A job's INFO line from outside the project (this test file) passes in the workers only
    where the parent's ``set_log_level`` passes it, and no worker warns of unparsed flags."""
    result = subprocess.run([sys.executable, "-c", LEVEL_PARENT, level], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[0, 1]" in result.stdout
    assert ("job 0 logs progress" in result.stderr) == shown
    assert "Logging before flag parsing" not in result.stderr
