"""Forward statistics against numpy and against the RMSNorm VJP."""

import jax
import jax.numpy as jnp
import numpy as np

from postnorm.diagnostics import stats as dg
from postnorm.model.layers import RMSNorm


def numpy_tsim(x_LxD: np.ndarray) -> float:
    return float(np.sum(x_LxD.sum(0) ** 2) / (len(x_LxD) * np.sum(x_LxD**2)))


def test_tsim_against_numpy_and_its_extremes():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 10, 6)) + rng.normal(size=(3, 1, 6))
    np.testing.assert_allclose(dg.tsim(jnp.asarray(x)), np.mean([numpy_tsim(s) for s in x]),
                               rtol=1e-5)
    identical = np.broadcast_to(rng.normal(size=(1, 1, 6)), (1, 10, 6))
    np.testing.assert_allclose(dg.tsim(jnp.asarray(identical)), 1.0, rtol=1e-6)
    orthogonal = np.eye(10)[None] * 3.0  # orthogonal equal-norm rows: tsim = 1/n
    np.testing.assert_allclose(dg.tsim(jnp.asarray(orthogonal)), 0.1, rtol=1e-6)


def test_effective_rank_against_numpy():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(12, 8)) * np.linspace(0.1, 3.0, 8)
    sigma = np.linalg.svd(x, compute_uv=False)
    p = sigma / sigma.sum()
    np.testing.assert_allclose(dg.effective_rank(jnp.asarray(x)), np.exp(-np.sum(p * np.log(p))),
                               rtol=1e-5)
    rank_one = np.outer(rng.normal(size=12), rng.normal(size=8))
    np.testing.assert_allclose(dg.effective_rank(jnp.asarray(rank_one)), 1.0, rtol=1e-4)


def test_contraction_equals_rmsnorm_vjp_on_directions_orthogonal_to_y():
    """c = alpha / r(y) is ||vjp(g)|| / ||g|| for g orthogonal to y (scalar gain alpha)."""
    rng = np.random.default_rng(2)
    d, alpha, eps = 16, 1.7, 1e-6
    y_BxLxD = rng.normal(size=(2, 5, d)) * rng.uniform(0.5, 4.0, size=(2, 5, 1))
    scale = np.full(d, alpha, np.float32)
    stats = dg.norm_input_stats(jnp.asarray(y_BxLxD, jnp.float32), jnp.asarray(scale), eps)
    norm = RMSNorm(eps=eps)
    ratios = []
    for b in range(2):
        for i in range(5):
            y = jnp.asarray(y_BxLxD[b, i], jnp.float32)
            g = rng.normal(size=d)
            g = jnp.asarray(g - (g @ y_BxLxD[b, i]) / (y_BxLxD[b, i] @ y_BxLxD[b, i])
                            * y_BxLxD[b, i], jnp.float32)
            _, vjp = jax.vjp(lambda v: norm.apply({"params": {"scale": scale}}, v), y)
            ratios.append(float(jnp.linalg.norm(vjp(g)[0]) / jnp.linalg.norm(g)))
    np.testing.assert_allclose(stats["c_mean"], np.mean(ratios), rtol=1e-5)
    np.testing.assert_allclose(stats["c_min"], np.min(ratios), rtol=1e-5)
    np.testing.assert_allclose(stats["c_bound_mean"], stats["c_mean"], rtol=1e-6)
    rms = np.sqrt(np.mean(y_BxLxD**2, -1))
    np.testing.assert_allclose(stats["y_rms_max"], rms.max(), rtol=1e-5)


