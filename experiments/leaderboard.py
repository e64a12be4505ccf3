"""The collapse leaderboard: train the plan of ``configs/sweeps/leaderboard.py`` and tabulate it.

    python -m experiments.leaderboard --out_dir runs/leaderboard [--sweep FILE[:variant]]
        [--methods post,pre,...] [--shard i/n] [--workers N] [--report_only] [--fresh_batches 512]
        [--archive results/leaderboard/runs]
    python -m experiments.leaderboard --runs DIR[,DIR...]   # the same measures of any runs, as JSON

Built on the sweep runner (``postnorm.sweep.runner``): every run's config is validated before the
first trains, finished runs are skipped and partial ones resume, so killing the command and
rerunning it finishes the plan without training a run twice; ``--shard i/n`` splits the plan over
hosts that share --out_dir, and ``--workers N`` trains in N pinned processes. ``--methods`` keeps
the plan's runs of those methods; ``--report_only`` trains nothing. It logs the whole plan's
progress first and last (runs finished and left, and an ETA from the measured training and
measuring times of the finished runs of the same depth: ``postnorm.sweep.progress``), and this
host's (or shard's) as each run ends, with the runs running; then it writes the sweep's
``summary.json`` and measures every finished run once more on its final checkpoint, cached in
``<run>/leaderboard.json`` (``postnorm.analysis.run_measures``):

* ``fresh_loss_over_lfreq``: the loss on the next ``--fresh_batches`` training batches the run
  never trained on, over L_freq (``postnorm.analysis.thm38.next_batches_loss``);
* ``min_c``: the smallest RMSNorm contraction c over every layer, sublayer, token and diagnostic
  step (the diagnostics' ``c_min``; the norm on the residual sum in Post-Norm arrangements);
* ``dldx_first_over_last_early``: ||dL/dX|| at the early layers' attention input, first
  diagnostic step over the last (geometric mean over the early layers): how far the gradient
  reaching the bottom of the stack fell;
* ``update_norm_early``: the early layers' parameter update norm at the last diagnostic step
  (AdamW normalises gradients, so this is what the bottom of the stack still moves).

* the early-warning monitor replayed over the run's records (``postnorm.analysis.collapse``):
  its first warn, the lead to the collapse step on a collapsed run, a false alarm on another.

Each method's cost, the train step's time and peak memory over Post-Norm's, comes from
side-by-side benchmark runs (``--cost``: ``benchmarks/bench.py`` JSON, by default the runs of
``benchmarks/methods_cost.py``: each method beside post, in both orders, on one CPU), not from
training wall times.

Per cell (method, depth, lr, warmup) the table gives the seeds finished and how they ended
(``done``; ``nonfinite``: stopped by a non-finite step; ``missing``: not run yet; ``stale``: a
result of another config than the plan's; each shown in its cell, never left out), how many
collapsed (the project's rule), these measures over seeds, the gap of the fresh-batch loss to
Pre-Norm's in the same cell, and to Post-Norm's in cells where every Post-Norm seed finished
and none collapsed. Writes ``leaderboard.json``, ``leaderboard.md``, ``leaderboard.png`` (methods x
cells, coloured by loss / L_freq, collapses marked, as the stability map) and ``leaderboard.html``
(the table, each cell linking its runs' reports, which it writes where missing) to --out_dir, and
``leaderboard_methods.md``, one row per method over the cells where Post-Norm collapses: did it
prevent the collapse on every run there, how far from Pre-Norm's loss, at what cost
(``method_verdicts``), ``leaderboard_paired.md``, each cell's seed-paired gap to Pre-Norm in
nats with its 95% interval and verdict (``paired_gaps``), and ``leaderboard_profiles.md`` and
``.png``: the final lambda profile of every run that records one (``profile_summary``).
With ``--archive A`` each run is measured as soon as it ends, in its worker, and its record (its
config, ``result.json`` and these measures) written to ``A/<run id>.json`` (``postnorm.sweep.
archive``), as are the finished runs of --out_dir not recorded yet: committed, the archive keeps
a plan that takes several sittings on machines whose run directories do not last. A run recorded
there is not trained again, and the table takes it from there when --out_dir lacks it, so
``--out_dir results/leaderboard --archive results/leaderboard/runs --report_only`` rebuilds the
committed table from the archive alone (its cells link no report).
With ``--runs`` it prints, for each run directory given, these measures and the collapse verdict
as JSON lines, with no sweep.
"""


