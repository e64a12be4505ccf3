"""A sweep's progress: runs finished, running and left, and an ETA from the measured times of
its finished runs (their training and, where the record keeps it, their measuring)."""

import dataclasses
import functools
import json
from collections.abc import Callable, Hashable

import ml_collections
import numpy as np

from postnorm.data.tokenizers import ByteTokenizer
from postnorm.model import ModelSpec
from postnorm.model.flops import train_flops_per_token


@dataclasses.dataclass(frozen=True)
class RunShape:
    """What a run's time depends on: its steps and the FLOPs of one (``postnorm.model.flops``)."""

    steps: int
    step_flops: float

    @classmethod
    def of(cls, config: ml_collections.ConfigDict) -> "RunShape":
        """The shape of ``config``'s run; the vocabulary is the byte tokenizer's or
        ``data.vocab_size``."""
        byte = config.data.tokenizer == "byte"
        vocab = ByteTokenizer.vocab_size if byte else config.data.vocab_size
        model = json.dumps(config.model.to_dict(), sort_keys=True)
        return cls(steps=config.train.steps,
                   step_flops=_step_flops(model, vocab, config.data.seq_len,
                                          config.data.batch_size))

    @property
    def flops(self) -> float:
        return self.steps * self.step_flops


@functools.lru_cache(maxsize=256)
def _step_flops(model_json: str, vocab_size: int, seq_len: int, batch_size: int) -> float:
    """The training FLOPs of one step of a model (its config section as JSON)."""
    model = json.loads(model_json) | {"attention": "einsum"}  # every kernel computes the same
    spec = ModelSpec.from_config(model, vocab_size=vocab_size, max_len=seq_len)
    return float(batch_size * seq_len * train_flops_per_token(spec, seq_len))


def run_times(record: dict) -> tuple[float | None, float | None]:
    """A finished run's training seconds (its result's ``wall_s``; None for a run stopped early
    by a non-finite step) and its measuring seconds (an archive record's ``measure_s``; None
    where it was not measured or not timed). ``record`` is an archive record, or
    ``{"result": <result.json>}``."""
    result = record["result"]
    return (result.get("wall_s") if result.get("status") == "done" else None,
            record.get("measure_s"))


class SweepProgress:
    """A plan's runs as they end, and an ETA for the rest.

    A run left is estimated at the mean training time of the finished runs of its shape
    (``RunShape``); a shape none has finished (or timed) at the mean time per FLOP of the timed
    shapes with its FLOPs per step if any, else of all of them, times its FLOPs. To that it
    adds the mean measuring time of the runs whose record keeps one with its FLOPs per step, or
    their mean time per FLOP of a step times its own (measuring reads the checkpoint and a
    fixed set of batches, whatever the steps). A running run counts half its estimate (its
    start is not observed). The ETA is the sum spread over the workers, and at least the
    longest single run's estimate.
    """

    def __init__(self, total: int, workers: int, measured: bool = True) -> None:
        """``measured``: the plan measures its runs after training (the ETA then says when it
        counts training alone)."""
        self.total, self.workers, self.measured = total, workers, measured
        self.finished = self.failed = 0
        self._train: dict[RunShape, list[float]] = {}
        self._measure: dict[float, list[float]] = {}  # by FLOPs per step

    def add_finished(self, shape: RunShape, train_s: float | None,
                     measure_s: float | None) -> None:
        """Count a finished run of ``shape`` and its measured times (None: unknown)."""
        self.finished += 1
        if train_s:
            self._train.setdefault(shape, []).append(train_s)
        if measure_s:
            self._measure.setdefault(shape.step_flops, []).append(measure_s)

    def add_failed(self) -> None:
        """Count a run that ended on an error (it is not finished; a rerun trains it again)."""
        self.failed += 1

    def run_estimate(self, shape: RunShape) -> float | None:
        """The estimated seconds of a run of ``shape``; None before any run is timed."""
        same_step = {s: t for s, t in self._train.items() if s.step_flops == shape.step_flops}
        train = _scaled_mean(same_step or self._train, shape, lambda s: s.flops)
        if train is None:
            return None
        return train + (_scaled_mean(self._measure, shape.step_flops, float) or 0.0)

    def line(self, left: list[RunShape], running: int | None = None) -> str:
        """``"150 of 247 runs finished, 2 running, 95 left; ETA 1 h 52 min with 2 worker(s)"``:
        ``left`` are the shapes of the runs not finished, the ``running`` of them first (None:
        not known, as for a plan shared between hosts; none is counted running)."""
        text = f"{self.finished} of {self.total} runs finished, "
        if self.failed:
            text += f"{self.failed} failed, "
        if running is not None:
            text += f"{running} running, "
        running = running or 0
        text += f"{len(left) - running} left"
        estimates = [self.run_estimate(shape) for shape in left]
        if left and None not in estimates:
            remaining = [0.5 * e for e in estimates[:running]] + estimates[running:]
            eta = max(sum(remaining) / self.workers, max(remaining))
            text += f"; ETA {duration(eta)} with {self.workers} worker(s)"
            if self.measured and not self._measure:
                text += " (training only: no finished run records its measuring time)"
        return text


def plan_progress(configs: list[ml_collections.ConfigDict], rows: list[dict],
                  archived: list[dict | None], workers: int) -> str:
    """A whole plan's runs finished and left and its ETA, from its summary ``rows``
    (``summary.write_summary``) and per run its archive record or None (``archived``, which
    times the measuring)."""
    plan = SweepProgress(len(configs), workers)
    left = []
    for config, row, entry in zip(configs, rows, archived, strict=True):
        if row["status"] in ("done", "nonfinite"):
            plan.add_finished(RunShape.of(config), *run_times(
                {"result": row, "measure_s": (entry or {}).get("measure_s")}))
        else:
            left.append(RunShape.of(config))
    return plan.line(left)


def duration(seconds: float) -> str:
    """``"1 h 52 min"``, ``"6 min 35 s"`` or ``"12 s"``."""
    seconds = round(seconds)
    if seconds >= 3600:
        minutes = round(seconds / 60)
        return f"{minutes // 60} h {minutes % 60:02d} min"
    if seconds >= 60:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds} s"


def _scaled_mean(times: dict[Hashable, list[float]], key: Hashable,
                 cost: Callable[[Hashable], float]) -> float | None:
    """The mean of ``times[key]``, else the mean over the keys timed of their mean time per
    unit of ``cost``, times the cost of ``key``; None when nothing is timed."""
    if key in times:
        return float(np.mean(times[key]))
    if not times:
        return None
    return float(np.mean([np.mean(t) / cost(k) for k, t in times.items()])) * cost(key)
