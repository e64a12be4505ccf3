"""The closed forms of ``postnorm.theory`` against Monte Carlo of each theorem's own setting."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from scipy import integrate, special

from postnorm import theory
from postnorm.analysis import monte_carlo
from postnorm.model import PLACEMENTS, Decoder, ModelSpec
from postnorm.model.initializers import embedding_init
from postnorm.model.layers import CausalSelfAttention, RMSNorm, SwiGLU
from postnorm.model.placements import init_gains
from postnorm.theory import INIT_SCHEMES, recursions
from tests import numpy_reference as ref

Z = 4.0  # tolerance in Monte Carlo standard errors
GRAM = {"post": theory.POST_GRAM, "pre": theory.PRE_GRAM}  # the theorems' two arrangements


def assert_within(estimate: monte_carlo.MCEstimate, expected: float, z: float = Z,
                  rel: float = 0.0) -> None:
    gap = abs(estimate.mean - expected)
    assert gap <= z * estimate.stderr + rel * abs(expected), (estimate, expected)


# §0 and the Gram algebra ----------------------------------------------------------------------

def test_prefix_averaging_facts_and_tsim():
    n = 37
    p_NxN = theory.prefix_average(np.eye(n))
    np.testing.assert_allclose(p_NxN, np.tril(np.ones((n, n))) / np.arange(1, n + 1)[:, None])
    np.testing.assert_allclose(np.sum(p_NxN.sum(0) ** 2), 2 * n - theory.harmonic(n))
    np.testing.assert_allclose(np.trace(p_NxN @ p_NxN.T), theory.harmonic(n))
    # rows as long as a recursion's n x n Gram are summed one by one: numpy's sums all the same
    wide_NxK = np.random.default_rng(2).normal(size=(n, recursions.LONG_ROW))
    np.testing.assert_allclose(theory.prefix_average(wide_NxK), p_NxN @ wide_NxK, atol=1e-14)
    np.testing.assert_array_equal(theory.prefix_average(wide_NxK),
                                  np.cumsum(wide_NxK, 0) / np.arange(1, n + 1)[:, None])


@pytest.mark.parametrize("norm", sorted(PLACEMENTS))
def test_the_recursion_leaves_its_input_gram_as_it_was(norm):
    n = 24
    spec = ModelSpec(vocab_size=2, max_len=n, n_layers=4, d_model=32, n_heads=2, d_ff=96,
                     norm=norm)
    amt = theory.amounts(32, 96, spec.init).with_gains(init_gains(spec))
    g0_NxN = monte_carlo.ec_input(np.random.default_rng(3), n, 32, 0.3)
    g0_NxN = g0_NxN @ g0_NxN.T / 32
    kept = g0_NxN.copy()
    theory.mean_field_recursion(g0_NxN, 4, amt, PLACEMENTS[norm].gram_maps(spec))
    np.testing.assert_array_equal(g0_NxN, kept)
    x = np.random.default_rng(0).normal(size=(3, n, 5)) + 0.7
    np.testing.assert_allclose(theory.tsim_of_gram(x @ x.transpose(0, 2, 1)), theory.tsim(x))
    x_ec = monte_carlo.ec_input(np.random.default_rng(1), n, 64, 0.3)
    np.testing.assert_allclose(theory.tsim(x_ec), 0.3)
    np.testing.assert_allclose(np.sum(x_ec**2, 1), 64.0)


def test_harmonic_past_the_exact_sum_matches_the_sum():
    for n in (2**20 + 1, 3 * 2**20 + 7):
        exact = math.fsum(1.0 / k for k in range(n, 0, -1))
        assert theory.harmonic(n) == pytest.approx(exact, rel=2e-15, abs=0)
    step = theory.harmonic(2**20 + 1) - theory.harmonic(2**20)
    assert step == pytest.approx(1.0 / (2**20 + 1), rel=1e-6)
    assert theory.harmonic(10**15) == pytest.approx(15 * math.log(10) + np.euler_gamma, rel=1e-14,
                                                    abs=0)


@pytest.mark.parametrize("n", [8, 100])
def test_gram_steps_on_an_ec_gram_reproduce_the_one_step_closed_forms(n):
    """On an EC Gram the FFN step without a norm (Pre-Norm) is Thm 3.4, and the recursion's
    one-step Delta_attn and energy ratio are Thm 3.2's, for both placements."""
    amt = theory.amounts(64, 192, "lecun_normal")
    kernel = theory.gate_kernel_table(amt.a)
    for t in (1.0 / n, 0.2, 0.9):
        rho = theory.ec_rho(t, n)
        g_NxN = (1 - rho) * np.eye(n) + rho
        after_ffn = theory.mean_field_ffn_step(g_NxN, amt.xi, kernel, theory.PRE_GRAM)
        np.testing.assert_allclose(theory.tsim_of_gram(after_ffn) - t,
                                   theory.delta_ffn(amt.xi, t, n, amt.a), rtol=1e-6, atol=1e-9)
        for norm in GRAM:
            trace = theory.mean_field_recursion(g_NxN, 1, amt, GRAM[norm])
            np.testing.assert_allclose(trace.tsim_in, t)
            np.testing.assert_allclose(trace.energy_attn, amt.s * theory.attn_f2(t, n))
            np.testing.assert_allclose(trace.delta_attn, theory.delta_attn(amt.s, t, n),
                                       rtol=1e-10, atol=1e-15)


