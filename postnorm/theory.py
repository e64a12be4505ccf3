"""Closed forms of the paper's theorems and the depth recursions built on them (docs/MATH.md).

Everything is numpy, float64 and vectorised over array arguments.

* §0  token similarity tsim, H_n, the equicorrelated (EC) correlation rho(t).
* §1  Thm 3.2, attention amplification: f1, f2, Delta_attn(s, t, n).
* §2  Thm 3.4, SwiGLU damping: the gate kernel m(rho; a) and Delta_FFN(xi, t, n, a).
* §1a/§2e  the amounts s, xi and the gate scale a of a model config and init scheme.
* §3  depth recursions: the scalar closure and the mean-field Gram recursion, Post and Pre.
* §4  Thm 3.6, the RMSNorm contraction factor c(y, alpha).
* §5  Thm 3.8(i), the collapse floor L_freq and its lower bound on the cross-entropy.

Conventions: P is causal prefix averaging (P_ij = 1/i for j <= i), the attention matrix at
initialisation. Gram matrices are in units of d, G = X X^T / d, so a row with RMS 1 has
G_ii = 1 and the correlation matrix corr(G) is the Gram of the RMS-normalised rows.
"""

import dataclasses
import functools
from collections.abc import Callable

import ml_collections
import numpy as np

from postnorm.data.lfreq import unigram_entropy
from postnorm.initializers import kernel_variance

ArrayLike = float | np.ndarray
GATE_NODES = 80  # Gauss-Hermite nodes per axis of the gate kernel; converged to ~1e-12
KERNEL_GRID = 4097  # rho grid of the tabulated gate kernel used on Gram matrices
S_READINGS = ("vo", "v_only")
NORM_PLACEMENTS = ("post", "pre")


# §0 -------------------------------------------------------------------------------------------

def _check_n(n: int, low: int = 2) -> None:
    """``n`` is an integer >= ``low`` (a sequence length: at n = 1 tsim is 1 and nothing
    changes), else a ValueError naming it."""
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < low:
        raise ValueError(f"n={n!r}: must be an integer >= {low}")


def _check_range(name: str, value: ArrayLike, low: float, high: float = np.inf) -> None:
    """``value`` lies in [low, high] (up to float rounding), else a ValueError naming it."""
    v = np.asarray(value, np.float64)
    if not np.all((v >= low - 1e-12) & (v <= high + 1e-12)):
        raise ValueError(f"{name}={value!r} is outside [{low}, {high}]")


_HARMONIC_EXACT_UP_TO = 1 << 20


def harmonic(n: int) -> float:
    """H_n = sum_{k<=n} 1/k: the sum itself up to n = 2^20, beyond it the Euler–Maclaurin
    series ln n + gamma + 1/(2n) - 1/(12n^2) + 1/(120n^4), whose error (< 1/(252 n^6)) is far
    below float64 rounding there."""
    _check_n(n, 1)
    if n <= _HARMONIC_EXACT_UP_TO:
        return float(np.sum(1.0 / np.arange(1, n + 1, dtype=np.float64)))
    inv_n2 = 1.0 / float(n) ** 2
    return float(np.log(n) + np.euler_gamma + 0.5 / n - inv_n2 / 12.0 + inv_n2**2 / 120.0)


def tsim(x_NxD: np.ndarray) -> np.ndarray:
    """tsim(X) = ||sum_i x_i||^2 / (n sum_i ||x_i||^2) over the last two axes [..., N, D]."""
    x = np.asarray(x_NxD, np.float64)
    n = x.shape[-2]
    return np.sum(np.sum(x, -2) ** 2, -1) / (n * np.sum(x * x, (-2, -1)))


def tsim_of_gram(g_NxN: np.ndarray) -> np.ndarray:
    """tsim = 1^T G 1 / (n tr G) from a Gram matrix [..., N, N]."""
    n = g_NxN.shape[-1]
    return np.sum(g_NxN, (-2, -1)) / (n * np.trace(g_NxN, axis1=-2, axis2=-1))


def ec_rho(t: ArrayLike, n: int) -> ArrayLike:
    """Correlation of the EC model with tsim t: rho = (n t - 1) / (n - 1)."""
    _check_n(n)
    _check_range("t", t, 0.0, 1.0)
    return (n * np.asarray(t, np.float64) - 1.0) / (n - 1.0)


# §1: Thm 3.2 -----------------------------------------------------------------------------------

