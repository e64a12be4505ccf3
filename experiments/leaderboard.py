"""The collapse leaderboard's table and figure, from the runs of ``configs/sweeps/leaderboard.py``.

    python -m experiments.sweep --sweep configs/sweeps/leaderboard.py --out_dir runs/leaderboard
    python -m experiments.leaderboard --out_dir runs/leaderboard [--fresh_batches 512]
    python -m experiments.leaderboard --runs DIR[,DIR...]   # the same measures of any runs, as JSON

Reads the sweep's ``summary.json`` (``experiments.sweep`` writes it; ``--report_only`` rewrites it
without training) and measures every finished run once more on its final checkpoint, cached in
``<run>/leaderboard.json``:

* ``fresh_loss_over_lfreq``: the loss on the next ``--fresh_batches`` training batches the run
  never trained on, over L_freq (``postnorm.analysis.thm38.next_batches_loss``);
* ``min_c``: the smallest RMSNorm contraction c over every layer, sublayer, token and diagnostic
  step (the diagnostics' ``c_min``; the norm on the residual sum in Post-Norm arrangements);
* ``dldx_first_over_last_early``: ||dL/dX|| at the early layers' attention input, first
  diagnostic step over the last (geometric mean over the early layers): how far the gradient
  reaching the bottom of the stack fell;
* ``update_norm_early``: the early layers' parameter update norm at the last diagnostic step
  (AdamW normalises gradients, so this is what the bottom of the stack still moves).

Per method and learning rate the table gives the seeds finished, how many collapsed (the
project's rule, ``postnorm.analysis.collapse``), these measures over seeds and the gap of the
fresh-batch loss to Pre-Norm's. Writes ``leaderboard.json``, ``leaderboard.md`` and
``leaderboard.png`` to --out_dir. With ``--runs`` it prints, for each run directory given, these
measures and the collapse verdict as JSON lines, with no sweep.
"""

import json
import os

import matplotlib
import numpy as np
from absl import app, flags, logging

from configs.sweeps.leaderboard import METHODS, method_of
from postnorm.analysis.collapse import DEFAULT_RULE
from postnorm.analysis.figures import save_figure
from postnorm.analysis.tables import cell, markdown_table
from postnorm.analysis.thm38 import next_batches_loss
from postnorm.errors import UserError, exit_on_error
from postnorm.files import write_bytes_atomic, write_json_atomic
from postnorm.sweep.record import run_metrics_summary
from postnorm.train.experiment import restore_run
from postnorm.workdir.config_record import recorded_config
from postnorm.workdir.layout import latest_checkpoint_step
from postnorm.workdir.metrics import layer_series, read_metrics

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

flags.DEFINE_string("out_dir", None, "The leaderboard sweep's --out_dir.")
flags.DEFINE_list("runs", None, "Run directories to measure and print as JSON lines, instead of "
                  "a sweep's --out_dir.")
flags.DEFINE_integer("fresh_batches", 512, "Training batches after the last step to evaluate "
                     "each final checkpoint on.", lower_bound=1)
FLAGS = flags.FLAGS

CACHE = "leaderboard.json"


class LeaderboardError(UserError, ValueError):
    """The sweep's summary is missing or unreadable."""


def run_measures(workdir: str, fresh_batches: int) -> dict:
    """The measures of one finished run (see the module docstring), cached in the workdir by
    its checkpoint step and the batch count."""
    step = latest_checkpoint_step(workdir)
    path = os.path.join(workdir, CACHE)
    if os.path.exists(path):
        with open(path) as f:
            cached = json.load(f)
        if cached.get("checkpoint_step") == step and cached.get("fresh_batches") == fresh_batches:
            return cached
    config = recorded_config(workdir)
    exp, state, step, batches = restore_run(config, workdir, "measure", data_position=True)
    fresh = next_batches_loss(exp, state, batches, fresh_batches)
    series = layer_series(read_metrics(workdir))
    early = DEFAULT_RULE.early_layers
    c_min = min(float(np.nanmin(series[f"c_min_{kind}"][1])) for kind in ("attn", "ffn"))
    _, grad_LxS = series["dldx_norm_attn"]
    ratio = grad_LxS[:early, 0] / grad_LxS[:early, -1]
    updates = [series[f"update_norm_{group}"][1][:early, -1] for group in ("attn", "ffn")
               if f"update_norm_{group}" in series]
    measures = {
        "checkpoint_step": int(step), "fresh_batches": fresh_batches,
        "fresh_loss": fresh["loss"], "fresh_floor": fresh["floor"], "lfreq": fresh["lfreq"],
        "fresh_loss_over_lfreq": fresh["loss_over_lfreq"],
        "min_c": c_min,
        "dldx_first_over_last_early": float(np.exp(np.mean(np.log(ratio)))),
        "update_norm_early": float(np.mean(np.sqrt(sum(u**2 for u in updates)))),
    }
    write_json_atomic(path, measures)
    return measures


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
            "collapsed": summary["collapse"]["collapsed"],
            "collapse_step": summary["collapse"]["collapse_step"],
            **run_measures(workdir, fresh_batches)}


def read_sweep_rows(out_dir: str) -> list[dict]:
    path = os.path.join(out_dir, "summary.json")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise LeaderboardError(f"{path} cannot be read ({err}): run python -m experiments.sweep "
                               "--sweep configs/sweeps/leaderboard.py --out_dir "
                               f"{out_dir} (with --report_only to only tabulate)") from err


