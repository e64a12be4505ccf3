"""Atomic cache writes, so an interrupted write never leaves a file that looks complete, and a
lock under which one process at a time prepares shared files."""

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from absl import logging

from postnorm.data.errors import DataError
from postnorm.json_numbers import dumps


def replace_file(path: str | os.PathLike, data: bytes) -> None:
    """Writes `data` to a temporary file beside `path`, then renames it into place, so a
    reader never sees a partial file; OSError (the temporary file removed) on failure."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)  # mkstemp creates 0600; outputs are shared like the dataset files
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    """``replace_file``; DataError naming the file when it cannot be written."""
    path = Path(path)
    try:
        replace_file(path, data)
    except OSError as e:
        raise DataError(f"Cannot write {path} ({e.strerror}); make "
                        f"{path.parent} writable and give it free space.") from e


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    """Writes `obj` as indented JSON, atomically; non-finite floats as text
    (``postnorm.json_numbers``)."""
    write_bytes_atomic(path, (dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def lock_exclusively(fd: int, path: str, *, wait: bool) -> None:
    """Takes an exclusive ``flock`` on ``fd`` (the open file ``path``); the kernel drops it
    when the holder ends in any way. Without ``wait``, BlockingIOError when another process
    holds it. On a filesystem without locks (some network mounts) it warns and returns."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        raise
    except OSError as e:
        logging.warning("cannot lock %s (%s): nothing keeps another process from using the "
                        "same files at the same time", path, e)


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
