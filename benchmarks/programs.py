"""The model's compiled programs on a random token batch, timed one call at a time.

Shared by the benchmarks: ``train`` (the jitted, guarded, donating train step the trainer
runs), ``diag`` (the diagnostic step) and ``forward`` (the logits at initialisation).
"""

import os
import pathlib
import re
import resource
import time

import jax
import ml_collections
import numpy as np
from absl import flags

from postnorm.data import check_batch_shape
from postnorm.kernels.build import NATIVE, register_attention_kernels, registered_march
from postnorm.model import Decoder
from postnorm.model.flops import forward_flops_per_token, train_flops_per_token
from postnorm.runtime.mesh import batch_sharding
from postnorm.runtime.xla_options import XlaOptions
from postnorm.train.programs import build_programs
from postnorm.train.validate import check_all_but_data

PROGRAMS = ("train", "diag", "forward")
flags.DEFINE_string("kernel_march", None, "Build the C++ attention kernel for this -march (e.g. "
                    "haswell: its AVX2 code) instead of this CPU's own.")
THP_SETTING = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")
CPUINFO = pathlib.Path("/proc/cpuinfo")
# The vector and matrix instruction sets a CPU step's speed depends on, as /proc/cpuinfo names them
CPU_ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


def compile_afresh() -> None:
    """Keep JAX's persistent compilation cache (which the environment can turn on) off in this
    process, so that ``Program.compile_s`` times a compile. Call before anything compiles."""
    jax.config.update("jax_enable_compilation_cache", False)


def transparent_hugepage_mode() -> str | None:
    """The kernel's transparent huge page mode (always, madvise or never); None off Linux.

    Under glibc's allocator XLA's CPU runtime maps each call's temporary buffer afresh, so
    every 4 KiB page of it faults on first touch in every call unless the kernel backs it with
    huge pages ("always"; under "madvise" only memory that asks for them is), which
    docs/PERFORMANCE.md measures.
    """
    try:
        return re.search(r"\[(\w+)\]", THP_SETTING.read_text()).group(1)
    except (OSError, AttributeError):
        return None


def cpu_description() -> dict[str, object]:
    """The CPU the benchmark ran on: its model name, the cores this process may use, and which
    of ``CPU_ISA_FLAGS`` it has (``None`` for what /proc/cpuinfo does not say, e.g. off Linux).

    The ranking of CPU settings, and the gap to other frameworks, differ between CPUs
    (docs/PERFORMANCE.md), so every benchmark record names its CPU.
    """
    try:
        text = CPUINFO.read_text()
    except OSError:
        text = ""
    model = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
    flags = re.search(r"^flags\s*:\s*(.*)$", text, re.M)
    present = set(flags.group(1).split()) if flags else None
    return {"model": model.group(1).strip() if model else None,
            "kernel_march": registered_march(),  # the C++ kernel's target, once it is built
            "cores": (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                      else os.cpu_count()),
            "isa": None if present is None else [f for f in CPU_ISA_FLAGS if f in present]}


def use_kernel_march() -> None:
    """Build and register the C++ kernel for ``--kernel_march`` before anything else does."""
    if flags.FLAGS.kernel_march not in (None, NATIVE):
        register_attention_kernels(march=flags.FLAGS.kernel_march)


def minor_page_faults() -> int:
    """Minor page faults of this process so far, all threads."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def memory_analysis(compiled) -> dict[str, int]:
    """XLA's buffer sizes; the peak estimate counts arguments, outputs and temporaries once."""
    a = compiled.memory_analysis()
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
              "temp_size_in_bytes")
    out = {f: int(getattr(a, f)) for f in fields}
    out["peak_estimate_bytes"] = (out["argument_size_in_bytes"] + out["output_size_in_bytes"]
                                  - out["alias_size_in_bytes"] + out["temp_size_in_bytes"])
    return out


def device_memory() -> dict[str, int] | None:
    """The first device's allocator statistics (accelerators; ``None`` on CPU)."""
    stats = jax.devices()[0].memory_stats()
    if not stats:
        return None
    keys = ("peak_bytes_in_use", "bytes_in_use", "bytes_limit")
    return {k: int(stats[k]) for k in keys if k in stats}


