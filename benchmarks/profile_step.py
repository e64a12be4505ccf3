"""Where a step's time goes: one profiled step, its XLA ops grouped by model part.

    python -m benchmarks.profile_step --config configs/default.py
    taskset -c 0 python -m benchmarks.profile_step --config configs/default.py --program diag

Compiles the train step (``--program diag``: the diagnostic step) for the config's model on
random tokens, runs two warm-up steps, then traces one step with ``jax.profiler`` (a Perfetto
trace in ``--trace_dir``). Each XLA op of the trace is mapped through the compiled HLO's
``op_name`` metadata to a part (attention projections, attention core = scores/softmax/PV,
FFN, norms, LM head and loss, optimizer, and the diagnostic step's statistics, forward
statistics, backward taps and per-layer norms: ``diag_stats``),
a pass (forward or backward) and a kind (matmul or other). Prints JSON: the step's wall time,
the summed op time per group, largest first, and the ``--top_ops`` HLO op kinds with the most
time (an op's name without its numeric suffix, e.g. ``bitcast_dynamic-update-slice_fusion``).
With more than one core, ops overlap, so the sums can exceed the wall time; pinned to one core
(``taskset -c 0``) they add up to it.
"""

import collections
import glob
import gzip
import json
import os
import re
import tempfile
import time

import jax
from absl import app, flags
from ml_collections import config_flags

from benchmarks.op_groups import hlo_op_names, op_group
from benchmarks.programs import check_benchmark_config, cpu_description, random_batch
from postnorm.config.args import parse_flags
from postnorm.errors import exit_on_error
from postnorm.runtime.allocator import use_allocator
from postnorm.runtime.xla_options import compiler_options
from postnorm.train.programs import build_programs

config_flags.DEFINE_config_file("config", "configs/default.py", "Config file.")
flags.DEFINE_string("trace_dir", "", "Where the trace goes; empty: a temporary directory.")
flags.DEFINE_integer("top_ops", 12, "How many HLO op kinds to list by summed time.",
                     lower_bound=0)
flags.DEFINE_enum("program", "train", ["train", "diag"], "The step to profile.")
FLAGS = flags.FLAGS


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    config = FLAGS.config
    check_benchmark_config(config)
    if FLAGS.trace_dir:
        try:
            os.makedirs(FLAGS.trace_dir, exist_ok=True)
        except OSError as err:
            raise app.UsageError(f"--trace_dir={FLAGS.trace_dir} cannot be created "
                                 f"({err})") from err
    allocator = use_allocator(config.runtime.allocator)  # may re-execute this command
    trace_dir = FLAGS.trace_dir or tempfile.mkdtemp(prefix="postnorm_profile_")
    programs = build_programs(config, config.data.vocab_size)
    steps = programs.steps
    batch = random_batch(config, config.data.vocab_size, programs.mesh)
    state = steps.init(config.seed)
    compiled = getattr(steps, FLAGS.program).lower(state, batch).compile()
    op_names = hlo_op_names(compiled.as_text())
    for _ in range(2):
        state, *_ = compiled(state, batch)
    jax.block_until_ready(state)

    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        start = time.perf_counter()
        state, *_ = compiled(state, batch)
        jax.block_until_ready(state)
        wall = time.perf_counter() - start
    path = max(glob.glob(os.path.join(trace_dir, "**", "*perfetto_trace.json.gz"),
                         recursive=True), key=os.path.getmtime)
    with gzip.open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    totals, op_kinds = collections.Counter(), collections.Counter()
    for event in events:
        if event.get("ph") == "X" and event["name"] in op_names:
            if op_names[event["name"]].endswith("/while"):
                continue  # the loop op spans its body's ops
            totals["/".join(op_group(op_names[event["name"]], event["name"]))] += event["dur"]
            op_kinds[re.sub(r"\.\d+$", "", event["name"])] += event["dur"]
    summed = sum(totals.values())
    print(json.dumps({
        "step_wall_s": wall, "summed_op_s": summed / 1e6, "trace": path,
        "cpu": cpu_description(), "allocator": allocator,
        "xla_options": compiler_options(config.runtime.xla_options),
        "groups_s": {k: round(v / 1e6, 4) for k, v in totals.most_common()},
        "groups_share": {k: round(v / summed, 4) for k, v in totals.most_common()},
        "top_op_kinds_s": {k: round(v / 1e6, 4) for k, v in op_kinds.most_common(FLAGS.top_ops)},
    }, indent=2))


if __name__ == "__main__":
    app.run(exit_on_error(main), flags_parser=parse_flags)
