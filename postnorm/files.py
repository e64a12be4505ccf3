"""Atomic file writes, NaN-safe JSON, writable directories and exclusive file locks."""

import fcntl
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from absl import logging

from postnorm.errors import UserError

# JSON has no NaN or infinity: the project's JSON files (metrics.jsonl, result.json, summaries,
# dumps) write them as these strings and read them back as floats.
_NONFINITE_TEXT = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


class FileWriteError(UserError):
    """A file that could not be written; the message names it and the fix."""


class OutputDirError(UserError):
    """An output directory that cannot be created or written; the message names the flag."""


def as_text(obj: Any) -> Any:
    """``obj`` with every non-finite float replaced by its text (lists, tuples, dicts walked;
    numpy floats become floats)."""
    if isinstance(obj, np.floating):
        obj = float(obj)
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {key: as_text(value) for key, value in obj.items()}
    if isinstance(obj, list | tuple):
        return [as_text(value) for value in obj]
    return obj


def dumps(obj: Any, **kwargs: Any) -> str:
    """``json.dumps`` of ``as_text(obj)``: valid JSON whatever floats ``obj`` holds."""
    return json.dumps(as_text(obj), allow_nan=False, **kwargs)


def from_text(obj: Any) -> Any:
    """The inverse of ``as_text``: ``"nan"``, ``"inf"`` and ``"-inf"`` values become floats."""
    if isinstance(obj, str):
        return _NONFINITE_TEXT.get(obj, obj)
    if isinstance(obj, dict):
        return {key: from_text(value) for key, value in obj.items()}
    if isinstance(obj, list):
        return [from_text(value) for value in obj]
    return obj


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
    """``replace_file``; ``FileWriteError`` naming the file when it cannot be written."""
    path = Path(path)
    try:
        replace_file(path, data)
    except OSError as e:
        raise FileWriteError(f"Cannot write {path} ({e.strerror}); make "
                             f"{path.parent} writable and give it free space.") from e


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    """Writes `obj` as indented JSON with sorted keys, atomically; non-finite floats as text."""
    write_bytes_atomic(path, (dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def make_writable_dir(path: str) -> None:
    """Create ``path`` (with its parents) and write and remove a probe file in it; raises the
    ``OSError`` of whichever failed, for the caller to name."""
    os.makedirs(path, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path, prefix=".write-probe-"):
        pass


def make_output_dir(path: str, name: str) -> str:
    """``make_writable_dir``, so that a directory that cannot hold the outputs fails before
    the work that produces them. Raises ``OutputDirError`` naming ``name`` (the flag or field
    that gave ``path``)."""
    try:
        make_writable_dir(path)
    except OSError as err:
        raise OutputDirError(
            f"{name}={path!r} cannot be created or written ({err.strerror or err}); give a "
            "directory that exists or can be created, with write permission, and no regular "
            "file on its path") from err
    return path


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
