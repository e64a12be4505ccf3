"""A run's figures from its ``metrics.jsonl``, into ``<workdir>/plots/``."""

import io
import os

import jax
import matplotlib
from absl import logging

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from postnorm.files import replace_file  # noqa: E402
from postnorm.workdir.layout import Workdir  # noqa: E402
from postnorm.workdir.metrics import MetricsFileError, layer_series, read_metrics  # noqa: E402

HEATMAPS = {
    "tsim": ("tsim", "token similarity tsim(X_k)", False),
    "dldx": ("dldx_norm", "log10 ||dL/dX_k||_F", True),
    "contraction": ("c_mean", "RMSNorm contraction c_k (token mean)", False),
    "y_rms": ("y_rms_mean", "||y_k|| / sqrt(d) (token mean)", False),
}


def save_figure(fig: plt.Figure, path: str, **savefig_kwargs) -> None:
    """Saves ``fig`` as a PNG with ``replace_file``, so a reader (a report rendered while a
    run writes its plots) never sees a partial one, and closes it."""
    png = io.BytesIO()
    try:
        fig.savefig(png, format="png", **savefig_kwargs)
    finally:
        plt.close(fig)
    replace_file(path, png.getvalue())


def cell_edges(centers: np.ndarray) -> np.ndarray:
    """Edges of cells around sorted ``centers``: midpoints between neighbours, and as far
    beyond each end as the nearest midpoint is inside it (one center: +-0.5)."""
    centers = np.asarray(centers, dtype=float)
    if len(centers) == 1:
        return centers[0] + np.array([-0.5, 0.5])
    mid = (centers[:-1] + centers[1:]) / 2
    return np.concatenate([[2 * centers[0] - mid[0]], mid, [2 * centers[-1] - mid[-1]]])


def _heatmap(ax, steps: np.ndarray, values_LxS: np.ndarray, title: str) -> None:
    """Layer x step cells, each column centred on its own step (diagnostic steps need not be
    evenly spaced: step 1, then ``postnorm.diagnostics.schedule``'s steps)."""
    layer_edges = np.arange(values_LxS.shape[0] + 1) - 0.5
    image = ax.pcolormesh(cell_edges(steps), layer_edges, np.ma.masked_invalid(values_LxS),
                          shading="flat")
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("step")
    ax.set_ylabel("layer")
    plt.colorbar(image, ax=ax)


def plot_heatmaps(series: dict, out_dir: str) -> list[str]:
    paths = []
    for file_name, (stat, title, log10) in HEATMAPS.items():
        panels = [(kind, series.get(f"{stat}_{kind}")) for kind in ("attn", "ffn")]
        panels = [(kind, data) for kind, data in panels if data is not None]
        if not panels:
            continue
        fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
        for ax, (kind, (steps, values)) in zip(axes[0], panels, strict=True):
            shown = np.log10(np.maximum(values, 1e-30)) if log10 else values
            _heatmap(ax, steps, shown, f"{title}, {kind} input")
        fig.tight_layout()
        path = os.path.join(out_dir, f"heatmap_{file_name}.png")
        save_figure(fig, path, dpi=110)
        paths.append(path)
    return paths


def plot_post_mix(series: dict, out_dir: str) -> str | None:
    """lambda, each sublayer's Post-Norm share, per diagnostic step (the lambda it ran with) as
    a sublayer x step heatmap on [0, 1], sublayer 2l the attention and 2l + 1 the FFN of layer
    l; None where the run logged no lambda (no adaptive placement)."""
    if "post_mix_attn" not in series:
        return None
    steps, attn_LxS = series["post_mix_attn"]
    mix_KxS = np.empty((2 * attn_LxS.shape[0], len(steps)))
    mix_KxS[0::2], mix_KxS[1::2] = attn_LxS, series["post_mix_ffn"][1]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    image = ax.pcolormesh(cell_edges(steps), np.arange(mix_KxS.shape[0] + 1) - 0.5,
                          np.ma.masked_invalid(mix_KxS), shading="flat", vmin=0.0, vmax=1.0)
    ax.set_title("Post-Norm share lambda (1: Post, 0: Pre)", fontsize=9)
    ax.set_xlabel("step")
    ax.set_ylabel("sublayer (2 x layer; + 1: FFN)")
    plt.colorbar(image, ax=ax)
    fig.tight_layout()
    path = os.path.join(out_dir, "heatmap_post_mix.png")
    save_figure(fig, path, dpi=110)
    return path


def plot_loss(records: list[dict], out_dir: str) -> str | None:
    train = [(r["step"], r["train/loss"]) for r in records if "train/loss" in r]
    evals = [(r["step"], r["eval/loss"]) for r in records if "eval/loss" in r]
    lfreq = next((r[k] for r in records for k in ("train/lfreq", "eval/lfreq") if k in r), None)
    if not train:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(*zip(*train, strict=True), label="train loss")
    floors = [(r["step"], r["train/freq_floor"]) for r in records if "train/freq_floor" in r]
    if floors:
        ax.plot(*zip(*floors, strict=True), color="0.6", lw=0.8,
                label="frequency floor of the batch")
    if evals:
        ax.plot(*zip(*evals, strict=True), "o-", label="eval loss")
    if lfreq is not None:
        ax.axhline(lfreq, color="k", linestyle="--", label=f"L_freq = {lfreq:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.legend()
    fig.tight_layout()
    path = os.path.join(out_dir, "loss_vs_lfreq.png")
    save_figure(fig, path, dpi=110)
    return path


def render_run_plots(workdir: str) -> list[str]:
    """Write every figure of the run in ``workdir`` to ``<workdir>/plots``; returns the paths."""
    records = read_metrics(workdir)  # first: a workdir without metrics gets no plots/
    out_dir = Workdir(workdir).plots
    os.makedirs(out_dir, exist_ok=True)
    series = layer_series(records)
    if not series:
        logging.warning("%s has no per-layer diagnostics (diag.every): no heatmaps, only the "
                        "loss plot", Workdir(workdir).metrics)
    paths = plot_heatmaps(series, out_dir)
    paths += [p for p in (plot_post_mix(series, out_dir), plot_loss(records, out_dir)) if p]
    return paths


def plots_after_training(workdir: str) -> None:
    """``render_run_plots`` of a run that has just trained (process 0 draws). A failure is
    logged, not raised: the run itself is complete and checkpointed."""
    if jax.process_index() != 0:
        return
    try:
        render_run_plots(workdir)
    except (OSError, MetricsFileError) as err:
        logging.error("the run finished, but its plots could not be written (%s); fix that, "
                      "then run main.py --mode=plots --workdir %s", err, workdir)
