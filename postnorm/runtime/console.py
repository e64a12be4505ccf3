"""What reaches the console (``runtime.log_level``): the project's own log lines always, other
libraries' (orbax, tfds, JAX, clu) only at or above the level chosen, and tfds's progress bars
(a first run's data preparation) only at ``info`` and ``debug``. ``debug`` also passes the
records of loggers a library turned to DEBUG (e.g. JAX's compiler under
``JAX_DEBUG_LOG_MODULES``)."""

import functools
import logging
import os
import sys

import tensorflow_datasets as tfds
from absl import logging as absl_logging

LOG_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
              "error": logging.ERROR}
_CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PROJECT_TOPS = ("postnorm", "main.py", "experiments", "configs", "benchmarks")


@functools.cache
def is_project_file(path: str) -> bool:
    """``path`` is one of the project's own sources (not a library's, even in a venv inside
    the checkout), or the script the process runs."""
    path = os.path.abspath(path)
    script = getattr(sys.modules.get("__main__"), "__file__", None)
    if script and path == os.path.abspath(script):
        return True
    rel = os.path.relpath(path, _CHECKOUT)
    return not rel.startswith(os.pardir) and rel.split(os.sep)[0] in _PROJECT_TOPS


class ThirdPartyFilter(logging.Filter):
    """Passes the project's own records, and other sources' at or above ``name`` (a
    ``LOG_LEVELS`` key)."""

    def __init__(self, name: str):
        super().__init__()
        self.level_name, self.level = name, LOG_LEVELS[name]

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= self.level or is_project_file(record.pathname)


def set_log_level(level: str) -> None:
    """Show other libraries' log records from ``level`` (a ``LOG_LEVELS`` key) up on absl's
    handler, which prints every record of the process; replaces an earlier setting."""
    tfds.display_progress_bar(LOG_LEVELS[level] <= logging.INFO)
    handler = absl_logging.get_absl_handler()
    for old in [f for f in handler.filters if isinstance(f, ThirdPartyFilter)]:
        handler.removeFilter(old)
    handler.addFilter(ThirdPartyFilter(level))


def current_log_level() -> str | None:
    """The level ``set_log_level`` last set in this process (None: never), for a worker process
    to set the same."""
    chosen = [f for f in absl_logging.get_absl_handler().filters
              if isinstance(f, ThirdPartyFilter)]
    return chosen[-1].level_name if chosen else None


def most_verbose(levels) -> str:
    """The most verbose of ``levels`` (``LOG_LEVELS`` keys), e.g. for a sweep of runs."""
    return min(levels, key=LOG_LEVELS.__getitem__)
