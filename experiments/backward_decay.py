"""Thm 3.6 where it bites, and Thm 3.8(ii) on trained networks, from recorded runs' diagnostics.

    python -m experiments.backward_decay --runs DIR[,DIR...] --out_dir OUT
    python -m experiments.backward_decay --runs_under runs/leaderboard --methods post,pre \
        --out_dir OUT

For every finished run (a directory with ``metrics.jsonl`` and ``config.json``), from the taps
and contractions logged at each diagnostic step (``postnorm.analysis.backward``):

* each sublayer's backward ratio r_k = ||dL/dX_k|| / ||dL/dX_{k+1}|| beside its c_k;
* the geometric decay rate of ||dL/dX_k|| toward the input (least squares over the 2L + 1
  sublayer inputs, with its standard error) at every diagnostic step, and the geometric means
  of r_k and c_k over the sublayers;
* at the last step, the parameter-gradient norms of the layers with tsim >= 0.99 against the
  other layers, and against the same layers of the run of the other placement with the same
  learning rate and seed (Thm 3.8(ii) on the trained network and its real batch).

Writes ``summary.json``, ``summary.md`` and ``backward_decay.png`` (Post and Pre in one figure) to
--out_dir.
"""

import collections
import os

import matplotlib
import numpy as np
from absl import app, flags

from configs.sweeps.leaderboard import method_label
from postnorm.analysis import backward
from postnorm.analysis.collapse import detect_collapse
from postnorm.analysis.tables import cell, markdown_table
from postnorm.errors import UserError, exit_on_error
from postnorm.files import make_output_dir, write_bytes_atomic, write_json_atomic
from postnorm.workdir.config_record import recorded_config
from postnorm.workdir.metrics import find_runs, read_metrics

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

flags.DEFINE_list("runs", [], "Run directories (Post and Pre runs; each finished).")
flags.DEFINE_list("runs_under", [], "Directories whose every run (a metrics.jsonl below them) is "
                  "read.")
flags.DEFINE_list("methods", ["post", "pre"], "Keep the runs of these methods (the leaderboard's "
                  "names, configs/sweeps/leaderboard.py; else model.norm).")
flags.DEFINE_string("out_dir", None, "Directory for summary.json, summary.md and the figure.")
FLAGS = flags.FLAGS

COLORS = {"post": "C3", "pre": "C0"}


class NoRunsError(UserError):
    """No finished run was given."""


def quantiles(values: np.ndarray) -> dict[str, float]:
    """The 5th, 50th and 95th percentiles of the finite values (NaN: a ratio unknown because a
    gradient underflowed to 0)."""
    finite = values[np.isfinite(values)]
    return {f"p{q}": float(np.percentile(finite, q)) if finite.size else float("nan")
            for q in (5, 50, 95)}


def run_record(workdir: str) -> dict:
    """One run's per-step decay fits and ratios, its verdict, and its last step's gradients."""
    records = read_metrics(workdir)
    config = recorded_config(workdir)
    series = backward.sublayer_series(records)
    fits = [backward.fit_decay(series.dldx[:, column]) for column in range(len(series.steps))]
    ratios = series.ratios()
    last = int(series.steps[-1])
    return {
        "workdir": workdir, "method": method_label(config), "norm": config["model"]["norm"],
        "lr": config["opt"]["lr"], "seed": config["seed"], "n_layers": config["model"]["n_layers"],
        "warmup": config["opt"]["warmup_steps"],
        "finished": max(r["step"] for r in records) >= config["train"]["steps"],
        "collapsed": detect_collapse(records).collapsed,
        "steps": series.steps.tolist(),
        "rate": [f.rate for f in fits], "rate_stderr": [f.rate_stderr for f in fits],
        # sublayers whose ||dL/dX_k|| is exactly 0 (underflowed float32), left out of the fit
        "vanished": [f.vanished for f in fits],
        "ratio_geomean": backward.geometric_mean(ratios).tolist(),
        "c_geomean": backward.geometric_mean(series.contraction).tolist(),
        "ratios_last": ratios[:, -1].tolist(), "c_last": series.contraction[:, -1].tolist(),
        "dldx_first": series.dldx[:, 0].tolist(), "dldx_last": series.dldx[:, -1].tolist(),
        "ratios_all": ratios.ravel().tolist(), "c_all": series.contraction.ravel().tolist(),
        # over every sublayer and diagnostic step: r_k, and r_k / c_k (Post-Norm: ||I + J_F||)
        "ratio_quantiles": quantiles(ratios), "ratio_over_c_quantiles": quantiles(
            ratios / series.contraction),
        "last_step": last, "layer_grads_last": {
            k: v.tolist() for k, v in backward.layer_grads_at(records, last).items()},
    }


