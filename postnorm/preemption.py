"""Noticing a preemption (SIGTERM) so the loop can checkpoint and stop at a step boundary.

One process: a SIGTERM handler only sets a flag, which the loop reads after each step (a
Python attribute read: no device sync). Several processes: they must all stop at the same
step, so jax's preemption sync manager (created by ``jax.distributed.initialize``, which
installs its own SIGTERM notifier) picks the step: ``reached_preemption_sync_point(step)``,
called with every step, is True on every process at the same one. It is a local check.
"""

import signal
import threading
import types

import jax
from absl import logging
from jax.experimental import multihost_utils


class Preempted(Exception):  # noqa: N818 -- not an error: the run stopped early on request
    """The run saved a checkpoint at ``step`` and stopped; rerunning it resumes there."""

    def __init__(self, step: int, checkpoint_dir: str):
        self.step = step
        super().__init__(f"preempted at step {step}: checkpoint saved in {checkpoint_dir}; "
                         "rerun the same command to resume")


class PreemptionWatch:
    """Answers, after each step, whether to checkpoint and stop now.

    Construct it right before the loop's first step and ``close`` it after the last.
    """

    def __init__(self, start_step: int):
        self._requested = False
        self._previous = None
        self._sync = False
        if jax.process_count() > 1:
            try:  # also registers the start step with the sync manager
                self._requested = multihost_utils.reached_preemption_sync_point(start_step)
                self._sync = True
            except RuntimeError as err:
                logging.warning("no preemption sync in this multi-process run (%s): SIGTERM "
                                "will stop it without a checkpoint", err)
        elif threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        else:
            logging.warning("training outside the main thread: SIGTERM will not checkpoint")

    def _on_sigterm(self, signum: int, frame: types.FrameType | None) -> None:
        del signum, frame
        self._requested = True

    def should_stop(self, step: int) -> bool:
        """True once a preemption was requested (every process agrees on the step)."""
        if self._sync and not self._requested:
            self._requested = multihost_utils.reached_preemption_sync_point(step)
        return self._requested

    def close(self) -> None:
        """Restores the previous SIGTERM handler."""
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