def attn_f1(t: ArrayLike, n: int) -> ArrayLike:
    """f1(t) = (1 - t)(1 + n t)(n - H_n) / (n (n - 1))  (Thm 3.2)."""
    _check_n(n)
    _check_range("t", t, 0.0, 1.0)
    t = np.asarray(t, np.float64)
    return (1.0 - t) * (1.0 + n * t) * (n - harmonic(n)) / (n * (n - 1.0))


def attn_f2(t: ArrayLike, n: int) -> ArrayLike:
    """f2(t) = (n t - 1 + (1 - t) H_n) / (n - 1) = ||P X||_F^2 / ||X||_F^2 for EC X (Thm 3.2)."""
    _check_n(n)
    _check_range("t", t, 0.0, 1.0)
    t = np.asarray(t, np.float64)
    return (n * t - 1.0 + (1.0 - t) * harmonic(n)) / (n - 1.0)


def delta_attn(s: ArrayLike, t: ArrayLike, n: int) -> ArrayLike:
    """One-step tsim change of X + P X W_VO for EC X: s f1(t) / (1 + s f2(t))  (Thm 3.2).

    ValueError for n < 2, t outside [0, 1] or s < 0 (the EC Gram is PSD for t in [0, 1])."""
    _check_range("s", s, 0.0)
    s = np.asarray(s, np.float64)
    return s * attn_f1(t, n) / (1.0 + s * attn_f2(t, n))


# §2: Thm 3.4 -----------------------------------------------------------------------------------

def _silu(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(0.5 * x))


def gate_kernel(rho: ArrayLike, a: ArrayLike, nodes: int = GATE_NODES) -> np.ndarray:
    """m(rho; a) = E[SiLU(a u) SiLU(a u')], (u, u') standard normal with correlation rho (Thm 3.4).

    2-D Gauss-Hermite quadrature (probabilists' weight) with u = z1, u' = rho z1 + sqrt(1-rho^2) z2.
    ``rho`` and ``a`` broadcast against each other.
    """
    z_K, w_K = np.polynomial.hermite_e.hermegauss(nodes)
    w_K = w_K / np.sqrt(2.0 * np.pi)
    _check_range("rho", rho, -1.0, 1.0)
    _check_range("a", a, 0.0)
    rho, a = np.broadcast_arrays(np.asarray(rho, np.float64), np.asarray(a, np.float64))
    rho4, a4 = rho[..., None, None], a[..., None, None]
    z1, z2 = z_K[:, None], z_K[None, :]
    u2 = rho4 * z1 + np.sqrt(np.clip(1.0 - rho4**2, 0.0, None)) * z2
    integrand = _silu(a4 * z1) * _silu(a4 * u2)
    return np.einsum("...ij,i,j->...", integrand, w_K, w_K)


@functools.lru_cache(maxsize=16)
def gate_kernel_table(a: float, grid: int = KERNEL_GRID) -> Callable[[np.ndarray], np.ndarray]:
    """m(.; a) tabulated on ``grid`` points of [-1, 1] and linearly interpolated.

    For elementwise use on n x n correlation matrices; the interpolation error is below 2e-8
    for a <= 1.5. Cached per (a, grid).
    """
    rho_R = np.linspace(-1.0, 1.0, grid)
    m_R = gate_kernel(rho_R, a)
    return lambda c: np.interp(np.clip(c, -1.0, 1.0), rho_R, m_R)


def delta_ffn(xi: ArrayLike, t: ArrayLike, n: int, a: ArrayLike) -> ArrayLike:
    """One-step tsim change of X + FFN(X) for EC X with RMS-1 rows (Thm 3.4):

    xi (t - 1/n)(m(rho(t)) - m(1)) / (1 + xi m(1)),  rho(t) = (n t - 1)/(n - 1).
    """
    _check_range("xi", xi, 0.0)
    xi, t = np.asarray(xi, np.float64), np.asarray(t, np.float64)
    m1 = gate_kernel(1.0, a)
    return xi * (t - 1.0 / n) * (gate_kernel(ec_rho(t, n), a) - m1) / (1.0 + xi * m1)