def _mean_sd(values: list[float]) -> str:
    if not values:
        return "–"
    return f"{np.mean(values):.3f} ± {np.std(values):.3f}" if len(values) > 1 else \
        f"{values[0]:.3f}"


def aggregate(rows: list[dict]) -> list[dict]:
    """One entry per (method, lr): the seeds finished and their measures."""
    groups: dict[tuple[str, float], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["method"], row["opt.lr"]), []).append(row)
    pre = {lr: [r["fresh_loss_over_lfreq"] for r in rows_ if r.get("fresh_loss_over_lfreq")]
           for (method, lr), rows_ in groups.items() if method == "pre"}
    out = []
    for method in METHODS:
        for lr in sorted({lr for m, lr in groups if m == method}):
            done = [r for r in groups[(method, lr)] if r["status"] in ("done", "nonfinite")]
            fresh = [r["fresh_loss_over_lfreq"] for r in done if r.get("fresh_loss_over_lfreq")]
            out.append({
                "method": method, "lr": lr, "seeds_planned": len(groups[(method, lr)]),
                "seeds_done": len(done),
                "collapsed": sum(bool(r.get("collapsed")) for r in done),
                "nonfinite": sum(r["status"] == "nonfinite" for r in done),
                "fresh_loss_over_lfreq": fresh,
                "gap_to_pre": (float(np.mean(fresh) - np.mean(pre[lr]))
                               if fresh and pre.get(lr) else None),
                "min_c": min((r["min_c"] for r in done if "min_c" in r), default=None),
                "dldx_first_over_last_early": [r["dldx_first_over_last_early"] for r in done
                                               if "dldx_first_over_last_early" in r],
                "update_norm_early": [r["update_norm_early"] for r in done
                                      if "update_norm_early" in r],
                "wall_s": [r["wall_s"] for r in done if r.get("wall_s")],
            })
    return out


def markdown(entries: list[dict], fresh_batches: int) -> str:
    header = ["method", "lr", "seeds", "collapsed", f"loss / L_freq ({fresh_batches} fresh "
              "batches)", "gap to pre", "min c", "early ‖∂L/∂X‖ first / last",
              "early update norm", "train s"]
    rows = [[e["method"], f"{e['lr']:g}", f"{e['seeds_done']}/{e['seeds_planned']}",
             f"{e['collapsed']}/{e['seeds_done']}" + (f" ({e['nonfinite']} non-finite)"
                                                       if e["nonfinite"] else ""),
             _mean_sd(e["fresh_loss_over_lfreq"]), cell(e["gap_to_pre"], "+.3f"),
             cell(e["min_c"], ".3f"), cell([float(v) for v in e["dldx_first_over_last_early"]],
                                           ".3g"),
             cell([float(v) for v in e["update_norm_early"]], ".3g"),
             cell(float(np.mean(e["wall_s"])) if e["wall_s"] else None, ".0f")]
            for e in entries]
    return "\n".join(markdown_table(header, rows)) + "\n"


def plot(path: str, rows: list[dict]) -> None:
    """Fresh-batch loss / L_freq per run, methods along x, one marker per seed; collapsed runs
    as red crosses."""
    lrs = sorted({r["opt.lr"] for r in rows})
    methods = list(METHODS)
    fig, ax = plt.subplots(figsize=(12, 4.5))
    for k, lr in enumerate(lrs):
        for i, method in enumerate(methods):
            for r in rows:
                if r["method"] != method or r["opt.lr"] != lr or "fresh_loss_over_lfreq" not in r:
                    continue
                x = i + (k - (len(lrs) - 1) / 2) * 0.25
                ax.plot(x, r["fresh_loss_over_lfreq"], "x" if r.get("collapsed") else "o",
                        color="C3" if r.get("collapsed") else f"C{k}", markersize=6)
        ax.plot([], [], "o", color=f"C{k}", label=f"lr {lr:g}")
    ax.plot([], [], "x", color="C3", label="collapsed")
    ax.axhline(1.0, color="k", linewidth=0.8)
    ax.set_xticks(range(len(methods)), methods, rotation=30, ha="right")
    ax.set_ylabel("loss / L_freq on fresh batches")
    ax.set_title("The collapse leaderboard: 48 layers, default CPU config, 300 steps")
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if (FLAGS.out_dir is None) == (FLAGS.runs is None):
        raise app.UsageError("give --out_dir (a leaderboard sweep) or --runs (run directories)")
    if FLAGS.runs is not None:
        for workdir in FLAGS.runs:
            print(json.dumps(single_run(workdir, FLAGS.fresh_batches)))
        return
    rows = []
    for row in read_sweep_rows(FLAGS.out_dir):
        row = {**row, "method": method_of(row)}
        if row["status"] == "done":
            logging.info("measuring %s", row["run_id"])
            row.update(run_measures(os.path.join(FLAGS.out_dir, row["workdir"]),
                                    FLAGS.fresh_batches))
        rows.append(row)
    entries = aggregate(rows)
    write_json_atomic(os.path.join(FLAGS.out_dir, "leaderboard.json"),
                      {"runs": rows, "methods": entries, "fresh_batches": FLAGS.fresh_batches})
    table = markdown(entries, FLAGS.fresh_batches)
    write_bytes_atomic(os.path.join(FLAGS.out_dir, "leaderboard.md"), table.encode())
    plot(os.path.join(FLAGS.out_dir, "leaderboard.png"), rows)
    print(table)


if __name__ == "__main__":
    app.run(exit_on_error(main))
