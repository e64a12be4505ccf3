"""The process's heap allocator (``runtime.allocator``): glibc's, or tcmalloc preloaded."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

from absl import logging

from postnorm.errors import UserError

ALLOCATORS = ("auto", "system", "tcmalloc")
TCMALLOC_LIBRARIES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
LIBRARY_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64",
                "/usr/lib", "/usr/local/lib")
# gperftools reports every allocation above 1 GiB on stderr by default; the paper-scale
# programs' temporaries are larger than that on every call.
QUIET_LARGE_ALLOCATIONS = {"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(1 << 62)}
# Set in the re-executed process's environment (to the preloaded library's path).
REEXECUTED = "POSTNORM_ALLOCATOR_PRELOADED"


class AllocatorError(UserError, RuntimeError):
    """``runtime.allocator`` cannot be honoured; the message names the field and the fix."""


def loaded_allocator(maps: Path = Path("/proc/self/maps")) -> str:
    """``tcmalloc`` if a tcmalloc library is mapped into this process, else ``system``."""
    try:
        text = maps.read_text()
    except OSError:
        return "system"
    return "tcmalloc" if "/libtcmalloc" in text else "system"


def find_tcmalloc(directories: Sequence[str] = LIBRARY_DIRS) -> str | None:
    """Path of the first tcmalloc library in ``directories``, or None."""
    for directory in directories:
        for name in TCMALLOC_LIBRARIES:
            path = os.path.join(directory, name)
            if os.path.isfile(path):
                return path
    return None


def preload_command(library: str, environ: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """This process's command line (interpreter options included) and ``environ`` with
    ``library`` first in ``LD_PRELOAD`` and the re-execution marked (``REEXECUTED``)."""
    preload = " ".join(filter(None, (library, environ.get("LD_PRELOAD", ""))))
    return ([sys.executable, *sys.orig_argv[1:]],
            {**QUIET_LARGE_ALLOCATIONS, **environ, "LD_PRELOAD": preload, REEXECUTED: library})


def use_allocator(choice: str, directories: Sequence[str] = LIBRARY_DIRS) -> str:
    """Returns the allocator in use, after re-executing this process under tcmalloc if
    ``choice`` asks for it and it is not loaded yet. Call before any JAX computation."""
    if choice not in ALLOCATORS:
        raise AllocatorError(f"runtime.allocator={choice!r} is invalid: must be one of "
                             f"{list(ALLOCATORS)}")
    current = loaded_allocator()
    if choice == "system" or current == "tcmalloc":
        return current
    if REEXECUTED in os.environ:  # re-executed once already: never loop
        ignored = (f"{os.environ[REEXECUTED]} was preloaded, but the loader did not map it "
                   "(see its message above, if any)")
        if choice == "auto":
            logging.warning("runtime.allocator='auto': %s; staying on the system allocator",
                            ignored)
            return current
        raise AllocatorError(f"runtime.allocator='tcmalloc': {ignored}; set "
                             "runtime.allocator=auto or system")
    library = find_tcmalloc(directories)
    if library is None:
        if choice == "auto":
            return current
        raise AllocatorError(
            f"runtime.allocator='tcmalloc', but none of {list(TCMALLOC_LIBRARIES)} is in "
            f"{list(directories)}. Install it (Debian/Ubuntu: apt install libtcmalloc-minimal4) "
            "or set runtime.allocator=auto or system")
    argv, env = preload_command(library, dict(os.environ))
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(argv[0], argv, env)  # replaces this process
    except OSError as e:
        raise AllocatorError(f"runtime.allocator={choice!r}: re-executing {argv[0]} with "
                             f"{library} preloaded failed ({e}); set runtime.allocator=system"
                             ) from e
