"""Gradient repair (improvement 2) against its controls, from recorded runs' diagnostics.

    python -m experiments.repair_study --runs_under runs/training_methods \
        --out_dir results/figures/repair

For every finished Post-Norm run among the runs given that changes nothing but (possibly)
``train.grad_repair``, the optimizer and the depth (``configs/sweeps/training_methods.py``,
groups ``repair`` and ``depth96``), at the diagnostic steps:

* each layer's parameter update norm (attention, FFN and norm gains together), and its mean over
  the early layers (0 .. 3, the collapse rule's) and the last four: what the bottom of the stack
  still moves, the quantity repair is meant to restore; beside it, under AdamW, the norm of the
  decoupled weight-decay step alone (lr * weight_decay * ||decayed parameters||), what a layer
  whose gradient carries nothing still moves;
* the true ||dL/dX|| at the early layers' attention input, first diagnostic step over the last
  (geometric mean over the early layers; a tap at exactly 0 is left out and counted);
* with repair, the cosine of the repaired and the true parameter gradient (per layer, and over
  every parameter): how far the update leaves the loss's gradient;
* the collapse verdict (the project's rule) and the loss over L_freq at the end of training,
  and on the training batches after the last step where the sweep measured the run
  (``--fresh_batches``).

Pairs each repaired run with the unrepaired run of the same optimizer, lr, depth and seed.
Writes ``summary.json``, ``summary.md`` and ``repair.png`` to --out_dir.
"""

import collections
import os

import matplotlib
import numpy as np
from absl import app, flags

from postnorm.analysis.backward import geometric_mean
from postnorm.analysis.collapse import DEFAULT_RULE, detect_collapse
from postnorm.analysis.figures import save_figure
from postnorm.analysis.run_measures import cached_measures
from postnorm.analysis.tables import cell, markdown_table
from postnorm.errors import UserError, exit_on_error
from postnorm.files import make_output_dir, write_bytes_atomic, write_json_atomic
from postnorm.sweep.record import run_metrics_summary
from postnorm.workdir.config_record import recorded_config
from postnorm.workdir.metrics import find_runs, layer_series, read_metrics

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

flags.DEFINE_list("runs", [], "Run directories.")
flags.DEFINE_list("runs_under", [], "Directories whose every run (a metrics.jsonl below them) is "
                  "read.")
flags.DEFINE_string("out_dir", None, "Directory for summary.json, summary.md and the figure.")
FLAGS = flags.FLAGS

EARLY = DEFAULT_RULE.early_layers
GROUPS = ("attn", "ffn", "norm")


class NoRunsError(UserError):
    """No finished run of the repair study was given."""


class StudyInputError(UserError):
    """A run the study cannot read, or two runs of one setting."""


def is_repair_study_run(config: dict) -> bool:
    """A Post-Norm run with no other remedy: no regulariser, z-loss, monitor action, budget,
    similarity-aware init or other arrangement."""
    return (config["model"]["norm"] == "post" and not config["opt"].get("diversity_weight")
            and not config["opt"].get("z_loss")
            and config.get("monitor", {}).get("action", "none") == "none"
            and config["model"].get("residual_budget", "none") == "none"
            and not config["model"].get("init_tsim_target")
            and not config["model"].get("qk_norm"))


def layer_update_norms(series: dict) -> tuple[np.ndarray, np.ndarray]:
    """(steps [S], [n_layers, S]): each layer's whole parameter update norm, its groups'
    norms added in quadrature."""
    parts = [series[f"update_norm_{g}"] for g in GROUPS if f"update_norm_{g}" in series]
    if not parts:
        raise ValueError("the records hold no diag/update_norm_*: no diagnostic step ran")
    steps = parts[0][0]
    return steps, np.sqrt(sum(values ** 2 for _, values in parts))


def _finite(reduce, values: np.ndarray) -> float | None:
    """``reduce`` over the finite values; None when there are none."""
    finite = values[np.isfinite(values)]
    return float(reduce(finite)) if finite.size else None


def decay_only_update(records: list[dict], series: dict, config: dict,
                      step: int) -> np.ndarray | None:
    """Per layer, the norm of AdamW's decoupled weight-decay step alone at ``step``,
    lr * weight_decay * ||the layer's decayed parameters||: what a layer whose gradient carries
    nothing still moves. None for another optimizer."""
    opt = config["opt"]
    if opt["optimizer"] != "adamw":
        return None
    lrs = [r["train/lr"] for r in records if r["step"] == step and "train/lr" in r]
    groups = ("attn", "ffn", "norm") if opt.get("decay_norms_and_embeddings") else ("attn", "ffn")
    steps = series["param_norm_attn"][0]
    column = int(np.flatnonzero(steps == step)[0])
    params_L = np.sqrt(sum(series[f"param_norm_{g}"][1][:, column] ** 2 for g in groups
                           if f"param_norm_{g}" in series))
    return lrs[0] * opt["weight_decay"] * params_L if lrs else None