@pytest.mark.parametrize("r0", [1.0, 4e-4, 3.0])
def test_pre_norm_closure_starts_from_the_inputs_energy(r0):
    """Pre-Norm's amount is s / R with R = ||X||^2 / (n d) of the actual input: on an EC Gram
    of RMS sqrt(r0) the closure's first attention step is the mean-field step, Thm 3.2 at
    s / r0 (an embedding with small entries amplifies far more than a unit-RMS one)."""
    n, t = 16, 0.2
    amt = theory.amounts(64, 192, "torch_default")
    rho = theory.ec_rho(t, n)
    g_NxN = r0 * ((1 - rho) * np.eye(n) + rho)
    closure = theory.scalar_recursion(t, n, 1, amt, theory.PRE_GRAM, r0=r0)
    mean_field = theory.mean_field_recursion(g_NxN, 1, amt, theory.PRE_GRAM)
    want = t + theory.delta_attn(amt.s / r0, t, n)
    np.testing.assert_allclose(closure[0, 0], want, rtol=1e-10)
    np.testing.assert_allclose(mean_field.tsim_after[0, 0], want, rtol=1e-9)


def numpy_prefix_matrix(n: int) -> np.ndarray:
    return np.tril(np.ones((n, n))) / np.arange(1, n + 1)[:, None]


def numpy_ec_gram(t: float, n: int, r: float = 1.0) -> np.ndarray:
    rho = (n * t - 1) / (n - 1)
    return r * ((1 - rho) * np.eye(n) + rho)


def numpy_tsim(g_NxN: np.ndarray) -> float:
    return g_NxN.sum() / (g_NxN.shape[0] * np.trace(g_NxN))


def numpy_corr(g_NxN: np.ndarray) -> np.ndarray:
    inv_sd = 1 / np.sqrt(np.diag(g_NxN))
    return g_NxN * inv_sd[:, None] * inv_sd[None, :]


@pytest.mark.parametrize("norm,init,r0", [("post", "lecun_normal", 1.0),
                                          ("pre", "lecun_normal", 3.0),
                                          ("pre", "torch_default", 0.2)])
