"""The errors bad input raises. Each message names the field or file and what would fix it;
entry points print it as one line and exit with status 2."""

import functools
import sys
from collections.abc import Callable

from postnorm.allocator import AllocatorError
from postnorm.checkpoint import CheckpointError
from postnorm.compilation_cache import CompilationCacheError
from postnorm.data import DataError
from postnorm.metrics import MetricsFileError
from postnorm.run_config import WorkdirError
from postnorm.validation import ConfigError

USER_ERRORS = (ConfigError, AllocatorError, CompilationCacheError, DataError, CheckpointError,
               WorkdirError, MetricsFileError)


def exit_2_on_user_error(main: Callable[[list[str]], None]) -> Callable[[list[str]], None]:
    """An absl ``main`` that prints a ``USER_ERRORS`` error as ``postnorm: error: ...`` and
    exits 2 instead of ending in a traceback."""

    @functools.wraps(main)
    def wrapped(argv: list[str]) -> None:
        try:
            main(argv)
        except USER_ERRORS as err:
            print(f"postnorm: error: {err}", file=sys.stderr)
            sys.exit(2)

    return wrapped
