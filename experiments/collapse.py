"""Stage II: Post-Norm against Pre-Norm trained with the same seeds, data and learning rate; the
collapse transition, its per-layer diagnostics and Theorem 3.8 on the trained checkpoints.

    python -m experiments.collapse --out_dir DIR [--seeds 0,1,2] [--config configs/default.py]
        [--steps N] [--norms post,pre] [--thm38] [--train_batches N] [--workers N]

Each (norm, seed) trains with ``train_and_evaluate`` into ``DIR/<norm>_seed<k>``; a rerun skips
finished runs and resumes partial ones (``postnorm.sweep.record``). With ``--workers N`` the runs
train, and Thm 3.8 is measured on them, in N processes pinned to disjoint CPU sets
(``postnorm.sweep.workers``) before the analysis.
The seed sets both the initialisation and the data order, so Post and Pre with the same seed see
the same batches.
Collapse is detected by the rule of ``postnorm.analysis.collapse``. Writes to DIR:

* ``figures/loss_vs_lfreq.png``: every run's train loss against L_freq;
* ``figures/<run>_layers.png``, ``_dldx.png``, ``_tsim.png``: sqrt(d)/||y_k|| and c_k, ||dL/dX_k||
  and the tsim heatmap, with the transition window shaded (``postnorm.analysis.collapse_figures``);
* ``<run>/thm38.json``: Thm 3.8 on the run's final checkpoint (``postnorm.analysis.thm38``), and
  that checkpoint's loss on the next ``--train_batches`` training batches;
* ``summary.json`` and ``summary.md``: per run and per norm, and the wall times;
* ``table.md``: one line per run, the figures the docs quote (``headline_table``).

``--report_only`` trains and measures nothing: it rewrites ``table.md`` from DIR's
``summary.json``.
"""

import copy
import json
import os
import time

import jax
import ml_collections
import numpy as np
from absl import app, flags, logging
from ml_collections import config_flags

from postnorm.analysis import thm38 as thm38_measure
from postnorm.analysis.collapse import Collapse, detect_collapse
from postnorm.analysis.collapse_figures import plot_loss_runs, render_collapse_figures
from postnorm.analysis.tables import cell, markdown_table
from postnorm.config import ConfigError
from postnorm.config.args import parse_flags
from postnorm.config.list_flags import choice_list, integer_list
from postnorm.data import DataError, load_data
from postnorm.errors import exit_on_error
from postnorm.files import dumps, from_text, make_output_dir, write_bytes_atomic, write_json_atomic
from postnorm.model import PLACEMENTS
from postnorm.runtime.allocator import use_allocator
from postnorm.sweep.record import run_once
from postnorm.sweep.workers import check_workers, run_pinned
from postnorm.train.validate import check_config
from postnorm.workdir.layout import Workdir
from postnorm.workdir.metrics import read_metrics

config_flags.DEFINE_config_file("config", "configs/default.py", "Base config (norm and seed are "
                                "set per run).", lock_config=False)
flags.DEFINE_string("out_dir", None, "Directory for the runs, figures and summaries.")
flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds; each runs with every norm.")
flags.DEFINE_list("norms", ["post", "pre"], "Norm placements to compare.")
flags.DEFINE_integer("steps", None, "Override train.steps.", lower_bound=1)
flags.DEFINE_bool("thm38", True, "Measure Thm 3.8 on every run's final checkpoint.")
flags.DEFINE_integer("train_batches", 0, "With --thm38: also the final checkpoint's loss on the "
                     "next this many training batches (not trained on); 0: not measured. Packed "
                     "windows of one document follow each other, so the batches' mean floor "
                     "nears L_freq slowly: within about 1% at 512 (default config, seeds 0-2).",
                     lower_bound=0)
flags.DEFINE_integer("workers", 1, "Train the runs in this many CPU-pinned processes.")
flags.DEFINE_bool("report_only", False, "Train nothing: rewrite --out_dir's table.md from its "
                  "summary.json.")
FLAGS = flags.FLAGS


def seeded_config(base: ml_collections.ConfigDict, norm: str, seed: int,
                  steps: int | None) -> ml_collections.ConfigDict:
    config = copy.deepcopy(base)
    config.model.norm, config.seed = norm, seed
    if steps is not None:
        config.train.steps = steps
    return config


def thm38(config: ml_collections.ConfigDict, workdir: str, train_batches: int) -> dict:
    """The run's Thm 3.8 record, measured once per final checkpoint and ``train_batches``."""
    path = Workdir(workdir).thm38
    cached = _recorded_thm38(path)
    if cached is not None:
        measured_batches = cached.get("next_train_batches", {}).get("batches", 0)
        if (cached["checkpoint_step"] == config.train.steps
                and train_batches in (0, measured_batches)):
            return cached
    start = time.perf_counter()
    result = thm38_measure.measure_run(config, workdir, train_batches)
    result["wall_s"] = time.perf_counter() - start
    write_json_atomic(path, result)
    return result


