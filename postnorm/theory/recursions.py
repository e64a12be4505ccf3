"""Depth recursions (docs/MATH.md §3): the scalar EC closure and the mean-field Gram recursion."""

import dataclasses
import math
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
LONG_ROW = 1024  # elements in a row from which ``_running_sum`` adds row by row


def prefix_average(x_NxK: np.ndarray) -> np.ndarray:
    """P X: row i becomes the mean of rows 1..i."""
    x_NxK = np.asarray(x_NxK)
    counts = np.arange(1, x_NxK.shape[0] + 1, dtype=np.float64)
    out = _running_sum(x_NxK).astype(np.float64, copy=False)
    out /= counts.reshape((-1,) + (1,) * (x_NxK.ndim - 1))
    return out


def _running_sum(x_NxK: np.ndarray) -> np.ndarray:
    """``np.cumsum(x, axis=0)``, the same sums in the same order. numpy strides down each
    column in turn; on long rows laid out one after another (a recursion's n x n Gram) adding
    row by row reads memory in order, several times faster."""
    if (x_NxK.ndim < 2 or len(x_NxK) == 0 or not x_NxK.flags.c_contiguous
            or math.prod(x_NxK.shape[1:]) < LONG_ROW):
        return np.cumsum(x_NxK, axis=0)
    out = np.empty_like(x_NxK)
    out[0] = x_NxK[0]
    for i in range(1, len(x_NxK)):
        np.add(out[i - 1], x_NxK[i], out=out[i])
    return out


def _scaled(g_NxN: np.ndarray, d_N: np.ndarray, in_place: bool = False) -> np.ndarray:
    """D G D with D = diag(``d_N``); into ``g_NxN`` itself where ``in_place`` (the recursion's
    n x n temporaries are reused rather than allocated at every step)."""
    out = np.multiply(g_NxN, d_N[:, None], out=g_NxN if in_place else None)
    out *= d_N[None, :]
    return out


def correlation(g_NxN: np.ndarray, in_place: bool = False) -> np.ndarray:
    """corr(G) = D^-1/2 G D^-1/2: the Gram of the RMS-normalised rows (exact per-row RMSNorm);
    into ``g_NxN`` itself where ``in_place``."""
    return _scaled(g_NxN, 1.0 / np.sqrt(np.diag(g_NxN)), in_place)


