"""Monte Carlo validators of ``postnorm.theory``: each samples the exact setting of a theorem.

* ``ec_input``: equicorrelated inputs (docs/MATH.md §0, §1d).
* ``mc_delta_attn_uniform`` / ``mc_delta_attn_softmax``: Thm 3.2 under prefix averaging and under
  the model's real softmax attention (``postnorm.model.layers.CausalSelfAttention``).
* ``mc_delta_ffn``: Thm 3.4 with the model's ``SwiGLU`` (docs/MATH.md §2d).
* ``mc_gate_kernel``: the gate kernel m(rho; a) by sampling.
* ``vjp_contraction``: Thm 3.6's c through ``jax.vjp`` of the model's ``RMSNorm``.
* ``LayerStack`` / ``stack_statistics``: the model's scanned layer stack run on a given residual
  stream, with real softmax, uniform (P) or prefix-centred (A - P) attention, for §3;
  ``stack_ec_statistics``: per layer, what Thm 3.2's one-step Delta needs from the measured
  state without the equicorrelation assumption, and how far the state is from equicorrelated.

Weight-space expectations are estimated as ratios of means over antithetic pairs (+W, -W) of
the last matrix of a branch, which cancels the skip-branch cross term exactly; standard errors
use the delta method.
"""

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from postnorm import theory
from postnorm.diagnostics.stats import tsim as batch_tsim
from postnorm.diagnostics.taps import zero_probes
from postnorm.model import PLACEMENTS, Block, ModelSpec
from postnorm.model.layers import CausalSelfAttention, RMSNorm, SwiGLU
from postnorm.theory import kernel_variance

ATTENTION_MODES = ("softmax", "uniform", "centered")
# Per layer, at the attention sublayer: X its residual input, H the attention's input (X in
# Post-Norm, RMSNorm(X) in Pre-Norm), P causal prefix averaging, 1 the all-ones vector.
EC_STATS = ("residual_sq",  # ||X||_F^2
            "residual_sum_sq",  # ||1^T X||^2 (tsim(X) = residual_sum_sq / (n residual_sq))
            "branch_in_sq",  # ||H||_F^2
            "prefix_sq",  # ||P H||_F^2
            "prefix_sum_sq",  # ||1^T P H||^2
            "corr_mean",  # mean over token pairs i != j of cos(x_i, x_j)
            "corr_sd")  # their standard deviation: 0 for an equicorrelated state
STACK_STATS = ("tsim_attn", "tsim_ffn", "tsim_branch_attn", "tsim_branch_ffn", "energy_ratio_attn",
               "energy_ratio_ffn", "attn_tv_uniform")


@dataclasses.dataclass(frozen=True)
class MCEstimate:
    """A Monte Carlo estimate and its standard error."""

    mean: float
    stderr: float


def ec_input(rng: np.random.Generator, n: int, d: int, t: float) -> np.ndarray:
    """Exact EC input with tsim t and rows of squared norm d: X = 1 mu^T + Z (docs/MATH.md §0).

    mu and the rows of Z are mutually orthogonal (a random orthonormal frame), with
    ||mu||^2 = rho d and ||z_i||^2 = (1 - rho) d, so G = d[(1 - rho) I + rho J]. Needs d > n.
    """
    if d <= n or not 1.0 / n <= t <= 1.0:
        raise ValueError(f"an exact EC input needs d > n and 1/n <= t <= 1, got n={n}, d={d}, "
                         f"t={t}")
    rho = float(theory.ec_rho(t, n))
    q_DxK, _ = np.linalg.qr(rng.normal(size=(d, n + 1)))
    return np.sqrt(rho * d) * q_DxK[:, 0][None, :] + np.sqrt((1.0 - rho) * d) * q_DxK[:, 1:].T


def isotropic_ec_input(rng: np.random.Generator, n: int, d: int, t: float) -> np.ndarray:
    """X = sqrt(rho) 1 g^T + sqrt(1 - rho) Z with g, Z iid N(0, 1): E G = d[(1 - rho) I + rho J].

    Any n and d (also n > d); the EC structure holds in expectation over X. Needs 1/n <= t <= 1.
    """
    if not 1.0 / n <= t <= 1.0:
        raise ValueError(f"an EC input needs 1/n <= t <= 1, got n={n}, t={t}")
    rho = float(theory.ec_rho(t, n))
    return np.sqrt(rho) * rng.normal(size=(1, d)) + np.sqrt(1.0 - rho) * rng.normal(size=(n, d))


