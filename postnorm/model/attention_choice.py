"""Which attention kernel can run where, and ``model.attention=auto``'s choice among them."""

import contextlib
import dataclasses
import functools
import hashlib
import json
import os

import jax
import jax.numpy as jnp
import jaxlib

from postnorm.files import FileWriteError, lock_exclusively, write_json_atomic
from postnorm.kernels.build import (
    BUILD_DIR,
    NATIVE,
    KernelBuildError,
    register_attention_kernels,
    registered_march,
)
from postnorm.kernels.build import build as build_kernel
from postnorm.kernels.causal_attention import HEAD_DIMS
from postnorm.model.decoder import layer_class
from postnorm.model.placements import PLACEMENTS
from postnorm.model.spec import ModelSpec
from postnorm.timing import interleaved_median_s

AUTO = "auto"
# What to set instead of a kernel that cannot run.
ALTERNATIVES = {"cpu": "model.attention=auto or blocked", "cudnn": "model.attention=auto or xla"}
# The CPU kernels the probe times: einsum is blocked with one block of all rows, which the
# blocked kernel never beats at a length longer than its block, where it skips masked blocks.
PROBED = ("cpu", "blocked")
PROBE_ROUNDS = 7
PROBE_CACHE = BUILD_DIR / "attention_choice.json"


def config_refusal(kernel: str, *, dtype: str, d_model: int, n_heads: int) -> str | None:
    """Why ``kernel`` cannot compute this model's attention (its dtype or head dim); None
    when it can."""
    head_dim = d_model // n_heads
    if kernel == "cpu" and dtype != "float32":
        return f"model.attention='cpu' computes in float32, but model.dtype={dtype!r}"
    if kernel == "cpu" and head_dim > HEAD_DIMS[-1]:
        return (f"model.attention='cpu' takes head dims up to {HEAD_DIMS[-1]}, but "
                f"model.d_model/model.n_heads = {d_model}/{n_heads} = {head_dim}")
    if kernel == "cudnn" and dtype != "bfloat16":
        return ("model.attention='cudnn' needs model.dtype='bfloat16' (cuDNN attention has no "
                "float32 kernel)")
    return None


def backend_refusal(kernel: str, *, platform: str) -> str | None:
    """Why ``kernel`` cannot run on ``platform`` (``jax.default_backend()``); None when it can."""
    if kernel == "cpu" and platform != "cpu":
        return f"model.attention='cpu' is a CPU kernel, but JAX runs on {platform!r}"
    if kernel == "cudnn" and platform != "gpu":
        return f"model.attention='cudnn' needs a GPU, but JAX runs on {platform!r}"
    return None


def unrunnable(kernel: str, spec: ModelSpec, platform: str) -> str | None:
    """Why ``kernel`` cannot run ``spec``'s attention here; None when it can. The C++ kernel is
    built to find out."""
    why = (config_refusal(kernel, dtype=spec.dtype, d_model=spec.d_model, n_heads=spec.n_heads)
           or backend_refusal(kernel, platform=platform))
    if why is None and kernel == "cpu":
        try:
            register_attention_kernels()
        except KernelBuildError as err:
            why = f"the C++ CPU kernel cannot be built here ({err})"
    return why


def layer_step_seconds(spec: ModelSpec, batch: int, kernels: tuple[str, ...],
                       rounds: int = PROBE_ROUNDS,
                       xla_options: dict | None = None) -> dict[str, float]:
    """Median seconds of one layer's forward and backward (the decoder's layer under
    ``spec.remat``, the gradients of its parameters and input) on ``batch`` sequences, per
    kernel, interleaved; compiled with ``xla_options``."""
    x_BxLxD = jax.random.normal(jax.random.key(0), (batch, spec.max_len, spec.d_model))
    profile_Lx2 = PLACEMENTS[spec.norm].post_mix(spec)  # the first layer's lambda, if any
    mix_2 = None if profile_Lx2 is None else jnp.asarray(profile_Lx2[0], jnp.float32)
    fns, args = {}, {}
    for kernel in kernels:
        layer = layer_class(spec)(dataclasses.replace(spec, attention=kernel))
        params = layer.init(jax.random.key(1), x_BxLxD, None, mix_2)

        def loss(params, x_BxLxD, layer=layer):
            return jnp.sum(layer.apply(params, x_BxLxD, None, mix_2)[0].astype(jnp.float32))

        step = jax.jit(jax.grad(loss, argnums=(0, 1)), compiler_options=xla_options or None)
        fns[kernel] = step.lower(params, x_BxLxD).compile()
        args[kernel] = (params, x_BxLxD)
    interleaved_median_s(fns, args, repeats=1)  # warm up
    return interleaved_median_s(fns, args, repeats=rounds)