@dataclasses.dataclass(frozen=True)
class GramMaps:
    """One sublayer's action on the expected Gram G of the residual stream (units of d).

    reads_normalized: the branch reads N(X), Gram corr(G) (a norm before it), else X itself.
      (The FFN branch reads rows of RMS 1 in every arrangement here, a norm's output or a
      stream a norm left normalised, so its Gram is corr(G) either way: ``ffn_branch_gram``.)
    output_normalized: the branch's output passes a norm (sandwich, Peri-LN): B -> corr(B).
    skip_gain: alpha of the skip path, y = alpha X + F (DeepNorm); 1 otherwise.
    normalized_stream: a norm follows the sum, so the stream leaves with Gram corr(y's Gram)
      and RMS 1 (its energy R stays 1 in the scalar closure); otherwise R grows by the branch
      energy and the branch's amount is divided by it.
    layer_skip: the layer's input is added to the sum as well (B2T's FFN sublayer:
      y = X_layer + h + F(h) with h the attention sublayer's output).
    profiled_skip: the skip gain is Admin's profiled omega (``postnorm.model.admin``), which the
      recursion tracks as the profiling pass sets it, with each variance over all entries taken
      as the mean square (the entries have mean 0 over the weights): omega = 1 at the first
      sublayer, then omega^2 <- omega^2 tr(G) / n + tr(B) / n after each, G the sublayer's
      input Gram and B its branch's. Replaces ``skip_gain``.
    post_mix: lambda of a mixed sublayer (``postnorm.model.placements.mixed_sublayer``): the
      branch reads lambda X + (1 - lambda) N(X) and the sublayer returns lambda N(y) +
      (1 - lambda) y, each a row scaling D G D with D_ii = lambda + (1 - lambda) / r_i, r_i the
      row's RMS (exact given the rows' RMS, as the recursion's norms are). Replaces
      ``reads_normalized`` and ``normalized_stream``; ``mixed_gram`` builds it. The FFN's input
      rows are then taken to have RMS 1 (``ffn_branch_gram``), which they have within the
      stream's growth at init.
    """

    reads_normalized: bool
    normalized_stream: bool
    output_normalized: bool = False
    skip_gain: float = 1.0
    layer_skip: bool = False
    profiled_skip: bool = False
    post_mix: float | None = None

    def branch_input(self, g_NxN: Gram) -> Gram:
        """The Gram the sublayer's branch reads."""
        if self.post_mix is not None:
            return _row_mix(g_NxN, self.post_mix, normalized_share=1 - self.post_mix)
        return correlation(g_NxN) if self.reads_normalized else g_NxN

    def branch_output(self, b_NxN: Gram) -> Gram:
        """The branch's Gram after its output norm, if any (into ``b_NxN`` itself: a branch's
        Gram is a temporary of the recursion)."""
        return correlation(b_NxN, in_place=True) if self.output_normalized else b_NxN

    def combine(self, g_NxN: Gram, b_NxN: Gram, skip_gain: float | None = None) -> Gram:
        """The Gram after the sublayer, from its input's G and the branch's Gram B (without a
        layer skip); ``skip_gain`` where given replaces the field (Admin's profiled omega)."""
        gain = self.skip_gain if skip_gain is None else skip_gain
        return self.after_sum(summed(g_NxN, b_NxN, gain))

    def after_sum(self, y_NxN: Gram) -> Gram:
        """The Gram the sublayer returns from its sum's Gram y (through its norm, if any), into
        ``y_NxN`` itself."""
        if self.post_mix is not None:
            return _row_mix(y_NxN, 1 - self.post_mix, normalized_share=self.post_mix,
                            in_place=True)
        return correlation(y_NxN, in_place=True) if self.normalized_stream else y_NxN

    def skip_path_gain(self, y_NxN: Gram, skip_gain: float | None = None) -> float:
        """The skip path's gain on the backward signal, from the sublayer's output to its input
        around the branch: gain x c with c = 1 / RMS(y) (Thm 3.6's contraction of a norm of unit
        weight, over the rows' mean square) behind a norm on the sum, lambda gain c +
        (1 - lambda) in a mixed sublayer, the gain itself without a norm; ``y_NxN`` the sum's
        Gram, ``skip_gain`` as in ``combine``."""
        gain = self.skip_gain if skip_gain is None else skip_gain
        c = float(np.sqrt(len(y_NxN) / np.trace(y_NxN)))
        if self.post_mix is not None:
            return self.post_mix * gain * c + 1 - self.post_mix
        return gain * c if self.normalized_stream else gain


def _row_mix(g_NxN: Gram, plain_share: float, normalized_share: float,
             in_place: bool = False) -> Gram:
    """The Gram of the rows a X_i + b X_i / r_i (a = ``plain_share``, b = ``normalized_share``,
    r_i the row's RMS): D G D with D_ii = a + b / r_i; into ``g_NxN`` itself where
    ``in_place``."""
    return _scaled(g_NxN, plain_share + normalized_share / np.sqrt(np.diag(g_NxN)), in_place)


def summed(g_NxN: Gram, b_NxN: Gram, skip_gain: float) -> Gram:
    """The Gram of the sum y = skip_gain X + F: skip_gain^2 G + B, in a new array."""
    y_NxN = np.multiply(g_NxN, skip_gain**2)
    y_NxN += b_NxN
    return y_NxN


POST_GRAM = GramMaps(reads_normalized=False, normalized_stream=True)
PRE_GRAM = GramMaps(reads_normalized=True, normalized_stream=False)
LayerMaps = tuple[GramMaps, GramMaps]  # the attention and the FFN sublayer of one layer


