"""Depth recursions (docs/MATH.md §3): the scalar EC closure and the mean-field Gram recursion."""

import dataclasses
from collections.abc import Callable

import numpy as np

from postnorm.theory.closed_forms import (
    Amounts,
    _check_range,
    attn_f2,
    delta_attn,
    delta_ffn,
    gate_kernel,
    gate_kernel_table,
    tsim_of_gram,
)

Gram = np.ndarray


def prefix_average(x_NxK: np.ndarray) -> np.ndarray:
    """P X: row i becomes the mean of rows 1..i."""
    counts = np.arange(1, x_NxK.shape[0] + 1, dtype=np.float64)
    return np.cumsum(x_NxK, axis=0) / counts.reshape((-1,) + (1,) * (x_NxK.ndim - 1))


def correlation(g_NxN: np.ndarray) -> np.ndarray:
    """corr(G) = D^-1/2 G D^-1/2: the Gram of the RMS-normalised rows (exact per-row RMSNorm)."""
    inv_sqrt_N = 1.0 / np.sqrt(np.diag(g_NxN))
    return g_NxN * inv_sqrt_N[:, None] * inv_sqrt_N[None, :]


@dataclasses.dataclass(frozen=True)
class GramMaps:
    """One arrangement's action on the expected Gram G of the residual stream.

    branch_input: G -> the Gram of what the attention branch reads. (The FFN branch reads rows
      of RMS 1 in every arrangement so far, a norm's output or a normalised stream, so its Gram
      is corr(G): ``ffn_branch_gram``. An arrangement whose FFN reads otherwise extends this.)
    combine: (G, B) -> the Gram after the sublayer, where B = E[F F^T] is the branch's Gram.
    normalized_stream: the stream leaving every sublayer has RMS 1 (its energy R stays 1 in
      the scalar closure); otherwise R grows by the branch energy and the branch's amount is
      divided by it.
    """

    branch_input: Callable[[Gram], Gram]
    combine: Callable[[Gram, Gram], Gram]
    normalized_stream: bool


POST_GRAM = GramMaps(branch_input=lambda g: g, combine=lambda g, b: correlation(g + b),
                     normalized_stream=True)
PRE_GRAM = GramMaps(branch_input=correlation, combine=lambda g, b: g + b,
                    normalized_stream=False)


def scalar_recursion(t0: float, n: int, n_layers: int, amt: Amounts, arrangement: GramMaps,
                     r0: float = 1.0) -> np.ndarray:
    """Iterated one-step maps under the EC closure: tsim after each sublayer, [n_layers, 2].

    A normalised stream (Post-Norm): t <- t + Delta_attn(s, t); t <- t + Delta_FFN(xi, t).
    Otherwise (Pre-Norm) the residual energy R = ||X||_F^2 / (n d) is tracked from the input's
    ``r0``: s_k = s / R, R <- R (1 + s_k f2(t)), then xi_k = xi / R, R <- R (1 + xi_k m(1)).
    """
    _check_range("r0", r0, 1e-300)
    m1 = float(gate_kernel(1.0, amt.a))
    grows = not arrangement.normalized_stream
    t, r = float(t0), float(r0)
    out_Lx2 = np.empty((n_layers, 2))
    for layer in range(n_layers):
        s_k = amt.s / r
        gain = s_k * attn_f2(t, n)
        t = t + delta_attn(s_k, t, n)
        r = r * (1.0 + gain) if grows else r
        out_Lx2[layer, 0] = t
        xi_k = amt.xi / r
        t = t + delta_ffn(xi_k, t, n, amt.a)
        r = r * (1.0 + xi_k * m1) if grows else r
        out_Lx2[layer, 1] = t
    return out_Lx2


def attn_branch_gram(g_NxN: np.ndarray, s: float, arrangement: GramMaps) -> np.ndarray:
    """E over W_V, W_O of the attention branch's Gram with uniform attention P (Thm 3.2's Gram
    algebra): s P G_in P^T, with G_in the Gram the arrangement's branch reads (G for Post-Norm,
    corr(G) for Pre-Norm)."""
    return s * prefix_average(prefix_average(arrangement.branch_input(g_NxN)).T)


def ffn_branch_gram(g_NxN: np.ndarray, xi: float,
                    kernel: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """E over the FFN weights of the FFN branch's Gram (Thm 3.4): xi C o m(C) with C = corr(G)
    and ``kernel`` m(.; a) (``gate_kernel_table``). The FFN reads rows of RMS 1 in every
    arrangement (a norm's output, or a stream the attention sublayer left normalised), so C is
    the correlation of the stream whatever the arrangement."""
    c_NxN = correlation(g_NxN)
    return xi * c_NxN * kernel(c_NxN)


def mean_field_ffn_step(g_NxN: np.ndarray, xi: float, kernel: Callable[[np.ndarray], np.ndarray],
                        arrangement: GramMaps) -> np.ndarray:
    """E over the FFN weights of the Gram after the FFN sublayer (Thm 3.4's G + xi C o m(C)):
    corr(G + xi C o m(C)) with C = corr(G) for Post-Norm, G + xi C o m(C) for Pre-Norm."""
    return arrangement.combine(g_NxN, ffn_branch_gram(g_NxN, xi, kernel))


@dataclasses.dataclass(frozen=True)
class MeanFieldTrace:
    """Per-layer output of ``mean_field_recursion``.

    tsim_after: [n_layers, 2], tsim after the attention and after the FFN sublayer of each layer.
    tsim_in: [n_layers], tsim at each attention sublayer's input.
    energy_attn: [n_layers], the attention branch-to-skip energy ratio tr E[F F^T] / tr G there.
    delta_attn: [n_layers], the expected one-step tsim change of the attention sublayer without
      its norm, 1^T(G + B)1 / (n tr(G + B)) - tsim(G) with B the branch Gram: Thm 3.2's Delta
      for this (not necessarily EC) Gram.
    """

    tsim_after: np.ndarray
    tsim_in: np.ndarray
    energy_attn: np.ndarray
    delta_attn: np.ndarray


def mean_field_recursion(g0_NxN: np.ndarray, n_layers: int, amt: Amounts,
                         arrangement: GramMaps) -> MeanFieldTrace:
    """The mean-field Gram recursion (docs/MATH.md §3) from the input Gram ``g0_NxN`` (units of d).

    Propagates the full expected Gram with uniform causal attention, exact per-row RMSNorm and
    the FFN kernel applied elementwise, without the EC closure.
    """
    kernel = gate_kernel_table(amt.a)
    g = np.asarray(g0_NxN, np.float64)
    rows = []
    for _ in range(n_layers):
        t_in = tsim_of_gram(g)
        branch = attn_branch_gram(g, amt.s, arrangement)
        energy = np.trace(branch) / np.trace(g)
        delta = tsim_of_gram(g + branch) - t_in
        g = arrangement.combine(g, branch)
        t_attn = tsim_of_gram(g)
        g = mean_field_ffn_step(g, amt.xi, kernel, arrangement)
        rows.append((t_attn, tsim_of_gram(g), t_in, energy, delta))
    out = np.array(rows)
    return MeanFieldTrace(tsim_after=out[:, :2], tsim_in=out[:, 2], energy_attn=out[:, 3],
                          delta_attn=out[:, 4])