def run_record(workdir: str) -> dict:
    """One run's update norms, true-gradient fall, repair cosines and verdict (only
    ``finished: False`` for a run short of train.steps)."""
    records = read_metrics(workdir)
    config = recorded_config(workdir)
    if max((r["step"] for r in records), default=0) < config["train"]["steps"]:
        return {"workdir": workdir, "finished": False}
    series = layer_series(records)
    try:
        steps, update_LxS = layer_update_norms(series)
    except ValueError as err:
        raise StudyInputError(f"{workdir}: {err}; train it with diag.every > 0") from err
    decay_L = decay_only_update(records, series, config, int(steps[-1]))
    dldx_LxS = series["dldx_norm_attn"][1]
    ratio_early = dldx_LxS[:EARLY, 0] / dldx_LxS[:EARLY, -1]
    collapse = detect_collapse(records)
    summary = run_metrics_summary(workdir)
    cos = series.get("repair_cos")
    cos_all = [r["diag/repair_cos_all"] for r in records if "diag/repair_cos_all" in r]
    fresh = cached_measures(workdir) or {}
    return {
        "workdir": workdir, "optimizer": config["opt"]["optimizer"],
        "lr": config["opt"]["lr"], "n_layers": config["model"]["n_layers"],
        "warmup": config["opt"]["warmup_steps"], "weight_decay": config["opt"]["weight_decay"],
        "steps_planned": config["train"]["steps"],
        "seed": config["seed"], "repair": bool(config["train"]["grad_repair"]),
        "finished": max(r["step"] for r in records) >= config["train"]["steps"],
        "collapsed": collapse.collapsed, "collapse_step": collapse.collapse_step,
        "fraction_tsim_ge_0.99_last": collapse.fraction_collapsed[-1],
        "train_loss_over_lfreq": summary.get("train_loss_over_lfreq"),
        "eval_loss_over_floor": summary.get("eval_loss_over_floor"),
        # the cross-entropy on the training batches after the last step, where the sweep
        # measured the run (experiments.sweep --fresh_batches)
        "fresh_loss_over_lfreq": fresh.get("fresh_loss_over_lfreq"),
        "fresh_batches": fresh.get("fresh_batches"),
        "steps": steps.tolist(),
        "update_norm_last": update_LxS[:, -1].tolist(),
        "update_norm_early": update_LxS[:EARLY].mean(axis=0).tolist(),
        "update_norm_late": update_LxS[-EARLY:].mean(axis=0).tolist(),
        "decay_only_update_early": None if decay_L is None else float(decay_L[:EARLY].mean()),
        # zero taps (float32 underflow) are left out of the mean and counted
        "true_dldx_first_over_last_early": float(geometric_mean(ratio_early)),
        "true_dldx_vanished_early": int(np.sum(dldx_LxS[:EARLY, -1] == 0)),
        # a layer whose true gradient underflowed to 0 has no cosine (NaN): left out, counted
        "repair_cos_last_median": None if cos is None else _finite(np.median, cos[1][:, -1]),
        "repair_cos_last_min": None if cos is None else _finite(np.min, cos[1][:, -1]),
        "repair_cos_undefined": None if cos is None else int(np.sum(~np.isfinite(
            cos[1][:, -1]))),
        "repair_cos_all_last": cos_all[-1] if cos_all else None,
    }


def pairs(rows: list[dict]) -> list[dict]:
    """Each repaired run beside the unrepaired run of the same setting and seed: the early and
    the late layers' update norm at the last diagnostic step, repaired over plain."""
    by_key = collections.defaultdict(dict)
    for row in rows:
        key = (row["optimizer"], row["lr"], row["n_layers"], row["seed"], row["warmup"],
               row["weight_decay"], row["steps_planned"])
        if row["repair"] in by_key[key]:
            raise StudyInputError(f"{by_key[key][row['repair']]['workdir']} and "
                                  f"{row['workdir']} are runs of one setting: give one of them")
        by_key[key][row["repair"]] = row
    out = []
    for (optimizer, lr, n_layers, seed, *_), runs in sorted(by_key.items()):
        if set(runs) != {False, True}:
            continue
        plain, repaired = runs[False], runs[True]
        out.append({
            "optimizer": optimizer, "lr": lr, "n_layers": n_layers, "seed": seed,
            "collapsed": [plain["collapsed"], repaired["collapsed"]],
            "early_update_repaired_over_plain": repaired["update_norm_early"][-1]
            / plain["update_norm_early"][-1],
            "late_update_repaired_over_plain": repaired["update_norm_late"][-1]
            / plain["update_norm_late"][-1],
        })
    return out


def _setting(row: dict) -> str:
    return (f"{row['optimizer']} lr {row['lr']:g}, {row['n_layers']} layers"
            + (f", seed {row['seed']}" if row["seed"] else ""))


def _fall(row: dict) -> str:
    """The early layers' true-gradient fall, with how many of them ended at exactly 0."""
    vanished = row["true_dldx_vanished_early"]
    if vanished == EARLY:
        return f"all {EARLY} at 0 (underflowed)"
    return (f"{row['true_dldx_first_over_last_early']:.3g}"
            + (f" ({vanished} at 0, left out)" if vanished else ""))