def test_scalar_recursion_is_the_iterated_ec_gram_algebra(norm, init, r0):
    """Every sublayer of the closure, Post and Pre: the EC Gram of the current (t, R), the Gram
    update (G + s P corr(G) P^T in Pre-Norm, G + s P G P^T in Post; then G + xi C o m(C)) with
    an explicit P, and t and R = tr G / n read back (R = 1 after a Post-Norm norm)."""
    n, layers = 12, 4
    amt = theory.amounts(64, 192, init)
    p_NxN = numpy_prefix_matrix(n)
    t, r = 0.2, (r0 if norm == "pre" else 1.0)
    want = []
    for _ in range(layers):
        g = numpy_ec_gram(t, n, r)
        g = g + amt.s * p_NxN @ (numpy_corr(g) if norm == "pre" else g) @ p_NxN.T
        t, r = numpy_tsim(g), (np.trace(g) / n if norm == "pre" else 1.0)
        after_attn = t
        c = numpy_corr(numpy_ec_gram(t, n, r))
        g = numpy_ec_gram(t, n, r) + amt.xi * c * theory.gate_kernel(c, amt.a)
        t, r = numpy_tsim(g), (np.trace(g) / n if norm == "pre" else 1.0)
        want.append([after_attn, t])
    got = theory.scalar_recursion(0.2, n, layers, amt, GRAM[norm], r0=r0)
    np.testing.assert_allclose(got, want, rtol=1e-9)


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_mean_field_layer_on_a_general_gram_against_numpy(norm):
    """One layer from a Gram that is neither EC nor unit-diagonal: the attention energy ratio
    (over tr G), the exact one-step Delta_attn, and tsim after each sublayer."""
    n, d = 10, 40
    amt = theory.amounts(64, 192, "lecun_normal")
    x_NxD = np.random.default_rng(0).normal(size=(n, d)) * 1.7 + 0.5
    g0 = x_NxD @ x_NxD.T / d
    p_NxN = numpy_prefix_matrix(n)
    branch = amt.s * p_NxN @ (g0 if norm == "post" else numpy_corr(g0)) @ p_NxN.T
    g1 = g0 + branch
    energy, delta = np.trace(branch) / np.trace(g0), numpy_tsim(g1) - numpy_tsim(g0)
    g1 = numpy_corr(g1) if norm == "post" else g1
    c = numpy_corr(g1)
    g2 = g1 + amt.xi * c * theory.gate_kernel(c, amt.a)
    trace = theory.mean_field_recursion(g0, 1, amt, GRAM[norm])
    np.testing.assert_allclose(trace.energy_attn, [energy], rtol=1e-12)
    np.testing.assert_allclose(trace.delta_attn, [delta], rtol=1e-10)
    np.testing.assert_allclose(trace.tsim_after, [[numpy_tsim(g1), numpy_tsim(g2)]], rtol=1e-7)


@pytest.mark.parametrize("call, message", [
    (lambda: theory.delta_attn(1 / 9, 0.5, 1), "n=1"),
    (lambda: theory.delta_attn(1 / 9, 1.5, 64), r"t=1.5 is outside \[0.0, 1.0\]"),
    (lambda: theory.delta_attn(-0.1, 0.5, 64), r"s=-0.1 is outside"),
    (lambda: theory.delta_ffn(-0.1, 0.5, 64, 0.5), r"xi=-0.1 is outside"),
    (lambda: theory.delta_ffn(0.1, 0.5, 64, -0.5), r"a=-0.5 is outside"),
    (lambda: theory.gate_kernel(1.5, 1.0), r"rho=1.5 is outside \[-1.0, 1.0\]"),
    (lambda: theory.harmonic(2.5), "integer"),
    (lambda: theory.rmsnorm_contraction(np.ones(4), np.ones(4)), "scalar gain"),
])
def test_out_of_domain_arguments_are_refused(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_domain_edges_and_batched_collapse_distance():
    assert theory.delta_attn(1 / 9, 1.0, 64) == 0.0  # t = 1: collapse is a fixed point
    assert theory.delta_attn(1 / 9, 0.0, 64) > 0.0  # t = 0 is a PSD EC Gram too
    assert theory.rmsnorm_contraction(np.full(4, 2.0), -1.0) == 0.5  # |alpha|
    rng = np.random.default_rng(0)
    x_BxNxD = rng.normal(size=(3, 5, 4))
    x_BxNxD[1] = x_BxNxD[1, :1]  # a collapsed sequence
    eps_B = theory.collapse_distance(x_BxNxD)
    np.testing.assert_allclose(eps_B, [theory.collapse_distance(x) for x in x_BxNxD])
    assert eps_B[1] == 0.0 and eps_B[0] > 0.0


# Thm 3.2 ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("n,d,s,t,exact", [
    (32, 96, 1 / 9, 1 / 32, True),
    (32, 96, 1.0, 0.3, True),
    (48, 64, 1.0, 0.7, True),
    (16, 128, 0.3, 0.1, True),
    (96, 32, 1.0, 0.2, False),  # n > d: isotropic EC input
])
def test_delta_attn_against_uniform_attention_mc(n, d, s, t, exact):
    rng = np.random.default_rng(n * d)
    estimate = monte_carlo.mc_delta_attn_uniform(rng, n, d, s, t, pairs=200, exact=exact)
    assert_within(estimate, theory.delta_attn(s, t, n))


