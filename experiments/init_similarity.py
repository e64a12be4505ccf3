"""Stage I: token similarity at initialisation, layer by layer, against Thm 3.2, Thm 3.4 and the
mean-field Gram recursion (docs/THEORY.md).

    python -m experiments.init_similarity --out_dir DIR [--seeds 4 --n_layers 48 --seq_len 2048]

The model is ``configs/paper.py`` (48 layers, d=512, d_ff=1536, 4 heads, n=2048, RoPE) on the
embedded corpus. For each norm placement and seed, a freshly initialised layer stack
(``postnorm.analysis.monte_carlo.LayerStack``, the decoder's own scanned ``Block``) runs one
sequence on two inputs: the token embeddings of a real validation sequence, and iid N(0, 1) rows
fed as the layer-0 residual stream. Per layer it records tsim at every sublayer input and:

* the one-step changes: ``d_*`` = tsim after minus before the sublayer (its RMSNorm included,
  one weight draw), and ``d_*_pm`` = the same change averaged over the sign of the branch's
  output matrix (+W, -W) as a ratio of expectations, without the norm: the theorems' Delta.
  With t = tsim(X), t_F = tsim(F) and e = ||F||^2/||X||^2 it is e (t_F - t) / (1 + e);
* the closed forms at the measured t and amounts inferred from the measured energies:
  s_inferred = e_attn / f2(t) (Thm 3.2, since e_attn = s f2(t) for an EC state; it absorbs part
  of the EC and softmax deviations, so it is not the paper's s) and xi = e_ffn / m(1) (Thm 3.4,
  since e_ffn = xi m(1));
* Thm 3.2 at the nominal s, the paper's s = n d^2 sigma_W^2 / ||X||^2 (1/9 at the default
  init for RMS-1 rows), per layer: s_nominal = s ||H||^2 / ||X||^2 with H the attention's input
  (X in Post-Norm, RMSNorm(X) in Pre-Norm), the closed form there, and the exact one-step
  Delta of the measured state X at that s: with uniform attention and E[W W^T] = s I,
  (||1^T X||^2 + s ||1^T P H||^2) / (n (||X||_F^2 + s ||P H||_F^2)) - tsim(X), which drops only
  the equicorrelation assumption; and how far from equicorrelated the state is: the mean and
  standard deviation of the pairwise cosines of X's rows against the EC value rho(t)
  (``monte_carlo.stack_ec_statistics``);
* the FFN energy ratio e_ffn against the nominal xi m(1) (FFN damping);
* the mean-field Gram recursion from the measured input Gram and the scalar closure from the
  measured input tsim, both with the config's nominal s, xi and a. Along the mean-field
  trajectory also its exact one-step Delta_attn and the EC closed form at its own (t, s): their
  ratio is the error the EC closure itself predicts for the closed form on non-EC states;
* Post-Norm, ``--uniform_check``: the same stack with attention forced to prefix averaging P
  (``monte_carlo.attention_mode("uniform")``), which removes assumption A1 from the comparison;
* Post-Norm ablation: the same stack with attention (A - P) V W_O, i.e. without the causal
  prefix mean of V (``monte_carlo.attention_mode("centered")``).

With ``--init_tsim_target`` every arrangement's W_O gain is solved by the similarity-aware init
(``postnorm.model.similarity_init``) first, and recorded.

Writes ``layers.csv``, ``summary.json``, ``summary.md``, ``theory_table.md`` (each setting's figures
of merit, one column per setting: ``theory_table``), ``init_similarity.png`` and
``arrangements.png`` (every arrangement, measured beside the mean-field prediction) to --out_dir.
``--report_only`` computes nothing: it rewrites ``theory_table.md`` from --out_dir's
``summary.json``.
"""

import csv
import json
import os
import resource
import sys
import time

import jax
import jax.numpy as jnp
import matplotlib
import ml_collections
import numpy as np
from absl import app, flags, logging

from configs import paper
from postnorm import theory
from postnorm.analysis import monte_carlo
from postnorm.analysis.tables import markdown_table
from postnorm.config import base_config
from postnorm.config.list_flags import choice_list
from postnorm.data import DataError, load_data
from postnorm.data.errors import ShortSplitError
from postnorm.errors import exit_on_error
from postnorm.files import dumps, from_text, make_output_dir, write_bytes_atomic, write_json_atomic
from postnorm.model import PLACEMENTS, ModelSpec
from postnorm.model.initializers import embedding_init
from postnorm.model.placements import init_gains
from postnorm.model.similarity_init import with_similarity_init
from postnorm.runtime.allocator import use_allocator
from postnorm.theory import INIT_SCHEMES
from postnorm.train.validate import check_model

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

flags.DEFINE_string("out_dir", None, "Directory for the CSV, JSON, markdown and PNG outputs.")
flags.DEFINE_integer("seeds", 4, "Seeds (weight draws) per norm placement and input.",
                     lower_bound=1)
flags.DEFINE_integer("n_layers", 48, "Layers of the stack.", lower_bound=1)
flags.DEFINE_integer("seq_len", 2048, "Tokens per sequence n.", lower_bound=2)
flags.DEFINE_enum("init", "torch_default", list(INIT_SCHEMES), "Weight initialisation scheme.")
flags.DEFINE_list("norms", ["post", "pre"], "Norm placements to run.")
flags.DEFINE_list("inputs", ["real", "gaussian"], "Inputs: real sequences and/or iid N(0,1).")
flags.DEFINE_bool("ablation", True, "Also run Post-Norm with prefix-centred attention (A - P).")
flags.DEFINE_bool("uniform_check", True, "Also run Post-Norm with attention forced to prefix "
                  "averaging P (the theorem's assumption A1) and compare Delta_attn there too.")