def _recorded_thm38(path: str) -> dict | None:
    """The Thm 3.8 record at ``path``; None when there is none, or when it cannot be read or
    lacks its fields (it is then measured again and replaced)."""
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            record = from_text(json.load(f))
        markdown([], [thm38_row("", record)], {"invocation_s": 0.0, "train_sum_s": 0.0})
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as err:
        logging.warning("%s is unreadable or incomplete (%s: %s); measuring it again", path,
                        type(err).__name__, err)
        return None
    return record


def train_and_measure(config: ml_collections.ConfigDict, workdir: str, measure: bool,
                      train_batches: int) -> str:
    """Train one run (``run_once``) and, if ``measure`` and it finished, record Thm 3.8 on its
    final checkpoint; the unit of work of a worker process. Returns the run's status."""
    result = run_once(config, workdir)
    if measure and result["status"] == "done":
        thm38(config, workdir, train_batches)
    return result["status"]


def run_row(name: str, result: dict, collapse: Collapse | None) -> dict:
    """One run's summary row; ``collapsed`` is None for a run that did not finish (``done``)."""
    done = result["status"] == "done"
    collapse = collapse if done else None
    return {
        "run": name, "status": result["status"],
        "final_train_loss": result.get("final_train_loss"), "lfreq": result.get("lfreq"),
        "loss_over_lfreq": result.get("train_loss_over_lfreq"),
        "final_train_floor": result.get("final_train_floor"),
        "loss_over_floor": result.get("train_loss_over_floor"),
        "eval_loss_over_floor": result.get("eval_loss_over_floor"),
        "collapsed": bool(collapse and collapse.collapsed) if done else None,
        "collapse_step": collapse.collapse_step if collapse else None,
        "window": collapse.window if collapse else None,
        "similar_layers_step": collapse.similar_layers_step if collapse else None,
        "pre_window_step": collapse.pre_window_step if collapse else None,
        "grad_ratio_early": collapse.grad_ratio_early if collapse else None,
        "grad_ratio_last": collapse.grad_ratio_last if collapse else None,
        "grad_first_over_last_early": result.get("dldx_first_over_last_early_layers"),
        "grad_first_over_last_last": result.get("dldx_first_over_last_last_layer"),
        "fraction_tsim_ge_0.99_final": result.get("fraction_of_layers_tsim_ge_0.99"),
        "skipped_steps": result.get("skipped_steps"), "rollbacks": result.get("rollbacks"),
        "train_wall_s": result["wall_s"],
    }


def norm_summary(rows: list[dict], norms: list[str]) -> dict:
    """Per norm placement: how many runs, how many finished (``done``) and collapsed, and the
    mean and sd of final loss / L_freq over the finished runs; runs stopped by a non-finite
    step are counted as ``stopped``, not averaged."""
    out = {}
    for norm in norms:
        runs = [r for r in rows if r["run"].startswith(norm + "_")]
        done = [r for r in runs if r["status"] == "done"]
        if not runs:
            continue
        ratios = [r["loss_over_lfreq"] for r in done if r["loss_over_lfreq"] is not None]
        out[norm] = {
            "runs": len(runs), "done": len(done), "stopped": len(runs) - len(done),
            "collapsed": sum(bool(r["collapsed"]) for r in done),
            "loss_over_lfreq_mean": float(np.mean(ratios)) if ratios else None,
            "loss_over_lfreq_sd": float(np.std(ratios, ddof=1)) if len(ratios) > 1 else None,
            "loss_over_floor": [r["loss_over_floor"] for r in done]}
    return out


def thm38_row(name: str, record: dict) -> dict:
    bound, point = record["bound"], record["stationary_point"]
    return {
        "run": name, "checkpoint_step": record["checkpoint_step"], "n": bound["n"],
        "sequences": bound["sequences"], **{f"mean_{k}": v for k, v in bound["mean"].items()},
        "w_lm_spectral_norm": bound["w_lm_spectral_norm"],
        "bound_holds_fraction": bound["bound_holds_fraction"], "min_slack": bound["min_slack"],
        "kl_pfreq_qbar": bound["kl_pfreq_qbar"], "lfreq_corpus": bound["lfreq_corpus"],
        **point_columns(point),
        **{f"next_{k}": v for k, v in record.get("next_train_batches", {}).items()
           if k not in ("losses", "floors")},
    }