def test_delta_attn_mc_estimates_the_ratio_of_expectations_at_small_n_and_d():
    """n = 4, d = 8, s = 4: a mean of per-draw ratios (Jensen gap, about -17%) or tsim with
    n - 1 (+33%) would be many standard errors off; the ratio of means is unbiased."""
    n, d, s, t = 4, 8, 4.0, 0.5
    estimate = monte_carlo.mc_delta_attn_uniform(np.random.default_rng(0), n, d, s, t, pairs=400)
    assert_within(estimate, theory.delta_attn(s, t, n))


def test_mc_standard_error_is_calibrated():
    """The spread of 40 independent estimates matches their stated standard error (an inflated
    one would loosen every Monte Carlo test above)."""
    rng = np.random.default_rng(3)
    runs = [monte_carlo.mc_delta_attn_uniform(rng, 8, 16, 1.0, 0.3, pairs=25) for _ in range(40)]
    spread = np.std([r.mean for r in runs], ddof=1)
    assert 0.6 < spread / np.median([r.stderr for r in runs]) < 1.6


@pytest.mark.parametrize("t", [1 / 32, 0.5])
def test_delta_attn_against_softmax_attention_mc(t):
    """Real softmax attention at torch_default init: uniform up to a few percent (A1)."""
    n, d = 32, 128
    estimate = monte_carlo.mc_delta_attn_softmax(3, n, d, t, 4, "torch_default", pairs=48)
    assert_within(estimate, theory.delta_attn(theory.amounts(d, d, "torch_default").s, t, n),
                  rel=0.05)


def test_delta_attn_sign_and_fixed_point():
    for n in (2, 16, 2048):
        t = np.linspace(1.0 / n, 1.0, 200, endpoint=False)
        for s in (1e-3, 1 / 9, 1.0, 30.0):
            assert np.all(theory.delta_attn(s, t, n) > 0)
            assert theory.delta_attn(s, 1.0, n) == 0.0


# Thm 3.4 ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("n,d,d_ff,t,init", [
    (32, 96, 192, 0.3, "lecun_normal"),
    (48, 64, 160, 0.8, "xavier"),
    (24, 128, 256, 0.1, "torch_default"),
])
def test_delta_ffn_against_mc(n, d, d_ff, t, init):
    amt = theory.amounts(d, d_ff, init)
    estimate = monte_carlo.mc_delta_ffn(n + d, n, d, d_ff, t, init, pairs=64)
    assert_within(estimate, theory.delta_ffn(amt.xi, t, n, amt.a))


def test_delta_ffn_sign():
    for n in (4, 64, 2048):
        t = np.linspace(1.0 / n, 1.0, 200)
        for xi, a in ((1 / 9, 0.577), (1.0, 1.0), (4.0, 1.4)):
            delta = theory.delta_ffn(xi, t, n, a)
            assert np.all(delta <= 0) and np.all(delta[1:-1] < 0)
            np.testing.assert_allclose(delta[[0, -1]], 0.0, atol=1e-15)


@pytest.mark.parametrize("a", [0.45, 1.0, 1.4])
def test_gate_kernel_against_mc_and_odd_part(a):
    rng = np.random.default_rng(7)
    for rho in (-0.8, 0.0, 0.5, 0.99):
        assert_within(monte_carlo.mc_gate_kernel(rng, rho, a, 200_000), theory.gate_kernel(rho, a))
    rho = np.linspace(-1, 1, 41)
    np.testing.assert_allclose(theory.gate_kernel(rho, a) - theory.gate_kernel(-rho, a),
                               a**2 * rho / 2, atol=1e-12)
    table = theory.gate_kernel_table(a)
    np.testing.assert_allclose(table(rho[1::2] + 0.013), theory.gate_kernel(rho[1::2] + 0.013, a),
                               atol=2e-8)