flags.DEFINE_float("init_tsim_target", 0.0, "The similarity-aware init's target "
                   "(model.init_tsim_target): W_O's gain solved per arrangement; 0 disables.")
flags.DEFINE_float("init_tsim_input", 0.05, "The input token similarity the solve assumes "
                   "(model.init_tsim_input).")
flags.DEFINE_enum("s_reading", "vo", list(theory.S_READINGS), "Reading of the amount s.")
flags.DEFINE_bool("report_only", False, "Compute nothing: rewrite --out_dir's theory_table.md "
                  "from its summary.json.")
FLAGS = flags.FLAGS

INPUTS = ("real", "gaussian")
TABLE_ROWS = 12  # layers shown per markdown table
THEORY_TABLE = "theory_table.md"


def build_config(n_layers: int, seq_len: int, init: str, init_tsim_target: float = 0.0,
                 init_tsim_input: float = 0.05) -> ml_collections.ConfigDict:
    """``configs/paper.py`` with the embedded corpus (default data fields) at length seq_len."""
    config = paper.get_config()
    config.data = base_config().data
    config.data.seq_len = seq_len
    config.model.n_layers = n_layers
    config.model.init = init
    config.model.init_tsim_target = init_tsim_target
    config.model.init_tsim_input = init_tsim_input
    return config


def derived(stats: dict[str, np.ndarray], amt: theory.Amounts, n: int) -> dict[str, np.ndarray]:
    """Per-layer one-step changes and closed forms at the measured (t, s) and (t, xi)."""
    t_attn, t_ffn = stats["tsim_attn"], stats["tsim_ffn"]
    t_out = np.append(t_attn[1:], stats["tsim_final"])
    e_attn, e_ffn = stats["energy_ratio_attn"], stats["energy_ratio_ffn"]
    s_inferred = e_attn / theory.attn_f2(t_attn, n)
    xi_measured = e_ffn / theory.gate_kernel(1.0, amt.a)
    return {
        "t_attn": t_attn, "t_ffn": t_ffn, "t_out": t_out,
        "d_attn": t_ffn - t_attn,
        "d_attn_pm": e_attn * (stats["tsim_branch_attn"] - t_attn) / (1.0 + e_attn),
        "d_attn_closed_s_inferred": theory.delta_attn(s_inferred, t_attn, n),
        "s_inferred": s_inferred,
        "d_ffn": t_out - t_ffn,
        "d_ffn_pm": e_ffn * (stats["tsim_branch_ffn"] - t_ffn) / (1.0 + e_ffn),
        "d_ffn_closed": theory.delta_ffn(xi_measured, t_ffn, n, amt.a),
        "xi_m1_measured": e_ffn,
        "attn_tv_uniform": stats["attn_tv_uniform"],
    }


# Arrangements whose attention sublayer adds a norm to its branch's output (X + N(F)): the sum
# is not X + P H W, so Thm 3.2's exact step does not apply to it.
BRANCH_OUTPUT_NORMED = ("sandwich", "periln")


def ec_derived(ec: dict[str, np.ndarray], amt: theory.Amounts, n: int,
               norm: str) -> dict[str, np.ndarray]:
    """Per layer, Thm 3.2 at the nominal s on the measured state, and its distance from EC.
    The step is X + P H W, as Thm 3.2 states it and as ``d_attn_pm`` measures it (DeepNorm's
    skip gain alpha is left out of both); NaN where the branch output is normed."""
    t = ec["residual_sum_sq"] / (n * ec["residual_sq"])
    s_nominal = amt.s * ec["branch_in_sq"] / ec["residual_sq"]
    exact = ((ec["residual_sum_sq"] + amt.s * ec["prefix_sum_sq"])
             / (n * (ec["residual_sq"] + amt.s * ec["prefix_sq"])) - t)
    if norm in BRANCH_OUTPUT_NORMED:
        exact = np.full_like(t, np.nan)
    return {"s_nominal": s_nominal,
            "d_attn_closed_s_nominal": theory.delta_attn(s_nominal, t, n),
            "d_attn_exact_s_nominal": exact, "rho_ec": theory.ec_rho(t, n),
            "corr_mean": ec["corr_mean"], "corr_sd": ec["corr_sd"]}


def _numpy(stats: dict[str, jax.Array]) -> dict[str, np.ndarray]:
    return {k: np.asarray(v, np.float64) for k, v in stats.items()}