def _energies(y_KxNxD: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(||1^T Y||^2, n ||Y||_F^2) per sample: tsim's numerator and denominator."""
    y = np.asarray(y_KxNxD, np.float64)
    return np.sum(np.sum(y, -2) ** 2, -1), y.shape[-2] * np.sum(y * y, (-2, -1))


def _tsim_change(y_num: np.ndarray, y_den: np.ndarray, x_num: np.ndarray,
                x_den: np.ndarray) -> MCEstimate:
    """E[num_Y]/E[den_Y] - E[num_X]/E[den_X] from paired samples, with a delta-method error."""
    r_y, r_x = y_num.mean() / y_den.mean(), x_num.mean() / x_den.mean()
    influence = (y_num - r_y * y_den) / y_den.mean() - (x_num - r_x * x_den) / x_den.mean()
    return MCEstimate(float(r_y - r_x), float(influence.std(ddof=1) / np.sqrt(len(influence))))


def _antithetic_change(x_KxNxD: np.ndarray, y_plus: np.ndarray,
                       y_minus: np.ndarray) -> MCEstimate:
    """tsim change from inputs and outputs of antithetic pairs (pair means of the energies)."""
    (num_plus, den_plus), (num_minus, den_minus) = _energies(y_plus), _energies(y_minus)
    return _tsim_change(0.5 * (num_plus + num_minus), 0.5 * (den_plus + den_minus),
                        *_energies(x_KxNxD))


def _inputs(rng: np.random.Generator, n: int, d: int, t: float, pairs: int,
            exact: bool) -> np.ndarray:
    make = ec_input if exact else isotropic_ec_input
    return np.stack([make(rng, n, d, t) for _ in range(pairs)])


def mc_delta_attn_uniform(rng: np.random.Generator, n: int, d: int, s: float, t: float,
                          pairs: int, exact: bool = True) -> MCEstimate:
    """Thm 3.2's setting: Y = X + P X W_V W_O with Gaussian W_V, W_O, d^2 sigma_V^2 sigma_O^2 = s.

    Each pair draws a fresh EC input (exact, or isotropic when ``exact`` is False) and W_V, W_O,
    and uses +W_O and -W_O.
    """
    sigma = np.sqrt(np.sqrt(s)) / np.sqrt(d)
    x_KxNxD = _inputs(rng, n, d, t, pairs, exact)
    w_v = rng.normal(scale=sigma, size=(pairs, d, d))
    w_o = rng.normal(scale=sigma, size=(pairs, d, d))
    branch = np.stack([theory.prefix_average(x) for x in x_KxNxD]) @ w_v @ w_o
    return _antithetic_change(x_KxNxD, x_KxNxD + branch, x_KxNxD - branch)


def _pair_outputs(module: nn.Module, params: dict, negate: str,
                  x_KxNxD: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """X + F(X) under ``params`` and under ``params`` with ``negate`` sign-flipped, per sample."""
    def both(p: dict, x_NxD: jax.Array) -> tuple[jax.Array, jax.Array]:
        def out(q: dict) -> jax.Array:
            return x_NxD + module.apply({"params": q}, x_NxD[None])[0]
        return out(p), out({**p, negate: -p[negate]})
    plus, minus = jax.jit(jax.vmap(both))(params, jnp.asarray(x_KxNxD, jnp.float32))
    return np.asarray(plus), np.asarray(minus)


def mc_delta_attn_softmax(seed: int, n: int, d: int, t: float, n_heads: int, init: str,
                          pairs: int) -> MCEstimate:
    """Thm 3.2 with the model's causal softmax attention (no positions) at ``init``.

    W_Q, W_K, W_V, W_O come from the module's own initialiser, so s = d^2 sigma_V^2 sigma_O^2 of
    ``init``; pairs use +W_O and -W_O on a fresh exact EC input. Attention is only approximately
    uniform here (assumption A1 of the theorem).
    """
    rng = np.random.default_rng(seed)
    x_KxNxD = _inputs(rng, n, d, t, pairs, exact=True)
    module = CausalSelfAttention(n_heads, init, "none", 10000.0, jnp.float32)
    keys = jax.random.split(jax.random.key(seed), pairs)
    params = jax.vmap(lambda k: nn.unbox(module.init(k, jnp.zeros((1, 1, d))))["params"])(keys)
    return _antithetic_change(x_KxNxD, *_pair_outputs(module, params, "w_o", x_KxNxD))


def mc_delta_ffn(seed: int, n: int, d: int, d_ff: int, t: float, init: str,
                 pairs: int) -> MCEstimate:
    """Thm 3.4's setting (docs/MATH.md §2d): Y = X + SwiGLU(X), exact EC X with RMS-1 rows.

    W_gate, W_up, W_down are Gaussian with the entry variances of ``init``; pairs use +W_down
    and -W_down.
    """
    rng = np.random.default_rng(seed)
    x_KxNxD = _inputs(rng, n, d, t, pairs, exact=True)
    sd_in = np.sqrt(kernel_variance(init, d, d_ff))
    sd_down = np.sqrt(kernel_variance(init, d_ff, d))
    params = {"w_gate": rng.normal(scale=sd_in, size=(pairs, d, d_ff)),
              "w_up": rng.normal(scale=sd_in, size=(pairs, d, d_ff)),
              "w_down": rng.normal(scale=sd_down, size=(pairs, d_ff, d))}
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
    module = SwiGLU(d_ff, init, jnp.float32)
    return _antithetic_change(x_KxNxD, *_pair_outputs(module, params, "w_down", x_KxNxD))


def mc_gate_kernel(rng: np.random.Generator, rho: float, a: float, samples: int) -> MCEstimate:
    """E[SiLU(a u) SiLU(a u')] over ``samples`` correlated standard normal pairs (u, u')."""
    z_2xS = rng.normal(size=(2, samples))
    u, u2 = z_2xS[0], rho * z_2xS[0] + np.sqrt(1.0 - rho**2) * z_2xS[1]
    values = np.asarray(jax.nn.silu(a * u) * jax.nn.silu(a * u2), np.float64)
    return MCEstimate(float(values.mean()), float(values.std(ddof=1) / np.sqrt(samples)))


def vjp_contraction(rng: np.random.Generator, y_D: np.ndarray, alpha: float, eps: float) -> float:
    """||vjp(g)|| / ||g|| of the model's RMSNorm (gain alpha) at y, for a random g orthogonal to y.

    Thm 3.6: this equals c(y, alpha), the norm's contraction of gradient directions not along y.
    """
    y = np.asarray(y_D, np.float64)
    g = rng.normal(size=y.shape)
    g = g - (g @ y) / (y @ y) * y
    scale = jnp.full(y.shape, alpha, jnp.float32)
    _, vjp = jax.vjp(lambda v: RMSNorm(eps).apply({"params": {"scale": scale}}, v),
                     jnp.asarray(y, jnp.float32))
    return float(jnp.linalg.norm(vjp(jnp.asarray(g, jnp.float32))[0]) / np.linalg.norm(g))


class LayerStack(nn.Module):
    """The decoder's layer stack, ``nn.scan`` over ``postnorm.model.Block``, on a given input.

    Its parameters are ``{"layers": ...}``, the same tree as ``Decoder``'s ``params["layers"]``,
    so a Decoder's layers can be run on a residual stream that bypasses the embedding.
    """

    spec: ModelSpec
    sow_layers: bool = False  # stack what the layers sow ("intermediates") over the layer axis

    @nn.compact
    def __call__(self, x_BxLxD: jax.Array,
                 probes_Lx2xS: jax.Array | None) -> tuple[jax.Array, dict | None]:
        axes = {"params": 0, **({"intermediates": 0} if self.sow_layers else {})}
        stack = nn.scan(Block, variable_axes=axes, split_rngs={"params": True},
                        length=self.spec.n_layers, metadata_params={nn.PARTITION_NAME: "layers"})
        profile = PLACEMENTS[self.spec.norm].post_mix(self.spec)
        post_mix_Lx2 = None if profile is None else jnp.asarray(profile)
        return stack(self.spec, name="layers")(x_BxLxD, probes_Lx2xS, post_mix_Lx2)


@functools.lru_cache(maxsize=8)
def _jitted_init(spec: ModelSpec) -> Callable[[jax.Array], dict]:
    x = jnp.zeros((1, 1, spec.d_model), jnp.float32)
    return jax.jit(lambda key: nn.unbox(LayerStack(spec).init(key, x, None)["params"]))


def init_stack_params(spec: ModelSpec, key: jax.Array) -> dict:
    """Unboxed ``{"layers": ...}`` parameters of a freshly initialised ``LayerStack``."""
    return _jitted_init(spec)(key)


def _prefix_mean_branch(module: CausalSelfAttention, x_BxLxD: jax.Array) -> jax.Array:
    """P X W_V W_O: the attention output when every head averages its causal prefix uniformly."""
    params = module.variables["params"]
    x = x_BxLxD.astype(module.dtype)
    counts_L = jnp.arange(1, x.shape[1] + 1, dtype=x.dtype)
    mean_BxLxD = jnp.cumsum(x, axis=1) / counts_L[None, :, None]
    return (mean_BxLxD @ params["w_v"].astype(x.dtype)) @ params["w_o"].astype(x.dtype)


@contextlib.contextmanager
def attention_mode(mode: str) -> Iterator[None]:
    """Within the context, every ``CausalSelfAttention`` output A V W_O is replaced.

    ``softmax``: unchanged. ``uniform``: P V W_O (prefix averaging, theorem assumption A1).
    ``centered``: (A - P) V W_O, the ablation without the prefix-mean component. The module's
    attention statistics still describe its softmax weights. Apply-time only (unboxed params).
    """
    if mode not in ATTENTION_MODES:
        raise ValueError(f"attention mode {mode!r} is not one of {ATTENTION_MODES}")

    def interceptor(next_fun: Callable, args: tuple, kwargs: dict,
                    context: nn.module.InterceptorContext) -> object:
        out = next_fun(*args, **kwargs)
        if (mode == "softmax" or not isinstance(context.module, CausalSelfAttention)
                or context.method_name != "__call__"):
            return out
        branch, stats = out if context.module.collect_stats else (out, None)
        mean_branch = _prefix_mean_branch(context.module, args[0])
        branch = mean_branch if mode == "uniform" else branch - mean_branch
        return (branch, stats) if context.module.collect_stats else branch

    with nn.intercept_methods(interceptor):
        yield


def _sum_sq(x_BxLxD: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(||X||_F^2, ||1^T X||^2) of the first sequence, in float32."""
    x = x_BxLxD[0].astype(jnp.float32)
    return jnp.sum(x * x), jnp.sum(jnp.sum(x, 0) ** 2)


def _pair_cosines(x_BxLxD: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Mean and standard deviation of cos(x_i, x_j) over the pairs i != j of the first sequence."""
    x = x_BxLxD[0].astype(jnp.float32)
    unit = x / jnp.linalg.norm(x, axis=-1, keepdims=True)
    cos_NxN = unit @ unit.T
    n = x.shape[0]
    off = ~jnp.eye(n, dtype=bool)
    mean = jnp.sum(jnp.where(off, cos_NxN, 0.0)) / (n * (n - 1))
    var = jnp.sum(jnp.where(off, (cos_NxN - mean) ** 2, 0.0)) / (n * (n - 1))
    return mean, jnp.sqrt(var)


def _ec_interceptor(next_fun: Callable, args: tuple, kwargs: dict,
                    context: nn.module.InterceptorContext) -> object:
    """Sows ``EC_STATS`` from each layer's input (``Block``) and attention input."""
    if context.method_name == "__call__" and isinstance(context.module, Block):
        residual_sq, residual_sum_sq = _sum_sq(args[0])
        corr_mean, corr_sd = _pair_cosines(args[0])
        for name, value in (("residual_sq", residual_sq), ("residual_sum_sq", residual_sum_sq),
                            ("corr_mean", corr_mean), ("corr_sd", corr_sd)):
            context.module.sow("intermediates", name, value)
    if context.method_name == "__call__" and isinstance(context.module, CausalSelfAttention):
        h = args[0].astype(jnp.float32)
        prefix = jnp.cumsum(h, axis=1) / jnp.arange(1, h.shape[1] + 1)[None, :, None]
        for name, value in zip(("branch_in_sq", "prefix_sq", "prefix_sum_sq"),
                               (_sum_sq(h)[0], *_sum_sq(prefix)), strict=True):
            context.module.sow("intermediates", name, value)
    return next_fun(*args, **kwargs)


def _last_name(path: tuple) -> str:
    """The innermost dict key of a pytree path (a sown value's name)."""
    return next(k.key for k in reversed(path) if isinstance(k, jax.tree_util.DictKey))


def stack_ec_statistics(spec: ModelSpec) -> Callable[[dict, jax.Array], dict[str, jax.Array]]:
    """A jitted ``f(params, x_BxLxD)`` -> the ``EC_STATS`` of every layer ([n_layers] each) on
    the first sequence, from the stack's forward with softmax attention."""
    model = LayerStack(spec, sow_layers=True)

    def run(params: dict, x_BxLxD: jax.Array) -> dict[str, jax.Array]:
        with nn.intercept_methods(_ec_interceptor):
            _, sown = model.apply({"params": params}, x_BxLxD, None, mutable=["intermediates"])
        found = {_last_name(path): value for path, value
                 in jax.tree_util.tree_flatten_with_path(sown["intermediates"])[0]}
        return {name: found[name].reshape(spec.n_layers) for name in EC_STATS}

    return jax.jit(run)


def stack_statistics(spec: ModelSpec,
                     mode: str = "softmax") -> Callable[[dict, jax.Array], dict[str, jax.Array]]:
    """A jitted ``f(params, x_BxLxD)`` -> the ``STACK_STATS`` of every layer ([n_layers] each)
    and ``tsim_final``, from the stack's diagnostic forward with attention ``mode``.

    Only these statistics leave the jitted function, so XLA drops the unused ones (the effective
    rank's SVD dominates the cost at n = 2048).
    """
    probes_Lx2xS = zero_probes(spec.n_layers)["layers"]

    def run(params: dict, x_BxLxD: jax.Array) -> dict[str, jax.Array]:
        with attention_mode(mode):
            x_out, stats = LayerStack(spec).apply({"params": params}, x_BxLxD, probes_Lx2xS)
        return {**{k: stats[k] for k in STACK_STATS}, "tsim_final": batch_tsim(x_out)}

    return jax.jit(run)
