"""Cost of the diagnostic step relative to the plain train step, measured side by side.

    python -m benchmarks.diag_overhead --config configs/default.py --repeats 15

Both steps are compiled for the config's model and a random token batch of the config's
shape; repeats are interleaved (train, train, diag, ...) and timed with a device sync after
each step. The plain step is timed twice per repeat: the ratio of its two timings is the
measurement noise floor. ``train_step`` is traced without probes, so its program contains no
diagnostic operation; the custom calls of both programs are listed (the diagnostic step's
SVD for the effective rank is one). Prints JSON: median seconds per step, the ratios, and
XLA's memory analysis of both compiled steps.
"""

import json
import re
import statistics
import time

import jax
from absl import app, flags
from ml_collections import config_flags

from benchmarks.programs import (
    check_benchmark_config,
    cpu_description,
    memory_analysis,
    random_batch,
)
from postnorm.config.args import parse_flags
from postnorm.errors import exit_on_error
from postnorm.runtime.allocator import use_allocator
from postnorm.runtime.xla_options import compiler_options
from postnorm.train.programs import build_programs

config_flags.DEFINE_config_file("config", "configs/default.py", "Config file.")
flags.DEFINE_integer("repeats", 15, "Timed repeats of each step.", lower_bound=1)
flags.DEFINE_integer("vocab_size", 8192, "Vocabulary size (the data is random tokens).",
                     lower_bound=1)
FLAGS = flags.FLAGS


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    config = FLAGS.config
    check_benchmark_config(config)
    allocator = use_allocator(config.runtime.allocator)  # may re-execute this command
    programs = build_programs(config, FLAGS.vocab_size)
    spec, steps = programs.spec, programs.steps
    batch = random_batch(config, FLAGS.vocab_size, programs.mesh)

    state = steps.init(config.seed)
    lowered = {"train": steps.train.lower(state, batch), "diag": steps.diag.lower(state, batch)}
    compiled = {name: low.compile() for name, low in lowered.items()}
    custom_calls = {name: sorted(set(re.findall(r"custom_call @(\w+)", low.as_text())))
                    for name, low in lowered.items()}

    order = (("train", "train"), ("train_again", "train"), ("diag", "diag"))
    times = {label: [] for label, _ in order}
    for name in ("train", "diag"):  # warm-up
        state, *_ = compiled[name](state, batch)
    for _ in range(FLAGS.repeats):
        for label, name in order:
            jax.block_until_ready(state)
            start = time.perf_counter()
            state, *rest = compiled[name](state, batch)
            jax.block_until_ready((state, rest))
            times[label].append(time.perf_counter() - start)

    median = {name: statistics.median(t) for name, t in times.items()}
    mem = {name: memory_analysis(c) for name, c in compiled.items()}
    print(json.dumps({
        "config": {"n_layers": spec.n_layers, "d_model": spec.d_model,
                   "seq_len": config.data.seq_len, "batch_size": config.data.batch_size,
                   "norm": spec.norm, "attention": spec.attention, "remat": spec.remat,
                   "scan_unroll": spec.scan_unroll, "devices": jax.device_count()},
        "cpu": cpu_description(), "allocator": allocator,
        "xla_options": compiler_options(config.runtime.xla_options),
        "repeats": FLAGS.repeats,
        "median_step_s": median,
        "diag_over_train_time": median["diag"] / median["train"],
        "train_again_over_train_time": median["train_again"] / median["train"],
        "memory": mem,
        "diag_over_train_peak_memory": (mem["diag"]["peak_estimate_bytes"]
                                        / mem["train"]["peak_estimate_bytes"]),
        "custom_calls": custom_calls,
    }, indent=2))


if __name__ == "__main__":
    app.run(exit_on_error(main), flags_parser=parse_flags)