def run_seed(spec: ModelSpec, fns: dict, params: dict, x0_1xNxD: jax.Array,
             amt: theory.Amounts) -> dict[str, np.ndarray]:
    """All per-layer quantities of one (norm, input, seed)."""
    n = spec.max_len
    start = time.perf_counter()
    out = derived(_numpy(fns["softmax"](params, x0_1xNxD)), amt, n)
    out.update(ec_derived(_numpy(fns["ec"](params, x0_1xNxD)), amt, n, spec.norm))
    logging.info("%s stack forward: %.1f s", spec.norm, time.perf_counter() - start)
    x0 = np.asarray(x0_1xNxD[0], np.float64)
    maps = PLACEMENTS[spec.norm].gram_maps(spec)
    mean_field = theory.mean_field_recursion(x0 @ x0.T / spec.d_model, spec.n_layers, amt, maps)
    t_in = mean_field.tsim_in
    if all(theory.scalar_closure_covers(m) for pair in maps for m in pair):
        scalar = theory.scalar_recursion(float(theory.tsim(x0)), n, spec.n_layers, amt, maps,
                                         r0=float(np.mean(x0**2)))
    else:  # the scalar closure models Post- and Pre-Norm sublayers only
        scalar = np.full((spec.n_layers, 2), np.nan)
    out.update(meanfield_attn=mean_field.tsim_after[:, 0],
               meanfield_ffn=mean_field.tsim_after[:, 1], meanfield_d_attn=mean_field.delta_attn,
               meanfield_d_attn_closed=theory.delta_attn(
                   mean_field.energy_attn / theory.attn_f2(t_in, n), t_in, n),
               scalar_attn=scalar[:, 0], scalar_ffn=scalar[:, 1])
    if "uniform" in fns:
        uniform = derived(_numpy(fns["uniform"](params, x0_1xNxD)), amt, n)
        out["uniform_d_attn_pm"] = uniform["d_attn_pm"]
        out["uniform_d_attn_closed_s_inferred"] = uniform["d_attn_closed_s_inferred"]
    if "centered" in fns:
        ablated = _numpy(fns["centered"](params, x0_1xNxD))
        out["ablation_t_out"] = np.append(ablated["tsim_attn"][1:], ablated["tsim_final"])
    return out


