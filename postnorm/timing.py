"""Wall-clock timing of jitted calls, interleaved so that every variant sees the same load."""

import statistics
import time
from collections.abc import Callable

import jax


def interleaved_median_s(fns: dict[str, Callable], args: dict[str, tuple], repeats: int,
                         calls: int = 1) -> dict[str, float]:
    """Median seconds per call of each jitted ``fns[name](*args[name])``: in each of
    ``repeats`` rounds every function runs ``calls`` times back to back (their mean is the
    round's time), so all of them see the same machine load."""
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(calls):
                out = fn(*args[name])
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - start) / calls)
    return {name: statistics.median(t) for name, t in times.items()}
