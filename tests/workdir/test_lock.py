"""One trainer per workdir: the lock refuses a second holder, names the first, and is free
again once the holder releases it or is killed."""

import os
import signal
import subprocess
import sys

import pytest

from postnorm.workdir.layout import WorkdirError
from postnorm.workdir.lock import WorkdirLock
from tests.reliability_helpers import REPO

HOLD = """
import sys, time
from postnorm.workdir.lock import WorkdirLock
WorkdirLock(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(120)
"""


def test_a_second_holder_is_refused_until_the_first_releases(tmp_path):
    workdir = tmp_path / "run"
    first, second = WorkdirLock(str(workdir)), WorkdirLock(str(workdir))
    first.acquire()  # creates the workdir
    assert (workdir / ".train.lock").is_file()
    with pytest.raises(WorkdirError, match=rf"{workdir} is in use by another training run "
                       rf"\(process {os.getpid()} on .*, started .*; lock {workdir}/.train.lock\)"):
        second.acquire()
    first.release()
    second.acquire()
    second.release()


def test_a_killed_holder_leaves_no_stale_lock(tmp_path):
    workdir = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(workdir)], cwd=REPO,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(WorkdirError, match=f"process {holder.pid} on "):
            WorkdirLock(str(workdir)).acquire()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    lock = WorkdirLock(str(workdir))
    lock.acquire()
    lock.release()


def test_an_uncreatable_workdir_names_it(tmp_path):
    (tmp_path / "file").write_text("")
    workdir = tmp_path / "file" / "run"
    with pytest.raises(WorkdirError, match=f"Workdir {workdir} cannot be created or written"):
        WorkdirLock(str(workdir)).acquire()