def markdown(rows: list[dict], paired: list[dict]) -> str:
    lines = ["## Per run, at the last diagnostic step", ""]
    lines += markdown_table(
        ["setting", "repair", "collapsed (step)", "layers tsim ≥ 0.99", "loss / L_freq (train)",
         "loss / L_freq (fresh batches)",
         "update norm, layers 0-3", "their weight decay alone (AdamW)",
         "update norm, last 4 layers", "early / last",
         "true early ‖∂L/∂X‖ first / last", "repair cos: median, min over layers",
         "repair cos, all parameters"],
        [[_setting(r), "yes" if r["repair"] else "no",
          f"{cell(r['collapsed'])} ({cell(r['collapse_step'])})",
          f"{r['fraction_tsim_ge_0.99_last']:.0%}", cell(r["train_loss_over_lfreq"], ".3f"),
          ("–" if r["fresh_loss_over_lfreq"] is None else
           f"{r['fresh_loss_over_lfreq']:.3f} ({r['fresh_batches']})"),
          f"{r['update_norm_early'][-1]:.3g}", cell(r["decay_only_update_early"], ".3g"),
          f"{r['update_norm_late'][-1]:.3g}",
          f"{r['update_norm_early'][-1] / r['update_norm_late'][-1]:.3g}",
          _fall(r),
          ("–" if r["repair_cos_last_median"] is None else
           f"{r['repair_cos_last_median']:.3f}, {r['repair_cos_last_min']:.3f}"
           + (f" ({r['repair_cos_undefined']} layers undefined: true gradient 0)"
              if r["repair_cos_undefined"] else "")),
          cell(r["repair_cos_all_last"], ".3f")] for r in rows])
    lines += ["", "## Repaired over plain, same setting and seed", ""]
    lines += markdown_table(
        ["setting", "collapsed: plain, repaired", "early layers' update norm", "last layers'"],
        [[_setting(p), ", ".join("yes" if c else "no" for c in p["collapsed"]),
          f"{p['early_update_repaired_over_plain']:.3g}×",
          f"{p['late_update_repaired_over_plain']:.3g}×"] for p in paired])
    return "\n".join(lines) + "\n"


def plot(path: str, rows: list[dict]) -> None:
    depths = sorted({r["n_layers"] for r in rows})
    fig, axes = plt.subplots(1, len(depths) + 1, figsize=(6 * (len(depths) + 1), 4.8))
    colors = {"adamw": "C0", "sgd": "C2"}
    for ax, depth in zip(axes, depths, strict=False):
        for row in (r for r in rows if r["n_layers"] == depth):
            ax.semilogy(row["update_norm_last"], "-" if row["repair"] else ":",
                        color=colors.get(row["optimizer"], "k"),
                        label=f"{row['optimizer']}, repair {'on' if row['repair'] else 'off'}"
                        + (" (collapsed)" if row["collapsed"] else ""))
        ax.set(xlabel="layer", ylabel="parameter update norm",
               title=f"{depth} layers: each layer's update at the last diagnostic step")
        ax.legend(fontsize=7)
    for row in rows:
        axes[-1].semilogy(row["steps"], row["update_norm_early"], "-" if row["repair"] else ":",
                          color=colors.get(row["optimizer"], "k"),
                          alpha=1.0 if row["n_layers"] == depths[0] else 0.5,
                          label=f"{row['n_layers']}L {row['optimizer']}, repair "
                          f"{'on' if row['repair'] else 'off'}")
    axes[-1].set(xlabel="step", ylabel="mean update norm, layers 0-3",
                 title="the early layers' update over training")
    axes[-1].legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


def main(argv: list[str]) -> None:
    del argv
    if FLAGS.out_dir is None:
        raise app.UsageError("--out_dir is required")
    chosen = [workdir for workdir in [*FLAGS.runs, *find_runs(FLAGS.runs_under)]
              if is_repair_study_run(recorded_config(workdir))]
    rows = [r for r in map(run_record, chosen) if r["finished"]]
    if not rows:
        raise NoRunsError("no finished Post-Norm run without another remedy among --runs and "
                          "--runs_under: give the runs of configs/sweeps/training_methods.py's "
                          "groups repair and depth96, each at train.steps")
    rows.sort(key=lambda r: (r["n_layers"], r["optimizer"], r["lr"], r["seed"], r["repair"]))
    paired = pairs(rows)
    out_dir = make_output_dir(os.path.abspath(FLAGS.out_dir), "--out_dir")
    table = markdown(rows, paired)
    write_json_atomic(os.path.join(out_dir, "summary.json"), {"runs": rows, "pairs": paired})
    write_bytes_atomic(os.path.join(out_dir, "summary.md"), table.encode())
    plot(os.path.join(out_dir, "repair.png"), rows)
    print(table)


if __name__ == "__main__":
    app.run(exit_on_error(main))
