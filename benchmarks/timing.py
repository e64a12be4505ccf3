"""Wall-clock timing of jitted calls, up to their results being ready."""

import time
from collections.abc import Callable

import jax

from postnorm.timing import interleaved_median_s


def timed(fn: Callable[[], object]) -> float:
    """Seconds of one call of ``fn``, up to its results being ready."""
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def interleaved_median_ms(fns: dict[str, Callable], args: tuple, repeats: int,
                          calls: int) -> dict[str, float]:
    """``postnorm.timing.interleaved_median_s`` of functions that share ``args``, in ms."""
    seconds = interleaved_median_s(fns, dict.fromkeys(fns, args), repeats, calls)
    return {name: s * 1e3 for name, s in seconds.items()}