def mehler_gate_kernel(rho: np.ndarray, a: float, terms: int = 40) -> np.ndarray:
    """m(rho; a) = sum_k c_k^2 rho^k (Mehler's expansion), c_k = E[SiLU(a g) He_k(g)] / sqrt(k!)
    by adaptive 1-D quadrature: independent of the code's 2-D Gauss-Hermite rule."""
    total = np.zeros_like(rho)
    for k in range(terms):
        he_k = np.polynomial.hermite_e.HermiteE.basis(k)
        def integrand(x, he_k=he_k):
            return a * x * special.expit(a * x) * he_k(x) * np.exp(-x * x / 2)
        c_k = integrate.quad(integrand, -np.inf, np.inf, epsabs=1e-14, epsrel=1e-13, limit=200)[0]
        total = total + c_k**2 / (2 * math.pi * math.factorial(k)) * rho**k
    return total


# quad warns that its 1e-14 target is below the roundoff of the high-order terms; they are tiny
@pytest.mark.filterwarnings("ignore::scipy.integrate.IntegrationWarning")
@pytest.mark.parametrize("a", [0.45, 1.0, 1.4])
def test_gate_kernel_against_its_mehler_series(a):
    """To 1e-10, far below Monte Carlo's 1e-3 and beyond what the odd-part identity sees (it
    holds for any quadrature order and any variance of the second gate input)."""
    rho = np.linspace(-0.8, 0.9, 37)  # over several of the quadrature's chunks of points
    np.testing.assert_allclose(theory.gate_kernel(rho, a), mehler_gate_kernel(rho, a), rtol=0,
                               atol=1e-10)
    assert isinstance(theory.gate_kernel(0.5, a), np.float64)  # a scalar for scalars
    rho_2x37 = np.stack([rho, rho[::-1]])  # any shape, broadcast against a
    np.testing.assert_allclose(theory.gate_kernel(rho_2x37, np.full((2, 1), a)),
                               mehler_gate_kernel(rho_2x37, a), rtol=0, atol=1e-10)


@pytest.mark.parametrize("init", INIT_SCHEMES)
def test_amounts_against_the_models_initialisers(init):
    """s = E||x W_V W_O||^2/||x||^2 (identical tokens: the attention output is x W_V W_O for any
    attention weights) and xi m(1) = E||FFN(x)||^2/||x||^2 for RMS-1 x, over fresh inits."""
    d, d_ff, draws = 64, 160, 96
    amt = theory.amounts(d, d_ff, init)
    x_1xLxD = jnp.broadcast_to(jax.random.normal(jax.random.key(0), (1, 1, d)), (1, 4, d))
    x_1xLxD = x_1xLxD / jnp.sqrt(jnp.mean(x_1xLxD**2))
    keys = jax.random.split(jax.random.key(1), draws)
    for module, expected in ((CausalSelfAttention(4, init, "none", 1e4, jnp.float32), amt.s),
                             (SwiGLU(d_ff, init, jnp.float32), amt.xi_m1)):
        def ratio(key, module=module):
            params = nn.unbox(module.init(key, x_1xLxD))
            return jnp.sum(module.apply(params, x_1xLxD) ** 2) / jnp.sum(x_1xLxD**2)
        ratios = np.asarray(jax.vmap(ratio)(keys), np.float64)
        assert_within(monte_carlo.MCEstimate(ratios.mean(), ratios.std() / np.sqrt(draws)),
                      expected)


@pytest.mark.parametrize("init", INIT_SCHEMES)
def test_the_v_only_reading_of_s_is_the_value_projections_energy_gain(init):
    """s_reading="v_only": s = E||x W_V||^2/||x||^2 over fresh inits of the model's attention,
    W_O left out (docs/MATH.md §1a)."""
    d, draws = 64, 96
    s = theory.amounts(d, 160, init, s_reading="v_only").s
    x_1x4xD = jnp.broadcast_to(jax.random.normal(jax.random.key(0), (1, 1, d)), (1, 4, d))
    attention = CausalSelfAttention(4, init, "none", 1e4, jnp.float32)

    def ratio(key):
        w_v_DxD = nn.unbox(attention.init(key, x_1x4xD))["params"]["w_v"]
        return jnp.sum((x_1x4xD[0, 0] @ w_v_DxD) ** 2) / jnp.sum(x_1x4xD[0, 0] ** 2)
    ratios = np.asarray(jax.vmap(ratio)(jax.random.split(jax.random.key(2), draws)), np.float64)
    assert_within(monte_carlo.MCEstimate(ratios.mean(), ratios.std() / np.sqrt(draws)), s)