def _probe_key(spec: ModelSpec, batch: int, xla_options: dict | None) -> str:
    """What the fastest kernel depends on: the C++ kernel's build (its source, compiler, CPU
    and jaxlib), the threads, the XLA options, and the layer's shapes and settings."""
    shape = {k: getattr(spec, k) for k in ("max_len", "d_model", "n_heads", "d_ff", "positions",
                                           "dtype", "attention_block", "remat", "norm")}
    parts = {"kernel": build_kernel(march=registered_march() or NATIVE).name,
             "jaxlib": jaxlib.__version__, "batch": batch,
             "threads": len(os.sched_getaffinity(0)), "xla_options": xla_options or {}, **shape}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def _valid(seconds: object) -> bool:
    """A cache entry: a finite positive time for each probed kernel."""
    return (isinstance(seconds, dict) and set(seconds) == set(PROBED)
            and all(isinstance(s, int | float) and 0 < s < float("inf")
                    for s in seconds.values()))


def probe_cpu_kernels(spec: ModelSpec, batch: int,
                      xla_options: dict | None = None) -> dict[str, float]:
    """``layer_step_seconds`` of ``PROBED`` for ``spec`` and ``batch``, measured once per CPU,
    build, thread count, XLA options and shape and cached in ``PROBE_CACHE`` (under a lock, so
    processes starting together measure once; without a writable or readable cache each
    process measures, and a damaged entry is measured again)."""
    key = _probe_key(spec, batch, xla_options)
    measure = functools.partial(layer_step_seconds, spec, batch, PROBED,
                                xla_options=xla_options)
    try:
        os.makedirs(BUILD_DIR, exist_ok=True)
        lock = open(BUILD_DIR / ".probe.lock", "w")  # noqa: SIM115 (held while measuring)
    except OSError:
        return measure()
    with lock:
        lock_exclusively(lock.fileno(), str(BUILD_DIR / ".probe.lock"), wait=True)
        try:
            cached = json.loads(PROBE_CACHE.read_text())
        except FileNotFoundError:
            cached = {}
        except (OSError, ValueError):  # unreadable: measured, and the file left as it is
            return measure()
        cached = cached if isinstance(cached, dict) else {}
        if _valid(cached.get(key)):
            return cached[key]
        seconds = measure()
        with contextlib.suppress(FileWriteError):  # not cached: measured again next time
            write_json_atomic(PROBE_CACHE, {**cached, key: seconds})
        return seconds


def choose_attention(spec: ModelSpec, *, batch: int, platform: str,
                     recorded: str | None = None,
                     xla_options: dict | None = None) -> tuple[str, str]:
    """(kernel, why) for ``model.attention=auto``: ``spec``'s attention on ``batch`` sequences
    per device on ``platform`` (``spec.attention`` is ignored).

    ``recorded`` (the kernel a resumed run started with) wins where it can run. On the CPU,
    where the C++ kernel can run, the faster of it and ``blocked`` in one layer's forward and
    backward at these shapes, compiled with ``xla_options`` (``probe_cpu_kernels``), else
    ``blocked``; on a GPU, cuDNN's
    fused kernel in bfloat16, else ``blocked``; elsewhere ``blocked``, which XLA compiles
    everywhere and which skips the masked half of the score blocks.
    """
    before = ""
    if recorded not in (None, AUTO):
        why_not = unrunnable(recorded, spec, platform)
        if why_not is None:
            return recorded, "the kernel the run started with (its config.json)"
        before = f"the run started with {recorded!r}, which cannot run here ({why_not}); "
    if platform == "cpu":
        why_not = unrunnable("cpu", spec, platform)
        if why_not is not None:
            return "blocked", before + why_not
        seconds = probe_cpu_kernels(spec, batch, xla_options)
        fastest = min(PROBED, key=seconds.get)
        times = ", ".join(f"{k} {seconds[k] * 1e3:.2f} ms" for k in PROBED)
        return fastest, (before + f"the faster on this CPU in one layer's forward and backward "
                         f"at this config's shapes ({times})")
    if unrunnable("cudnn", spec, platform) is None:
        return "cudnn", before + "cuDNN's fused attention on a GPU in bfloat16"
    return "blocked", before + f"the blocked XLA kernel on {platform!r} in {spec.dtype}"
