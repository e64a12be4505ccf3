"""One training run per workdir at a time: an advisory file lock held while a run trains."""

from __future__ import annotations

import json
import os
import socket
import time

from absl import logging

from postnorm.files import lock_exclusively
from postnorm.workdir.layout import Workdir, WorkdirError


class WorkdirLock:
    """``acquire`` creates the workdir and takes its lock; ``release`` lets it go."""

    def __init__(self, workdir: str) -> None:
        self.workdir = workdir
        self.path = Workdir(workdir).lock
        self._fd: int | None = None

    def acquire(self) -> None:
        """Takes the lock, or raises ``WorkdirError`` naming the run that holds it."""
        try:
            os.makedirs(self.workdir, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise WorkdirError(
                f"Workdir {self.workdir} cannot be created or written ({err}). Use a --workdir "
                "that can be created and written (no parent path may be a regular file; check "
                "permissions and free space).") from err
        try:
            lock_exclusively(fd, self.path, wait=False)
        except BlockingIOError:
            os.close(fd)
            raise WorkdirError(
                f"{self.workdir} is in use by another training run ({self._holder()}; lock "
                f"{self.path}). Wait for that run to finish or stop it, or use another "
                "--workdir.") from None
        self._fd = fd
        holder = {"pid": os.getpid(), "host": socket.gethostname(),
                  "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(holder).encode(), 0)
        except OSError as err:  # the lock holds; only the message of a refused run is poorer
            logging.warning("could not record this run in %s (%s)", self.path, err)

    def _holder(self) -> str:
        """Who holds the lock, as its file says."""
        try:
            with open(self.path) as f:
                holder = json.load(f)
            return f"process {holder['pid']} on {holder['host']}, started {holder['started']}"
        except (OSError, ValueError, KeyError, TypeError):
            return "its holder did not record itself yet"

    def release(self) -> None:
        """Lets the lock go (closing the file releases it); the file stays."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