def aggregate(per_seed: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Mean over seeds of every per-layer array, and ``<key>_se`` standard errors."""
    out = {}
    for key in per_seed[0]:
        values_SxL = np.stack([r[key] for r in per_seed])
        out[key] = values_SxL.mean(0)
        spread = values_SxL.std(0, ddof=1) if len(per_seed) > 1 else np.zeros_like(out[key])
        out[f"{key}_se"] = spread / np.sqrt(len(per_seed))
    return out


def compared(measured: np.ndarray, reference: np.ndarray) -> dict[str, float | int | None]:
    """Per-layer relative error of ``measured`` against ``reference``: the worst layer and its
    error, the mean |error|, the layers beyond 10%, and the first layer from which every layer
    is within 10% (None if the last is not); all None where ``reference`` is not defined (NaN)."""
    rel = measured / reference - 1.0
    if not np.isfinite(rel).all():
        return dict.fromkeys(("worst_layer", "worst_rel_err", "mean_abs_rel_err",
                              "layers_beyond_10pct", "within_10pct_from_layer"))
    layer = int(np.argmax(np.abs(rel)))
    beyond = np.flatnonzero(np.abs(rel) > 0.1)
    within_from = 0 if beyond.size == 0 else int(beyond[-1]) + 1
    return {"worst_layer": layer, "worst_rel_err": float(rel[layer]),
            "mean_abs_rel_err": float(np.mean(np.abs(rel))),
            "layers_beyond_10pct": int(beyond.size),
            "within_10pct_from_layer": within_from if within_from < len(rel) else None}


def acceptance(agg: dict[str, np.ndarray]) -> dict[str, object]:
    """The figures of merit of one (norm, input)."""
    def worst(measured: np.ndarray, closed: np.ndarray) -> tuple[int, float]:
        found = compared(measured, closed)
        return found["worst_layer"], found["worst_rel_err"]

    out = {
        "tsim_in": float(agg["t_attn"][0]), "tsim_final": float(agg["t_out"][-1]),
        "tsim_final_se": float(agg["t_out_se"][-1]),
        "meanfield_final": float(agg["meanfield_ffn"][-1]),
        "scalar_final": float(agg["scalar_ffn"][-1]),
        "min_d_attn": float(agg["d_attn"].min()),
        "layers_d_attn_nonpositive": int(np.sum(agg["d_attn"] <= 0)),
        "min_d_attn_pm": float(agg["d_attn_pm"].min()),
        "ffn_over_attn_median": float(np.median(np.abs(agg["d_ffn_pm"]) / agg["d_attn_pm"])),
        "ffn_over_attn_max": float(np.max(np.abs(agg["d_ffn_pm"]) / agg["d_attn_pm"])),
        "xi_m1_measured_mean": float(agg["xi_m1_measured"].mean()),
        "s_inferred_first": float(agg["s_inferred"][0]),
        "s_inferred_last": float(agg["s_inferred"][-1]),
        "s_nominal_first": float(agg["s_nominal"][0]),
        "s_nominal_last": float(agg["s_nominal"][-1]),
        # Thm 3.2 at the nominal s: the measured +-W Delta against the closed form and against
        # the exact Delta of the measured state; the latter two against each other isolate the
        # equicorrelation assumption
        "attn_pm_vs_closed_s_nominal": compared(agg["d_attn_pm"], agg["d_attn_closed_s_nominal"]),
        "attn_pm_vs_exact_s_nominal": compared(agg["d_attn_pm"], agg["d_attn_exact_s_nominal"]),
        "attn_exact_vs_closed_s_nominal": compared(agg["d_attn_exact_s_nominal"],
                                                   agg["d_attn_closed_s_nominal"]),
        "corr_sd_first": float(agg["corr_sd"][0]), "corr_sd_last": float(agg["corr_sd"][-1]),
        "corr_sd_max": float(agg["corr_sd"].max()),
        # Thm 3.4: the measured +-W Delta_FFN against the closed form at the measured (t, xi)
        "ffn_pm_vs_closed": compared(agg["d_ffn_pm"], agg["d_ffn_closed"]),
    }
    for name, measured in (("pm", agg["d_attn_pm"]), ("direct", agg["d_attn"])):
        found = compared(measured, agg["d_attn_closed_s_inferred"])
        out[f"worst_layer_attn_{name}"] = found["worst_layer"]
        out[f"worst_rel_err_attn_{name}"] = found["worst_rel_err"]
        out[f"mean_abs_rel_err_attn_{name}"] = found["mean_abs_rel_err"]
    layer, rel = worst(agg["meanfield_d_attn"], agg["meanfield_d_attn_closed"])
    out["worst_layer_attn_meanfield"], out["worst_rel_err_attn_meanfield"] = layer, rel
    if "uniform_d_attn_pm" in agg:
        found = compared(agg["uniform_d_attn_pm"], agg["uniform_d_attn_closed_s_inferred"])
        out["worst_layer_attn_pm_uniform"] = found["worst_layer"]
        out["worst_rel_err_attn_pm_uniform"] = found["worst_rel_err"]
        out["mean_abs_rel_err_attn_pm_uniform"] = found["mean_abs_rel_err"]
    if "ablation_t_out" in agg:
        out["ablation_tsim_final"] = float(agg["ablation_t_out"][-1])
    return out


def amounts_table(d_model: int, d_ff: int) -> list[dict[str, float | str]]:
    """s (both readings), xi, a and xi m(1) of every init scheme at this width."""
    rows = []
    for scheme in INIT_SCHEMES:
        amt = theory.amounts(d_model, d_ff, scheme)
        rows.append({"init": scheme, "s_vo": amt.s,
                     "s_v_only": theory.amounts(d_model, d_ff, scheme, "v_only").s,
                     "xi": amt.xi, "a": amt.a, "m1": float(theory.gate_kernel(1.0, amt.a)),
                     "xi_m1": amt.xi_m1})
    return rows


CSV_KEYS = ("t_attn", "t_ffn", "t_out", "d_attn", "d_attn_se", "d_attn_pm", "d_attn_pm_se",
            "d_attn_closed_s_inferred", "s_inferred", "s_nominal", "d_attn_closed_s_nominal",
            "d_attn_exact_s_nominal", "rho_ec", "corr_mean", "corr_sd", "d_ffn", "d_ffn_se",
            "d_ffn_pm", "d_ffn_pm_se", "d_ffn_closed", "xi_m1_measured", "attn_tv_uniform",
            "meanfield_attn", "meanfield_ffn", "meanfield_d_attn", "meanfield_d_attn_closed",
            "scalar_attn", "scalar_ffn", "ablation_t_out", "uniform_d_attn_pm",
            "uniform_d_attn_closed_s_inferred")


def write_csv(path: str, results: dict[tuple[str, str], dict[str, np.ndarray]]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(("norm", "input", "layer") + CSV_KEYS)
        for (norm, source), agg in results.items():
            for layer in range(len(agg["t_attn"])):
                writer.writerow((norm, source, layer) + tuple(
                    f"{agg[k][layer]:.6e}" if k in agg else "" for k in CSV_KEYS))


def _errors(found: dict, percent: bool = False) -> str:
    """A ``compared`` record as worst (layer) / mean |error| / layers beyond 10%, as fractions
    or in percent."""
    if found["worst_layer"] is None:
        return "–"
    scale, unit, digits = (100, "%", 1) if percent else (1, "", 3)
    return (f"{found['worst_rel_err'] * scale:+.{digits}f}{unit} ({found['worst_layer']}) / "
            f"{found['mean_abs_rel_err'] * scale:.{digits}f}{unit} / "
            f"{found['layers_beyond_10pct']}")


def _optional(fig: dict, value: str, layer: str) -> str:
    return f"{fig[value]:+.3f} ({fig[layer]})" if value in fig else "-"


def _percent(fig: dict, value: str, layer: str | None = None, mean: str | None = None) -> str:
    """A relative error in percent, with its layer and a mean |error| when given; "–" where the
    setting did not measure it."""
    if fig.get(value) is None:
        return "–"
    text = f"{fig[value] * 100:+.1f}%"
    text += f" ({fig[layer]})" if layer else ""
    return text + (f" / {fig[mean] * 100:.1f}%" if mean else "")


def _number(fig: dict, key: str, spec: str) -> str:
    return "–" if fig.get(key) is None else format(fig[key], spec)


THEORY_ROWS = (  # (label, cell of one setting's figures of merit)
    ("tsim at the input", lambda f: _number(f, "tsim_in", ".4f")),
    ("tsim after the last layer (± s.e.)",
     lambda f: f"{f['tsim_final']:.4f} ± {f['tsim_final_se']:.4f}"),
    ("the same, mean-field recursion", lambda f: _number(f, "meanfield_final", ".4f")),
    ("the same, scalar (EC) closure", lambda f: _number(f, "scalar_final", ".4f")),
    ("smallest direct Δattn (layers with Δattn ≤ 0)",
     lambda f: f"{f['min_d_attn']:.2e} ({f['layers_d_attn_nonpositive']})"),
    (r"±W Δattn vs the closed form at (t, s_inferred): worst (layer) / mean \|error\|",
     lambda f: _percent(f, "worst_rel_err_attn_pm", "worst_layer_attn_pm",
                        "mean_abs_rel_err_attn_pm")),
    ("direct Δattn vs the same: worst (layer)",
     lambda f: _percent(f, "worst_rel_err_attn_direct", "worst_layer_attn_direct")),
    ("±W Δattn, attention forced to P (A1 exact): worst (layer)",
     lambda f: _percent(f, "worst_rel_err_attn_pm_uniform", "worst_layer_attn_pm_uniform")),
    ("closed-form error along the mean-field trajectory: worst (layer)",
     lambda f: _percent(f, "worst_rel_err_attn_meanfield", "worst_layer_attn_meanfield")),
    (r"\|ΔFFN\| / Δattn (±W): median (max)",
     lambda f: f"{f['ffn_over_attn_median']:.3f} ({f['ffn_over_attn_max']:.3f})"),
    ("FFN energy ratio ‖F‖²/‖X‖², mean over layers",
     lambda f: _number(f, "xi_m1_measured_mean", ".5f")),
    ("final tsim, ablation (A − P) V W_O", lambda f: _number(f, "ablation_tsim_final", ".4f")),
    ("s_nominal at the first, last layer",
     lambda f: f"{f['s_nominal_first']:.4f}, {f['s_nominal_last']:.4f}"),
    ("s_inferred at the first, last layer",
     lambda f: f"{f['s_inferred_first']:.4f}, {f['s_inferred_last']:.4f}"),
    (r"±W Δattn vs the closed form at s_nominal: worst (layer) / mean \|error\| / layers "
     "beyond 10%", lambda f: _errors(f["attn_pm_vs_closed_s_nominal"], percent=True)),
    ("±W Δattn vs the exact Δ of the measured state at s_nominal",
     lambda f: _errors(f["attn_pm_vs_exact_s_nominal"], percent=True)),
    ("exact Δ vs the closed form, both at s_nominal (the EC assumption alone)",
     lambda f: _errors(f["attn_exact_vs_closed_s_nominal"], percent=True)),
    ("pairwise cosines' sd at the first, last layer (max)",
     lambda f: f"{f['corr_sd_first']:.3f}, {f['corr_sd_last']:.3f} ({f['corr_sd_max']:.3f})"),
    ("±W ΔFFN vs its closed form at the measured (t, ξ)",
     lambda f: _errors(f["ffn_pm_vs_closed"], percent=True)),
    ("ΔFFN within 10% of its closed form from layer",
     lambda f: _number(f["ffn_pm_vs_closed"], "within_10pct_from_layer", "d")),
)


def theory_table(meta: dict) -> str:
    """``theory_table.md`` from a ``summary.json``: the nominal amounts, then each setting's
    figures of merit (``acceptance``), one column per setting."""
    amounts, figures = meta["amounts"], dict(sorted(meta["figures"].items()))
    lines = [f"Nominal s = {amounts['s']:.4f}, ξ = {amounts['xi']:.4f}, a = {amounts['a']:.4f}, "
             f"ξ m(1) = {amounts['xi_m1']:.5f}; means over {meta['seeds']} seeds.", ""]
    lines += markdown_table([""] + list(figures),
                            [[label] + [value(fig) for fig in figures.values()]
                             for label, value in THEORY_ROWS])
    return "\n".join(lines) + "\n"


def write_markdown(path: str, meta: dict, results: dict, figures: dict) -> None:
    lines = ["# Stage I: token similarity at initialisation", "",
             f"Command: `{meta['command']}`", "",
             f"Model: {meta['model']}; seeds {meta['seeds']}; s reading `{meta['s_reading']}`; "
             f"nominal s = {meta['amounts']['s']:.4f}, xi = {meta['amounts']['xi']:.4f}, "
             f"a = {meta['amounts']['a']:.4f}, xi m(1) = {meta['amounts']['xi_m1']:.5f}.", "",
             f"Wall time {meta['wall_s']:.0f} s; peak RSS {meta['peak_rss_mib']:.0f} MiB.", "",
             "## Amounts per init scheme (theory, this width)", ""]
    lines += markdown_table(
        ["init", "s (W_VO)", "s (W_V only)", "xi", "a", "m(1)", "xi m(1)"],
        [[r["init"]] + [f"{r[k]:.5g}" for k in ("s_vo", "s_v_only", "xi", "a", "m1", "xi_m1")]
         for r in meta["amounts_table"]])
    lines += ["", "## Summary", "",
              "`pm`: one-step change averaged over +-W (theorems' Delta); `direct`: tsim after "
              "minus before the sublayer, its norm included, one draw. Relative errors are "
              "against the closed form at the measured t and s_inferred = e_attn / f2(t) (not "
              "the paper's s: the next table has that); means over seeds.", ""]
    header = ["norm/input", "tsim in", "tsim final", "mean-field", "scalar", "min d_attn",
              "worst pm err (layer)", "worst direct err (layer)", "worst pm err, uniform attn",
              "mean-field EC gap (layer)", r"\|dFFN\| / dattn med (max)",
              "FFN energy (xi m1)", "ablation final"]
    rows = []
    for (norm, source), fig in figures.items():
        rows.append([f"{norm}/{source}", f"{fig['tsim_in']:.4f}",
                     f"{fig['tsim_final']:.4f}+-{fig['tsim_final_se']:.4f}",
                     f"{fig['meanfield_final']:.4f}", f"{fig['scalar_final']:.4f}",
                     f"{fig['min_d_attn']:.2e}",
                     f"{fig['worst_rel_err_attn_pm']:+.3f} ({fig['worst_layer_attn_pm']})",
                     f"{fig['worst_rel_err_attn_direct']:+.3f} ({fig['worst_layer_attn_direct']})",
                     _optional(fig, "worst_rel_err_attn_pm_uniform", "worst_layer_attn_pm_uniform"),
                     _optional(fig, "worst_rel_err_attn_meanfield", "worst_layer_attn_meanfield"),
                     f"{fig['ffn_over_attn_median']:.3f} ({fig['ffn_over_attn_max']:.3f})",
                     f"{fig['xi_m1_measured_mean']:.5f} ({meta['amounts']['xi_m1']:.5f})",
                     (f"{fig['ablation_tsim_final']:.4f}" if "ablation_tsim_final" in fig
                      else "-")])
    lines += markdown_table(header, rows)
    lines += ["", "## Thm 3.2 at the nominal s, and Thm 3.4, per setting", "",
              "s_nominal = s ||H||^2/||X||^2 (H the attention's input); `closed`: the EC closed "
              "form at (t, s_nominal); `exact`: the one-step Delta of the measured state at "
              "s_nominal under uniform attention (no EC assumption); `pm`: the measured +-W "
              "Delta. Each error cell: worst (layer) / mean |error| / layers beyond 10%. "
              "corr sd: the standard deviation of the pairwise cosines of the layer input's "
              "rows (0 for an EC state). Thm 3.4: +-W Delta_FFN against its closed form at the "
              "measured (t, xi), and the first layer from which every layer is within 10%.", ""]
    lines += markdown_table(
        ["norm/input", "s_nominal first, last", "s_inferred first, last", "pm vs closed",
         "pm vs exact", "exact vs closed", "corr sd first, last (max)", "FFN pm vs closed",
         "FFN within 10% from layer"],
        [[f"{norm}/{source}",
          f"{fig['s_nominal_first']:.4f}, {fig['s_nominal_last']:.4f}",
          f"{fig['s_inferred_first']:.4f}, {fig['s_inferred_last']:.4f}",
          _errors(fig["attn_pm_vs_closed_s_nominal"]), _errors(fig["attn_pm_vs_exact_s_nominal"]),
          _errors(fig["attn_exact_vs_closed_s_nominal"]),
          f"{fig['corr_sd_first']:.3f}, {fig['corr_sd_last']:.3f} ({fig['corr_sd_max']:.3f})",
          _errors(fig["ffn_pm_vs_closed"]), str(fig["ffn_pm_vs_closed"]["within_10pct_from_layer"])]
         for (norm, source), fig in figures.items()])
    for (norm, source), agg in results.items():
        n_layers = len(agg["t_attn"])
        shown = sorted(set(np.linspace(0, n_layers - 1, min(TABLE_ROWS, n_layers)).astype(int)))
        lines += ["", f"## {norm} / {source}", ""]
        keys = ["t_attn", "d_attn", "d_attn_pm", "d_attn_closed_s_inferred", "meanfield_d_attn",
                "meanfield_d_attn_closed", "s_inferred", "d_ffn_pm",
                "d_ffn_closed", "t_out", "meanfield_ffn", "scalar_ffn"]
        keys += ["ablation_t_out"] if "ablation_t_out" in agg else []
        lines += markdown_table(["layer"] + keys,
                                 [[str(i)] + [f"{agg[k][i]:.4g}" for k in keys] for i in shown])
        lines += ["", f"### {norm} / {source}: Thm 3.2 at both s readings and Thm 3.4, every "
                  "layer", ""]
        lines += markdown_table(
            ["layer", "t", "rho(t)", "corr mean", "corr sd", "s_inferred", "s_nominal",
             "pm", "closed (s_inferred)", "closed (s_nominal)", "exact (s_nominal)",
             "pm/closed(s_nominal) - 1", "exact/closed(s_nominal) - 1", "dFFN pm",
             "dFFN closed", "dFFN pm/closed - 1"],
            [[str(i)] + [f"{agg[k][i]:.4g}" for k in (
                "t_attn", "rho_ec", "corr_mean", "corr_sd", "s_inferred", "s_nominal",
                "d_attn_pm", "d_attn_closed_s_inferred", "d_attn_closed_s_nominal",
                "d_attn_exact_s_nominal")]
             + [f"{agg['d_attn_pm'][i] / agg['d_attn_closed_s_nominal'][i] - 1:+.3f}",
                f"{agg['d_attn_exact_s_nominal'][i] / agg['d_attn_closed_s_nominal'][i] - 1:+.3f}",
                f"{agg['d_ffn_pm'][i]:.4g}", f"{agg['d_ffn_closed'][i]:.4g}",
                f"{agg['d_ffn_pm'][i] / agg['d_ffn_closed'][i] - 1:+.3f}"]
             for i in range(n_layers)])
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def plot(path: str, results: dict) -> None:
    norms = sorted({norm for norm, _ in results}, reverse=True)
    fig, axes = plt.subplots(len(norms), 4, figsize=(21, 4.5 * len(norms)), squeeze=False)
    for row, norm in zip(axes, norms, strict=True):
        for color, source in zip(("C0", "C1"), INPUTS, strict=True):
            agg = results.get((norm, source))
            if agg is None:
                continue
            layers = np.arange(len(agg["t_out"]))
            depth = np.arange(len(agg["t_out"]) + 1)  # layers applied; 0 is the input

            def with_input(values: np.ndarray, agg=agg) -> np.ndarray:
                return np.concatenate([agg["t_attn"][:1], values])

            ax = row[0]
            errors = np.concatenate([agg["t_attn_se"][:1], agg["t_out_se"]])
            ax.errorbar(depth, with_input(agg["t_out"]), errors, color=color, marker=".",
                        label=f"{source}: measured")
            ax.plot(depth, with_input(agg["meanfield_ffn"]), "--", color=color,
                    label=f"{source}: mean-field")
            ax.plot(depth, with_input(agg["scalar_ffn"]), ":", color=color,
                    label=f"{source}: scalar closure")
            if "ablation_t_out" in agg:
                ax.plot(depth, with_input(agg["ablation_t_out"]), "-x", color=color, alpha=0.6,
                        label=f"{source}: ablation (A - P)")
            closed_color = "k" if color == "C0" else "grey"
            for ax, kind in ((row[1], "attn"), (row[2], "ffn")):
                ax.plot(layers, agg[f"d_{kind}"], ".", color=color, alpha=0.5,
                        label=f"{source}: direct")
                ax.plot(layers, agg[f"d_{kind}_pm"], "-", color=color, label=f"{source}: +-W")
            row[1].plot(layers, agg["d_attn_closed_s_inferred"], "--", color=closed_color,
                        label=f"{source}: closed form, s_inferred")
            row[1].plot(layers, agg["d_attn_closed_s_nominal"], ":", color=closed_color,
                        label=f"{source}: closed form, nominal s")
            row[1].plot(layers, agg["d_attn_exact_s_nominal"], "-", color=closed_color,
                        alpha=0.5, label=f"{source}: exact on the measured state, nominal s")
            row[2].plot(layers, agg["d_ffn_closed"], "--", color=closed_color,
                        label=f"{source}: closed form at measured (t, xi)")
            row[3].plot(layers, agg["corr_mean"], "-", color=color,
                        label=f"{source}: mean pairwise cosine")
            row[3].fill_between(layers, agg["corr_mean"] - agg["corr_sd"],
                                agg["corr_mean"] + agg["corr_sd"], color=color, alpha=0.2,
                                label=f"{source}: +- its sd (0 if EC)")
            row[3].plot(layers, agg["rho_ec"], "--", color=closed_color,
                        label=f"{source}: EC value rho(t)")
        titles = ("tsim after each layer", "one-step Delta_attn (Thm 3.2)",
                  "one-step Delta_FFN (Thm 3.4)", "layer input: pairwise cosines vs EC")
        for ax, title, xlabel in zip(row, titles, ("layers applied", "layer", "layer", "layer"),
                                     strict=True):
            ax.set_title(f"{norm}-norm: {title}")
            ax.set_xlabel(xlabel)
            ax.legend(fontsize=7)
        row[0].set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_arrangements(path: str, results: dict, target: float) -> None:
    """One panel per input: tsim after each layer for every arrangement, measured (solid, with
    its standard error) beside the mean-field recursion's prediction (dashed)."""
    norms = sorted({norm for norm, _ in results})
    sources = [source for source in INPUTS if any(src == source for _, src in results)]
    fig, axes = plt.subplots(1, len(sources), figsize=(7.5 * len(sources), 5), squeeze=False)
    for ax, source in zip(axes[0], sources, strict=True):
        for index, norm in enumerate(norms):
            agg = results[(norm, source)]
            depth = np.arange(len(agg["t_out"]) + 1)
            color = f"C{index % 10}"
            measured = np.concatenate([agg["t_attn"][:1], agg["t_out"]])
            errors = np.concatenate([agg["t_attn_se"][:1], agg["t_out_se"]])
            ax.errorbar(depth, measured, errors, color=color, marker=".", markersize=3,
                        label=f"{norm}: measured")
            ax.plot(depth, np.concatenate([agg["t_attn"][:1], agg["meanfield_ffn"]]), "--",
                    color=color, alpha=0.8, label=f"{norm}: mean-field")
        if target:
            ax.axhline(target, color="k", linewidth=0.8, label=f"target {target}")
        ax.set_yscale("log")
        ax.set_title(f"tsim after each layer at init, {source} inputs")
        ax.set_xlabel("layers applied")
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def real_sequences(config: ml_collections.ConfigDict, count: int) -> list[np.ndarray]:
    """The first ``count`` validation sequences, each int32[1, n]; sets ``data.vocab_size`` to the
    tokenizer's."""
    data = load_data(config.data)
    config.data.vocab_size = data.tokenizer.vocab_size
    try:
        batches = data.eval_batches(batch_size=1, num_batches=count)
    except ShortSplitError as err:
        raise DataError(f"the real inputs need --seeds={count} validation sequences of "
                        f"--seq_len={config.data.seq_len} tokens, and {data.info['path']} has "
                        "fewer: lower --seeds or --seq_len, or use --inputs=gaussian") from err
    return [b["inputs"] for b in batches]


def run(config: ml_collections.ConfigDict, *, seeds: int, norms: list[str], inputs: list[str],
        ablation: bool, uniform_check: bool, s_reading: str
        ) -> tuple[dict, dict, theory.Amounts, dict[str, float]]:
    """Aggregated per-layer results and figures of merit per (norm, input), the nominal amounts
    and each arrangement's W_O gain (the similarity-aware init's solved value, else 1)."""
    n, d = config.data.seq_len, config.model.d_model
    tokens = real_sequences(config, seeds) if "real" in inputs else []
    amt = theory.amounts_from_config(config.model, s_reading)
    embed = embedding_init(config.model.init)
    results, figures, gains = {}, {}, {}
    for norm in norms:
        config.model.norm = norm
        spec = with_similarity_init(
            ModelSpec.from_config(config.model, vocab_size=config.data.vocab_size, max_len=n),
            config.model.init_tsim_target, config.model.init_tsim_input)
        gains[norm] = spec.attn_out_gain
        norm_amt = amt.with_gains(init_gains(spec))
        fns = {"softmax": monte_carlo.stack_statistics(spec, "softmax"),
               "ec": monte_carlo.stack_ec_statistics(spec)}
        if ablation and norm == "post":
            fns["centered"] = monte_carlo.stack_statistics(spec, "centered")
        if uniform_check and norm == "post":
            fns["uniform"] = monte_carlo.stack_statistics(spec, "uniform")
        per_seed = {source: [] for source in inputs}
        for seed in range(seeds):
            key_params, key_embed, key_gauss = jax.random.split(jax.random.key(seed), 3)
            params = monte_carlo.init_stack_params(spec, key_params)
            if "real" in inputs:
                embedding_VxD = embed(key_embed, (config.data.vocab_size, d), jnp.float32)
            for source in inputs:
                x0_1xNxD = (jnp.take(embedding_VxD, tokens[seed], axis=0) if source == "real"
                            else jax.random.normal(key_gauss, (1, n, d)))
                per_seed[source].append(run_seed(spec, fns, params, x0_1xNxD, norm_amt))
                logging.info("done %s/%s seed %d", norm, source, seed)
        for source in inputs:
            results[(norm, source)] = aggregate(per_seed[source])
            figures[(norm, source)] = acceptance(results[(norm, source)])
    return results, figures, amt, gains


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
            meta = from_text(json.load(f))
        write_bytes_atomic(os.path.join(FLAGS.out_dir, THEORY_TABLE), theory_table(meta).encode())
        return
    norms = choice_list("norms", FLAGS.norms, tuple(PLACEMENTS))
    inputs = choice_list("inputs", FLAGS.inputs, INPUTS)
    config = build_config(FLAGS.n_layers, FLAGS.seq_len, FLAGS.init, FLAGS.init_tsim_target,
                          FLAGS.init_tsim_input)
    for norm in norms:  # every arrangement's model fields, before anything is computed
        config.model.norm = norm
        check_model(config)
    make_output_dir(FLAGS.out_dir, "--out_dir")  # before the computing, not after it
    start = time.perf_counter()
    use_allocator(config.runtime.allocator)  # may re-execute this command
    results, figures, amt, gains = run(config, seeds=FLAGS.seeds, norms=norms,
                                inputs=inputs, ablation=FLAGS.ablation,
                                uniform_check=FLAGS.uniform_check, s_reading=FLAGS.s_reading)
    m = config.model
    meta = {
        "command": "python -m experiments.init_similarity " + " ".join(sys.argv[1:]),
        "model": f"{m.n_layers} layers, d={m.d_model}, d_ff={m.d_ff}, {m.n_heads} heads, "
                 f"n={config.data.seq_len}, init={m.init}, positions={m.positions}",
        "seeds": FLAGS.seeds, "s_reading": FLAGS.s_reading,
        "init_tsim_target": FLAGS.init_tsim_target, "init_tsim_input": FLAGS.init_tsim_input,
        "attn_out_gain": gains,
        "amounts": {"s": amt.s, "xi": amt.xi, "a": amt.a, "xi_m1": amt.xi_m1},
        "amounts_table": amounts_table(m.d_model, m.d_ff),
        "wall_s": time.perf_counter() - start,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
        "figures": {f"{norm}/{source}": fig for (norm, source), fig in figures.items()},
    }
    write_csv(os.path.join(FLAGS.out_dir, "layers.csv"), results)
    write_json_atomic(os.path.join(FLAGS.out_dir, "summary.json"), meta)
    write_markdown(os.path.join(FLAGS.out_dir, "summary.md"), meta, results, figures)
    write_bytes_atomic(os.path.join(FLAGS.out_dir, THEORY_TABLE), theory_table(meta).encode())
    plot(os.path.join(FLAGS.out_dir, "init_similarity.png"), results)
    plot_arrangements(os.path.join(FLAGS.out_dir, "arrangements.png"), results,
                      FLAGS.init_tsim_target)
    print(dumps({"wall_s": meta["wall_s"], "peak_rss_mib": meta["peak_rss_mib"],
                      "figures": meta["figures"]}, indent=1))


if __name__ == "__main__":
    app.run(exit_on_error(main))
