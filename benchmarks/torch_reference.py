"""The config's model in PyTorch, trained side by side with the JAX train step: MFU of both.

    pip install -r benchmarks/requirements-torch.txt
    python -m benchmarks.torch_reference --config configs/default.py --repeats 7
    taskset -c 0 python -m benchmarks.torch_reference --config configs/default.py --repeats 5

What PyTorch's CPU kernels reach on the same shapes, on the same machine, in the same run, on
CPU only. The PyTorch model (``benchmarks.torch_model``) trains with fused AdamW at the
config's peak learning rate, betas, eps and weight decay (a constant rate: the schedule does
not change the cost), eager or, with ``--torch_compile``, under ``torch.compile`` (which needs
a C++ compiler). It keeps every activation for the backward pass, as PyTorch does by default;
the JAX step is the trainer's, with the config's remat policy.

Before timing, the PyTorch model is loaded with the JAX model's initial parameters and both
compute the loss and its gradient on one batch: their largest relative differences are
reported (``equivalence``; beyond 1e-5 in the loss or 1e-3 in a gradient it stops), so the
two timings are of the same network. Repeats are
interleaved (JAX peak matmul, PyTorch peak matmul, JAX step, PyTorch step); MFU counts the
model FLOPs of ``postnorm.model.flops`` against each framework's own fastest 2048² float32 matmul
of that repeat. Both steps' minor page faults per call and the kernel's transparent huge page
mode are reported too (``benchmarks.programs.transparent_hugepage_mode``), and the heap
allocator both run on (``allocator``, from ``runtime.allocator``) and the CPU (``cpu``);
``--profile_ops`` adds the largest ops of one profiled PyTorch step. Prints JSON.
"""

import collections
import json
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import torch
from absl import app, flags
from ml_collections import config_flags

from benchmarks.programs import (
    check_benchmark_config,
    compile_afresh,
    cpu_description,
    minor_page_faults,
    random_tokens,
    timed_programs,
    transparent_hugepage_mode,
)
from benchmarks.timing import timed
from benchmarks.torch_model import (
    TorchDecoder,
    check_supported,
    equivalence,
    make_optimizer,
    train_loss,
)
from postnorm.config.args import parse_flags
from postnorm.errors import exit_on_error
from postnorm.model import ModelSpec
from postnorm.runtime.allocator import use_allocator
from postnorm.train.programs import resolve_attention

config_flags.DEFINE_config_file("config", "configs/default.py", "Config file.")
flags.DEFINE_integer("repeats", 7, "Timed repeats of each step (after one warm-up).",
                     lower_bound=1)
flags.DEFINE_integer("vocab_size", 0, "Vocabulary size; 0: data.vocab_size.", lower_bound=0)
flags.DEFINE_integer("peak_calls", 5, "Back-to-back peak matmuls per repeat; the fastest counts.",
                     lower_bound=1)
flags.DEFINE_bool("torch_compile", False, "Time the PyTorch step under torch.compile.")
flags.DEFINE_integer("profile_ops", 0, "After timing, profile one PyTorch step and report its "
                     "this many largest ops by self CPU time; 0: no profile.", lower_bound=0)
FLAGS = flags.FLAGS
PEAK_SIZE = 2048

