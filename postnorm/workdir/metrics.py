"""``metrics.jsonl`` and TensorBoard events: the writer, the reader and the per-layer key format."""

import contextlib
import errno
import glob
import itertools
import json
import os
import re
from collections import defaultdict
from collections.abc import Iterator, Mapping

import numpy as np
from absl import logging

from postnorm.errors import UserError
from postnorm.files import as_text, from_text, replace_file
from postnorm.workdir.event_file import EventFile
from postnorm.workdir.layout import Workdir

_LAYER_KEY = re.compile(r"^diag/(?P<name>.+)/layer_(?P<layer>\d+)$")


def layer_key(name: str, layer: int, n_layers: int) -> str:
    """``diag/tsim_attn`` + 7 of 48 -> ``diag/tsim_attn/layer_07``."""
    width = max(2, len(str(n_layers - 1)))
    return f"{name}/layer_{layer:0{width}d}"


def flatten_diagnostics(diagnostics: Mapping[str, np.ndarray]) -> dict[str, float]:
    """The diagnostic step's statistics as metric keys: ``diag/<name>`` for a scalar, one
    ``layer_key`` per layer for an ``[n_layers]`` array."""
    flat = {}
    for name, value in diagnostics.items():
        value = np.asarray(value, np.float64)
        if value.ndim == 0:
            flat[f"diag/{name}"] = float(value)
        else:
            for layer, v in enumerate(value):
                flat[layer_key(f"diag/{name}", layer, len(value))] = float(v)
    return flat


def layer_series(records: list[dict]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{stat name: (steps [S], values [n_layers, S])} for every per-layer diagnostic."""
    by_name: dict[str, dict[int, dict[int, float]]] = defaultdict(lambda: defaultdict(dict))
    for record in records:
        for key, value in record.items():
            match = _LAYER_KEY.match(key)
            if match:
                by_name[match["name"]][record["step"]][int(match["layer"])] = float(value)
    series = {}
    for name, per_step in by_name.items():
        steps = np.array(sorted(per_step))
        n_layers = 1 + max(max(layers) for layers in per_step.values())
        values = np.full((n_layers, len(steps)), np.nan)
        for column, step in enumerate(steps):
            for layer, value in per_step[step].items():
                values[layer, column] = value
        series[name] = (steps, values)
    return series


class MetricsFileError(UserError, ValueError):
    """A ``metrics.jsonl`` that is missing or has a line that is not a step's JSON record."""


class MetricsWriteError(UserError, RuntimeError):
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
        self.jsonl_path = Workdir(workdir).metrics
        self._failed = False
        self._tb, self._jsonl = None, None
        if not enabled:
            return
        # An event file is named by the second it was opened and opened with "wb": a writer
        # reopened within that second (a rollback's restart) would erase the first.
        suffix = f".{os.getpid()}.{next(_WRITER_COUNT):04d}"
        tensorboard_dir = Workdir(workdir).tensorboard
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


def find_runs(roots: list[str]) -> list[str]:
    """Every directory below ``roots`` holding a ``metrics.jsonl``, sorted."""
    return sorted(os.path.dirname(p) for root in roots
                  for p in glob.glob(os.path.join(root, "**", "metrics.jsonl"), recursive=True))


def read_metrics(workdir: str) -> list[dict]:
    """The run's ``metrics.jsonl`` records (``read_jsonl``); ``MetricsFileError`` until the
    run has logged a train step. An unfinished last line is logged as a warning."""
    path = Workdir(workdir).metrics
    records = read_jsonl(path)
    if not any("train/loss" in record for record in records):
        raise MetricsFileError(f"{path} holds no logged train step yet: rerun this once the run "
                               "has logged one (every train.log_every steps)")
    if unfinished := unfinished_last_line(path):
        logging.warning("%s ends in an unfinished line of %d bytes (a record being written, or "
                        "one its writer was stopped in), left out", path, unfinished)
    return records


def train_loss_and_floor(records: list[dict]) -> list[tuple[int, float, float]]:
    """(step, train loss, frequency floor of that batch) per logged train step, in step order;
    the loss is the cross-entropy (``train/ce``) where the objective logged other terms beside
    it, and the floor is L_freq where the records hold none."""
    lfreq = lfreq_of(records)
    return sorted((int(r["step"]), float(r.get("train/ce", r["train/loss"])),
                   float(r.get("train/freq_floor", lfreq)))
                  for r in records if "train/loss" in r)


def lfreq_of(records: list[dict]) -> float:
    """L_freq as logged with the train (or else the eval) metrics."""
    for key in ("train/lfreq", "eval/lfreq"):
        for record in records:
            if key in record:
                return float(record[key])
    raise MetricsFileError("metrics.jsonl holds no train/lfreq or eval/lfreq record, which the "
                           "trainer logs with every train step and eval: it was not written by "
                           "the trainer, or was edited; restore it or train again")
