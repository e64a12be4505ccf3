"""Closed forms of the paper's theorems (docs/MATH.md); numpy, float64, vectorised.

* §0  token similarity tsim, H_n, the equicorrelated (EC) correlation rho(t).
* §1  Thm 3.2, attention amplification: f1, f2, Delta_attn(s, t, n).
* §2  Thm 3.4, SwiGLU damping: the gate kernel m(rho; a) and Delta_FFN(xi, t, n, a).
* §1a/§2e  the amounts s, xi and the gate scale a of a model config and init scheme.
* §4  Thm 3.6, the RMSNorm contraction factor c(y, alpha).
* §5  Thm 3.8(i), the collapse floor L_freq and its lower bound on the cross-entropy.

Conventions: P is causal prefix averaging (P_ij = 1/i for j <= i), the attention matrix at
initialisation. Gram matrices are in units of d, G = X X^T / d, so a row with RMS 1 has
G_ii = 1 and the correlation matrix corr(G) is the Gram of the RMS-normalised rows.
"""

import dataclasses
import functools
from collections.abc import Callable

import numpy as np

ArrayLike = float | np.ndarray
GATE_NODES = 80  # Gauss-Hermite nodes per axis of the gate kernel; converged to ~1e-12
KERNEL_GRID = 4097  # rho grid of the tabulated gate kernel used on Gram matrices
GATE_CHUNK = 16  # points of the gate kernel computed at once (nodes^2 values each)
S_READINGS = ("vo", "v_only")
INIT_SCHEMES = ("torch_default", "normal_0.02", "lecun_normal", "xavier", "xavier_normal")


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
    rho_P, a_P, m_P = rho.ravel(), a.ravel(), np.empty(rho.size)
    for start in range(0, rho.size, GATE_CHUNK):  # nodes^2 values per point: kept in cache
        part = slice(start, start + GATE_CHUNK)
        m_P[part] = _gauss_hermite_gate(rho_P[part], a_P[part], z_K, w_K)
    return m_P.reshape(rho.shape)[()]  # a scalar for scalar arguments


def _gauss_hermite_gate(rho_P: np.ndarray, a_P: np.ndarray, z_K: np.ndarray,
                        w_K: np.ndarray) -> np.ndarray:
    """``gate_kernel`` at the points (rho, a) of ``rho_P``, ``a_P`` on the nodes ``z_K`` with
    weights ``w_K``."""
    rho_Px1x1, a_Px1x1 = rho_P[:, None, None], a_P[:, None, None]
    z1, z2 = z_K[:, None], z_K[None, :]
    u2_PxKxK = rho_Px1x1 * z1 + np.sqrt(np.clip(1.0 - rho_Px1x1**2, 0.0, None)) * z2
    integrand_PxKxK = _silu(a_Px1x1 * z1) * _silu(a_Px1x1 * u2_PxKxK)
    return np.einsum("pij,i,j->p", integrand_PxKxK, w_K, w_K)


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


# §2e: the init schemes' entry variances ------------------------------------------------------

def kernel_variance(scheme: str, fan_in: int, fan_out: int) -> float:
    """Entry variance of a ``[fan_in, fan_out]`` matrix under the init ``scheme``
    (``postnorm.model.initializers`` draws them): torch_default 1/(3 fan_in), normal_0.02
    4e-4, lecun_normal 1/fan_in, xavier and xavier_normal 2/(fan_in + fan_out)."""
    variances = {
        "torch_default": 1.0 / (3.0 * fan_in),
        "normal_0.02": 0.02**2,
        "lecun_normal": 1.0 / fan_in,
        "xavier": 2.0 / (fan_in + fan_out),
        "xavier_normal": 2.0 / (fan_in + fan_out),
    }
    if scheme not in variances:
        raise ValueError(f"model.init={scheme!r} is not one of {INIT_SCHEMES}")
    return variances[scheme]


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

    def with_gains(self, gains: dict[str, float]) -> "Amounts":
        """The amounts after multiplying weight matrices by ``gains`` (by parameter name, 1 where
        absent): s scales with g_v^2 g_o^2, xi with g_up^2 g_down^2 and a with g_gate."""
        g = {name: float(gains.get(name, 1.0)) for name in
             ("w_v", "w_o", "w_gate", "w_up", "w_down")}
        return Amounts(s=self.s * (g["w_v"] * g["w_o"]) ** 2,
                       xi=self.xi * (g["w_up"] * g["w_down"]) ** 2, a=self.a * g["w_gate"])


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


def amounts_from_config(model_cfg, s_reading: str = "vo") -> Amounts:
    """``amounts`` for ``config.model`` (its d_model, d_ff and init)."""
    return amounts(model_cfg.d_model, model_cfg.d_ff, model_cfg.init, s_reading)


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

def unigram_entropy(counts: np.ndarray) -> float:
    """-sum p log p in nats of the distribution proportional to `counts`."""
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


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