import functools
import glob
import html
import json
import os
import time

import matplotlib
import ml_collections
import numpy as np
from absl import app, flags, logging

from configs.sweeps.leaderboard import ALL_METHODS, method_label, method_of
from postnorm.analysis.figures import save_figure
from postnorm.analysis.report import write_report
from postnorm.analysis.run_measures import run_measures
from postnorm.config import config_data
from postnorm.config.list_flags import choice_list
from postnorm.errors import UserError, exit_on_error
from postnorm.files import make_output_dir, write_bytes_atomic, write_json_atomic
from postnorm.runtime.allocator import use_allocator
from postnorm.sweep.archive import archive_finished, archived_runs
from postnorm.sweep.leaderboard_table import (
    aggregate,
    cell_key,
    markdown,
    method_verdicts,
    paired_gaps,
    paired_markdown,
    profiles_markdown,
    verdicts_markdown,
)
from postnorm.sweep.plan import RunSpec, build_config, parse_shard, plan_file, shard, split_arg
from postnorm.sweep.progress import plan_progress
from postnorm.sweep.record import read_result, run_metrics_summary
from postnorm.sweep.runner import planned_configs, run_sweep, run_workdirs
from postnorm.sweep.summary import write_summary
from postnorm.sweep.workers import check_workers
from postnorm.workdir.layout import Workdir, latest_checkpoint_step

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

flags.DEFINE_string("out_dir", None, "Directory for the runs, the table and the figure.")
flags.DEFINE_string("sweep", "configs/sweeps/leaderboard.py", "The plan: a sweep file whose "
                    "runs set the leaderboard's method fields, e.g. "
                    "configs/sweeps/leaderboard.py:grid.")
flags.DEFINE_list("methods", list(ALL_METHODS), "Keep the plan's runs of these methods.")
flags.DEFINE_string("shard", "0/1", "i/n: train every n-th run of the plan, starting at i.")
flags.DEFINE_integer("workers", 1, "Train this shard's runs in this many CPU-pinned processes.")
flags.DEFINE_bool("report_only", False, "Train nothing: tabulate the runs finished so far.")
flags.DEFINE_list("runs", None, "Run directories to measure and print as JSON lines, instead of "
                  "a sweep's --out_dir.")
flags.DEFINE_string("archive", None, "Directory of the leaderboard's archive: one JSON record "
                    "per finished run with its measures, written as each ends; runs recorded "
                    "there are not trained again and the table reads them from there.")
flags.DEFINE_list("cost", ["results/perf/methods_cost_amd_zen4"],
                  "benchmarks/bench.py JSON files (or directories of them), each timing methods "
                  "side by side with post: the table's step time and peak memory relative to "
                  "post (geometric mean over the files); empty: no cost columns.")
flags.DEFINE_integer("fresh_batches", 512, "Training batches after the last step to evaluate "
                     "each final checkpoint on.", lower_bound=1)
FLAGS = flags.FLAGS

class LeaderboardError(UserError, ValueError):
    """A run cannot be measured or the plan holds no run."""


