"""Agreement between the processes of a multi-process run (one process: trivially true)."""

from collections.abc import Callable

import jax
import numpy as np
from jax.experimental import multihost_utils


def all_processes_agree(ok: bool) -> bool:
    """True iff ``ok`` on every JAX process (a collective: every process calls it)."""
    if jax.process_count() == 1:
        return ok
    return bool(np.all(multihost_utils.process_allgather(np.asarray(ok))))


def stop_together(check: Callable[[], object], elsewhere: Callable[[], Exception]) -> None:
    """Run ``check`` on every process. If it raised on any process, every process raises: that
    one its own error, the others ``elsewhere()``, so that none is left waiting for the others
    in a collective."""
    try:
        check()
    except Exception:
        all_processes_agree(False)
        raise
    if not all_processes_agree(True):
        raise elsewhere()


def process_mean(value: float) -> float:
    """The mean of ``value`` over the processes."""
    if jax.process_count() == 1:
        return float(value)
    return float(np.mean(multihost_utils.process_allgather(np.float64(value))))


def from_process_0(index: int) -> int:
    """Process 0's ``index`` (a choice it made for every process), on every process."""
    if jax.process_count() == 1:
        return index
    return int(multihost_utils.broadcast_one_to_all(np.int32(index)))
