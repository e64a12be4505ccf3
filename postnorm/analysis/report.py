"""A self-contained HTML report of one run (``python main.py --mode=report``)."""

import base64
import glob
import html
import json
import math
import os
import time

from postnorm.analysis.collapse import (
    DEFAULT_RULE,
    Collapse,
    CollapseRule,
    detect_collapse,
    lfreq_of,
    loss_and_floor_at,
    replay_monitor,
    train_loss_and_floor,
)
from postnorm.analysis.collapse_figures import render_collapse_figures
from postnorm.analysis.figures import HEATMAPS, plot_heatmaps, plot_post_mix
from postnorm.diagnostics.early_warning import monitor_rule_from
from postnorm.files import from_text, replace_file
from postnorm.train.monitor_actions import recorded_actions
from postnorm.workdir.config_record import read_run_config
from postnorm.workdir.layout import Workdir
from postnorm.workdir.metrics import layer_series, read_metrics, unfinished_last_line

VANISHING_FACTOR = 100.0  # early-layer ||dL/dX|| falling by more than this is flagged

_STYLE = """body{font-family:sans-serif;max-width:1150px;margin:2em auto;color:#222}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #bbb;padding:3px 8px;
text-align:left;font-size:14px}.warn{background:#fff3cd;border:1px solid #e0b000;padding:.5em 1em}
.ok{background:#e8f5e9;border:1px solid #4caf50;padding:.5em 1em}img{max-width:100%}
pre{background:#f5f5f5;padding:1em;font-size:12px;overflow-x:auto}"""


# Each figure's caption, by its file's name
CAPTIONS = {
    "loss_vs_lfreq": "Train loss against L_freq, the loss of predicting each token by its "
                     "corpus frequency (left), and over the frequency floor of its own batch, "
                     "with the collapse rule's band (right)",
    "tsim": "Token similarity tsim(X_k) at each layer's attention input over the steps; "
            "dashed lines: the edges of the transition window",
    "layers": "Per layer over the steps: sqrt(d)/||y_k|| (top) and the RMSNorm contraction c_k "
              "(bottom), attention and FFN sublayers; shaded: the transition window",
    "dldx": "Gradient norm ||dL/dX_k|| at each layer's attention and FFN inputs over the steps "
            "(log scale); shaded: the transition window",
    "heatmap_post_mix": "Post-Norm share lambda of each sublayer over the steps (1: Post-Norm, "
                        "0: Pre-Norm)",
} | {f"heatmap_{name}": f"Heatmap of {title} per layer and diagnostic step, at the attention "
                        "and FFN inputs" for name, (_, title, _) in HEATMAPS.items()}


def _img(path: str) -> str:
    with open(path, "rb") as f:
        data = base64.b64encode(f.read()).decode()
    name = os.path.splitext(os.path.basename(path))[0]
    caption = CAPTIONS.get(name, name.replace("_", " "))
    return (f'<figure><img alt="{html.escape(name)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{html.escape(caption)}</figcaption></figure>")


def _table(rows: list[tuple[str, object]]) -> str:
    def fmt(value: object) -> str:
        if isinstance(value, float):
            return f"{value:.6g}"
        if isinstance(value, list | tuple):
            return ", ".join(fmt(v) for v in value)
        return "–" if value is None else str(value)

    body = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(fmt(v))}</td></tr>"
                   for k, v in rows)
    return f"<table>{body}</table>"


