"""A sweep's progress: runs finished, running and left, and an ETA from the measured times of
its finished runs (their training and, where the record keeps it, their measuring)."""

import dataclasses

import ml_collections
import numpy as np


@dataclasses.dataclass(frozen=True)
class RunShape:
    """What a run's time depends on: its steps, its model's depth and widths, and the tokens
    of a step."""

    layers: int
    steps: int
    d_model: int
    d_ff: int
    seq_len: int
    batch_size: int
    vocab_size: int

    @classmethod
    def of(cls, config: ml_collections.ConfigDict) -> "RunShape":
        return cls(config.model.n_layers, config.train.steps, config.model.d_model,
                   config.model.d_ff, config.data.seq_len, config.data.batch_size,
                   config.data.vocab_size)

    @property
    def flops(self) -> float:
        """The run's training FLOPs: 6 per token for each weight of a matmul (attention's four
        d x d maps, the SwiGLU's three d x d_ff, the d x vocab output) and 6 n d per token
        and layer for causal attention's scores and mixing (n = ``seq_len``)."""
        d = self.d_model
        per_layer = 4 * d * d + 3 * d * self.d_ff + self.seq_len * d
        per_token = 6 * (self.layers * per_layer + self.vocab_size * d)
        return float(self.steps * self.batch_size * self.seq_len * per_token)


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
    (``RunShape``), plus the mean measuring time of those whose record keeps one. A shape none
    has finished (or timed) is scaled from the timed shapes most like it, by their mean time per
    FLOP (``RunShape.flops``): those that differ from it in steps alone if any (time per step
    is then exact), else all of them. A running run counts half its estimate (its start is not
    observed). The ETA is the sum spread over the workers, and at least the longest single
    run's estimate.
    """

    def __init__(self, total: int, workers: int, measured: bool = True) -> None:
        """``measured``: the plan measures its runs after training (the ETA then says when it
        counts training alone)."""
        self.total, self.workers, self.measured = total, workers, measured
        self.finished = self.failed = 0
        self._train: dict[RunShape, list[float]] = {}
        self._measure: dict[RunShape, list[float]] = {}

    def add_finished(self, shape: RunShape, train_s: float | None,
                     measure_s: float | None) -> None:
        """Count a finished run of ``shape`` and its measured times (None: unknown)."""
        self.finished += 1
        if train_s:
            self._train.setdefault(shape, []).append(train_s)
        if measure_s:
            self._measure.setdefault(shape, []).append(measure_s)

    def add_failed(self) -> None:
        """Count a run that ended on an error (it is not finished; a rerun trains it again)."""
        self.failed += 1

    def run_estimate(self, shape: RunShape) -> float | None:
        """The estimated seconds of a run of ``shape``; None before any run is timed."""
        train = _by_shape(self._train, shape)
        if train is None:
            return None
        return train + (_by_shape(self._measure, shape) or 0.0)

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


def _by_shape(times: dict[RunShape, list[float]], shape: RunShape) -> float | None:
    """The mean of ``times[shape]``, else the mean time per FLOP of the timed shapes most like
    ``shape`` (``SweepProgress``) times its FLOPs; None when nothing is timed."""
    if shape in times:
        return float(np.mean(times[shape]))
    steps_apart = {s: t for s, t in times.items()
                   if dataclasses.replace(s, steps=shape.steps) == shape}
    like = steps_apart or times
    if not like:
        return None
    return float(np.mean([np.mean(t) / s.flops for s, t in like.items()])) * shape.flops