# §1a, §2e: amounts from a config ---------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Amounts:
    """Per-sublayer amounts at initialisation for RMS-1 branch inputs.

    s: attention amount, the branch energy gain E||x W_V W_O||^2 / ||x||^2 (Thm 3.2).
    xi: FFN amount d d_ff sigma_up^2 sigma_down^2 (Thm 3.4).
    a: gate pre-activation scale sigma_gate sqrt(d).
    """

    s: float
    xi: float
    a: float

    @property
    def xi_m1(self) -> float:
        """xi m(1): the FFN branch-to-skip energy ratio E||FFN(x)||^2 / ||x||^2."""
        return float(self.xi * gate_kernel(1.0, self.a))


def amounts(d_model: int, d_ff: int, init: str, s_reading: str = "vo") -> Amounts:
    """s, xi and a of a model with width ``d_model``, FFN width ``d_ff`` and init scheme ``init``.

    ``s_reading`` (docs/MATH.md §1a): ``"vo"`` (default) reads the paper's sigma_W^2 as the entry
    variance of W_VO = W_V W_O, giving s = d^2 sigma_V^2 sigma_O^2, the branch energy gain of the
    model's separate W_V and W_O; ``"v_only"`` reads it as the variance of W_V, s = d sigma_V^2.
    """
    d = d_model
    var_v = kernel_variance(init, d, d)
    var_o = kernel_variance(init, d, d)
    if s_reading == "vo":
        s = d * d * var_v * var_o
    elif s_reading == "v_only":
        s = d * var_v
    else:
        raise ValueError(f"s_reading={s_reading!r} is not one of {S_READINGS}")
    var_in = kernel_variance(init, d, d_ff)  # W_gate and W_up
    var_down = kernel_variance(init, d_ff, d)
    return Amounts(s=float(s), xi=float(d * d_ff * var_in * var_down),
                   a=float(np.sqrt(var_in * d)))


def amounts_from_config(model_cfg: ml_collections.ConfigDict, s_reading: str = "vo") -> Amounts:
    """``amounts`` for ``config.model`` (its d_model, d_ff and init)."""
    return amounts(model_cfg.d_model, model_cfg.d_ff, model_cfg.init, s_reading)


# §3: depth recursions --------------------------------------------------------------------------

def _check_norm(norm: str) -> None:
    if norm not in NORM_PLACEMENTS:
        raise ValueError(f"norm={norm!r} is not one of {NORM_PLACEMENTS}")


def scalar_recursion(t0: float, n: int, n_layers: int, amt: Amounts, norm: str,
                     r0: float = 1.0) -> np.ndarray:
    """Iterated one-step maps under the EC closure: tsim after each sublayer, [n_layers, 2].

    Post-Norm: t <- t + Delta_attn(s, t); t <- t + Delta_FFN(xi, t). Pre-Norm also tracks the
    residual energy R = ||X||_F^2 / (n d), from the input's ``r0``: s_k = s / R,
    R <- R (1 + s_k f2(t)), then xi_k = xi / R, R <- R (1 + xi_k m(1)).
    """
    _check_norm(norm)
    _check_range("r0", r0, 1e-300)
    m1 = float(gate_kernel(1.0, amt.a))
    t, r = float(t0), float(r0)
    out_Lx2 = np.empty((n_layers, 2))
    for layer in range(n_layers):
        s_k = amt.s / r
        gain = s_k * attn_f2(t, n)
        t = t + delta_attn(s_k, t, n)
        r = r * (1.0 + gain) if norm == "pre" else r
        out_Lx2[layer, 0] = t
        xi_k = amt.xi / r
        t = t + delta_ffn(xi_k, t, n, amt.a)
        r = r * (1.0 + xi_k * m1) if norm == "pre" else r
        out_Lx2[layer, 1] = t
    return out_Lx2


def prefix_average(x_NxK: np.ndarray) -> np.ndarray:
    """P X: row i becomes the mean of rows 1..i."""
    counts = np.arange(1, x_NxK.shape[0] + 1, dtype=np.float64)
    return np.cumsum(x_NxK, axis=0) / counts.reshape((-1,) + (1,) * (x_NxK.ndim - 1))


def correlation(g_NxN: np.ndarray) -> np.ndarray:
    """corr(G) = D^-1/2 G D^-1/2: the Gram of the RMS-normalised rows (exact per-row RMSNorm)."""
    inv_sqrt_N = 1.0 / np.sqrt(np.diag(g_NxN))
    return g_NxN * inv_sqrt_N[:, None] * inv_sqrt_N[None, :]


