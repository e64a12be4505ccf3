"""Thm 3.6 and 3.8(ii) read from a run's logged diagnostics (docs/MATH.md §4, §5).

Sublayer inputs are numbered k = 0 .. 2L in forward order: X_{2i} is layer i's attention input,
X_{2i+1} its FFN input and X_{2L} the stack's output. Per diagnostic step the taps give
g_k = ||dL/dX_k||_F and the norms give c_k, the mean RMSNorm contraction of sublayer k's norm.

* The backward ratio r_k = g_k / g_{k+1}. Thm 3.6: in Post-Norm the norm after sublayer k scales
  the skip path too, so r_k is about c_k ||I + J_F||: with a small branch, about c_k. In
  Pre-Norm the skip path bypasses the norm and r_k stays near 1.
* The geometric decay rate toward early layers: the least-squares slope b of log g_k on k over
  the sublayers, reported as exp(-b), the factor by which the gradient shrinks per sublayer
  going toward the input, with its standard error (delta method on the slope's).
* Thm 3.8(ii) on the trained network: parameter-gradient norms of the layers whose input tsim is
  near 1 against the other layers, at the same step and batch.
"""

import dataclasses
import warnings

import numpy as np

from postnorm.workdir.metrics import layer_series

SUBLAYERS = ("attn", "ffn")


@dataclasses.dataclass(frozen=True)
class SublayerSeries:
    """``steps`` [S] the diagnostic steps; ``dldx`` [2L + 1, S] the g_k and ``contraction``
    [2L, S] the c_k, in sublayer order."""

    steps: np.ndarray
    dldx: np.ndarray
    contraction: np.ndarray

    def ratios(self) -> np.ndarray:
        """r_k = g_k / g_{k+1}, [2L, S]; NaN where either is 0 (a gradient that underflowed
        float32: the ratio is unknown)."""
        upper, lower = self.dldx[:-1], self.dldx[1:]
        known = (upper > 0) & (lower > 0)
        return np.where(known, upper / np.where(known, lower, 1.0), np.nan)


def _interleaved(series: dict, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, [2L, S]) of ``<name>_attn`` and ``<name>_ffn`` interleaved by layer."""
    steps_S, attn_LxS = series[f"{name}_attn"]
    ffn_steps_S, ffn_LxS = series[f"{name}_ffn"]
    if not np.array_equal(steps_S, ffn_steps_S):
        raise ValueError(f"{name}_attn and {name}_ffn are logged at different steps")
    out = np.empty((2 * attn_LxS.shape[0], len(steps_S)))
    out[0::2], out[1::2] = attn_LxS, ffn_LxS
    return steps_S, out


def sublayer_series(records: list[dict]) -> SublayerSeries:
    """The taps' gradient norms and the contractions of a run's metric records."""
    series = layer_series(records)
    for name in ("dldx_norm_attn", "dldx_norm_ffn", "c_mean_attn", "c_mean_ffn"):
        if name not in series:
            raise ValueError(f"the metrics hold no per-layer diag/{name}: no diagnostic step ran")
    steps_S, dldx_KxS = _interleaved(series, "dldx_norm")
    c_steps_S, c_KxS = _interleaved(series, "c_mean")
    final = {r["step"]: r["diag/dldx_norm_final"] for r in records
             if "diag/dldx_norm_final" in r}
    if not np.array_equal(steps_S, c_steps_S) or set(final) != set(steps_S.tolist()):
        raise ValueError("the taps, the contractions and the final tap are logged at different "
                         "steps")
    final_S = np.array([final[int(s)] for s in steps_S])
    return SublayerSeries(steps_S, np.vstack([dldx_KxS, final_S[None]]), c_KxS)


@dataclasses.dataclass(frozen=True)
class DecayFit:
    """exp(-slope) of log g_k on k: the gradient's factor per sublayer toward the input, fitted
    over ``sublayers`` sublayers; ``vanished`` more had g_k = 0 and are left out."""

    rate: float
    rate_stderr: float
    sublayers: int
    vanished: int = 0


def fit_decay(dldx_K: np.ndarray) -> DecayFit:
    """Ordinary least squares of log g_k on k = 0 .. K-1, over the sublayers with g_k > 0 (a
    gradient that underflowed float32 to 0 has no logarithm); NaN with fewer than 3."""
    g_K = np.asarray(dldx_K, np.float64)
    keep = g_K > 0
    vanished = int(np.sum(g_K == 0))
    k, y = np.arange(len(g_K), dtype=np.float64)[keep], np.log(g_K[keep])
    if len(k) < 3:
        return DecayFit(float("nan"), float("nan"), len(k), vanished)
    slope, intercept = np.polyfit(k, y, 1)
    fitted = slope * k + intercept
    sigma2 = float(np.sum((y - fitted) ** 2)) / (len(k) - 2)
    slope_se = np.sqrt(sigma2 / np.sum((k - k.mean()) ** 2))
    rate = float(np.exp(-slope))
    return DecayFit(rate=rate, rate_stderr=float(rate * slope_se), sublayers=len(k),
                    vanished=vanished)


def geometric_mean(values: np.ndarray, axis: int = 0) -> np.ndarray:
    """Over the finite values (NaN where there are none)."""
    with np.errstate(divide="ignore", invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # an all-NaN slice's mean is NaN
        logs = np.log(values)
        return np.exp(np.nanmean(np.where(np.isfinite(logs), logs, np.nan), axis=axis))


def layer_grads_at(records: list[dict], step: int) -> dict[str, np.ndarray]:
    """At diagnostic ``step``, per layer: the attention input's tsim and the attention's and the
    FFN's parameter-gradient norms."""
    series = layer_series(records)
    steps_S = series["tsim_attn"][0]
    if step not in steps_S:
        raise ValueError(f"step {step} is not a diagnostic step of the run")
    column = int(np.flatnonzero(steps_S == step)[0])
    return {name: series[key][1][:, column] for name, key in (
        ("tsim", "tsim_attn"), ("attn", "grad_norm_attn"), ("ffn", "grad_norm_ffn"))}


def grads_by_similarity(run: dict[str, np.ndarray], reference: dict[str, np.ndarray] | None,
                        threshold: float = 0.99) -> dict:
    """Thm 3.8(ii) on a trained network: per sublayer kind, the mean parameter-gradient norm of
    ``run``'s layers with tsim >= ``threshold`` and of its other layers (``layer_grads_at``), and
    the same layers' mean in ``reference`` (the other placement at the same step), which
    separates similarity from depth: in Post-Norm the similar layers are the deep ones."""
    similar_L = run["tsim"] >= threshold
    out = {"threshold": threshold, "similar_layers": np.flatnonzero(similar_L).tolist()}
    for sub in SUBLAYERS:
        for label, mask in (("similar", similar_L), ("other", ~similar_L)):
            out[f"{sub}_{label}"] = float(run[sub][mask].mean()) if mask.any() else None
            if reference is not None:
                out[f"{sub}_{label}_reference"] = (float(reference[sub][mask].mean())
                                                   if mask.any() else None)
    return out