def mixed_gram(post_mix: float) -> GramMaps:
    """A mixed sublayer's maps with Post-Norm share lambda = ``post_mix``: exactly ``POST_GRAM``
    at 1 and ``PRE_GRAM`` at 0."""
    if post_mix == 1:
        return POST_GRAM
    if post_mix == 0:
        return PRE_GRAM
    return GramMaps(reads_normalized=False, normalized_stream=False, post_mix=float(post_mix))


def _per_layer(arrangement: "GramMaps | list[LayerMaps]", n_layers: int) -> list[LayerMaps]:
    if isinstance(arrangement, GramMaps):
        return [(arrangement, arrangement)] * n_layers
    if len(arrangement) != n_layers:
        raise ValueError(f"{len(arrangement)} layers of Gram maps for {n_layers} layers")
    return list(arrangement)


def scalar_recursion(t0: float, n: int, n_layers: int, amt: Amounts,
                     arrangement: "GramMaps | list[LayerMaps]", r0: float = 1.0) -> np.ndarray:
    """Iterated one-step maps under the EC closure: tsim after each sublayer, [n_layers, 2].

    A normalised stream (Post-Norm): t <- t + Delta_attn(s, t); t <- t + Delta_FFN(xi, t).
    Otherwise (Pre-Norm) the residual energy R = ||X||_F^2 / (n d) is tracked from the input's
    ``r0``: s_k = s / R, R <- R (1 + s_k f2(t)), then xi_k = xi / R, R <- R (1 + xi_k m(1)).
    """
    _check_range("r0", r0, 1e-300)
    layers = _per_layer(arrangement, n_layers)
    if not all(scalar_closure_covers(maps) for pair in layers for maps in pair):
        raise ValueError("the scalar closure covers Post- and Pre-Norm sublayers only (no skip "
                         "gain, branch output norm or layer skip): use mean_field_recursion")
    m1 = float(gate_kernel(1.0, amt.a))
    t, r = float(t0), float(r0)
    out_Lx2 = np.empty((n_layers, 2))
    for layer, (attn_maps, ffn_maps) in enumerate(layers):
        s_k = amt.s / r
        gain = s_k * attn_f2(t, n)
        t = t + delta_attn(s_k, t, n)
        r = r if attn_maps.normalized_stream else r * (1.0 + gain)
        out_Lx2[layer, 0] = t
        xi_k = amt.xi / r
        t = t + delta_ffn(xi_k, t, n, amt.a)
        r = r if ffn_maps.normalized_stream else r * (1.0 + xi_k * m1)
        out_Lx2[layer, 1] = t
    return out_Lx2


def scalar_closure_covers(maps: GramMaps) -> bool:
    """Whether ``scalar_recursion`` models a sublayer: a plain Post- or Pre-Norm one."""
    return (maps.skip_gain == 1.0 and not maps.output_normalized and not maps.layer_skip
            and not maps.profiled_skip and maps.post_mix is None
            and maps.reads_normalized != maps.normalized_stream)


def attn_branch_gram(g_NxN: np.ndarray, s: float, maps: GramMaps) -> np.ndarray:
    """E over W_V, W_O of the attention branch's Gram with uniform attention P (Thm 3.2's Gram
    algebra): s P G_in P^T, with G_in the Gram the branch reads (G, or corr(G) behind a norm),
    then through the branch's output norm if any."""
    b_NxN = prefix_average(prefix_average(maps.branch_input(g_NxN)).T)
    b_NxN *= s
    return maps.branch_output(b_NxN)