def attn_branch_gram(g_NxN: np.ndarray, s: float, norm: str) -> np.ndarray:
    """E over W_V, W_O of the attention branch's Gram with uniform attention P (Thm 3.2's Gram
    algebra): s P G P^T for Post-Norm, s P corr(G) P^T for Pre-Norm (the branch sees N(X))."""
    _check_norm(norm)
    branch_in = g_NxN if norm == "post" else correlation(g_NxN)
    return s * prefix_average(prefix_average(branch_in).T)


def mean_field_ffn_step(g_NxN: np.ndarray, xi: float, kernel: Callable[[np.ndarray], np.ndarray],
                        norm: str) -> np.ndarray:
    """E over the FFN weights of the Gram after the FFN sublayer (Thm 3.4's G + xi G o m(C)).

    ``kernel`` is m(.; a) (``gate_kernel_table``). Post: corr(G + xi C o m(C)) with C = corr(G).
    Pre: G + xi C o m(C).
    """
    _check_norm(norm)
    c_NxN = correlation(g_NxN)
    g_next = g_NxN + xi * c_NxN * kernel(c_NxN)
    return correlation(g_next) if norm == "post" else g_next


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
                         norm: str) -> MeanFieldTrace:
    """The mean-field Gram recursion (docs/MATH.md §3) from the input Gram ``g0_NxN`` (units of d).

    Propagates the full expected Gram with uniform causal attention, exact per-row RMSNorm and
    the FFN kernel applied elementwise, without the EC closure.
    """
    kernel = gate_kernel_table(amt.a)
    g = np.asarray(g0_NxN, np.float64)
    rows = []
    for _ in range(n_layers):
        t_in = tsim_of_gram(g)
        branch = attn_branch_gram(g, amt.s, norm)
        energy = np.trace(branch) / np.trace(g)
        g = g + branch
        delta = tsim_of_gram(g) - t_in
        g = correlation(g) if norm == "post" else g
        t_attn = tsim_of_gram(g)
        g = mean_field_ffn_step(g, amt.xi, kernel, norm)
        rows.append((t_attn, tsim_of_gram(g), t_in, energy, delta))
    out = np.array(rows)
    return MeanFieldTrace(tsim_after=out[:, :2], tsim_in=out[:, 2], energy_attn=out[:, 3],
                          delta_attn=out[:, 4])


# §4: Thm 3.6 -----------------------------------------------------------------------------------

def rmsnorm_contraction(y_D: np.ndarray, alpha: float = 1.0, eps: float = 0.0) -> np.ndarray:
    """c(y, alpha) = |alpha| / sqrt(||y||^2 / d + eps) over the last axis (Thm 3.6).

    The spectral norm of the Jacobian of z = alpha y / r(y) for a scalar gain alpha
    (alpha sqrt(d) / ||y|| when eps = 0); c < 1 iff ||y||^2 / d > alpha^2 - eps. A vector
    gain is refused: the diagnostics report its RMS and max (``postnorm.diagnostics``).
    """
    if np.ndim(alpha) != 0:
        raise ValueError("alpha must be a scalar gain; for a vector gain the spectral norm is "
                         "at most max|alpha| / r (the diagnostics' c_bound), and the "
                         "diagnostics' c puts rms(alpha) in place of the scalar gain")
    y = np.asarray(y_D, np.float64)
    return abs(float(alpha)) / np.sqrt(np.mean(y * y, -1) + eps)


# §5: Thm 3.8 -----------------------------------------------------------------------------------

def frequency_loss(targets_N: np.ndarray) -> float:
    """L_freq = H(p_hat), the entropy in nats of the empirical target frequencies (Thm 3.8)."""
    return unigram_entropy(np.bincount(np.asarray(targets_N).ravel()))


def collapse_distance(x_NxD: np.ndarray) -> np.ndarray:
    """epsilon = ||X - Pi_1 X||_F, the distance of the hidden states from full collapse, over
    the last two axes [..., N, D] (one value per sequence)."""
    x = np.asarray(x_NxD, np.float64)
    return np.sqrt(np.sum((x - x.mean(-2, keepdims=True)) ** 2, (-2, -1)))


def collapse_loss_bound(lfreq: float, w_lm_VxD: np.ndarray, eps: float, n: int) -> float:
    """Thm 3.8(i): L_CE >= L_freq - (2 / sqrt(n)) ||W_lm||_2 eps for logits W_lm x_i."""
    return float(lfreq - 2.0 / np.sqrt(n) * np.linalg.norm(w_lm_VxD, 2) * eps)