def method_costs(paths: list[str], base_config: str) -> dict[str, dict]:
    """Per method, its train-step time and peak memory over post's, each a geometric mean over
    the ``benchmarks/bench.py`` runs in ``paths`` (files, or directories of them; variants as
    after ``base_config``'s colon;
    a method's first variant in a file counts, post's is the reference). Methods a file does not
    time are absent."""
    ratios: dict[str, dict[str, list[float]]] = {}
    files = [sorted(glob.glob(os.path.join(p, "*.json"))) if os.path.isdir(p) else [p]
             for p in paths]
    for path in [f for listed in files for f in listed]:
        measured: dict[str, dict] = {}
        try:
            with open(path) as f:
                variants = json.load(f)["variants"]
            for label, bench in variants.items():
                config = build_config(f"{split_arg(base_config)[0]}:{label}", RunSpec("", ()))
                train = bench["programs"]["train"]
                measured.setdefault(method_label(config_data(config)),
                                    {"time": float(train["median_s"]),
                                     "memory": float(train["memory"]["peak_estimate_bytes"])})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise LeaderboardError(f"--cost: {path} is not a benchmarks/bench.py JSON file of "
                                   f"{base_config}'s variants ({type(err).__name__}: {err}); "
                                   "give one, or --cost= for no cost columns") from err
        if "post" not in measured:
            raise LeaderboardError(f"--cost: {path} times no post variant to compare against")
        post = measured["post"]
        for method, train in measured.items():
            entry = ratios.setdefault(method, {"step_time": [], "peak_memory": []})
            entry["step_time"].append(train["time"] / post["time"])
            entry["peak_memory"].append(train["memory"] / post["memory"])
    return {method: {f"{k}_vs_post": float(np.exp(np.mean(np.log(v)))) for k, v in r.items()}
            | {"benchmark_runs": len(r["step_time"])} for method, r in ratios.items()}


def single_run(workdir: str, fresh_batches: int) -> dict:
    """The leaderboard's measures of one run directory, with the project's collapse verdict and
    the run's end-of-training figures."""
    if latest_checkpoint_step(workdir) is None:
        raise LeaderboardError(f"--runs: {workdir} holds no checkpoint: give a trained run's "
                               "--workdir")
    summary = run_metrics_summary(workdir)
    keep = ("final_step", "final_eval_loss", "train_loss_over_lfreq", "eval_loss_over_floor",
            "fraction_of_layers_tsim_ge_0.99", "skipped_steps", "rollbacks")
    return {"workdir": workdir, **{k: summary[k] for k in keep if k in summary},
            "collapsed": summary.get("collapse", {}).get("collapsed"),
            "collapse_step": summary.get("collapse", {}).get("collapse_step"),
            **run_measures(workdir, fresh_batches)}


def chosen_plan(sweep_arg: str, methods: list[str]) -> tuple[str, list[RunSpec]]:
    """The sweep file's plan, only its runs of ``methods``."""
    base, specs = plan_file(sweep_arg)
    kept = [s for s in specs if method_of(dict(s.overrides)) in methods]
    if not kept:
        raise LeaderboardError(f"{sweep_arg} plans no run of --methods={','.join(methods)}")
    return base, kept


def plot(path: str, entries: list[dict]) -> None:
    """Methods x cells coloured by the mean fresh-batch loss / L_freq; collapsed seeds marked
    ``C k/n`` in a red frame, runs stopped by a non-finite step ``x``, runs of the plan not
    trained yet ``n to run``; cells outside the plan blank."""
    methods = [m for m in ALL_METHODS if any(e["method"] == m for e in entries)]
    cells = sorted({cell_key(e)[1:] for e in entries})
    by_key = {cell_key(e): e for e in entries}
    means = {key: np.mean(e["fresh_loss_over_lfreq"]) for key, e in by_key.items()
             if e["fresh_loss_over_lfreq"]}
    grid = np.array([[means.get((m, *c), np.nan) for c in cells] for m in methods], dtype=float)
    fig, ax = plt.subplots(figsize=(max(1.1 * len(cells) + 3, 6.5), 0.42 * len(methods) + 2))
    image = ax.imshow(grid, cmap="viridis_r", aspect="auto")
    for i, method in enumerate(methods):
        for j, c in enumerate(cells):
            e = by_key.get((method, *c))
            if e is None:
                continue
            label = f"{grid[i, j]:.3f}" if np.isfinite(grid[i, j]) else ""
            if e["collapsed"]:
                label += f"\nC {e['collapsed']}/{e['done']}"
                ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, ec="red", lw=2))
            if e["status"].get("nonfinite"):
                label += f"\nx {e['status']['nonfinite']}"
            if e["status"].get("missing"):
                label += f"\n{e['status']['missing']} to run"
            dark = np.isfinite(grid[i, j]) and image.norm(grid[i, j]) > 0.6
            ax.text(j, i, label.strip("\n"), ha="center", va="center", fontsize=7,
                    color="white" if dark else "black")
    ax.set_yticks(range(len(methods)), methods)
    ax.set_xticks(range(len(cells)), [f"{layers}L lr {lr:g}\nwarmup {w}"
                                      for layers, lr, w in cells], fontsize=7)
    fig.colorbar(image, ax=ax, label="loss / L_freq on fresh batches (mean over seeds)")
    ax.set_title("The collapse leaderboard\n(C k/n: k of n seeds collapsed; x: non-finite stop;\n"
                 "n to run: runs of the plan not trained yet)", fontsize=10)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