# Thm 3.6 ---------------------------------------------------------------------------------------

def test_contraction_is_the_largest_singular_value_of_the_rmsnorm_jacobian():
    rng = np.random.default_rng(4)
    for d, alpha, scale, eps in ((8, 1.0, 0.3, 1e-6), (32, 1.7, 2.0, 1e-6), (64, 0.5, 1.0, 1e-6),
                                 (16, 1.3, 0.6, 0.5), (32, 0.7, 0.6, 2.0)):  # eps matters
        y = (rng.normal(size=d) * scale).astype(np.float32)
        params = {"params": {"scale": jnp.full((d,), alpha, jnp.float32)}}
        jac_DxD = jax.jacfwd(lambda v, p=params, e=eps: RMSNorm(e).apply(p, v))(jnp.asarray(y))
        sigma_max = np.linalg.svd(np.asarray(jac_DxD, np.float64), compute_uv=False)[0]
        c = theory.rmsnorm_contraction(y, alpha, eps)
        np.testing.assert_allclose(sigma_max, c, rtol=1e-5)
        np.testing.assert_allclose(monte_carlo.vjp_contraction(rng, y, alpha, eps), c, rtol=1e-5)
        assert (c < 1) == (np.mean(y.astype(np.float64) ** 2) + eps > alpha**2)


# Thm 3.8 ---------------------------------------------------------------------------------------

def _cross_entropy(logits_NxV: np.ndarray, targets_N: np.ndarray) -> float:
    log_z = np.log(np.sum(np.exp(logits_NxV - logits_NxV.max(1, keepdims=True)), 1))
    log_p = logits_NxV - logits_NxV.max(1, keepdims=True) - log_z[:, None]
    return float(-np.mean(log_p[np.arange(len(targets_N)), targets_N]))


def test_collapse_bound_holds_on_random_instances():
    rng = np.random.default_rng(5)
    n, vocab, d = 40, 12, 16
    slack = []
    for trial in range(300):
        targets = rng.integers(0, vocab, n)
        lfreq = theory.frequency_loss(targets)
        x_mean = rng.normal(size=d)
        if trial % 2:  # near the optimum: W x_mean = log p_hat (+ a constant)
            log_p = np.log(np.bincount(targets, minlength=vocab) + 1e-3)
            w_VxD = np.outer(log_p, x_mean) / (x_mean @ x_mean)
        else:
            w_VxD = rng.normal(size=(vocab, d)) * rng.uniform(0.1, 3.0)
        e_NxD = rng.normal(size=(n, d))
        e_NxD = (e_NxD - e_NxD.mean(0)) * rng.uniform(0.0, 2.0) / np.sqrt(d)
        x_NxD = x_mean + e_NxD
        eps = theory.collapse_distance(x_NxD)
        cross_entropy = _cross_entropy(x_NxD @ w_VxD.T, targets)
        slack.append(cross_entropy - theory.collapse_loss_bound(lfreq, w_VxD, eps, n))
    assert min(slack) >= 0.0
    # Adversarial: from the p_hat optimum, move every token along its own loss gradient. The
    # loss then falls below L_freq by nearly the bound's margin: a constant 2/n in place of
    # 2/sqrt(n) (or no eps term) fails here, where the random instances above came nowhere near.
    targets = rng.permutation(np.arange(n) % vocab)
    p_hat = np.bincount(targets, minlength=vocab) / n
    w_VxD = np.linalg.qr(rng.normal(size=(d, vocab)))[0].T  # orthonormal rows: ||W||_2 = 1
    x_mean = np.linalg.lstsq(w_VxD, np.log(p_hat), rcond=None)[0]  # softmax(W x_mean) = p_hat
    grad_NxV = p_hat[None, :] - np.eye(vocab)[targets]  # d loss_i / d logits at x_mean
    x_NxD = x_mean - 0.05 * grad_NxV @ w_VxD
    eps = theory.collapse_distance(x_NxD)
    lfreq = theory.frequency_loss(targets)
    cross_entropy = _cross_entropy(x_NxD @ w_VxD.T, targets)
    assert cross_entropy >= theory.collapse_loss_bound(lfreq, w_VxD, eps, n)
    # and the instance is sharp: below L_freq by about half the bound's margin
    assert cross_entropy - lfreq < -0.5 * np.linalg.norm(w_VxD, 2) * eps / np.sqrt(n)
    targets = rng.integers(0, vocab, n)
    p_hat = np.bincount(targets, minlength=vocab) / n
    shared = np.log(np.where(p_hat > 0, p_hat, 1e-300))
    np.testing.assert_allclose(_cross_entropy(np.tile(shared, (n, 1)), targets),
                               theory.frequency_loss(targets))


