"""The errors bad input raises. Each message names the field or file and what would fix it;
entry points print it as one line and exit with status 2."""

import functools
import sys
from collections.abc import Callable

from postnorm.allocator import AllocatorError
from postnorm.checkpoint import CheckpointError
from postnorm.compilation_cache import CompilationCacheError
from postnorm.data import DataError
from postnorm.kernels.build import KernelBuildError
from postnorm.metrics import MetricsFileError, MetricsWriteError
from postnorm.output_dir import OutputDirError
from postnorm.preemption import Stopped
from postnorm.run_config import WorkdirError
from postnorm.sweep import SweepError
from postnorm.validation import ConfigError
from postnorm.xla_options import XlaOptionsError

USER_ERRORS = (ConfigError, AllocatorError, CompilationCacheError, DataError, CheckpointError,
               WorkdirError, MetricsFileError, MetricsWriteError, SweepError, XlaOptionsError,
               OutputDirError, KernelBuildError)


def exit_2_on_user_error(main: Callable[[list[str]], None]) -> Callable[[list[str]], None]:
    """An absl ``main`` that prints a ``USER_ERRORS`` error as ``postnorm: error: ...`` and
    exits 2 instead of ending in a traceback; a ``Stopped`` run prints its message and exits
    0 (130 after a Ctrl-C), as main.py does."""

    @functools.wraps(main)
    def wrapped(argv: list[str]) -> None:
        try:
            main(argv)
        except Stopped as stop:  # a checkpoint was saved: rerunning resumes
            print(f"postnorm: {stop}", file=sys.stderr)
            sys.exit(130 if stop.interrupted else 0)
        except USER_ERRORS as err:
            print(f"postnorm: error: {err}", file=sys.stderr)
            sys.exit(2)

    return wrapped
