"""Wall-clock timing of jitted calls, up to their results being ready."""

import statistics
import time
from collections.abc import Callable

import jax


def timed(fn: Callable[[], object]) -> float:
    """Seconds of one call of ``fn``, up to its results being ready."""
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def interleaved_median_ms(fns: dict[str, Callable], args: tuple, repeats: int,
                          calls: int) -> dict[str, float]:
    """Median milliseconds per call of each jitted ``fn(*args)``: in each of ``repeats``
    rounds every function runs ``calls`` times back to back (their mean is the round's time),
    so all of them see the same machine load."""
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(calls):
                out = fn(*args)
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - start) / calls)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}