def test_collapsed_model_predicting_frequencies_is_stationary():
    """Thm 3.8(ii) on the real Decoder: identical input tokens collapse every layer; with the LM
    head solved so that softmax(logits) = p_hat, loss = L_freq and every gradient vanishes."""
    vocab, n, d = 8, 64, 32
    spec = ModelSpec(vocab_size=vocab, max_len=n, n_layers=3, d_model=d, n_heads=4, d_ff=48,
                     positions="none", init="xavier")
    model = Decoder(spec)
    key_layers, key_embed = jax.random.split(jax.random.key(0))
    params = {**monte_carlo.init_stack_params(spec, key_layers),
              "embedding": embedding_init(spec.init)(key_embed, (vocab, d), jnp.float32)}
    rng = np.random.default_rng(6)
    targets_1xN = jnp.asarray(rng.permutation(np.arange(n) % vocab)[None])  # covers the vocab
    collapsed_1xN = jnp.full((1, n), 3, jnp.int32)
    hidden = monte_carlo.LayerStack(spec).apply(
        {"params": {"layers": params["layers"]}}, params["embedding"][collapsed_1xN], None)[0]
    hidden_NxD = np.asarray(hidden[0], np.float64)
    assert theory.tsim(hidden_NxD) > 1 - 1e-6
    log_p = np.log(np.bincount(np.asarray(targets_1xN[0]), minlength=vocab) / n)
    w_lm_DxV, *_ = np.linalg.lstsq(hidden_NxD.mean(0)[None], log_p[None], rcond=None)
    params["lm_head"] = jnp.asarray(w_lm_DxV, jnp.float32)

    def loss(p, tokens_1xN):
        logits = model.apply({"params": p}, tokens_1xN)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets_1xN).mean()

    value_and_grad = jax.jit(jax.value_and_grad(loss))
    value, grads = value_and_grad(params, collapsed_1xN)
    np.testing.assert_allclose(value, theory.frequency_loss(np.asarray(targets_1xN)), rtol=1e-5)
    assert max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(grads)) < 1e-5
    _, control = value_and_grad(params, jnp.asarray(rng.integers(0, vocab, (1, n)), jnp.int32))
    assert max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(control)) > 1e-2


# §3: depth -------------------------------------------------------------------------------------