def run_warnings(workdir: str, records: list[dict], collapse: Collapse | None,
                 config: dict, rule: CollapseRule = DEFAULT_RULE) -> list[str]:
    """Plain-text warnings about the run (collapse, non-finite steps, vanishing gradients, ...)."""
    warnings = []
    if collapse is None:
        warnings.append("No per-layer diagnostics in the metrics: collapse cannot be assessed.")
    elif collapse.collapsed:
        warnings.append(
            f"Collapse detected: from step {collapse.collapse_step} on, >= "
            f"{rule.layer_fraction:.0%} of the layers have tsim >= {rule.tsim_threshold} and the "
            f"train loss is within {rule.loss_rtol:.0%} of the frequency floor of its batches "
            f"(L_freq on average); transition window "
            f"{list(collapse.window)} (onset = first layer with tsim >= {rule.tsim_threshold}).")
    if collapse is not None:
        alarms, monitor = replay_monitor(records, monitor_rule_from(config.get("monitor")))
        if monitor.first_warn is not None:
            lead = (f", {collapse.collapse_step - monitor.first_warn} steps before the collapse "
                    "step" if collapse.collapsed else "; the run did not collapse by the rule")
            reason = next(a.reason for a in alarms if a.level == 2)
            warnings.append(f"Collapse early warning (warn) from step {monitor.first_warn}"
                            f"{lead}: {reason}.")
    for action in recorded_actions(workdir):
        back = (f", rolled back to step {action['rolled_back_to']}"
                if action["rolled_back_to"] is not None else "")
        warnings.append(f"The early warning acted (action {action['actions']}): "
                        f"monitor.action={action['action']} on the warn at step "
                        f"{action['step']}{back}.")
    losses = [r["train/loss"] for r in records if "train/loss" in r]
    if any(not math.isfinite(v) for v in losses):
        warnings.append("Non-finite train loss values were logged.")
    skipped = [r["train/skipped_steps"] for r in records if "train/skipped_steps" in r]
    if skipped and skipped[-1] > 0:
        warnings.append(f"{int(skipped[-1])} non-finite steps were skipped (train.nonfinite=skip).")
    if unfinished := unfinished_last_line(Workdir(workdir).metrics):
        warnings.append(f"metrics.jsonl ends in an unfinished line of {unfinished} bytes (a record "
                        "being written, or one its writer was stopped in): it is left out, so "
                        "this report may miss the last logged step or eval.")
    for dump in sorted(glob.glob(Workdir(workdir).nonfinite_dumps)):
        warnings.append(f"Non-finite step dump present: {os.path.basename(dump)}.")
    series = layer_series(records)
    if "dldx_norm_attn" in series:
        steps_S, grad_LxS = series["dldx_norm_attn"]
        ratio = grad_LxS[: rule.early_layers, 0] / grad_LxS[: rule.early_layers, -1]
        if ratio.min() > VANISHING_FACTOR:
            warnings.append(
                f"Gradient vanishing in the early layers: ||dL/dX|| at layers 0-"
                f"{len(ratio) - 1} fell by {ratio.min():.3g}x to {ratio.max():.3g}x "
                f"between steps {steps_S[0]} and {steps_S[-1]}.")
    total = config.get("train", {}).get("steps")
    last = max((r["step"] for r in records), default=0)
    if isinstance(total, int) and last < total:
        warnings.append(f"The run is incomplete: metrics end at step {last} of {total}.")
    return warnings


def _thm38_section(record: dict) -> str:
    bound, point = record["bound"], record["stationary_point"]
    rows = [("checkpoint step", record["checkpoint_step"]), ("sequences", bound["sequences"]),
            ("||W_lm||_2", bound["w_lm_spectral_norm"])]
    rows += [(f"mean {k}", v) for k, v in bound["mean"].items()]
    rows += [("fraction of sequences with loss >= bound", bound["bound_holds_fraction"]),
             ("min slack (loss - bound)", bound["min_slack"]),
             ("KL(p_freq || mean model output)", bound["kl_pfreq_qbar"]),
             ("corpus L_freq", bound["lfreq_corpus"])]
    if "skipped" in point:
        rows.append(("p_freq point", f"not built: {point['skipped']}"))
    else:
        rows += [("p_freq point: loss - L_freq(batch)", point["loss"] - point["lfreq_batch"]),
                 ("p_freq point: max |grad|", point["at_point"]["max_abs_grad"]),
                 ("same W_lm, real inputs: max |grad|", point["control"]["max_abs_grad"])]
    if "next_train_batches" in record:  # experiments/collapse.py --train_batches
        fresh = record["next_train_batches"]
        label = f"next {fresh['batches']} training batches (not trained on)"
        rows += [(f"{label}: loss", fresh["loss"]),
                 (f"{label}: mean frequency floor", fresh["floor"]),
                 (f"{label}: loss / L_freq", fresh["loss_over_lfreq"]),
                 (f"{label}: loss / floor", fresh["loss_over_floor"])]
    return ("<h2>Theorem 3.8 on the final checkpoint</h2><p>eps = ||X_H - Pi_1 X_H||_F per "
            "sequence; bound = L_freq(p_hat) - (2/sqrt(n)) ||W_lm||_2 eps (docs/MATH.md §5).</p>"
            + _table(rows))


