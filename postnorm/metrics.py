"""Metric output: TensorBoard event files, ``metrics.jsonl`` and a progress line with ETA.

TensorBoard event files are written with tensorboardX's record writer and protos (clu's
metric writers import TensorFlow), in the caller's thread (``postnorm/event_file.py``).
Only process 0 writes. Per-layer keys carry a zero-padded layer index (``layer_07``).
"""

import contextlib
import errno
import itertools
import json
import os
import time
from collections.abc import Iterator, Mapping

import numpy as np

from postnorm.data.files import replace_file
from postnorm.event_file import EventFile
from postnorm.json_numbers import as_text, from_text

JSONL_NAME = "metrics.jsonl"


def layer_key(name: str, layer: int, n_layers: int) -> str:
    """``diag/tsim_attn`` + 7 of 48 -> ``diag/tsim_attn/layer_07``."""
    width = max(2, len(str(n_layers - 1)))
    return f"{name}/layer_{layer:0{width}d}"


class MetricsFileError(ValueError):
    """A ``metrics.jsonl`` that is missing or has a line that is not a step's JSON record."""


class MetricsWriteError(RuntimeError):
    """Writing ``metrics.jsonl`` or a TensorBoard event file failed (a full disk, a quota)."""


_OUT_OF_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


@contextlib.contextmanager
def _writing(path: str, kind: str = "file") -> Iterator[None]:
    """Turns an ``OSError`` while writing ``path`` (a ``kind``: file or directory) into a
    ``MetricsWriteError`` that says what to do about it."""
    try:
        yield
    except OSError as err:
        fix = ("Free space on its file system (or raise the quota or file-size limit that "
               "stopped it)" if err.errno in _OUT_OF_SPACE else
               f"Make it a writable {kind} in a writable directory")
        raise MetricsWriteError(f"Writing {path} failed ({err.strerror or err}). {fix}, then "
                                "rerun: the run resumes from its latest finalized checkpoint"
                                ) from err


def _complete_lines(path: str) -> list[tuple[bytes, dict]]:
    """(line, record) of every complete line of ``path``; a last line without its newline (a
    killed writer's) is left out. Raises ``MetricsFileError`` naming the file and line."""
    try:
        with open(path, "rb") as f:
            lines = f.readlines()
    except (FileNotFoundError, NotADirectoryError) as err:
        raise MetricsFileError(f"{path} does not exist: nothing has been logged there; train "
                               "first or point --workdir at a run") from err
    except OSError as err:
        raise MetricsFileError(f"{path} cannot be read ({err}): make it a readable file") from err
    out = []
    for number, line in enumerate(lines, start=1):
        if not line.endswith(b"\n") or not line.strip():
            continue
        try:
            record = from_text(json.loads(line.decode("utf-8")))
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise ValueError("no integer 'step'")
            for key, value in record.items():
                if isinstance(value, bool) or not isinstance(value, int | float):
                    raise ValueError(f"{key} is {value!r}, not a number")
        except ValueError as err:  # JSONDecodeError and UnicodeDecodeError included
            raise MetricsFileError(
                f"{path} line {number} is not a step's JSON record ({err}); delete that line "
                "(the other records are kept) and rerun") from err
        out.append((line, record))
    return out


def unfinished_last_line(path: str) -> int:
    """The length in bytes of what follows ``path``'s last newline: a record being written, or
    one a killed writer left unfinished, which the readers leave out (0: none)."""
    with open(path, "rb") as f:
        end = start = f.seek(0, os.SEEK_END)
        while start > 0:  # back a block at a time until a newline
            start = max(start - 2**16, 0)
            f.seek(start)
            newline = f.read(end - start).rfind(b"\n")
            if newline >= 0:
                return end - start - newline - 1
    return end


def read_jsonl(path: str) -> list[dict]:
    """Every complete record of a ``metrics.jsonl`` (see ``_complete_lines``); non-finite
    values, written as text, read back as floats."""
    return [record for _, record in _complete_lines(path)]


def truncate_jsonl(path: str, last_step: int) -> None:
    """Drop records after ``last_step`` (a resumed run rewrites the steps it repeats), and a
    last line that a killed writer left without its newline. The file is replaced whole, and
    only when something is dropped; a failed write leaves it as it was."""
    if not os.path.exists(path):
        return
    kept = [line for line, record in _complete_lines(path) if record["step"] <= last_step]
    if sum(map(len, kept)) == os.path.getsize(path):
        return
    with _writing(path):
        replace_file(path, b"".join(kept))


