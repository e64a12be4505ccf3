"""Independent training runs in parallel worker processes, each pinned to its own CPUs.

A small model leaves CPU cores idle inside one process: its operations are too small for XLA's
intra-op parallelism. Training several runs at once, each process pinned to a disjoint share of
the cores, gets more runs done per hour (docs/PERFORMANCE.md). Each worker is a fresh (spawned)
interpreter whose CPU affinity is set before JAX creates its CPU client, which sizes its thread
pool to the pinned cores.
"""

import multiprocessing
import os
import signal
import threading
import types
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, wait

from postnorm.preemption import Stopped, record_stop_requests, stop_requested


def cpu_groups(workers: int, cpus: Sequence[int] | None = None) -> list[list[int]]:
    """Split the CPUs this process may use into ``workers`` contiguous, near-equal groups."""
    cpus = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    if not 1 <= workers <= len(cpus):
        raise ValueError(f"workers={workers} must be between 1 and the {len(cpus)} CPUs "
                         "available to this process")
    bounds = [round(i * len(cpus) / workers) for i in range(workers + 1)]
    return [cpus[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def _start_worker(groups) -> None:
    os.sched_setaffinity(0, groups.get())
    record_stop_requests()  # a signal between runs must not kill the worker (and the pool)


def _run_job(fn: Callable, job: tuple):
    """``fn(*job)`` in a worker, unless a stop was requested before it started."""
    if stop_requested():
        raise Stopped("not started: a stop was requested")
    return fn(*job)


class _StopRequests:
    """While active (in the main thread), SIGTERM and SIGINT only record a request."""

    def __init__(self) -> None:
        self.requested = self.interrupted = False
        self._previous: dict[int, object] = {}

    def _record(self, signum: int, frame: types.FrameType | None) -> None:
        del frame
        self.requested = True
        self.interrupted |= signum == signal.SIGINT

    def __enter__(self) -> "_StopRequests":
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous[signum] = signal.signal(signum, self._record)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def _stop_workers(futures: list[Future]) -> None:
    """Cancels the jobs not yet started and asks every worker to checkpoint and stop (SIGTERM;
    a worker that got the terminal's Ctrl-C too records it once)."""
    for future in futures:
        future.cancel()
    for child in multiprocessing.active_children():
        os.kill(child.pid, signal.SIGTERM)


def run_pinned(fn: Callable, jobs: Sequence[tuple], workers: int) -> list:
    """``[fn(*job) for job in jobs]``, spread over ``workers`` pinned processes (in-process when
    ``workers`` is 1). ``fn`` must be importable (a module-level function); a job's exception
    is raised here once every job has ended.

    On SIGTERM or Ctrl-C the jobs not started are dropped and the running ones are asked to
    checkpoint and stop; then ``Stopped`` says how many runs are unfinished. A job that
    stopped on its own request (its worker got the signal) counts the same way.
    """
    if workers == 1:
        return [fn(*job) for job in jobs]
    context = multiprocessing.get_context("spawn")
    groups = context.Queue()
    for group in cpu_groups(workers):
        groups.put(group)
    with _StopRequests() as stop, ProcessPoolExecutor(
            workers, mp_context=context, initializer=_start_worker, initargs=(groups,)) as pool:
        futures = [pool.submit(_run_job, fn, job) for job in jobs]
        pending, stopping = set(futures), False
        while pending:
            _, pending = wait(pending, timeout=0.2)
            if stop.requested and not stopping:
                _stop_workers(futures)
                stopping = True
    unfinished = [f for f in futures if f.cancelled() or isinstance(f.exception(), Stopped)]
    errors = [f.exception() for f in futures if f not in unfinished and f.exception()]
    if errors:
        raise errors[0]
    if unfinished:
        interrupted = stop.interrupted or any(
            f.exception().interrupted for f in unfinished if not f.cancelled())
        raise Stopped(f"stopped on request with {len(unfinished)} of {len(jobs)} runs "
                      "unfinished (each one started saved a checkpoint); rerun the same command "
                      "to resume", interrupted)
    return [f.result() for f in futures]