def point_columns(point: dict) -> dict:
    """Thm 3.8(ii)'s columns; None where the point was skipped (``thm38.point_unavailable``)."""
    if "skipped" in point:
        return dict.fromkeys(("point_loss_minus_lfreq", "point_hidden_eps_max",
                              "point_max_abs_grad", "control_max_abs_grad"))
    return {"point_loss_minus_lfreq": point["loss"] - point["lfreq_batch"],
            "point_hidden_eps_max": point["hidden_eps_max"],
            "point_max_abs_grad": point["at_point"]["max_abs_grad"],
            "control_max_abs_grad": point["control"]["max_abs_grad"]}


RUN_COLUMNS = (  # (header, row key, format)
    ("run", "run", ""), ("status", "status", ""), ("final train loss", "final_train_loss", ".4f"),
    ("L_freq", "lfreq", ".4f"), ("loss/L_freq", "loss_over_lfreq", ".3f"),
    ("floor of those batches", "final_train_floor", ".4f"),
    ("loss/floor", "loss_over_floor", ".3f"),
    ("eval loss/floor", "eval_loss_over_floor", ".3f"), ("collapsed", "collapsed", ""),
    ("collapse step", "collapse_step", ""), ("window", "window", "d"),
    ("half the layers at tsim ≥ 0.99", "similar_layers_step", ""),
    ("grad ratio across window, layers 0-3", "grad_ratio_early", ".3g"),
    ("last layer", "grad_ratio_last", ".3g"),
    ("grad step 1/last, layers 0-3", "grad_first_over_last_early", ".3g"),
    ("last layer", "grad_first_over_last_last", ".3g"), ("skipped steps", "skipped_steps", ""),
    ("train wall s", "train_wall_s", ".0f"))
THM_COLUMNS = (
    ("run", "run", ""), ("loss", "mean_loss", ".4f"), ("L_freq(p_hat)", "mean_lfreq_seq", ".4f"),
    ("eps", "mean_eps", ".3g"), ("bound", "mean_bound", ".3g"),
    ("bound holds", "bound_holds_fraction", ".2f"),
    ("loss at x_bar", "mean_collapsed_prediction_loss", ".4f"),
    ("KL(p_freq‖q̄)", "kl_pfreq_qbar", ".4f"),
    ("p_freq point: loss − L_freq", "point_loss_minus_lfreq", ".2e"),
    ("max\\|grad\\| point", "point_max_abs_grad", ".2e"),
    ("max\\|grad\\| control", "control_max_abs_grad", ".2e"))
NEXT_COLUMNS = (
    ("run", "run", ""), ("loss", "next_loss", ".4f"), ("floor", "next_floor", ".4f"),
    ("L_freq", "next_lfreq", ".4f"), ("loss/L_freq", "next_loss_over_lfreq", ".3f"),
    ("loss/floor", "next_loss_over_floor", ".3f"))


def _table(columns: tuple[tuple[str, str, str], ...], rows: list[dict]) -> list[str]:
    return markdown_table([header for header, _, _ in columns],
                          [[cell(row[key], spec) for _, key, spec in columns] for row in rows])


def markdown(rows: list[dict], thm_rows: list[dict], wall: dict) -> str:
    lines = _table(RUN_COLUMNS, rows)
    if thm_rows:
        lines += ["", "Theorem 3.8 on the final checkpoints (means over the validation "
                  "sequences; eps = ||X_H - Pi_1 X_H||_F):", "", *_table(THM_COLUMNS, thm_rows)]
    if thm_rows and "next_batches" in thm_rows[0]:
        lines += ["", f"The final checkpoints on the next {thm_rows[0]['next_batches']} training "
                  "batches (not trained on; floor: their mean frequency floor):", "",
                  *_table(NEXT_COLUMNS, thm_rows)]
    lines += ["", f"Wall time of this invocation: {wall['invocation_s']:.0f} s; training time "
              f"summed over the runs (including earlier invocations): {wall['train_sum_s']:.0f} s."]
    return "\n".join(lines) + "\n"


def _range(values: list[float] | None, spec: str) -> str:
    """The least and the largest of ``values`` as a factor, "–" for None."""
    if values is None:
        return "–"
    return f"{format(min(values), spec)}–{format(max(values), spec)}×"