def with_similarity(rows: list[dict]) -> None:
    """Adds each row's Thm 3.8(ii) comparison, against the other placement's run with the same
    depth, lr, warmup and seed where one was given."""
    by_key = {(r["method"], r["n_layers"], r["lr"], r["warmup"], r["seed"]): r for r in rows}
    for row in rows:
        other = {"post": "pre", "pre": "post"}.get(row["method"])
        reference = by_key.get((other, row["n_layers"], row["lr"], row["warmup"], row["seed"]))
        grads = {k: np.asarray(v) for k, v in row["layer_grads_last"].items()}
        ref_grads = (None if reference is None else
                     {k: np.asarray(v) for k, v in reference["layer_grads_last"].items()})
        row["similarity"] = backward.grads_by_similarity(grads, ref_grads)
        row["reference"] = None if reference is None else reference["workdir"]


def by_setting(rows: list[dict]) -> list[dict]:
    """Per (norm, depth, lr): the last step's decay rate over seeds (mean, sd) and the runs'
    verdicts."""
    groups = collections.defaultdict(list)
    for row in rows:
        groups[(row["method"], row["n_layers"], row["lr"], row["warmup"])].append(row)
    out = []
    for (norm, n_layers, lr, _), group in sorted(groups.items()):
        rates = np.array([r["rate"][-1] for r in group])
        out.append({"norm": norm, "n_layers": n_layers, "lr": lr, "runs": len(group),
                    "collapsed": sum(r["collapsed"] for r in group),
                    "rate_last_mean": float(rates.mean()),
                    "rate_last_sd": float(rates.std(ddof=1)) if len(rates) > 1 else None,
                    "ratio_geomean_last_mean": float(np.mean([r["ratio_geomean"][-1]
                                                              for r in group])),
                    "c_geomean_last_mean": float(np.mean([r["c_geomean"][-1] for r in group]))})
    return out


def _quantile_cell(found: dict[str, float]) -> str:
    return f"{found['p50']:.3f} [{found['p5']:.3f}, {found['p95']:.3f}]"


def markdown(rows: list[dict], settings: list[dict]) -> str:
    lines = ["## Per run, at the last diagnostic step", ""]
    lines += markdown_table(
        ["norm", "layers", "lr", "seed", "collapsed", "decay rate per sublayer (± s.e.)",
         "sublayers at ‖dL/dX‖ = 0 (left out)", "geo. mean r_k", "geo. mean c_k",
         "r_k: median [5%, 95%], all steps",
         "r_k / c_k: median [5%, 95%]", "‖dL/dX_0‖ / ‖dL/dX_2L‖", "layers tsim ≥ 0.99",
         "attn grad: those layers / others", "the same layers in the other placement",
         "FFN grad: those / others", "the same, other placement"],
        [[r["norm"], str(r["n_layers"]), cell(r["lr"]), str(r["seed"]), cell(r["collapsed"]),
          f"{r['rate'][-1]:.4f} ± {r['rate_stderr'][-1]:.4f}", str(r["vanished"][-1]),
          f"{r['ratio_geomean'][-1]:.4f}", f"{r['c_geomean'][-1]:.4f}",
          _quantile_cell(r["ratio_quantiles"]), _quantile_cell(r["ratio_over_c_quantiles"]),
          f"{r['dldx_last'][0] / r['dldx_last'][-1]:.3g}",
          str(len(r["similarity"]["similar_layers"])),
          f"{cell(r['similarity']['attn_similar'], '.3g')} / "
          f"{cell(r['similarity']['attn_other'], '.3g')}",
          f"{cell(r['similarity'].get('attn_similar_reference'), '.3g')} / "
          f"{cell(r['similarity'].get('attn_other_reference'), '.3g')}",
          f"{cell(r['similarity']['ffn_similar'], '.3g')} / "
          f"{cell(r['similarity']['ffn_other'], '.3g')}",
          f"{cell(r['similarity'].get('ffn_similar_reference'), '.3g')} / "
          f"{cell(r['similarity'].get('ffn_other_reference'), '.3g')}"] for r in rows])
    lines += ["", "## Per placement, depth and learning rate, over seeds", ""]
    lines += markdown_table(
        ["norm", "layers", "lr", "runs", "collapsed", "decay rate, mean (sd)", "geo. mean r_k",
         "geo. mean c_k"],
        [[s["norm"], str(s["n_layers"]), cell(s["lr"]), str(s["runs"]), str(s["collapsed"]),
          f"{s['rate_last_mean']:.4f} ({cell(s['rate_last_sd'], '.4f')})",
          f"{s['ratio_geomean_last_mean']:.4f}", f"{s['c_geomean_last_mean']:.4f}"]
         for s in settings])
    return "\n".join(lines) + "\n"