def plot_profiles(path: str, rows: list[dict]) -> None:
    """The final lambda per layer of every run that recorded one, attention and FFN side by
    side, one line per run (colour: method and lr; style: seed)."""
    runs = sorted((r for r in rows if r.get("final_post_mix")),
                  key=lambda r: (r["method"], r["lr"], r["seed"]))
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True)
    groups = sorted({(r["method"], r["lr"]) for r in runs})
    colours = {g: plt.cm.tab10(i % 10) for i, g in enumerate(groups)}
    for r in runs:
        mix_Lx2 = np.asarray(r["final_post_mix"])
        for kind, ax in enumerate(axes):
            ax.plot(mix_Lx2[:, kind], color=colours[(r["method"], r["lr"])],
                    ls=("-", "--", ":")[r["seed"] % 3], lw=1.2,
                    label=f"{r['method']} lr {r['lr']:g} seed {r['seed']}" if kind else None)
    for ax, kind in zip(axes, ("attention", "FFN"), strict=True):
        ax.set_xlabel("layer")
        ax.set_title(f"final λ, {kind} sublayers")
    axes[0].set_ylabel("λ (1: Post-Norm, 0: Pre-Norm)")
    if runs:
        axes[1].legend(fontsize=6, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


def html_page(entries: list[dict], table: str, out_dir: str) -> str:
    """The table as HTML, each cell's runs linked to their reports."""
    def links(entry: dict) -> str:
        return " ".join(
            f'<a href="{html.escape(os.path.join(run, "report.html"))}">{n}</a>'
            for n, run in enumerate(entry["runs"])
            if os.path.exists(os.path.join(out_dir, run, "report.html")))

    lines = table.strip().splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")] + ["reports"]
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(c.strip())}</td>" for c in line.strip("|").split("|"))
        + f"<td>{links(entry)}</td></tr>" for line, entry in zip(lines[2:], entries, strict=True))
    return ("<!doctype html><meta charset=utf-8><title>postnorm leaderboard</title>"
            "<img src=leaderboard.png style='max-width:100%'><table border=1><tr>"
            + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr>" + body
            + "</table>")