def headline_table(summary: dict) -> str:
    """``table.md`` from a ``summary.json``: per run, loss over L_freq and over the floors, the
    next training batches' loss where measured, the layers alike at the end, the collapse
    verdict, and how far the early layers' gradient fell."""
    thm = {r["run"]: r for r in summary["thm38"]}
    batches = next((r["next_batches"] for r in summary["thm38"] if "next_batches" in r), None)
    fresh = f"next {batches} batches" if batches else "next batches"
    header = ["run", "train loss / L_freq", "/ floor of those batches",
              f"{fresh}: loss / L_freq", "/ their floor", "eval loss / floor",
              "layers at tsim ≥ 0.99, last step", "collapse step, window",
              "early-layer ‖∂L/∂X‖ across the window (layers 0–3)", "last layer",
              "early-layer ‖∂L/∂X‖, step 1 / last"]
    rows = []
    for run in summary["runs"]:
        next_run = thm.get(run["run"], {})
        fraction = run["fraction_tsim_ge_0.99_final"]
        rows.append([
            run["run"], cell(run["loss_over_lfreq"], ".3f"), cell(run["loss_over_floor"], ".3f"),
            cell(next_run.get("next_loss_over_lfreq"), ".3f"),
            cell(next_run.get("next_loss_over_floor"), ".3f"),
            cell(run["eval_loss_over_floor"], ".3f"),
            "–" if fraction is None else f"{fraction:.0%}",
            (f"{run['collapse_step']}, [{run['window'][0]}, {run['window'][1]}]"
             if run["collapsed"] else cell(run["collapsed"])),
            _range(run["grad_ratio_early"], ".3g"),
            "–" if run["grad_ratio_last"] is None else f"{run['grad_ratio_last']:.3g}×",
            _range(run["grad_first_over_last_early"], ".3g")])
    return "\n".join(markdown_table(header, rows)) + "\n"


def write_table(out_dir: str, summary: dict) -> None:
    write_bytes_atomic(os.path.join(out_dir, "table.md"), headline_table(summary).encode())


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if FLAGS.out_dir is None:
        raise app.UsageError("--out_dir is required")
    if FLAGS.report_only:
        path = os.path.join(FLAGS.out_dir, "summary.json")
        if not os.path.exists(path):
            raise app.UsageError(f"--report_only reads {path}, which does not exist")
        with open(path) as f:
            write_table(FLAGS.out_dir, from_text(json.load(f)))
        return
    check_workers(FLAGS.workers)
    use_allocator(FLAGS.config.runtime.allocator)  # may re-execute this command
    start = time.perf_counter()
    norms = choice_list("norms", FLAGS.norms, tuple(PLACEMENTS))
    seeds = integer_list("seeds", FLAGS.seeds, 0)
    runs = [(f"{norm}_seed{seed}", seeded_config(FLAGS.config, norm, seed, FLAGS.steps))
            for norm in norms for seed in seeds]
    devices = jax.device_count()
    for name, config in runs:  # every run's config before anything is written
        try:
            check_config(config, device_count=devices, process_count=jax.process_count())
        except (ConfigError, DataError) as err:
            raise type(err)(f"run {name}: {err}") from err
    out_dir = make_output_dir(os.path.abspath(FLAGS.out_dir), "--out_dir")
    fig_dir = make_output_dir(os.path.join(out_dir, "figures"), "--out_dir's figures")
    if FLAGS.workers > 1:
        load_data(runs[0][1].data, seed=runs[0][1].seed)  # build the shared caches once
        run_pinned(train_and_measure,
                   [(config, os.path.join(out_dir, name), FLAGS.thm38, FLAGS.train_batches)
                    for name, config in runs],
                   FLAGS.workers)
    rows, thm_rows, all_records = [], [], {}
    for name, config in runs:
        workdir = os.path.join(out_dir, name)
        result = run_once(config, workdir)
        records = all_records[name] = read_metrics(workdir)
        collapse = detect_collapse(records) if "collapse" in result else None
        render_collapse_figures(records, collapse, fig_dir, prefix=f"{name}_")
        rows.append(run_row(name, result, collapse))
        if FLAGS.thm38 and result["status"] == "done":
            thm_rows.append(thm38_row(name, thm38(config, workdir, FLAGS.train_batches)))
        logging.info("%s: %s", name, dumps(rows[-1]))
    plot_loss_runs(all_records, os.path.join(fig_dir, "loss_vs_lfreq.png"))
    wall = {"invocation_s": time.perf_counter() - start,
            "train_sum_s": float(sum(r["train_wall_s"] for r in rows))}
    by_norm = norm_summary(rows, norms)
    summary = {"runs": rows, "by_norm": by_norm, "thm38": thm_rows, "wall": wall}
    write_json_atomic(os.path.join(out_dir, "summary.json"), summary)
    write_table(out_dir, summary)
    write_bytes_atomic(os.path.join(out_dir, "summary.md"), markdown(rows, thm_rows, wall).encode())
    print(markdown(rows, thm_rows, wall))
    print(dumps(by_norm, indent=2))


if __name__ == "__main__":
    app.run(exit_on_error(main), flags_parser=parse_flags)
