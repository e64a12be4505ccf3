"""Independent training runs in parallel worker processes, each pinned to its own CPUs.

A small model leaves CPU cores idle inside one process: its operations are too small for XLA's
intra-op parallelism. Training several runs at once, each process pinned to a disjoint share of
the cores, gets more runs done per hour (docs/PERFORMANCE.md). Each worker is a fresh (spawned)
interpreter whose CPU affinity is set before JAX creates its CPU client, which sizes its thread
pool to the pinned cores.
"""

import multiprocessing
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor


def cpu_groups(workers: int, cpus: Sequence[int] | None = None) -> list[list[int]]:
    """Split the CPUs this process may use into ``workers`` contiguous, near-equal groups."""
    cpus = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    if not 1 <= workers <= len(cpus):
        raise ValueError(f"workers={workers} must be between 1 and the {len(cpus)} CPUs "
                         "available to this process")
    bounds = [round(i * len(cpus) / workers) for i in range(workers + 1)]
    return [cpus[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def _pin_next_group(groups) -> None:
    os.sched_setaffinity(0, groups.get())


def run_pinned(fn: Callable, jobs: Sequence[tuple], workers: int) -> list:
    """``[fn(*job) for job in jobs]``, spread over ``workers`` pinned processes (in-process when
    ``workers`` is 1). ``fn`` must be importable (a module-level function); a job's exception
    is raised here once every job has ended."""
    if workers == 1:
        return [fn(*job) for job in jobs]
    context = multiprocessing.get_context("spawn")
    groups = context.Queue()
    for group in cpu_groups(workers):
        groups.put(group)
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_pin_next_group,
                             initargs=(groups,)) as pool:
        futures = [pool.submit(fn, *job) for job in jobs]
        return [future.result() for future in futures]