def ffn_branch_gram(g_NxN: np.ndarray, xi: float,
                    kernel: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """E over the FFN weights of the FFN branch's Gram (Thm 3.4): xi C o m(C) with C = corr(G)
    and ``kernel`` m(.; a) (``gate_kernel_table``). The FFN reads rows of RMS 1 in every
    arrangement (a norm's output, or a stream the attention sublayer left normalised), so C is
    the correlation of the stream whatever the arrangement."""
    c_NxN = correlation(g_NxN)
    b_NxN = c_NxN * xi
    b_NxN *= kernel(c_NxN)
    return b_NxN


def mean_field_ffn_step(g_NxN: np.ndarray, xi: float, kernel: Callable[[np.ndarray], np.ndarray],
                        maps: GramMaps) -> np.ndarray:
    """E over the FFN weights of the Gram after a FFN sublayer without a layer skip (Thm 3.4's
    G + xi C o m(C)): corr(G + xi C o m(C)) with C = corr(G) for Post-Norm, G + xi C o m(C) for
    Pre-Norm."""
    return maps.combine(g_NxN, maps.branch_output(ffn_branch_gram(g_NxN, xi, kernel)))


def layer_skip_ffn_step(g_in_NxN: np.ndarray, branch_attn_NxN: np.ndarray, g_h_NxN: np.ndarray,
                        b_ffn_NxN: np.ndarray, maps: GramMaps) -> tuple[np.ndarray, np.ndarray]:
    """The Gram of y = X + h + F(h) (B2T's FFN sublayer) through its norm if any, and y's.

    X is the layer's input (Gram G = ``g_in``), h = N(X + A) the attention sublayer's output
    (Gram ``g_h``; G + ``branch_attn`` is the Gram of X + A) and F the FFN branch (Gram
    ``b_ffn``). Over the zero-mean W_O and FFN weights, E[X A^T] = 0 and F is uncorrelated with
    X and h, so the cross term is E[X h^T]_ij = G_ij / r_j with r_j^2 = (G + B)_jj.
    """
    r_N = np.sqrt(np.diag(g_in_NxN + branch_attn_NxN))
    cross_NxN = g_in_NxN / r_N[None, :]
    y = g_in_NxN + g_h_NxN + cross_NxN + cross_NxN.T + b_ffn_NxN
    return (correlation(y) if maps.normalized_stream else y), y


def mean_contraction(y_NxN: Gram) -> float:
    """c of a unit-weight RMSNorm on the sum y averaged over the rows (tokens): the mean of
    1 / RMS(y_i) = y_ii^(-1/2), the diagnostics' ``c_mean`` at init."""
    return float(np.mean(1.0 / np.sqrt(np.diag(y_NxN))))


def summed_step(g_NxN: Gram, b_NxN: Gram, maps: GramMaps, omega_sq: float
                ) -> tuple[Gram, float, float, float]:
    """The Gram after a sublayer without a layer skip, from its input's G and its branch's B,
    Admin's running omega^2 after it (``GramMaps.profiled_skip``; else ``omega_sq``
    unchanged), the sublayer's skip-path gain (``GramMaps.skip_path_gain``) and its sum's
    ``mean_contraction``."""
    gain = float(np.sqrt(omega_sq)) if maps.profiled_skip else maps.skip_gain
    y_NxN = summed(g_NxN, b_NxN, gain)
    skip, c_mean = maps.skip_path_gain(y_NxN, gain), mean_contraction(y_NxN)
    if maps.profiled_skip:
        n = len(g_NxN)
        omega_sq = omega_sq * float(np.trace(g_NxN)) / n + float(np.trace(b_NxN)) / n
    return maps.after_sum(y_NxN), omega_sq, skip, c_mean


@dataclasses.dataclass(frozen=True)
class MeanFieldTrace:
    """Per-layer output of ``mean_field_recursion``.

    tsim_after: [n_layers, 2], tsim after the attention and after the FFN sublayer of each layer.
    tsim_in: [n_layers], tsim at each attention sublayer's input.
    energy_attn: [n_layers], the attention branch-to-skip energy ratio tr E[F F^T] / tr G there.
    delta_attn: [n_layers], the expected one-step tsim change of the attention sublayer without
      its norm, 1^T(G + B)1 / (n tr(G + B)) - tsim(G) with B the branch Gram: Thm 3.2's Delta
      for this (not necessarily EC) Gram.
    skip_gain: [n_layers], the layer's skip-path gain on the backward signal, from its output to
      its input around both branches: the product of its sublayers' ``GramMaps.skip_path_gain``
      (Stage II's product of contractions c in Post-Norm, 1 in Pre-Norm); with a layer skip
      (B2T), c_FFN (1 + c_attn), the paths through h = N(X + A) and past it added.
    sublayer_skip_gain: [n_layers, 2], each sublayer's ``GramMaps.skip_path_gain``, from its
      output to its input (B2T's FFN: to h, the layer skip's path aside): the mean-field
      backward gain ||dL/dX_in|| / ||dL/dX_out|| of ``postnorm.train.placement_control``, the
      branch's path left out as in ``skip_gain`` (whose factors these are without a layer skip).
    c_mean: [n_layers, 2], each sublayer's ``mean_contraction`` of its sum y = skip + branch
      (the norm input; in a mixed sublayer the Post norm's, whatever lambda).
    """

    tsim_after: np.ndarray
    tsim_in: np.ndarray
    energy_attn: np.ndarray
    delta_attn: np.ndarray
    skip_gain: np.ndarray
    sublayer_skip_gain: np.ndarray
    c_mean: np.ndarray


def mean_field_recursion(g0_NxN: np.ndarray, n_layers: int, amt: Amounts,
                         arrangement: "GramMaps | list[LayerMaps]",
                         stop_above: float | None = None) -> MeanFieldTrace:
    """The mean-field Gram recursion (docs/MATH.md §3) from the input Gram ``g0_NxN`` (units of d).

    Propagates the full expected Gram with uniform causal attention, exact per-row RMSNorm and
    the FFN kernel applied elementwise, without the EC closure. ``arrangement`` is one
    ``GramMaps`` for every sublayer, or one (attention, FFN) pair per layer
    (``postnorm.model.placements``' ``gram_maps``). With ``stop_above``, the recursion stops
    after the first layer whose tsim exceeds it (the trace then has fewer rows).
    """
    kernel = gate_kernel_table(amt.a)
    g = np.asarray(g0_NxN, np.float64)
    omega_sq = 1.0  # Admin's running omega^2 (GramMaps.profiled_skip)
    rows = []
    for attn_maps, ffn_maps in _per_layer(arrangement, n_layers):
        g_layer_in = g
        t_in = tsim_of_gram(g)
        branch = attn_branch_gram(g, amt.s, attn_maps)
        energy = np.trace(branch) / np.trace(g)
        delta = tsim_of_gram(g + branch) - t_in
        g, omega_sq, skip_attn, c_attn = summed_step(g, branch, attn_maps, omega_sq)
        t_attn = tsim_of_gram(g)
        if ffn_maps.layer_skip:
            if (not attn_maps.normalized_stream or ffn_maps.skip_gain != 1.0
                    or ffn_maps.profiled_skip or ffn_maps.post_mix is not None):
                raise ValueError("a layer skip is modelled behind a normalised attention "
                                 "sublayer and without a skip gain")
            b_ffn = ffn_maps.branch_output(ffn_branch_gram(g, amt.xi, kernel))
            g, y = layer_skip_ffn_step(g_layer_in, branch, g, b_ffn, ffn_maps)
            skip_ffn, c_ffn = ffn_maps.skip_path_gain(y), mean_contraction(y)
            skip = skip_ffn * (1 + skip_attn)
        else:
            g, omega_sq, skip_ffn, c_ffn = summed_step(
                g, ffn_maps.branch_output(ffn_branch_gram(g, amt.xi, kernel)), ffn_maps, omega_sq)
            skip = skip_attn * skip_ffn
        rows.append((t_attn, tsim_of_gram(g), t_in, energy, delta, skip, skip_attn, skip_ffn,
                     c_attn, c_ffn))
        if stop_above is not None and max(rows[-1][:2]) > stop_above:
            break
    out = np.array(rows)
    return MeanFieldTrace(tsim_after=out[:, :2], tsim_in=out[:, 2], energy_attn=out[:, 3],
                          delta_attn=out[:, 4], skip_gain=out[:, 5],
                          sublayer_skip_gain=out[:, 6:8], c_mean=out[:, 8:10])
