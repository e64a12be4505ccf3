"""The loop's reporting: step rate and ETA, each step's metrics fetched one step late, and the
collapse early-warning monitor's reading of every diagnostic step."""

import contextlib
import os
import time
from collections.abc import Iterator, Mapping

import jax
import numpy as np
from absl import logging

from postnorm.diagnostics.early_warning import (
    DEFAULT_MONITOR,
    Alarm,
    MonitorRule,
    MonitorState,
    assess,
    loss_and_floor_at,
    replay,
)
from postnorm.runtime.multihost import stop_together
from postnorm.train.experiment import unusable_elsewhere
from postnorm.train.state import GuardedState
from postnorm.workdir.layout import Workdir
from postnorm.workdir.metrics import (
    MetricsWriteError,
    MetricWriter,
    flatten_diagnostics,
    layer_series,
    read_jsonl,
    train_loss_and_floor,
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


class Monitor:
    """The early-warning monitor over the run's logged train losses and diagnostic steps, as
    ``postnorm.analysis.collapse.replay_monitor`` reads them from ``metrics.jsonl``: on a
    (re)start its state is rebuilt by replaying the records kept, so that a resumed run reads
    every later step as an uninterrupted one would."""

    def __init__(self, rule: MonitorRule, records: list[dict]):
        self.rule = rule
        self.train_S = train_loss_and_floor(records) if records else []
        series = layer_series(records)
        self.state, self.last = MonitorState(), None
        self.new_warning: int | None = None  # the step of a warn not yet acted on
        if "tsim_attn" in series:
            alarms, self.state = replay(*series["tsim_attn"], self.train_S, rule)
            self.last = alarms[-1] if alarms else None

    def log_train(self, step: int, loss: float, floor: float) -> None:
        self.train_S.append((step, loss, floor))

    def read(self, step: int, tsim_L) -> Alarm:
        """The alarm of diagnostic step ``step``; logged when its level differs from the last."""
        loss, floor = loss_and_floor_at(self.train_S, step, self.rule.collapse.loss_smoothing)
        alarm, self.state = assess(step, tsim_L, loss, floor, self.state, self.rule)
        previous = self.last.level if self.last else 0
        if alarm.level == 2 and previous < 2:
            self.new_warning = step
        if alarm.level != previous:
            log = logging.warning if alarm.level else logging.info
            log("collapse early warning at step %d: %s%s", step, alarm.name.upper(),
                f": {alarm.reason}" if alarm.reason else " (cleared)")
        self.last = alarm
        return alarm


class Reporter:
    """Fetches held device metrics one step late, then logs and writes them (process 0 writes),
    with the monitor's reading of each diagnostic step (``monitor/*``)."""

    def __init__(self, workdir: str, tokens_per_step: int, total_steps: int, lfreq: float,
                 monitor_rule: MonitorRule = DEFAULT_MONITOR):
        self.workdir, self.tokens_per_step = workdir, tokens_per_step
        self.total_steps, self.lfreq = total_steps, lfreq
        self.monitor_rule = monitor_rule
        self.final: dict[str, float] = {}
        self.writer: MetricWriter | None = None
        self.saw_skip = False  # the last fetched metrics counted more skipped steps than before
        self.last_tsim: np.ndarray | None = None  # at the last diagnostic step flushed
        self._held = None

    def restart(self, step: int, skipped_steps: int) -> None:
        """(Re)start after ``step``, whose state has skipped ``skipped_steps`` steps: the
        records of later steps are dropped, and the monitor reads the ones kept."""
        self.close()
        self.writer = open_metrics(self.workdir, step)
        self.progress = Progress(self.total_steps, self.tokens_per_step, step)
        self.saw_skip, self._held, self._skipped = False, None, skipped_steps
        path = Workdir(self.workdir).metrics

        def rebuild() -> None:  # from process 0's records; if they fail, every process raises
            records = (read_jsonl(path) if jax.process_index() == 0 and os.path.exists(path)
                       else [])
            self.monitor = Monitor(self.monitor_rule, records)

        stop_together(rebuild, unusable_elsewhere)

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

    def take_warning(self) -> int:
        """The step of a new warn since the last call, else 0 (tsim there: ``last_tsim``)."""
        step, self.monitor.new_warning = self.monitor.new_warning, None
        return step or 0

    def flush(self) -> bool:
        """Log and write the held step; True when it was a diagnostic step."""
        if self._held is None:
            return False
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
            self.monitor.log_train(step, scalars.get("train/ce", scalars["train/loss"]),
                                   floor)
        if device_diag is not None:
            diagnostics = jax.device_get(device_diag)
            scalars.update(flatten_diagnostics(diagnostics))
            self.last_tsim = np.asarray(diagnostics["tsim_attn"])
            alarm = self.monitor.read(step, self.last_tsim)
            scalars.update({"monitor/level": alarm.level,
                            "monitor/similar_fraction": alarm.fraction})
        self._write(step, scalars)
        self.final.update(scalars)
        return device_diag is not None

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
