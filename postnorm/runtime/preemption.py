"""Noticing a preemption (SIGTERM) or Ctrl-C so the loop can checkpoint and stop at a step
boundary."""

import signal
import threading
import types

import jax
from absl import logging
from jax.experimental import multihost_utils

from postnorm.errors import Stopped


class Preempted(Stopped):
    """The run saved a checkpoint at ``step`` and stopped; rerunning it resumes there."""

    def __init__(self, step: int, checkpoint_dir: str, interrupted: bool = False):
        reason = "interrupted (Ctrl-C)" if interrupted else "preempted"
        super().__init__(f"{reason} at step {step}: checkpoint saved in {checkpoint_dir}; "
                         "rerun the same command to resume", interrupted)
        self.step, self.checkpoint_dir = step, checkpoint_dir

    def __reduce__(self):
        return Preempted, (self.step, self.checkpoint_dir, self.interrupted)


# A stop asked for in a worker process (``record_stop_requests``): before its run's
# PreemptionWatch took over, or during a run, so that the worker starts no other one.
_early_request = {"recording": False, "requested": False, "interrupted": False}


def _record_request(signum: int, frame: types.FrameType | None) -> None:
    del frame
    _early_request["requested"] = True
    _early_request["interrupted"] |= signum == signal.SIGINT


def record_stop_requests() -> None:
    """Makes SIGTERM and SIGINT only record a stop request until a ``PreemptionWatch`` takes
    over (worker processes, which they would otherwise kill between or before runs)."""
    _early_request["recording"] = True
    signal.signal(signal.SIGTERM, _record_request)
    signal.signal(signal.SIGINT, _record_request)


def stop_requested() -> bool:
    """Whether ``record_stop_requests``'s handlers have seen a signal."""
    return _early_request["requested"]


class PreemptionWatch:
    """Answers, after each step, whether to checkpoint and stop now.

    Construct it right before the loop's first step and ``close`` it after the last.
    """

    def __init__(self, start_step: int):
        self._requested = False
        self.interrupted = False  # the stop was asked for with Ctrl-C
        self._previous: dict[int, object] = {}
        self._sync = False
        if jax.process_count() > 1:
            try:  # also registers the start step with the sync manager
                self._requested = multihost_utils.reached_preemption_sync_point(start_step)
                self._sync = True
            except RuntimeError as err:
                logging.warning("no preemption sync in this multi-process run (%s): SIGTERM "
                                "will stop it without a checkpoint", err)
        elif threading.current_thread() is threading.main_thread():
            self._previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._on_sigterm)
            self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._on_sigint)
        else:
            logging.warning("training outside the main thread: SIGTERM will not checkpoint")
        # A request recorded before this watch's handlers existed (read after installing them,
        # so that none falls between the two).
        self._requested |= _early_request["requested"]
        self.interrupted |= _early_request["interrupted"]

    def _on_sigterm(self, signum: int, frame: types.FrameType | None) -> None:
        self._requested = True
        if _early_request["recording"]:
            _record_request(signum, frame)

    def _on_sigint(self, signum: int, frame: types.FrameType | None) -> None:
        self._requested = self.interrupted = True
        if _early_request["recording"]:
            _record_request(signum, frame)
        signal.signal(signum, self._previous.pop(signum))  # a second Ctrl-C stops at once
        logging.warning("Ctrl-C: saving a checkpoint after this step, then stopping (Ctrl-C "
                        "again to stop now without it)")

    def should_stop(self, step: int) -> bool:
        """True once a preemption was requested (every process agrees on the step)."""
        if self._sync and not self._requested:
            self._requested = multihost_utils.reached_preemption_sync_point(step)
        return self._requested

    def close(self) -> None:
        """Restores the previous SIGTERM and SIGINT handlers."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}
