"""Step time and peak memory of every leaderboard method against Post-Norm, side by side.

    python -m benchmarks.methods_cost --out_dir results/perf/methods_cost [--repeats 5]
    python -m benchmarks.methods_cost --out_dir results/perf/methods_cost --report_only

Every method of ``configs/sweeps/leaderboard.py`` (its overrides as the sweep sets them; the
own-profile control with the final profile of the archived two-way run at lr 1e-3, seed 0) is
timed by ``benchmarks/bench.py`` on the default config in two processes of three variants each:
post, the method, then post again as a control, and the method first, then post and the
control. Few variants per process keep every timing in the same state of the process, and the
control shows what the process's drift alone does to a ratio. Writes ``<method>.json`` and
``<method>_reversed.json`` (the bench's JSON, which ``experiments/leaderboard.py --cost`` reads
from the directory) and ``methods_cost.md``: per method, each process's train-step time over
post's, their geometric mean, the control's ratio in each, and peak memory over post's, headed
by the CPU. ``--report_only`` writes the table from the JSON files already in --out_dir.
"""

import json
import os
import subprocess
import sys

import numpy as np
from absl import app, flags

from configs.sweeps.leaderboard import method_variants
from postnorm.files import make_output_dir, write_bytes_atomic, write_json_atomic

flags.DEFINE_string("out_dir", "results/perf/methods_cost", "Directory for the JSON files and "
                    "the markdown table.")
flags.DEFINE_integer("repeats", 5, "Timed repeats of each program per process.", lower_bound=1)
flags.DEFINE_list("methods", None, "Time only these methods (default: every one).")
flags.DEFINE_bool("report_only", False, "Time nothing: write the table from the JSON files.")
FLAGS = flags.FLAGS

BASE_CONFIG = "configs/default.py"
CONTROL = "post,model.init_tsim_target=0.0"  # post's program under another label
ORDERS = {"": lambda post, method: [post, method, CONTROL],
          "_reversed": lambda post, method: [method, post, CONTROL]}


def run_bench(variants: list[str], repeats: int) -> dict:
    """One ``benchmarks.bench`` process timing ``variants``' train steps side by side; its
    JSON."""
    command = [sys.executable, "-m", "benchmarks.bench", "--config", BASE_CONFIG,
               "--programs", "train", "--repeats", str(repeats)]
    command += [f"--variant={v}" for v in variants]
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    return json.loads(done.stdout)


def _train(bench: dict, label: str) -> dict:
    return bench["variants"][label]["programs"]["train"]


def cost_table(variants: dict[str, str], benches: dict[str, list[dict]]) -> str:
    """The markdown table of each method's two processes (``benches[method]``)."""
    post = variants["post"]
    first = benches[next(iter(benches))][0]
    cpu = first["cpu"]
    post_memory = _train(first, post)["memory"]["peak_estimate_bytes"]
    post_s = [_train(b, post)["median_s"] for runs in benches.values() for b in runs]
    lines = [f"CPU: {cpu['model']}, {cpu['cores']} cores, ISA {', '.join(cpu['isa'])}; "
             f"{first['repeats']} interleaved repeats per process; post's train step "
             f"{min(post_s):.3f}–{max(post_s):.3f} s over the processes; "
             f"its peak memory {post_memory / 2**20:.1f} MiB.", "",
             "| method | train step / post: post first, method first | geometric mean "
             "| control (post again) / post | peak memory / post |",
             "|---|---|---|---|---|"]
    for name, runs in benches.items():
        ratios = [_train(b, variants[name])["median_s"] / _train(b, post)["median_s"]
                  for b in runs]
        controls = [_train(b, CONTROL)["median_s"] / _train(b, post)["median_s"] for b in runs]
        memory = _train(runs[0], variants[name])["memory"]["peak_estimate_bytes"]
        lines.append(f"| {name} | {', '.join(f'{r:.3f}' for r in ratios)} "
                     f"| {np.exp(np.mean(np.log(ratios))):.3f} "
                     f"| {', '.join(f'{r:.3f}' for r in controls)} "
                     f"| {memory / post_memory:.4f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    variants = method_variants()
    unknown = sorted(set(FLAGS.methods or ()) - set(variants))
    if unknown:
        raise app.UsageError(f"--methods: unknown {unknown}; known: {sorted(variants)}")
    make_output_dir(FLAGS.out_dir, "--out_dir")
    benches = {}
    for name in [m for m in variants if m != "post"]:
        benches[name] = []
        for suffix, order in ORDERS.items():
            path = os.path.join(FLAGS.out_dir, f"{name}{suffix}.json")
            if FLAGS.report_only or (FLAGS.methods and name not in FLAGS.methods):
                if not os.path.exists(path):
                    break
                with open(path) as f:
                    benches[name].append(json.load(f))
                continue
            print(f"timing {name}{suffix}", flush=True)
            benches[name].append(run_bench(order(variants["post"], variants[name]),
                                           FLAGS.repeats))
            write_json_atomic(path, benches[name][-1])
        if len(benches[name]) < len(ORDERS):
            del benches[name]
    table = cost_table(variants, benches)
    write_bytes_atomic(os.path.join(FLAGS.out_dir, "methods_cost.md"), table.encode())
    print(table)


if __name__ == "__main__":
    app.run(main)