def build_report(workdir: str, fallback_config: dict | None = None,
                 rule: CollapseRule = DEFAULT_RULE) -> str:
    """The report's HTML, with the run's ``config.json`` (else ``fallback_config``)."""
    config = read_run_config(workdir)
    recorded = config is not None
    if not recorded:
        if fallback_config is None:
            raise FileNotFoundError(f"{Workdir(workdir).config} does not exist and no config "
                                    "was given")
        config = fallback_config
    records = read_metrics(workdir)
    series = layer_series(records)
    collapse = detect_collapse(records, rule) if "tsim_attn" in series else None
    plot_dir = Workdir(workdir).report_plots  # the run's own plots/ stay as written
    name = os.path.basename(os.path.abspath(workdir))
    figures = render_collapse_figures(records, collapse, plot_dir, title=name)
    heatmaps = plot_heatmaps(series, plot_dir)
    if post_mix := plot_post_mix(series, plot_dir):
        heatmaps.append(post_mix)

    train = [(r["step"], r["train/loss"]) for r in records if "train/loss" in r]
    evals = [r for r in records if "eval/loss" in r]
    last_eval = evals[-1] if evals else {}
    lfreq = lfreq_of(records)
    train_S = train_loss_and_floor(records)
    floor = loss_and_floor_at(train_S, train_S[-1][0], rule.loss_smoothing)
    model = {k: config.get("model", {}).get(k, "?") for k in ("norm", "n_layers", "d_model")}
    summary = [("workdir", os.path.abspath(workdir)),
               ("model", f"{model['norm']}-norm, {model['n_layers']} layers, "
                         f"d={model['d_model']}"),
               ("last logged step", train[-1][0]),
               ("train loss at the last logged step", train[-1][1]),
               ("final eval loss", last_eval.get("eval/loss")), ("L_freq", lfreq),
               ("train loss at the last logged step / L_freq", train[-1][1] / lfreq),
               ("final eval loss / L_freq",
                last_eval["eval/loss"] / lfreq if evals else None),
               ("final eval loss / the frequency floor of the eval batches",
                last_eval.get("eval/loss_over_floor")),  # as the trainer logged it
               (f"mean train loss of the last {rule.loss_smoothing} logged steps / the "
                "frequency floor of their batches", floor[0] / floor[1])]
    if collapse is not None:
        summary += [("collapsed", "yes" if collapse.collapsed else "no"),
                    ("collapse step", collapse.collapse_step),
                    ("transition window", collapse.window),
                    (f"first step with >= {rule.layer_fraction:.0%} of layers at tsim >= "
                     f"{rule.tsim_threshold}", collapse.similar_layers_step),
                    ("||dL/dX|| ratio across the window, layers 0-"
                     f"{min(rule.early_layers, len(series['tsim_attn'][1])) - 1}",
                     collapse.grad_ratio_early), ("same, last layer", collapse.grad_ratio_last)]
    warnings = run_warnings(workdir, records, collapse, config, rule)
    if not recorded:
        warnings.insert(0, f"{Workdir(workdir).config} does not exist: the config shown is the one "
                        "--config gave, not necessarily the run's.")
    warn_html = ("".join(f'<p class="warn">{html.escape(w)}</p>' for w in warnings)
                 or '<p class="ok">No warnings.</p>')
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>postnorm run report"
             f"</title><style>{_STYLE}</style></head><body>",
             f"<h1>Run report: {html.escape(name)}</h1>",
             f"<p>Generated {time.strftime('%Y-%m-%d %H:%M:%S')}.</p>",
             "<h2>Summary</h2>", _table(summary), "<h2>Warnings</h2>", warn_html,
             "<h2>Loss against L_freq</h2>", _img(figures["loss"])]
    titles = {"tsim": "Token similarity (window edges dashed)",
              "layers": "sqrt(d)/||y_k|| and c_k per layer (window shaded)",
              "dldx": "||dL/dX_k|| per layer (window shaded)"}
    for name, title in titles.items():
        if name in figures:
            parts += [f"<h2>{title}</h2>", _img(figures[name])]
    parts += ["<h2>Layer x step heatmaps</h2>"] + [_img(p) for p in heatmaps]
    thm_path = Workdir(workdir).thm38
    if os.path.exists(thm_path):
        try:
            with open(thm_path) as f:
                parts.append(_thm38_section(from_text(json.load(f))))
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as err:
            parts.append(f'<h2>Theorem 3.8 on the final checkpoint</h2><p class="warn">'
                         f"{html.escape(thm_path)} is unreadable or incomplete "
                         f"({html.escape(type(err).__name__)}: {html.escape(str(err))}): "
                         "rerun experiments/collapse.py to measure it again.</p>")
    parts += ["<h2>Config</h2>", f"<pre>{html.escape(json.dumps(config, indent=2))}</pre>",
              "</body></html>"]
    return "\n".join(parts)


def write_report(workdir: str, fallback_config: dict | None = None) -> str:
    """Write ``<workdir>/report.html``; returns its path."""
    path = Workdir(workdir).report
    text = build_report(workdir, fallback_config)
    replace_file(path, text.encode())
    return path