def profile_step(step_fn: Callable[[], None], top: int) -> dict:
    """Self CPU seconds of one step's ops (``torch.profiler``), the ``top`` largest by name."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step_fn()
    by_op = collections.Counter()
    for event in prof.key_averages():
        by_op[event.key] += event.self_cpu_time_total / 1e6
    largest = dict(by_op.most_common(top))
    return {"total_self_s": sum(by_op.values()), "largest_ops_self_s": largest,
            "other_self_s": sum(by_op.values()) - sum(largest.values())}


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    config = FLAGS.config
    allocator = use_allocator(config.runtime.allocator)  # may re-execute this command
    compile_afresh()
    check_benchmark_config(config)
    if jax.default_backend() != "cpu":
        raise app.UsageError(f"JAX runs on {jax.default_backend()}: the PyTorch reference "
                             "times CPU against CPU; hide the accelerator (JAX_PLATFORMS=cpu)")
    config = resolve_attention(config)  # the JAX model the equivalence check runs
    vocab = FLAGS.vocab_size or config.data.vocab_size
    seq_len, batch_size = config.data.seq_len, config.data.batch_size
    spec = ModelSpec.from_config(config.model, vocab_size=vocab, max_len=seq_len)
    try:
        check_supported(spec)
    except ValueError as error:
        raise app.UsageError(str(error)) from error
    if config.opt.clip_norm:
        raise app.UsageError("opt.clip_norm: the PyTorch reference step has no clipping; set 0")

    torch.manual_seed(config.seed)
    model = TorchDecoder(spec)
    tokens = random_tokens(config, vocab)
    check = equivalence(spec, model, tokens, config.seed)
    worst = max(check["grad_max_relative_difference"].values())
    if abs(check["torch_loss"] - check["jax_loss"]) > 1e-5 * check["jax_loss"] or worst > 1e-3:
        raise RuntimeError(f"the PyTorch model does not compute the JAX model's loss and "
                           f"gradients: {check}")
    optimizer = make_optimizer(model, config.opt)
    tokens_t = torch.from_numpy(tokens).long()

    def torch_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        train_loss(model, tokens_t).backward()
        optimizer.step()

    step_fn = torch.compile(torch_step) if FLAGS.torch_compile else torch_step
    programs, model_info = timed_programs(config, ["train"], vocab)
    jax_train = programs["train"]

    a_jax = jax.random.normal(jax.random.key(1), (PEAK_SIZE, PEAK_SIZE), jnp.float32)
    jax_matmul = jax.jit(lambda x: x @ x).lower(a_jax).compile()
    a_torch = torch.randn(PEAK_SIZE, PEAK_SIZE)

    def torch_timed(fn: Callable[[], object]) -> float:
        """Seconds of one call; PyTorch's CPU ops return when done, so no sync is needed."""
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    start = time.perf_counter()
    step_fn()  # warm-up (and, with --torch_compile, compilation)
    torch_first_s = time.perf_counter() - start
    jax_train.warm_up()
    jax_peak, torch_peak, torch_times, torch_faults = [], [], [], []
    for _ in range(FLAGS.repeats):
        jax_peak.append(min(timed(lambda: jax_matmul(a_jax)) for _ in range(FLAGS.peak_calls)))
        torch_peak.append(min(torch_timed(lambda: a_torch @ a_torch)
                              for _ in range(FLAGS.peak_calls)))
        jax_train.run()
        faults = minor_page_faults()
        torch_times.append(torch_timed(step_fn))
        torch_faults.append(minor_page_faults() - faults)

    flops = jax_train.flops
    peak_flops = 2 * PEAK_SIZE**3

    def summary(times: list[float], peak_times: list[float], faults: list[int]) -> dict:
        median = statistics.median(times)
        peak = peak_flops / statistics.median(peak_times)
        return {"median_s": median, "min_s": min(times), "max_s": max(times),
                "tokens_per_s": batch_size * seq_len / median,
                "achieved_gflop_s": flops / median / 1e9, "peak_gflop_s": peak / 1e9,
                "mfu": flops / median / peak, "minor_page_faults": statistics.median(faults)}

    jax_summary = summary(jax_train.times, jax_peak, jax_train.page_faults)
    torch_summary = summary(torch_times, torch_peak, torch_faults)
    torch_summary.update({"first_call_s": torch_first_s, "compiled": FLAGS.torch_compile,
                          "threads": torch.get_num_threads(), "version": torch.__version__})
    jax_summary.update({"compile_s": jax_train.compile_s, "attention": spec.attention,
                        "remat": spec.remat, "version": jax.__version__,
                        "xla_options": config.runtime.xla_options})
    profile = profile_step(step_fn, FLAGS.profile_ops) if FLAGS.profile_ops else None
    print(json.dumps({
        "model": {**model_info, "model_gflop": flops / 1e9},
        "repeats": FLAGS.repeats, "cpu": cpu_description(),
        "transparent_hugepages": transparent_hugepage_mode(),
        "allocator": allocator, "equivalence": check, "jax": jax_summary,
        "torch": torch_summary,
        "torch_time_vs_jax": torch_summary["median_s"] / jax_summary["median_s"],
        "torch_profile": profile,
    }, indent=2))


if __name__ == "__main__":
    app.run(exit_on_error(main), flags_parser=parse_flags)
