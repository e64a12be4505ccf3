"""Step time, throughput, MFU, compile time and memory of the model's programs.

    python -m benchmarks.bench --config configs/default.py
    python -m benchmarks.bench --config configs/paper.py:width12 --programs train
    python -m benchmarks.bench --config configs/paper.py:data.batch_size=1 --programs forward
    python -m benchmarks.bench --config configs/default.py --programs train \
        --variant model.remat=none --variant model.remat=dots

Programs (``--programs``, comma-separated):

* ``train``: the jitted, guarded, donating train step the trainer runs;
* ``diag``: the diagnostic step (the train step plus per-layer statistics);
* ``forward``: the logits of one batch at initialisation (no gradient).

Each program is compiled for the config's model on a random token batch of the config's shape
(``--vocab_size`` defaults to ``data.vocab_size``). ``--variant`` (repeatable) applies the
config file's named variants and ``key=value`` overrides, written as after the file's colon
(``pre,model.remat=none``), to the config; every variant's programs then run side by side, and
each program's time is also reported as a ratio to the first variant's. ``--xla_options``
(repeatable) compiles every variant once per set of XLA compile options, applied over the
config's ``runtime.xla_options`` (``postnorm.runtime.xla_options``), so XLA settings compare side by
side in one process too (they are per compilation, unlike ``XLA_FLAGS``):

    python -m benchmarks.bench --config configs/default.py --programs train \
        --xla_options '' --xla_options xla_cpu_copy_insertion_use_region_analysis=false

The machine's peak is measured in the same run: a square matmul (``--peak_size``, in
``--peak_dtype``: float32 on CPU, bfloat16 for an accelerator's tensor cores),
called ``--peak_calls`` times back to back in each repeat, the fastest call counting for that
repeat (the first calls after a long program run slower while threads wake). Repeats are
interleaved (peak, then every program once), so every figure sees the same machine load; each
timing ends with a device sync. Model FLOPs follow ``postnorm.model.flops``; MFU is the achieved
model FLOP/s over the median measured peak (and, with ``--nominal_peak_tflops``, also over a
datasheet peak). Memory: XLA's memory analysis of each compiled program, and
the process's resident set (current, and lifetime peak including compilation). Also the minor
page faults of each call (median, ``minor_page_faults``), the kernel's transparent huge page
mode (``transparent_hugepages``) and the heap allocator (``allocator``, from the config's
``runtime.allocator``; the same for every variant): under glibc's allocator XLA's CPU runtime
maps each call's temporaries afresh, so they fault page by page (docs/PERFORMANCE.md). The
record names the CPU (``cpu``: ``benchmarks.programs.cpu_description``). Every
program is compiled afresh (JAX's persistent compilation cache is kept off), so ``compile_s``
times a compile. Prints JSON.
"""

import copy
import json
import resource
import statistics

import jax
import jax.numpy as jnp
import psutil
from absl import app, flags
from ml_collections import config_flags

from benchmarks.programs import (
    PROGRAMS,
    check_benchmark_config,
    compile_afresh,
    cpu_description,
    device_memory,
    memory_analysis,
    timed_programs,
    transparent_hugepage_mode,
    use_kernel_march,
)
from benchmarks.timing import timed
from postnorm.config.args import ConfigArgError, apply_arg, config_file_variants, parse_flags
from postnorm.errors import exit_on_error
from postnorm.runtime.allocator import use_allocator
from postnorm.runtime.xla_options import XlaOptionsError, compiler_options

config_flags.DEFINE_config_file("config", "configs/default.py", "Config file.")
flags.DEFINE_list("programs", ["train", "diag"], f"Programs to time, from {list(PROGRAMS)}.")
flags.DEFINE_multi_string("variant", [""], "Config variants and overrides, as after the config "
                           "file's colon (pre,a.b=v); repeat to compare.")
flags.DEFINE_multi_string("xla_options", [""], "XLA compile options, name=value separated by "
                          "spaces (e.g. xla_cpu_enable_fast_math=true), over the config's "
                          "runtime.xla_options; repeat to compare sets side by side. Each set "
                          "applies to every variant; '' adds nothing.")
flags.DEFINE_integer("repeats", 5, "Timed repeats of each program (after one warm-up).",
                     lower_bound=1)
flags.DEFINE_integer("vocab_size", 0, "Vocabulary size; 0: data.vocab_size.", lower_bound=0)
flags.DEFINE_integer("peak_size", 2048, "Side of the square float32 matmul that measures peak.",
                     lower_bound=1)
flags.DEFINE_integer("peak_calls", 5, "Back-to-back peak matmuls per repeat; the fastest counts.",
                     lower_bound=1)