_WRITER_COUNT = itertools.count()


class MetricWriter:
    """Writes scalars to TensorBoard and ``<workdir>/metrics.jsonl`` (process 0 only)."""

    def __init__(self, workdir: str, *, enabled: bool = True, after_step: int | None = None):
        """``after_step``: the steps to come are later ones; TensorBoard hides the events of
        a previous writer at those steps (a resume or rollback repeats them), as
        ``truncate_jsonl`` drops their JSONL records. None: hide nothing."""
        self.enabled = enabled
        self.jsonl_path = os.path.join(workdir, JSONL_NAME)
        self._failed = False
        self._tb, self._jsonl = None, None
        if not enabled:
            return
        # An event file is named by the second it was opened and opened with "wb": a writer
        # reopened within that second (a rollback's restart) would erase the first.
        suffix = f".{os.getpid()}.{next(_WRITER_COUNT):04d}"
        tensorboard_dir = os.path.join(workdir, "tensorboard")
        with self._writing(tensorboard_dir, "directory"):
            self._tb = EventFile(tensorboard_dir, filename_suffix=suffix,
                                 purge_step=None if after_step is None else after_step + 1)
        with self._writing(self.jsonl_path):
            self._jsonl = open(self.jsonl_path, "a")  # noqa: SIM115

    @contextlib.contextmanager
    def _writing(self, path: str, kind: str = "file") -> Iterator[None]:
        """``_writing(path, kind)``, remembering a failure (``close`` then raises no more)."""
        try:
            with _writing(path, kind):
                yield
        except MetricsWriteError:
            self._failed = True
            raise

    def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        if not self.enabled:
            return
        record = {"step": int(step)}
        with self._writing(self._tb.path):
            for key, value in scalars.items():
                value = float(np.asarray(value))
                record[key] = as_text(value)
                self._tb.add_scalar(key, value, int(step))
        with self._writing(self.jsonl_path):
            self._jsonl.write(json.dumps(record) + "\n")

    def flush(self) -> None:
        if self.enabled:
            with self._writing(self.jsonl_path):
                self._jsonl.flush()
            with self._writing(self._tb.path):
                self._tb.flush()

    def close(self) -> None:
        """Closes both files, then raises the first failure; after a failed write, raises
        nothing more."""
        failed_before, errors = self._failed, []
        for path, file in ((self.jsonl_path, self._jsonl),
                           (self._tb and self._tb.path, self._tb)):
            if file is None:
                continue
            try:
                with self._writing(path):
                    file.close()
            except MetricsWriteError as err:
                errors.append(err)
        self._tb, self._jsonl = None, None
        if errors and not failed_before:
            raise errors[0]


def _duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    hours, rem = divmod(seconds, 3600)
    return f"{hours}h{rem // 60:02d}m" if hours else f"{rem // 60}m{rem % 60:02d}s"


class Progress:
    """Step rate and ETA over the steps since the previous report, less the time set aside
    with ``exclude`` (compiles, evals, checkpoint saves)."""

    def __init__(self, total_steps: int, tokens_per_step: int, start_step: int):
        self.total_steps = total_steps
        self.tokens_per_step = tokens_per_step
        self._last_step, self._last_time = start_step, None
        self._excluded_s = 0.0

    def exclude(self, seconds: float) -> None:
        """Leave ``seconds`` of the current interval out of its step rate."""
        self._excluded_s += seconds

    def report(self, step: int, metrics: Mapping[str, float],
               lfreq: float) -> tuple[str, float | None]:
        """A one-line summary of ``step`` and the tokens/s since the last report (if known)."""
        now = time.perf_counter()
        rate, tokens_per_s = "", None
        stepping_s = (now - self._last_time - self._excluded_s
                      if self._last_time is not None else 0.0)
        if step > self._last_step and stepping_s > 0:
            steps_per_s = (step - self._last_step) / stepping_s
            tokens_per_s = steps_per_s * self.tokens_per_step
            eta = (self.total_steps - step) / steps_per_s
            rate = f" | {tokens_per_s:,.0f} tok/s | ETA {_duration(eta)}"
        self._last_step, self._last_time, self._excluded_s = step, now, 0.0
        line = (f"step {step}/{self.total_steps} | loss {metrics['train/loss']:.4f} | "
                f"L_freq {lfreq:.4f} | lr {metrics['train/lr']:.2e}{rate}")
        return line, tokens_per_s
