"""Independent training runs in parallel worker processes, each pinned to its own CPUs."""

import contextlib
import multiprocessing
import os
import queue
import signal
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool

from absl import app, flags
from absl import logging as absl_logging

from postnorm.errors import Stopped
from postnorm.runtime.console import current_log_level, set_log_level
from postnorm.runtime.preemption import PreemptionWatch, record_stop_requests, stop_requested


def cpu_groups(workers: int, cpus: Sequence[int] | None = None) -> list[list[int]]:
    """Split the CPUs this process may use into ``workers`` contiguous, near-equal groups."""
    cpus = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    if not 1 <= workers <= len(cpus):
        raise ValueError(f"workers={workers} must be between 1 and the {len(cpus)} CPUs "
                         "available to this process")
    bounds = [round(i * len(cpus) / workers) for i in range(workers + 1)]
    return [cpus[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def check_workers(workers: int) -> None:
    """A ``--workers`` flag that ``cpu_groups`` refuses is a usage error."""
    try:
        cpu_groups(workers)
    except ValueError as err:
        raise app.UsageError(f"--{err}") from None


_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


_sweep_stopping = None  # in a worker: the parent's event, set once the pool is stopping


def _start_worker(groups, pids, stopping, verbosity: int, log_level: str | None) -> None:
    global _sweep_stopping
    flags.FLAGS.mark_as_parsed()  # a worker takes no flags: absl need not warn that none parsed
    absl_logging.use_absl_handler()  # the parent's log lines, at its verbosity, on stderr
    absl_logging.set_verbosity(verbosity)
    if log_level is not None:  # and other libraries' at the parent's level, from JAX's start
        set_log_level(log_level)
    record_stop_requests()  # a signal between runs must not kill the worker (and the pool)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)  # blocked since the parent spawned it
    _sweep_stopping = stopping
    os.sched_setaffinity(0, groups.get())
    pids.put(os.getpid())


def _run_job(fn: Callable, job: tuple):
    """``fn(*job)`` in a worker, unless a stop was requested before it started."""
    if stop_requested() or _sweep_stopping.is_set():
        raise Stopped("not started: a stop was requested")
    return fn(*job)


class _Workers:
    """The pool's worker processes, as they report their pids."""

    def __init__(self, pids: queue.Queue) -> None:
        self._pids, self.known, self._signalled = pids, set(), set()

    def signal(self, signum: int, *, again: bool = False) -> None:
        """Sends ``signum`` to the workers not sent one yet (``again``: to every worker)."""
        with contextlib.suppress(queue.Empty):
            while True:
                self.known.add(self._pids.get_nowait())
        for pid in self.known if again else self.known - self._signalled:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)
        self._signalled |= self.known


def _unfinished(future: Future, stopping: bool) -> bool:
    """Whether the job stopped on request (or its worker died while the pool was stopping)."""
    if future.cancelled():
        return True
    error = future.exception()
    return isinstance(error, Stopped) or (stopping and isinstance(error, BrokenProcessPool))


def _report(on_done: Callable[[int, bool], None] | None, index: int, returned: bool) -> None:
    """``on_done(index, returned)``; its error is logged, never raised into the pool's loop."""
    if on_done is None:
        return
    try:
        on_done(index, returned)
    except Exception:  # a progress report must not stop or stall the runs
        absl_logging.exception("reporting the end of job %d failed", index)


def run_pinned(fn: Callable, jobs: Sequence[tuple], workers: int,
               on_done: Callable[[int, bool], None] | None = None) -> list:
    """``[fn(*job) for job in jobs]``, spread over ``workers`` pinned processes (in-process when
    ``workers`` is 1). ``fn`` must be importable (a module-level function); a job's exception
    is raised here once every job has ended (in-process: at once). ``on_done(i, returned)``
    runs here as job ``i`` ends, returned or raised (not one stopped on request), within 0.2 s
    with several workers; an error in it is logged, and the jobs go on.

    On SIGTERM or Ctrl-C, or when one job stops on request (its worker got the signal), every
    worker is asked to checkpoint and stop (SIGTERM) and starts no further job; then
    ``Stopped`` says how many runs are unfinished. A second Ctrl-C kills the workers at once.
    """
    if workers == 1 or not jobs:
        results = []
        for index, job in enumerate(jobs):
            results.append(fn(*job))
            _report(on_done, index, True)
        return results
    # first: SIGTERM and a first Ctrl-C only recorded (a second one raises), also while the
    # queues below start multiprocessing's resource tracker, which takes a while on a busy host
    watch = PreemptionWatch(0)
    try:
        context = multiprocessing.get_context("spawn")
        groups, pids, stopping_event = context.Queue(), context.Queue(), context.Event()
        for group in cpu_groups(workers):
            groups.put(group)
        pool_workers = _Workers(pids)
        # Workers inherit the blocked signals and unblock them once they can record them:
        # a signal while one is still starting would otherwise kill it (and the pool).
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
        try:
            pool = ProcessPoolExecutor(workers, mp_context=context, initializer=_start_worker,
                                       initargs=(groups, pids, stopping_event,
                                                 absl_logging.get_verbosity(),
                                                 current_log_level()))
            futures = [pool.submit(_run_job, fn, job) for job in jobs]
            index_of = {future: index for index, future in enumerate(futures)}
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        pending, stopping = set(futures), False
        try:
            while pending:
                done, pending = wait(pending, timeout=0.2)
                for future in done:
                    if not _unfinished(future, stopping):
                        _report(on_done, index_of[future], future.exception() is None)
                if not stopping and (watch.should_stop(0)
                                     or any(_unfinished(f, False) for f in done)):
                    stopping_event.set()  # no worker starts another job
                    stopping = True
                if stopping:  # running jobs checkpoint and stop (workers reporting late too)
                    pool_workers.signal(signal.SIGTERM)
        except KeyboardInterrupt:  # the second Ctrl-C
            pool_workers.signal(signal.SIGKILL, again=True)
            raise
        finally:
            pool.shutdown(wait=True)
    finally:
        requested = watch.should_stop(0)  # also a request once every job had ended
        watch.close()
    unfinished = [f for f in futures if _unfinished(f, stopping)]
    errors = [f.exception() for f in futures if f not in unfinished and f.exception()]
    if errors:
        raise errors[0]
    if unfinished:
        interrupted = watch.interrupted or any(
            isinstance(f.exception(), Stopped) and f.exception().interrupted for f in unfinished)
        raise Stopped(f"stopped on request with {len(unfinished)} of {len(jobs)} runs "
                      "unfinished (each one started saved a checkpoint); rerun the same command "
                      "to resume", interrupted)
    if requested:
        raise Stopped(f"stopped on request once all {len(jobs)} runs had ended; rerun the same "
                      "command to go on", watch.interrupted)
    return [f.result() for f in futures]