flags.DEFINE_enum("peak_dtype", "float32", ["float32", "bfloat16"], "Dtype of the peak matmul.")
flags.DEFINE_float("nominal_peak_tflops", 0.0, "Datasheet peak, TFLOP/s; 0: not reported.")
FLAGS = flags.FLAGS


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    unknown = sorted(set(FLAGS.programs) - set(PROGRAMS))
    if unknown or not FLAGS.programs:
        raise app.UsageError(f"--programs={FLAGS.programs}: choose one or more of "
                             f"{list(PROGRAMS)}")
    for name in ("variant", "xla_options"):
        if len(set(FLAGS[name].value)) < len(FLAGS[name].value):
            raise app.UsageError(f"--{name}: each once, not {FLAGS[name].value}")
    check_benchmark_config(FLAGS.config)
    allocator = use_allocator(FLAGS.config.runtime.allocator)  # may re-execute this command
    compile_afresh()
    use_kernel_march()
    base_options = compiler_options(FLAGS.config.runtime.xla_options)
    option_sets = {}
    for text in FLAGS.xla_options:
        try:
            option_sets[text] = base_options | compiler_options(text, f"--xla_options={text!r}")
        except XlaOptionsError as err:
            raise app.UsageError(str(err)) from err
    named = config_file_variants(config_flags.get_config_filename(FLAGS["config"]))
    variants, models, labels = {}, {}, {}
    for overrides in FLAGS.variant:
        try:
            config = apply_arg(copy.deepcopy(FLAGS.config), overrides, named)
        except ConfigArgError as err:
            raise app.UsageError(f"--variant={overrides!r}: {err}") from err
        if config.runtime != FLAGS.config.runtime:
            raise app.UsageError(f"--variant={overrides!r}: runtime.* is one per process; "
                                 "compare runtime.xla_options with --xla_options, and the rest "
                                 "in separate runs (--config FILE:runtime.allocator=X)")
        check_benchmark_config(config)
        for text, options in option_sets.items():
            label = overrides
            if len(option_sets) > 1:
                label += f" | xla: {text or 'config'}"
            labels[label] = options
            variants[label], models[label] = timed_programs(
                config, FLAGS.programs, FLAGS.vocab_size or config.data.vocab_size, options)

    n = FLAGS.peak_size
    a_NxN = jax.random.normal(jax.random.key(1), (n, n), jnp.dtype(FLAGS.peak_dtype))
    matmul = jax.jit(lambda x: x @ x).lower(a_NxN).compile()
    all_programs = [p for programs in variants.values() for p in programs.values()]
    for program in all_programs:
        program.warm_up()
    peak_times = []
    for _ in range(FLAGS.repeats):
        peak_times.append(min(timed(lambda: matmul(a_NxN)) for _ in range(FLAGS.peak_calls)))
        for program in all_programs:
            program.run()

    peak_flops_s = 2 * n**3 / statistics.median(peak_times)
    first = next(iter(variants.values()))
    results = {}
    for overrides, programs in variants.items():
        tokens = models[overrides]["tokens_per_call"]
        results[overrides] = {"model": models[overrides], "xla_options": labels[overrides],
                              "programs": {}}
        for name, program in programs.items():
            median = statistics.median(program.times)
            achieved = program.flops / median
            results[overrides]["programs"][name] = {
                "median_s": median, "min_s": min(program.times), "max_s": max(program.times),
                "time_vs_first_variant": median / statistics.median(first[name].times),
                "tokens_per_s": tokens / median, "model_gflop": program.flops / 1e9,
                "achieved_gflop_s": achieved / 1e9, "mfu": achieved / peak_flops_s,
                "compile_s": program.compile_s, "memory": memory_analysis(program.compiled),
                "minor_page_faults": statistics.median(program.page_faults)}
            if FLAGS.nominal_peak_tflops:
                results[overrides]["programs"][name]["mfu_vs_nominal"] = (
                    achieved / (FLAGS.nominal_peak_tflops * 1e12))
    print(json.dumps({
        "platform": jax.default_backend(), "devices": jax.device_count(), "cpu": cpu_description(),
        "repeats": FLAGS.repeats, "transparent_hugepages": transparent_hugepage_mode(),
        "allocator": allocator,
        "peak": {"matmul_size": n, "dtype": FLAGS.peak_dtype,
                 "median_s": statistics.median(peak_times), "gflop_s": peak_flops_s / 1e9},
        "variants": results,
        "rss_bytes": psutil.Process().memory_info().rss,
        "rss_peak_bytes": max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                              psutil.Process().memory_info().rss),
        "device_memory": device_memory(),
    }, indent=2))


if __name__ == "__main__":
    app.run(exit_on_error(main), flags_parser=parse_flags)