def tabulate(out_dir: str, specs: list[RunSpec], configs: list[ml_collections.ConfigDict],
             rows: list[dict], fresh_batches: int, archive: str | None = None,
             costs: dict[str, dict] | None = None) -> str:
    """Measure the finished runs (or read an archived run's measures) and write the
    leaderboard's files; with ``archive``, record there each measured run not recorded yet.
    Returns the markdown."""
    archived = archived_runs(archive, configs)
    for spec, config, row, entry in zip(specs, configs, rows, archived, strict=True):
        row.update(method=method_of(dict(spec.overrides)), layers=config.model.n_layers,
                   lr=config.opt.lr, warmup=config.opt.warmup_steps)
        workdir = os.path.join(out_dir, row["workdir"])
        result = entry["result"] if row.get("archived") else read_result(workdir)
        if result and result.get("final_post_mix"):
            row["final_post_mix"] = result["final_post_mix"]
        if row.get("archived"):
            measures = entry.get("measures") or {}
            if row["status"] == "done" and measures.get("fresh_batches") != fresh_batches:
                logging.warning("%s: its archived record has no loss on %d fresh batches (%s); "
                                "its cell shows none", row["run_id"], fresh_batches,
                                f"{measures['fresh_batches']} instead" if measures
                                else "no measures")
                measures = {}
            row.update(measures)
        elif row["status"] == "done":
            logging.info("measuring %s", row["run_id"])
            row.update(run_measures(workdir, fresh_batches))
            if not os.path.exists(Workdir(workdir).report):
                write_report(workdir)
    if archive:
        archive_finished(archive, [s.run_id for s in specs], configs,
                         [os.path.join(out_dir, r["workdir"]) for r in rows],
                         functools.partial(run_measures, fresh_batches=fresh_batches),
                         lambda measures: measures.get("fresh_batches") != fresh_batches)
    entries = aggregate(rows, list(ALL_METHODS), costs)
    verdicts = method_verdicts(entries)
    gaps = paired_gaps(rows)
    write_json_atomic(os.path.join(out_dir, "leaderboard.json"),
                      {"runs": rows, "cells": entries, "methods": verdicts, "paired": gaps,
                       "fresh_batches": fresh_batches, "costs": costs or {}})
    table = markdown(entries, fresh_batches)
    write_bytes_atomic(os.path.join(out_dir, "leaderboard.md"), table.encode())
    write_bytes_atomic(os.path.join(out_dir, "leaderboard_methods.md"),
                       verdicts_markdown(verdicts, fresh_batches).encode())
    plot(os.path.join(out_dir, "leaderboard.png"), entries)
    write_bytes_atomic(os.path.join(out_dir, "leaderboard_paired.md"),
                       paired_markdown(gaps, list(ALL_METHODS)).encode())
    write_bytes_atomic(os.path.join(out_dir, "leaderboard_profiles.md"),
                       profiles_markdown(rows).encode())
    plot_profiles(os.path.join(out_dir, "leaderboard_profiles.png"), rows)
    write_bytes_atomic(os.path.join(out_dir, "leaderboard.html"),
                       html_page(entries, table, out_dir).encode())
    return table


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if (FLAGS.out_dir is None) == (FLAGS.runs is None):
        raise app.UsageError("give --out_dir (a leaderboard sweep) or --runs (run directories)")
    if FLAGS.runs is not None:
        for workdir in FLAGS.runs:
            print(json.dumps(single_run(workdir, FLAGS.fresh_batches)))
        return
    start = time.perf_counter()
    check_workers(FLAGS.workers)
    methods = choice_list("methods", FLAGS.methods, tuple(ALL_METHODS))
    index, count = parse_shard(FLAGS.shard)
    base, specs = chosen_plan(FLAGS.sweep, methods)
    configs = planned_configs(base, specs, {})
    costs = method_costs(FLAGS.cost, base)
    use_allocator(configs[0].runtime.allocator)  # may re-execute this command
    out_dir = make_output_dir(os.path.abspath(FLAGS.out_dir), "--out_dir")
    archive = (make_output_dir(os.path.abspath(FLAGS.archive), "--archive") if FLAGS.archive
               else None)
    workdirs = run_workdirs(out_dir, specs, configs)
    archived = archived_runs(archive, configs)
    rows = write_summary(base, specs, out_dir, {}, workdirs, archived)
    logging.info("the plan: %s", plan_progress(configs, rows, archived, FLAGS.workers))
    if not FLAGS.report_only:
        mine = shard(list(range(len(specs))), index, count)
        run_sweep([specs[i] for i in mine], [configs[i] for i in mine],
                  [workdirs[i] for i in mine], FLAGS.workers, archive=archive,
                  measure=functools.partial(run_measures, fresh_batches=FLAGS.fresh_batches))
    archived = archived_runs(archive, configs)
    rows = write_summary(base, specs, out_dir, {}, workdirs, archived)
    logging.info("the plan: %s", plan_progress(configs, rows, archived, FLAGS.workers))
    print(tabulate(out_dir, specs, configs, rows, FLAGS.fresh_batches, archive, costs))
    logging.info("wall time of this invocation: %.0f s", time.perf_counter() - start)


if __name__ == "__main__":
    app.run(exit_on_error(main))