def plot(path: str, rows: list[dict]) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(19, 5.2))
    ax = axes[0]
    for norm in ("post", "pre"):
        chosen = [r for r in rows if r["norm"] == norm]
        if chosen:
            ax.scatter(np.concatenate([r["c_all"] for r in chosen]),
                       np.concatenate([r["ratios_all"] for r in chosen]), s=3, alpha=0.25,
                       color=COLORS[norm], label=f"{norm}: every sublayer and diagnostic step")
    limits = np.array([0.0, 1.2])
    ax.plot(limits, limits, "k--", linewidth=0.8, label="r_k = c_k")
    ax.axhline(1.0, color="grey", linewidth=0.6)
    ax.set(xlabel="c_k (mean RMSNorm contraction)",
           ylabel="r_k = ||dL/dX_k|| / ||dL/dX_k+1||", title="Thm 3.6: backward ratio vs c_k")
    ax.legend(fontsize=7)
    for row in rows:
        k = np.arange(len(row["dldx_last"]))
        label = f"{row['norm']} lr {row['lr']:g} seed {row['seed']}"
        axes[1].semilogy(k, row["dldx_last"], color=COLORS.get(row["norm"], "k"), alpha=0.7,
                         label=f"{label}, step {row['last_step']}")
        axes[1].semilogy(k, row["dldx_first"], ":", color=COLORS.get(row["norm"], "k"),
                         alpha=0.5)
        steps, rate, err = (np.asarray(row[key]) for key in ("steps", "rate", "rate_stderr"))
        axes[2].plot(steps, rate, color=COLORS.get(row["norm"], "k"), alpha=0.8, label=label)
        axes[2].fill_between(steps, rate - 2 * err, rate + 2 * err,
                             color=COLORS.get(row["norm"], "k"), alpha=0.15)
        axes[2].plot(steps, row["c_geomean"], "--", color=COLORS.get(row["norm"], "k"),
                     alpha=0.5, linewidth=0.8)
    axes[1].set(xlabel="sublayer input k (0 = first attention input, 2L = stack output)",
                ylabel="||dL/dX_k||", title="taps at the last step (dotted: step 1)")
    axes[1].legend(fontsize=6)
    axes[2].axhline(1.0, color="grey", linewidth=0.6)
    axes[2].set(xlabel="step", ylabel="per-sublayer factor toward the input",
                title="fitted decay rate ± 2 s.e. (dashed: geometric mean of c_k)")
    axes[2].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> None:
    del argv
    if FLAGS.out_dir is None:
        raise app.UsageError("--out_dir is required")
    chosen = [workdir for workdir in [*FLAGS.runs, *find_runs(FLAGS.runs_under)]
              if method_label(recorded_config(workdir)) in FLAGS.methods]
    rows = [r for r in map(run_record, chosen) if r["finished"]]
    if not rows:
        raise NoRunsError(f"no finished run of --methods={','.join(FLAGS.methods)} among --runs "
                          "and --runs_under: give run directories whose metrics.jsonl reaches "
                          "train.steps")
    out_dir = make_output_dir(os.path.abspath(FLAGS.out_dir), "--out_dir")
    rows.sort(key=lambda r: (r["norm"] != "post", r["n_layers"], r["lr"], r["seed"]))
    with_similarity(rows)
    settings = by_setting(rows)
    table = markdown(rows, settings)
    summary = {"runs": [{k: v for k, v in r.items() if k not in ("ratios_all", "c_all")}
                        for r in rows], "settings": settings}
    write_json_atomic(os.path.join(out_dir, "summary.json"), summary)
    write_bytes_atomic(os.path.join(out_dir, "summary.md"), table.encode())
    plot(os.path.join(out_dir, "backward_decay.png"), rows)
    print(table)


if __name__ == "__main__":
    app.run(exit_on_error(main))
