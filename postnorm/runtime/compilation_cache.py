"""JAX's persistent compilation cache (``runtime.compilation_cache_dir``)."""

import os

import jax
from absl import logging

from postnorm.errors import UserError
from postnorm.files import make_writable_dir

_directory_in_use: str | None = None  # the directory this process set, once set


class CompilationCacheError(UserError, RuntimeError):
    """``runtime.compilation_cache_dir`` cannot be used; the message names the field and fix."""


def use_compilation_cache(directory: str) -> None:
    """Turn the cache on at ``directory`` (``~`` expanded, created if missing); nothing
    changes when ``directory`` is empty.

    One directory serves a process (JAX opens it at the first compilation after it is set and
    keeps it), so asking for another one later in the same process is an error.
    """
    if not directory:
        return
    field = f"runtime.compilation_cache_dir={directory!r}"
    if "://" in directory:
        raise CompilationCacheError(f"{field}: only local or mounted directories are supported; "
                                    "mount the bucket and give its path")
    global _directory_in_use
    path = os.path.abspath(os.path.expanduser(directory))
    if _directory_in_use not in (None, path):
        raise CompilationCacheError(f"{field}: this process already uses the compilation cache "
                                    f"at {_directory_in_use}, and one serves a process; run the "
                                    "config in a new process or give it the same directory")
    try:
        make_writable_dir(path)
    except OSError as err:
        raise CompilationCacheError(
            f"{field}: {path} cannot be created or written ({err.strerror or err}); point it at "
            "a writable directory or set it to '' to compile without the cache") from err
    jax.config.update("jax_compilation_cache_dir", path)
    _directory_in_use = path
    logging.info("compilation cache: %s (%d compiled programs)", path,
                 sum(name.endswith("-cache") for name in os.listdir(path)))