def test_attention_modes_split_softmax_attention_into_uniform_and_centered():
    """uniform = P X W_V W_O (numpy), and softmax = uniform + centered: the ablation's
    (A - P) V W_O is exactly what is left of the attention output without prefix averaging."""
    n, d = 12, 32
    module = CausalSelfAttention(4, "torch_default", "none", 1e4, jnp.float32)
    params = nn.unbox(module.init(jax.random.key(0), jnp.zeros((1, n, d))))
    x_1xNxD = jax.random.normal(jax.random.key(1), (1, n, d))
    out = {}
    for mode in monte_carlo.ATTENTION_MODES:
        with monte_carlo.attention_mode(mode):
            out[mode] = np.asarray(module.apply(params, x_1xNxD), np.float64)
    w = {k: np.asarray(v, np.float64) for k, v in params["params"].items()}
    uniform = numpy_prefix_matrix(n) @ np.asarray(x_1xNxD[0], np.float64) @ w["w_v"] @ w["w_o"]
    np.testing.assert_allclose(out["uniform"][0], uniform, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(out["centered"], out["softmax"] - out["uniform"], atol=1e-5)


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_ec_statistics_are_those_of_each_layer_input(norm):
    """``stack_ec_statistics`` against a numpy layer loop: per layer the residual input X, the
    attention's input H (X in Post-Norm, RMSNorm(X) in Pre-Norm), the prefix means P H, and the
    pairwise cosines of X's rows."""
    n, d, n_layers = 12, 32, 3
    spec = ModelSpec(vocab_size=2, max_len=n, n_layers=n_layers, d_model=d, n_heads=4,
                     d_ff=3 * d, norm=norm, positions="none")
    params = monte_carlo.init_stack_params(spec, jax.random.key(0))
    x_1xNxD = jax.random.normal(jax.random.key(1), (1, n, d))
    got = {k: np.asarray(v, np.float64)
           for k, v in monte_carlo.stack_ec_statistics(spec)(params, x_1xNxD).items()}
    prefix_NxN = numpy_prefix_matrix(n)
    x = np.asarray(x_1xNxD[0], np.float64)
    for layer in range(n_layers):
        p = ref.layer_params(params, layer)

        def norm_of(name, z, p=p):
            return ref.rms_norm(z, p[name]["scale"], spec.norm_eps)

        h = x if norm == "post" else norm_of("norm_attn", x)
        unit = x / np.linalg.norm(x, axis=1, keepdims=True)
        cos = (unit @ unit.T)[~np.eye(n, dtype=bool)]
        want = {"residual_sq": np.sum(x * x), "residual_sum_sq": np.sum(x.sum(0) ** 2),
                "branch_in_sq": np.sum(h * h), "prefix_sq": np.sum((prefix_NxN @ h) ** 2),
                "prefix_sum_sq": np.sum((prefix_NxN @ h).sum(0) ** 2),
                "corr_mean": cos.mean(), "corr_sd": cos.std()}
        for name, value in want.items():
            np.testing.assert_allclose(got[name][layer], value, rtol=2e-4, err_msg=name)
        attn = ref.attention(h, p["attn"], 4, "none", 1e4)
        if norm == "post":
            x = norm_of("norm_attn", x + attn)
            x = norm_of("norm_ffn", x + ref.swiglu(x, p["ffn"]))
        else:
            x = x + attn
            x = x + ref.swiglu(norm_of("norm_ffn", x), p["ffn"])


@pytest.mark.parametrize("norm,init,mode,n_layers", [
    ("post", "torch_default", "softmax", 24),
    ("pre", "torch_default", "uniform", 24),
    ("deepnorm", "torch_default", "uniform", 24),
    ("sandwich", "torch_default", "uniform", 24),
    ("b2t", "torch_default", "uniform", 24),
    ("mixln", "torch_default", "uniform", 24),
    pytest.param("post", "xavier", "uniform", 12, marks=pytest.mark.slow),
    pytest.param("deepnorm", "xavier", "softmax", 12, marks=pytest.mark.slow),
])
def test_mean_field_tracks_a_simulated_stack(norm, init, mode, n_layers):
    """tsim after every sublayer, mean over seeds, within 15%, for every arrangement the
    recursion models (its Gram maps and init gains: ``postnorm.model.placements``); the
    recursion assumes uniform attention, which softmax approximates at these query-key scales."""
    n, d, seeds = 64, 128, 16
    spec = ModelSpec(vocab_size=2, max_len=n, n_layers=n_layers, d_model=d, n_heads=4,
                     d_ff=3 * d, norm=norm, positions="none", init=init)
    amt = theory.amounts(d, 3 * d, init).with_gains(init_gains(spec))
    maps = PLACEMENTS[norm].gram_maps(spec)
    run = monte_carlo.stack_statistics(spec, mode)
    measured, predicted = [], []
    for seed in range(seeds):
        key_params, key_x = jax.random.split(jax.random.key(seed))
        x_1xNxD = jax.random.normal(key_x, (1, n, d))
        stats = run(monte_carlo.init_stack_params(spec, key_params), x_1xNxD)
        after_ffn = np.append(np.asarray(stats["tsim_attn"][1:]), float(stats["tsim_final"]))
        measured.append(np.stack([np.asarray(stats["tsim_ffn"]), after_ffn], 1))
        x = np.asarray(x_1xNxD[0], np.float64)
        predicted.append(theory.mean_field_recursion(x @ x.T / d, n_layers, amt, maps).tsim_after)
    np.testing.assert_allclose(np.mean(measured, 0), np.mean(predicted, 0), rtol=0.15)
