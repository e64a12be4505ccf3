"""Pinned worker processes (postnorm.workers): CPU groups and per-process affinity."""

import os

import pytest

from postnorm.workers import cpu_groups, run_pinned


def affinity_and_square(x: int) -> tuple[list[int], int, int]:
    """Runs in a worker: its CPU set, its pid and a result."""
    return sorted(os.sched_getaffinity(0)), os.getpid(), x * x


def test_cpu_groups_split_evenly_and_disjointly():
    assert cpu_groups(2, range(5)) == [[0, 1], [2, 3, 4]]
    assert cpu_groups(3, [7, 1, 4]) == [[1], [4], [7]]
    groups = cpu_groups(4, range(16))
    assert [len(g) for g in groups] == [4] * 4 and sorted(sum(groups, [])) == list(range(16))
    with pytest.raises(ValueError, match="workers=3 must be between 1 and the 2 CPUs"):
        cpu_groups(3, [0, 1])


def test_workers_are_pinned_to_disjoint_cpus_and_return_in_job_order():
    workers = min(2, len(os.sched_getaffinity(0)))
    results = run_pinned(affinity_and_square, [(x,) for x in range(6)], workers)
    assert [r[2] for r in results] == [x * x for x in range(6)]
    by_pid = {pid: tuple(cpus) for cpus, pid, _ in results}
    if workers == 1:
        assert list(by_pid) == [os.getpid()]
        return
    assert os.getpid() not in by_pid
    assert set(by_pid.values()) <= {tuple(g) for g in cpu_groups(workers)}
    assert len(set(by_pid.values())) == len(by_pid)  # no two processes share a group
