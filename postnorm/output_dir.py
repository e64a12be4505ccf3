"""Directories a run writes to (outputs, checkpoints, the compilation cache): created and
proved writable before any work."""

import os
import tempfile


class OutputDirError(ValueError):
    """An output directory that cannot be created or written; the message names the flag."""


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
