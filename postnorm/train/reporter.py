"""The loop's reporting: step rate and ETA, and each step's metrics fetched one step late."""

import contextlib
import time
from collections.abc import Iterator, Mapping

import jax
from absl import logging

from postnorm.runtime.multihost import stop_together
from postnorm.train.experiment import unusable_elsewhere
from postnorm.train.state import GuardedState
from postnorm.workdir.layout import Workdir
from postnorm.workdir.metrics import (
    MetricsWriteError,
    MetricWriter,
    flatten_diagnostics,
    truncate_jsonl,
)


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


def open_metrics(workdir: str, last_step: int) -> MetricWriter:
    """A metric writer (process 0 writes), after dropping the records of steps after
    ``last_step``."""
    path, writer = Workdir(workdir).metrics, jax.process_index() == 0
    stop_together(lambda: truncate_jsonl(path, last_step) if writer else None,
                  unusable_elsewhere)
    return MetricWriter(workdir, enabled=writer, after_step=last_step)


class Reporter:
    """Fetches held device metrics one step late, then logs and writes them."""

    def __init__(self, workdir: str, tokens_per_step: int, total_steps: int, lfreq: float):
        self.workdir, self.tokens_per_step = workdir, tokens_per_step
        self.total_steps, self.lfreq = total_steps, lfreq
        self.final: dict[str, float] = {}
        self.writer: MetricWriter | None = None
        self.saw_skip = False  # the last fetched metrics counted more skipped steps than before
        self._held = None

    def restart(self, step: int, skipped_steps: int) -> None:
        """(Re)start after ``step``, whose state has skipped ``skipped_steps`` steps: the
        records of later steps are dropped."""
        self.close()
        self.writer = open_metrics(self.workdir, step)
        self.progress = Progress(self.total_steps, self.tokens_per_step, step)
        self.saw_skip, self._held, self._skipped = False, None, skipped_steps

    @contextlib.contextmanager
    def excluded(self, state: GuardedState) -> Iterator[None]:
        """Leave the time of the block (a compile, an eval, a save) out of the step rate,
        once the steps dispatched before it have produced ``state``: their run time, which
        would otherwise overlap the block, stays in the rate."""
        jax.block_until_ready(state)
        start = time.perf_counter()
        try:
            yield
        finally:
            self.progress.exclude(time.perf_counter() - start)

    def hold(self, step: int, metrics, diagnostics, floor: float | None) -> None:
        """Keep ``step``'s device metrics (with its batch's frequency floor) and diagnostics
        until the next ``flush``."""
        self._held = (step, metrics, diagnostics, floor)

    def flush(self) -> None:
        if self._held is None:
            return
        step, device_metrics, device_diag, floor = self._held
        self._held = None
        scalars = {}
        if device_metrics is not None:
            scalars = {k: float(v) for k, v in jax.device_get(device_metrics).items()}
            line, tokens_per_s = self.progress.report(step, scalars, self.lfreq)
            logging.info(line)
            scalars["train/lfreq"] = self.lfreq
            scalars["train/freq_floor"] = floor
            if tokens_per_s is not None:
                scalars["train/tokens_per_s"] = tokens_per_s
            skipped = scalars["train/skipped_steps"]
            self.saw_skip = skipped > self._skipped
            if self.saw_skip:
                logging.warning("%d steps skipped so far: non-finite loss or gradient", skipped)
            self._skipped = skipped
        if device_diag is not None:
            scalars.update(flatten_diagnostics(jax.device_get(device_diag)))
        self._write(step, scalars)
        self.final.update(scalars)

    def _write(self, step: int, scalars: dict[str, float]) -> None:
        """Write and flush ``scalars`` (process 0 writes); when that fails, every process
        raises, so none is left waiting for it in the next step's collective."""
        def write() -> None:
            self.writer.write_scalars(step, scalars)
            self.writer.flush()
        stop_together(write, lambda: MetricsWriteError(
            "process 0 could not write the metrics: its log says why"))

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def write_eval(self, step: int, eval_loss: float, eval_floor: float) -> None:
        logging.info("eval at step %d: loss %.4f | L_freq %.4f | frequency floor of the eval "
                     "batches %.4f | loss / floor %.4f", step, eval_loss, self.lfreq, eval_floor,
                     eval_loss / eval_floor)
        scalars = {"eval/loss": eval_loss, "eval/lfreq": self.lfreq,
                   "eval/loss_minus_lfreq": eval_loss - self.lfreq,
                   "eval/freq_floor": eval_floor, "eval/loss_over_floor": eval_loss / eval_floor}
        self._write(step, scalars)
        self.final.update(scalars)
