"""JAX's persistent compilation cache (``runtime.compilation_cache_dir``; empty: off).

JAX keys each cached program on its HLO, the compile options, the devices and the jax/jaxlib
versions, so a process whose programs match an earlier process's (a resumed or restarted run,
another seed of a sweep, the same config run again) loads them instead of compiling them. A
program whose HLO differs (another shape, learning rate or model setting) misses and is
compiled as usual. JAX writes only programs that took at least a second to compile, and in a
multi-process run only process 0 writes: give every host the same directory (a shared file
system, or a ``gs://`` path) so that all of them read what it wrote.

Entries are executable code: a directory others can write to lets them run code as you.
"""

import os
import tempfile

import jax
from absl import logging


class CompilationCacheError(RuntimeError):
    """``runtime.compilation_cache_dir`` cannot be used; the message names the field and fix."""


def use_compilation_cache(directory: str) -> str | None:
    """Turn the cache on at ``directory`` (``~`` expanded, created if missing) and return its
    absolute path; None, and nothing changes, when ``directory`` is empty. A URL
    (``gs://bucket/dir``) is passed to JAX as it is.

    Call before the process compiles anything with another cache directory: JAX opens the
    cache at the first compilation after one is set, and keeps it for the process.
    """
    if not directory:
        return None
    if "://" in directory:
        jax.config.update("jax_compilation_cache_dir", directory)
        logging.info("compilation cache: %s", directory)
        return directory
    path = os.path.abspath(os.path.expanduser(directory))
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as err:
        raise CompilationCacheError(
            f"runtime.compilation_cache_dir={directory!r}: {path} cannot be created or written "
            f"({err.strerror or err}); point it at a writable directory or set it to '' to "
            "compile without the cache") from err
    jax.config.update("jax_compilation_cache_dir", path)
    logging.info("compilation cache: %s (%d compiled programs)", path,
                 sum(name.endswith("-cache") for name in os.listdir(path)))
    return path