class Program:
    """One compiled program, the arguments it runs on, and its model FLOPs per call."""

    def __init__(self, jitted, args: tuple, flops: int, carries_state: bool):
        start = time.perf_counter()
        self.compiled = jitted.lower(*args).compile()
        self.compile_s = time.perf_counter() - start  # tracing, lowering and XLA compilation
        self.args, self.flops, self.carries_state = args, flops, carries_state
        self.times: list[float] = []
        self.page_faults: list[int] = []

    def warm_up(self) -> None:
        """One untimed call (the first call of a program pays one-off costs)."""
        self.run()
        self.times.clear()
        self.page_faults.clear()

    def run(self) -> None:
        """Time one call and count its page faults; a step's new state replaces the donated
        old one."""
        faults, start = minor_page_faults(), time.perf_counter()
        result = jax.block_until_ready(self.compiled(*self.args))
        self.times.append(time.perf_counter() - start)
        self.page_faults.append(minor_page_faults() - faults)
        if self.carries_state:
            self.args = (result[0],) + self.args[1:]


def check_benchmark_config(config: ml_collections.ConfigDict) -> None:
    """A run's config checks (``postnorm.train.validate``), less the data source's: the batches
    are random tokens of the config's shape. ``ConfigError`` or ``DataError`` names a bad
    field."""
    check_all_but_data(config, device_count=jax.device_count())
    check_batch_shape(config.data)


def random_tokens(config: ml_collections.ConfigDict, vocab: int) -> np.ndarray:
    """The benchmarks' batch: [batch_size, seq_len + 1] tokens, inputs and targets shifted."""
    shape = (config.data.batch_size, config.data.seq_len + 1)
    return np.random.default_rng(0).integers(0, vocab, shape, np.int32)


def random_batch(config: ml_collections.ConfigDict, vocab: int, mesh) -> dict[str, jax.Array]:
    """``random_tokens`` as the steps' ``{inputs, targets}`` batch, sharded over ``mesh``."""
    tokens = random_tokens(config, vocab)
    return {k: jax.device_put(v, batch_sharding(mesh))
            for k, v in (("inputs", tokens[:, :-1]), ("targets", tokens[:, 1:]))}


def timed_programs(config: ml_collections.ConfigDict, names: list[str], vocab: int,
                   xla_options: XlaOptions | None = None) -> tuple[dict[str, Program], dict]:
    """The programs in ``names`` order (from ``PROGRAMS``), built as the trainer builds them
    (``postnorm.train.programs.build_programs``), and a description of the model and batch:
    random tokens of the config's batch shape over ``vocab``. They compile with
    ``xla_options`` (default: the config's ``runtime.xla_options``)."""
    built = build_programs(config, vocab, xla_options=xla_options)
    spec, steps, options = built.spec, built.steps, built.xla_options
    seq_len, batch_size = config.data.seq_len, config.data.batch_size
    batch = random_batch(config, vocab, built.mesh)
    n_tokens = batch_size * seq_len
    programs = {}
    for name in {"train", "diag"} & set(names):
        programs[name] = Program(getattr(steps, name), (steps.init(config.seed), batch),
                                 train_flops_per_token(spec, seq_len) * n_tokens, True)
    if "forward" in names:
        model = Decoder(spec)
        params = jax.jit(lambda key: model.init(key, batch["inputs"])["params"])(
            jax.random.key(config.seed))
        forward = jax.jit(lambda p, x: model.apply({"params": p}, x),
                          compiler_options=options or None)
        programs["forward"] = Program(forward, (params, batch["inputs"]),
                                      forward_flops_per_token(spec, seq_len) * n_tokens, False)
    model_info = {"n_layers": spec.n_layers, "d_model": spec.d_model, "d_ff": spec.d_ff,
                  "n_heads": spec.n_heads, "vocab_size": vocab, "seq_len": seq_len,
                  "batch_size": batch_size, "norm": spec.norm, "dtype": spec.dtype,
                  "attention": spec.attention, "remat": spec.remat,
                  "tokens_per_call": n_tokens}
    return {n: programs[n] for n in names}, model_info
