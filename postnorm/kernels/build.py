"""Compile the C++ kernels once per source, compiler, target, jaxlib and CPU; register them."""

import ctypes
import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jaxlib

from postnorm.errors import UserError

KERNEL_DIR = Path(__file__).resolve().parent
BUILD_DIR = KERNEL_DIR / "_build"
ATTENTION_SOURCE = KERNEL_DIR / "causal_attention_cpu.cc"
COMPILERS = ("c++", "g++", "clang++")
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-w")
NATIVE = "native"  # -march: this CPU's instruction sets, which choose the kernel's vector width
FFI_TARGETS = {"postnorm_causal_attention_fwd": "PostnormCausalAttentionForward",
               "postnorm_causal_attention_fwd_stats": "PostnormCausalAttentionForwardStats",
               "postnorm_causal_attention_bwd": "PostnormCausalAttentionBackward"}

_registered: dict[str, str] = {}  # FFI target -> the -march of the library registered for it


class KernelBuildError(UserError, RuntimeError):
    """The C++ kernel could not be compiled or loaded; the message says what would fix it."""


def find_compiler() -> str | None:
    """The first C++ compiler of ``COMPILERS`` on the PATH."""
    return next((path for name in COMPILERS if (path := shutil.which(name))), None)


def cpu_flags() -> str:
    """The CPU's feature flags (``/proc/cpuinfo``), or the machine name where there are none:
    ``-march=native`` code is only valid on a CPU with the same features."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.machine() + platform.processor()


def compile_flags(march: str) -> tuple[str, ...]:
    return (*FLAGS, f"-march={march}")


def build_key(source: Path, compiler: str, march: str = NATIVE) -> str:
    """A hash of the source, the compiler's version, the flags, jaxlib and the CPU."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    parts = (source.read_bytes(), version.encode(), " ".join(compile_flags(march)).encode(),
             jaxlib.__version__.encode(), cpu_flags().encode())
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part)
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def build(source: Path = ATTENTION_SOURCE, compiler: str | None = None,
          build_dir: Path = BUILD_DIR, march: str = NATIVE) -> Path:
    """The shared library of ``source`` for the CPU target ``march`` (``-march``; by default
    this CPU), compiled unless an identical build exists."""
    compiler = compiler or find_compiler()
    if compiler is None or shutil.which(compiler) is None:
        raise KernelBuildError(
            f"model.attention='cpu' compiles {source.name} with a C++17 compiler, but "
            f"{compiler or ' / '.join(COMPILERS)} is not on the PATH: install one (e.g. "
            "apt-get install g++) or set model.attention=blocked")
    library = build_dir / f"{source.stem}-{build_key(source, compiler, march)}.so"
    if library.exists():
        return library
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        lock = open(build_dir / ".lock", "w")  # noqa: SIM115 (held for the whole build)
    except OSError as err:
        raise KernelBuildError(f"model.attention='cpu' builds its kernel in {build_dir}, which "
                               f"is not writable ({err}); make it writable or set "
                               "model.attention=blocked") from err
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # processes starting at once compile it once
        if not library.exists():
            _compile(source, compiler, library, march)
    return library


def _compile(source: Path, compiler: str, library: Path, march: str) -> None:
    """Compile to a temporary file and rename it, readable by every user, to ``library``."""
    fd, partial = tempfile.mkstemp(dir=library.parent, suffix=".so.partial")
    os.close(fd)
    command = [compiler, *compile_flags(march), f"-I{jax.ffi.include_dir()}", str(source), "-o",
               partial]
    try:
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise KernelBuildError(f"compiling {source} failed ({' '.join(command)}):\n"
                                   f"{result.stderr.strip()[-2000:]}\nset "
                                   "model.attention=blocked to train without it")
        os.chmod(partial, 0o755)  # mkstemp made it private to this user
        os.replace(partial, library)
    except OSError as err:
        raise KernelBuildError(f"compiling {source} with {compiler} failed ({err}); set "
                               "model.attention=blocked to train without it") from err
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def register_attention_kernels(compiler: str | None = None, march: str | None = None) -> None:
    """Build (if needed) and register the CPU attention kernel's FFI targets, once a process:
    for the CPU target ``march`` (``-march``), or without one for this CPU, unless a build
    for another target is registered already (tests and benchmarks register one first)."""
    if set(FFI_TARGETS) <= set(_registered):
        registered = _registered[next(iter(FFI_TARGETS))]
        if march not in (None, registered):
            raise KernelBuildError(f"this process registered the C++ kernel built for "
                                   f"-march={registered}, not -march={march}: one build serves "
                                   "a process")
        return
    march = march or NATIVE
    path = build(ATTENTION_SOURCE, compiler, march=march)
    try:
        library = ctypes.cdll.LoadLibrary(str(path))
    except OSError as err:
        raise KernelBuildError(f"loading {path} failed ({err}); delete it to rebuild it, or set "
                               "model.attention=blocked") from err
    for target, symbol in FFI_TARGETS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)),
                                    platform="cpu")
        _registered[target] = march


def registered_march() -> str | None:
    """The ``-march`` of the kernel this process registered; None before it registers one."""
    return _registered.get(next(iter(FFI_TARGETS)))