def test_contraction_with_a_vector_gain_against_numpy_and_the_jacobian():
    """With a gain that varies by entry, c uses its RMS and c_bound its largest |entry| (the
    two differ), per token against numpy; c_bound bounds the spectral norm of each token's
    RMSNorm Jacobian (jax.jacfwd), and y_rms is the RMS of y."""
    rng = np.random.default_rng(5)
    d, eps = 16, 1e-6
    y_BxLxD = rng.normal(size=(2, 5, d)) * rng.uniform(0.5, 4.0, size=(2, 5, 1))
    scale = rng.uniform(0.2, 2.5, size=d).astype(np.float32)
    stats = dg.norm_input_stats(jnp.asarray(y_BxLxD, jnp.float32), jnp.asarray(scale), eps)
    rms = np.sqrt(np.mean(y_BxLxD**2, -1))
    r = np.sqrt(rms**2 + eps)
    c, c_bound = np.sqrt(np.mean(scale**2)) / r, np.abs(scale).max() / r
    assert np.all(c_bound > 1.2 * c)  # the gain's RMS and max are far apart here
    for key, value in (("c_mean", c.mean()), ("c_min", c.min()), ("c_bound_mean", c_bound.mean()),
                       ("c_bound_min", c_bound.min()), ("y_rms_mean", rms.mean()),
                       ("y_rms_max", rms.max())):
        np.testing.assert_allclose(stats[key], value, rtol=1e-5, err_msg=key)
    norm = RMSNorm(eps=eps)
    for b, i in ((0, 0), (1, 3)):
        jac = jax.jacfwd(lambda v: norm.apply({"params": {"scale": scale}}, v))(
            jnp.asarray(y_BxLxD[b, i], jnp.float32))
        spectral = np.linalg.svd(np.asarray(jac), compute_uv=False)[0]
        assert spectral <= c_bound[b, i] * (1 + 1e-5)
        assert spectral >= 0.5 * c_bound[b, i]


def test_contraction_includes_eps_when_the_norm_input_is_small():
    """rms(y)^2 near eps: c = alpha / sqrt(rms^2 + eps), against numpy and the RMSNorm VJP on
    a direction orthogonal to y."""
    rng = np.random.default_rng(11)
    d, alpha, eps = 16, 1.3, 1e-6
    y_BxLxD = rng.normal(size=(2, 5, d)) * rng.uniform(3e-4, 3e-3, size=(2, 5, 1))
    stats = dg.norm_input_stats(jnp.asarray(y_BxLxD, jnp.float32), jnp.full((d,), alpha), eps)
    c = alpha / np.sqrt(np.mean(y_BxLxD**2, -1) + eps)
    np.testing.assert_allclose(stats["c_mean"], c.mean(), rtol=1e-5)
    np.testing.assert_allclose(stats["c_min"], c.min(), rtol=1e-5)
    y = y_BxLxD[0, 0]
    g = rng.normal(size=d)
    g -= (g @ y) / (y @ y) * y
    scale = np.full(d, alpha, np.float32)
    _, vjp = jax.vjp(lambda v: RMSNorm(eps=eps).apply({"params": {"scale": scale}}, v),
                     jnp.asarray(y, jnp.float32))
    ratio = np.linalg.norm(vjp(jnp.asarray(g, jnp.float32))[0]) / np.linalg.norm(g)
    np.testing.assert_allclose(ratio, c[0, 0], rtol=1e-4)


def test_attention_row_stats_against_numpy_whole_and_by_row_blocks():
    """Per-row entropy, KL and TV to prefix averaging, on the full matrix and on row blocks that
    see only their causal keys (as the blocked kernel computes them), against numpy."""
    rng = np.random.default_rng(3)
    n = 7
    causal = np.tril(np.ones((n, n))) > 0
    logits = np.where(causal, rng.normal(size=(2, 3, n, n)) * 2, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    uniform = causal / np.arange(1, n + 1)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        entropy = -np.where(probs > 0, probs * np.log(probs), 0.0).sum(-1)
        kl = np.where(probs > 0, probs * np.log(probs / uniform), 0.0).sum(-1)
    want = {"attn_entropy": entropy, "attn_kl_uniform": kl,
            "attn_tv_uniform": 0.5 * np.abs(probs - uniform).sum(-1)}
    probs_f32 = jnp.asarray(probs, jnp.float32)
    whole = dg.attention_row_stats(probs_f32)
    blocks = [dg.attention_row_stats(probs_f32[:, :, start:end, :end], query_offset=start)
              for start, end in ((0, 3), (3, 6), (6, 7))]
    for key, value in want.items():
        np.testing.assert_allclose(whole[key], value, rtol=1e-5, atol=1e-6, err_msg=key)
        by_blocks = np.concatenate([np.asarray(b[key]) for b in blocks], axis=-1)
        np.testing.assert_allclose(by_blocks, value, rtol=1e-5, atol=1e-6, err_msg=key)
        np.testing.assert_allclose(dg.mean_attention_stats(whole)[key], value.mean(), rtol=1e-5)
    prefix = dg.attention_row_stats(jnp.asarray(uniform[None, None], jnp.float32))
    np.testing.assert_allclose(prefix["attn_kl_uniform"], 0.0, atol=1e-6)
    np.testing.assert_allclose(prefix["attn_tv_uniform"], 0.0, atol=1e-6)
