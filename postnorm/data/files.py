"""Atomic cache writes, so an interrupted write never leaves a file that looks complete."""

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from postnorm.data.errors import DataError


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Writes `data` to a temporary file beside `path`, then renames it into place."""
    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise DataError(
            f"Cannot write the cache file {path} ({e.strerror}); make {path.parent} writable."
        ) from e
    try:
        os.fchmod(fd, 0o644)  # mkstemp creates 0600; caches are shared like the dataset files
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    """Writes `obj` as indented JSON, atomically."""
    write_bytes_atomic(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())
