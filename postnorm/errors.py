"""The errors every entry point turns into one line and an exit status (0, 2, 3 or 130)."""

import functools
import sys
from collections.abc import Callable


class UserError(Exception):
    """Bad input: the message names the field or file and what would fix it (exit 2)."""


class NonFiniteError(RuntimeError):
    """Training stopped on a non-finite step; the message names the step and the dump (exit 3)."""


class Stopped(Exception):  # noqa: N818 -- not an error: work stopped early on request
    """Work stopped early on request, and rerunning the same command resumes it (exit 0, or
    130 when ``interrupted``: the request was a Ctrl-C, not a preemption)."""

    def __init__(self, message: str, interrupted: bool = False):
        super().__init__(message, interrupted)  # both in args: it pickles across processes
        self.interrupted = interrupted

    def __str__(self) -> str:
        return self.args[0]


def exit_on_error(main: Callable[[list[str]], None]) -> Callable[[list[str]], None]:
    """An absl ``main`` that prints a ``UserError`` or ``NonFiniteError`` as ``postnorm: error:
    ...`` and exits 2 or 3 instead of ending in a traceback, and prints a ``Stopped`` run's
    message and exits 0 (130 after a Ctrl-C)."""

    @functools.wraps(main)
    def wrapped(argv: list[str]) -> None:
        try:
            main(argv)
        except Stopped as stop:  # a checkpoint was saved: rerunning resumes
            print(f"postnorm: {stop}", file=sys.stderr)
            sys.exit(130 if stop.interrupted else 0)
        except (UserError, NonFiniteError) as err:
            print(f"postnorm: error: {err}", file=sys.stderr)
            sys.exit(2 if isinstance(err, UserError) else 3)

    return wrapped
