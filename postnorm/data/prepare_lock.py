"""The lock under which one process at a time prepares a data directory's shared files."""

import contextlib
import os
from collections.abc import Iterator

from absl import logging

from postnorm.files import lock_exclusively


@contextlib.contextmanager
def preparing(directory: str, purpose: str, *, create: bool) -> Iterator[None]:
    """Holds an exclusive lock on ``<directory>/.prepare.lock`` for the body, waiting for
    another process that holds it (several runs starting together on a fresh data_dir); the
    kernel drops it when the holder ends in any way. ``create``: make ``directory`` first.
    Where no lock can be taken (a read-only, already prepared directory) the body runs
    without one."""
    path, fd = os.path.join(directory, ".prepare.lock"), None
    try:
        if create:
            os.makedirs(directory, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        logging.info("no lock on %s (%s): preparing %s without one", path, e.strerror, purpose)
    if fd is None:
        yield
        return
    try:
        try:
            lock_exclusively(fd, path, wait=False)
        except BlockingIOError:
            logging.info("waiting for another process preparing %s in %s", purpose, directory)
            lock_exclusively(fd, path, wait=True)
        yield
    finally:
        os.close(fd)
