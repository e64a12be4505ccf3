"""A sweep's progress: runs finished, running and left, and an ETA from the measured times of
its finished runs (their training and, where the record keeps it, their measuring)."""

import ml_collections
import numpy as np


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

    A run left is estimated at the mean training time of the finished runs of its depth, plus
    the mean measuring time of those whose record keeps one; at a depth none has finished (or
    timed), at the mean time per layer of the depths that have, times its layers. A running run
    counts half its estimate (its start is not observed). The ETA is the sum spread over the
    workers, and at least the longest single run's estimate.
    """

    def __init__(self, total: int, workers: int, measured: bool = True) -> None:
        """``measured``: the plan measures its runs after training (the ETA then says when it
        counts training alone)."""
        self.total, self.workers, self.measured = total, workers, measured
        self.finished = self.failed = 0
        self._train: dict[int, list[float]] = {}
        self._measure: dict[int, list[float]] = {}

    def add_finished(self, layers: int, train_s: float | None,
                     measure_s: float | None) -> None:
        """Count a finished run of ``layers`` layers and its measured times (None: unknown)."""
        self.finished += 1
        if train_s:
            self._train.setdefault(layers, []).append(train_s)
        if measure_s:
            self._measure.setdefault(layers, []).append(measure_s)

    def add_failed(self) -> None:
        """Count a run that ended on an error (it is not finished; a rerun trains it again)."""
        self.failed += 1

    def run_estimate(self, layers: int) -> float | None:
        """The estimated seconds of a run of ``layers`` layers; None before any run is timed."""
        train = _by_depth(self._train, layers)
        if train is None:
            return None
        return train + (_by_depth(self._measure, layers) or 0.0)

    def line(self, left_layers: list[int], running: int | None = None) -> str:
        """``"150 of 247 runs finished, 2 running, 95 left; ETA 1 h 52 min with 2 worker(s)"``:
        ``left_layers`` are the depths of the runs not finished, the ``running`` of them first
        (None: not known, as for a plan shared between hosts; none is counted running)."""
        text = f"{self.finished} of {self.total} runs finished, "
        if self.failed:
            text += f"{self.failed} failed, "
        if running is not None:
            text += f"{running} running, "
        running = running or 0
        text += f"{len(left_layers) - running} left"
        estimates = [self.run_estimate(layers) for layers in left_layers]
        if left_layers and None not in estimates:
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
            plan.add_finished(config.model.n_layers, *run_times(
                {"result": row, "measure_s": (entry or {}).get("measure_s")}))
        else:
            left.append(config.model.n_layers)
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


def _by_depth(times: dict[int, list[float]], layers: int) -> float | None:
    """The mean of ``times[layers]``, else the mean time per layer over the depths timed times
    ``layers``; None when nothing is timed."""
    if layers in times:
        return float(np.mean(times[layers]))
    if not times:
        return None
    return float(np.mean([np.mean(t) / depth for depth, t in times.items()])) * layers
