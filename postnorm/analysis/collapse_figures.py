"""Figures of the collapse transition, from ``metrics.jsonl`` records (matplotlib, Agg)."""

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from postnorm.analysis.collapse import (  # noqa: E402
    DEFAULT_RULE,
    Collapse,
    lfreq_of,
    train_loss_and_floor,
)
from postnorm.analysis.figures import cell_edges, save_figure  # noqa: E402
from postnorm.model.decoder import SUBLAYERS  # noqa: E402
from postnorm.workdir.metrics import layer_series  # noqa: E402

Series = dict[str, tuple[np.ndarray, np.ndarray]]
Window = tuple[int, int] | None
NORM_COLOURS = {"post": "tab:red", "pre": "tab:blue"}


def _save(fig: plt.Figure, path: str) -> str:
    fig.tight_layout()
    save_figure(fig, path, dpi=100)
    return path


def _shade(ax: plt.Axes, window: Window) -> None:
    if window is not None:
        ax.axvspan(window[0], window[1], color="tab:orange", alpha=0.18, lw=0,
                   label=f"transition window [{window[0]}, {window[1]}]")


def plot_loss_runs(runs: dict[str, list[dict]], path: str,
                   loss_rtol: float = DEFAULT_RULE.loss_rtol) -> str:
    """Train loss of every run (label -> records), coloured by the norm named in the label:
    against L_freq (left) and divided by each batch's frequency floor (right), with the
    collapse rule's band 1 ± ``loss_rtol``."""
    fig, (ax, ax_ratio) = plt.subplots(1, 2, figsize=(12, 4))
    lfreqs, per_colour = set(), {}
    for label, records in sorted(runs.items()):
        train_S = train_loss_and_floor(records)
        if not train_S:
            continue
        steps_S, loss_S, floor_S = np.array(train_S).T
        colour = next((c for norm, c in NORM_COLOURS.items() if label.startswith(norm)), None)
        index = per_colour[colour] = per_colour.get(colour, -1) + 1  # seeds of one norm
        style = {"color": colour, "alpha": 0.8, "lw": 1.2,
                 "linestyle": ("-", "--", ":", "-.")[index % 4], "label": label}
        ax.plot(steps_S, loss_S, **style)
        ax_ratio.plot(steps_S, loss_S / floor_S, **style)
        lfreqs.add(round(lfreq_of(records), 6))
    ax_ratio.axhspan(1 - loss_rtol, 1 + loss_rtol, color="0.85", lw=0,
                     label=f"floor ± {loss_rtol:.0%}")
    ax_ratio.set_xlabel("step")
    ax_ratio.set_ylabel("train loss / frequency floor of the batch")
    ax_ratio.legend(fontsize=7, ncol=2)
    for lfreq in sorted(lfreqs):
        ax.axhline(lfreq, color="k", lw=1, linestyle="--")
        ax.annotate(f"L_freq = {lfreq:.4f}", (ax.get_xlim()[1], lfreq), ha="right",
                    va="bottom", fontsize=8)
    ax.set_xlabel("step")
    ax.set_ylabel("train cross-entropy (nats/token)")
    ax.legend(fontsize=7, ncol=2)
    return _save(fig, path)


def _layer_lines(ax: plt.Axes, steps_S: np.ndarray, values_LxS: np.ndarray, log: bool) -> None:
    cmap = plt.get_cmap("viridis")
    n_layers = values_LxS.shape[0]
    for layer in range(n_layers):
        ax.plot(steps_S, values_LxS[layer], color=cmap(layer / max(n_layers - 1, 1)), lw=0.8)
    if log:
        ax.set_yscale("log")
    ax.set_xlabel("step")
    mappable = plt.cm.ScalarMappable(cmap=cmap, norm=plt.Normalize(0, n_layers - 1))
    plt.colorbar(mappable, ax=ax, label="layer")


def plot_layer_lines(series: Series, window: Window, path: str, title: str = "") -> str:
    """sqrt(d)/||y_k|| and c_k per layer over steps, attention and FFN sublayers."""
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), squeeze=False)
    for col, kind in enumerate(SUBLAYERS):
        steps_S, y_rms_LxS = series[f"y_rms_mean_{kind}"]
        _layer_lines(axes[0, col], steps_S, 1.0 / y_rms_LxS, log=False)
        axes[0, col].set_title(f"sqrt(d)/||y_k|| = 1/y_rms_mean, {kind}", fontsize=9)
        steps_S, c_LxS = series[f"c_mean_{kind}"]
        _layer_lines(axes[1, col], steps_S, c_LxS, log=False)
        axes[1, col].set_title(f"RMSNorm contraction c_k (with gain), {kind}", fontsize=9)
        for row in range(2):
            _shade(axes[row, col], window)
    if window:
        axes[0, 0].legend(fontsize=7, loc="best")
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def plot_dldx_lines(series: Series, window: Window, path: str, title: str = "") -> str:
    """||dL/dX_k||_F per layer over steps (log scale) at the attention and FFN inputs."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), squeeze=False)
    for col, kind in enumerate(SUBLAYERS):
        steps_S, grad_LxS = series[f"dldx_norm_{kind}"]
        _layer_lines(axes[0, col], steps_S, grad_LxS, log=True)
        axes[0, col].set_title(f"||dL/dX_k||_F at the {kind} input", fontsize=9)
        _shade(axes[0, col], window)
    if window:
        axes[0, 0].legend(fontsize=7, loc="best")
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def plot_tsim_heatmap(series: Series, window: Window, path: str, title: str = "") -> str:
    """tsim(X_k) at the attention input, layer x step; dashed lines at the window edges."""
    steps_S, tsim_LxS = series["tsim_attn"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    mesh = ax.pcolormesh(cell_edges(steps_S.astype(float)), np.arange(tsim_LxS.shape[0] + 1) - 0.5,
                         tsim_LxS, vmin=0.0, vmax=1.0, cmap="magma", shading="flat")
    plt.colorbar(mesh, ax=ax, label="tsim(X_k)")
    if window is not None:
        for edge in window:
            ax.axvline(edge, color="cyan", linestyle="--", lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("layer")
    ax.set_title(title or "tsim at the attention input", fontsize=10)
    return _save(fig, path)


def render_collapse_figures(records: list[dict], collapse: Collapse | None, out_dir: str,
                            prefix: str = "", title: str = "") -> dict[str, str]:
    """The per-run figures into ``out_dir`` as ``<prefix><name>.png``: {name: path} for the ones
    the records support. ``title`` (default: the prefix) labels them."""
    os.makedirs(out_dir, exist_ok=True)
    series = layer_series(records)
    window = collapse.window if collapse is not None else None
    title = title or prefix.rstrip("_")
    paths = {"loss": plot_loss_runs({title or "run": records},
                                    os.path.join(out_dir, f"{prefix}loss_vs_lfreq.png"))}
    needs = {"layers": ("y_rms_mean_attn", "y_rms_mean_ffn", "c_mean_attn", "c_mean_ffn"),
             "dldx": ("dldx_norm_attn", "dldx_norm_ffn"), "tsim": ("tsim_attn",)}
    plotters = {"layers": plot_layer_lines, "dldx": plot_dldx_lines, "tsim": plot_tsim_heatmap}
    for name, keys in needs.items():
        if all(k in series for k in keys):
            path = os.path.join(out_dir, f"{prefix}{name}.png")
            paths[name] = plotters[name](series, window, path, title)
    return paths
