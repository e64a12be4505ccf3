"""Residual-norm budgeting: the branch scale against a numpy solution of its constraint, the bound
it keeps on the diagnostics' c, finite gradients, the logged fractions of scaled and switched-off
branches against numpy, the hinge penalty against numpy, the objective it enters, and the configs
it refuses."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training.train_state import TrainState

from configs.default import get_config
from postnorm.config.schema import ConfigError
from postnorm.diagnostics.taps import zero_probes
from postnorm.model import Decoder, ModelSpec
from postnorm.model.layers import BUDGET_COLLECTION, budget_branch_scale, cap_rms
from postnorm.train.losses import make_loss
from postnorm.train.steps import diag_step
from postnorm.train.validate import check_config
from postnorm.workdir.metrics import MetricWriter, flatten_diagnostics, layer_series, read_jsonl
from tests import numpy_reference as ref

TINY = dict(vocab_size=50, max_len=12, n_layers=3, d_model=16, n_heads=4, d_ff=24)


def numpy_largest_beta(skip_D: np.ndarray, branch_D: np.ndarray, limit_sq: float) -> float:
    """The largest beta in [0, 1] with ||skip + beta F||^2 <= limit_sq, from numpy's roots of the
    quadratic (0 when no beta in [0, 1] meets it)."""
    a, b, c = branch_D @ branch_D, 2 * skip_D @ branch_D, skip_D @ skip_D - limit_sq
    if a + b + c <= 0:
        return 1.0
    if c > 0:
        return 0.0
    return float(max(r.real for r in np.roots([a, b, c]) if abs(r.imag) < 1e-12))


def test_the_branch_scale_is_the_largest_that_meets_the_limit():
    rng = np.random.default_rng(0)
    skip = rng.normal(size=(4, 64, 32))
    branch = rng.normal(size=(4, 64, 32)) * rng.uniform(0.01, 3, size=(4, 64, 1))
    limit_sq = 32 * rng.uniform(0.5, 3.0, size=(4, 64, 1))
    beta = np.asarray(budget_branch_scale(jnp.asarray(skip, jnp.float32),
                                          jnp.asarray(branch, jnp.float32),
                                          jnp.asarray(limit_sq, jnp.float32)))
    want = np.array([[numpy_largest_beta(skip[b, t], branch[b, t], limit_sq[b, t, 0])
                      for t in range(64)] for b in range(4)])
    assert (want == 1).any() and (want == 0).any() and ((want > 0) & (want < 1)).any()
    np.testing.assert_allclose(beta[..., 0], want, rtol=2e-5, atol=2e-6)


def test_the_branch_scale_has_finite_gradients_at_its_edges():
    """A zero branch, a branch anti-parallel to the skip, and a skip already over the limit."""
    skip = jnp.asarray(np.random.default_rng(1).normal(size=(3, 8)), jnp.float32)
    branch = jnp.stack([jnp.zeros(8), -1e-4 * skip[1], skip[2]])
    limit_sq = jnp.asarray([[20.0], [20.0], [0.1]])

    def total(s, f):
        return jnp.sum(budget_branch_scale(s, f, limit_sq) * (s + f))

    grads = jax.grad(total, argnums=(0, 1))(skip, branch)
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)


def diag_forward(spec: ModelSpec, params: dict, tokens: jax.Array):
    return Decoder(spec).apply({"params": params}, tokens, probes=zero_probes(spec.n_layers),
                               mutable=[BUDGET_COLLECTION])


def big_branch_params(spec: ModelSpec) -> dict:
    """Initial parameters with the branch matrices scaled up 4x, so that c falls well below 1;
    embedding rows scaled 1.5x, so that most of them have RMS above 1/0.9 (layer 0's skip, which
    the budget caps at RMS 1), and each norm's gain a constant in [0.97, 1.03], so that every
    later skip is within every budget (where a skip is not, no branch scale can meet it:
    ``test_the_branch_scale_is_the_largest_that_meets_the_limit``'s zeros)."""
    params = nn.unbox(Decoder(spec).init(jax.random.key(0), jnp.zeros((1, 12), jnp.int32))[
        "params"])
    for group in ("attn", "ffn"):
        params["layers"][group] = jax.tree.map(lambda w: 4 * w, params["layers"][group])
    params["embedding"] = 1.5 * params["embedding"]
    rng = np.random.default_rng(2)
    for name, norm in params["layers"].items():
        if name.startswith("norm_"):
            gains_L = rng.uniform(0.97, 1.03, size=(spec.n_layers, 1))
            norm["scale"] = jnp.asarray(gains_L * np.ones(norm["scale"].shape), jnp.float32)
    return params


@pytest.mark.parametrize("norm", ["post"])
def test_the_branch_scale_keeps_c_at_or_above_its_threshold(norm):
    spec = ModelSpec(**TINY, norm=norm)
    budgeted = ModelSpec(**TINY, norm=norm, residual_budget="scale", residual_budget_c=0.9)
    params = big_branch_params(spec)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 50, size=(4, 12)))
    (_, plain), _ = diag_forward(spec, params, tokens)
    (_, kept), _ = diag_forward(budgeted, params, tokens)
    for kind in ("attn", "ffn"):
        assert float(jnp.min(plain[f"c_min_{kind}"])) < 0.9
        assert float(jnp.min(kept[f"c_min_{kind}"])) >= 0.9 * (1 - 1e-5)
    assert float(plain["c_min_attn"][0]) < 0.9  # layer 0, whose skip is the embedding


def test_the_embedding_cap_against_numpy():
    """Rows of RMS above 1 are brought to RMS 1, the others are left bit for bit; under a budget
    the decoder's stream starts from the capped rows."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(2, 12, 16)) * rng.uniform(0.3, 2.0, size=(2, 12, 1))
    rms = np.sqrt(np.mean(x**2, axis=-1, keepdims=True))
    assert (rms > 1).any() and (rms < 1).any()
    got = np.asarray(cap_rms(jnp.asarray(x, jnp.float32)))
    np.testing.assert_allclose(got, np.where(rms > 1, x / rms, x), rtol=1e-6)
    np.testing.assert_array_equal(got[rms[..., 0] <= 1], np.float32(x)[rms[..., 0] <= 1])
    # the penalty leaves the forward alone but for the cap: its logits are the plain model's
    # with the embedding table's rows capped (no position embedding)
    spec = ModelSpec(**TINY, norm="post", positions="none")
    params = big_branch_params(spec)
    tokens = jnp.asarray(rng.integers(0, 50, size=(2, 12)))
    emb = np.asarray(params["embedding"], np.float64)
    capped = {**params, "embedding": jnp.asarray(
        emb / np.maximum(1, np.sqrt(np.mean(emb**2, axis=-1, keepdims=True))), jnp.float32)}
    penalised = ModelSpec(**TINY, norm="post", positions="none", residual_budget="penalty")
    got, _ = Decoder(penalised).apply({"params": params}, tokens, mutable=[BUDGET_COLLECTION])
    want = Decoder(spec).apply({"params": capped}, tokens)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)


def test_the_penalty_is_the_hinge_of_every_norm_input_against_numpy():
    """The sown hinge of each layer's sublayers, from the forward's own weights recomputed in
    numpy: the norm inputs y of an unscanned numpy Post-Norm forward."""
    spec = ModelSpec(**TINY, norm="post", positions="none", residual_budget="penalty",
                     residual_budget_c=0.95)
    params = big_branch_params(spec)
    tokens = np.random.default_rng(0).integers(0, 50, size=(2, 12))
    _, sown = Decoder(spec).apply({"params": params}, jnp.asarray(tokens),
                                  mutable=[BUDGET_COLLECTION])
    numpy_params = jax.tree.map(lambda v: np.asarray(v, np.float64), params)
    want = {"attn": np.zeros(3), "ffn": np.zeros(3)}
    for b in range(2):
        x = numpy_params["embedding"][tokens[b]]
        x = x / np.maximum(1, np.sqrt(np.mean(x**2, axis=-1, keepdims=True)))  # the budget's cap
        for layer in range(3):
            p = ref.layer_params(numpy_params, layer)
            for kind, fn in (("attn", lambda z, p=p: ref.attention(z, p["attn"], 4, "none", 1e4)),
                             ("ffn", lambda z, p=p: ref.swiglu(z, p["ffn"]))):
                scale = p[f"norm_{kind}"]["scale"]
                y = x + fn(x)
                excess = ((y**2).mean(-1) + spec.norm_eps) / (scale**2).mean() - 1 / 0.95**2
                want[kind][layer] += np.maximum(excess, 0).mean() / 2
                x = ref.rms_norm(y, scale, spec.norm_eps)
    hinges = sown[BUDGET_COLLECTION]["layers"]
    for kind in ("attn", "ffn"):
        got = np.asarray(hinges[f"norm_{kind}"]["hinge"][0])
        assert want[kind].max() > 0
        np.testing.assert_allclose(got, want[kind], rtol=1e-4, atol=1e-6)
    config = get_config("model.residual_budget=penalty,model.residual_budget_weight=0.5")
    loss = make_loss(config)
    logits = jnp.zeros((2, 12, 50))
    targets = jnp.zeros((2, 12), jnp.int32)
    objective, parts = loss(logits, targets, sown)
    mean_hinge = np.mean(np.concatenate([want["attn"], want["ffn"]]))
    np.testing.assert_allclose(parts["residual_budget"], mean_hinge, rtol=1e-4)
    np.testing.assert_allclose(objective, np.log(50) + 0.5 * mean_hinge, rtol=1e-5)


@pytest.mark.parametrize("fields,message", [
    ("model.norm=pre,model.residual_budget=scale", "model.norm='pre' does not allow"),
    ("model.norm=deepnorm,model.residual_budget=penalty", "model.norm='deepnorm' does not"),
    ("model.residual_budget=clip", r"model.residual_budget='clip' .*one of"),
    ("model.residual_budget_c=0", r"model.residual_budget_c=0.* in \(0, 1\]"),
    ("model.residual_budget_weight=-1", r"model.residual_budget_weight=-1.* >= 0"),
])
def test_bad_budget_fields_name_the_field(fields, message):
    with pytest.raises(ConfigError, match=message):
        check_config(get_config(fields), device_count=1)


def numpy_branch_scales(spec: ModelSpec, params: dict, tokens_BxL: np.ndarray
                        ) -> dict[str, np.ndarray]:
    """beta [n_layers, B, L] of each sublayer, and (numpy_margin) the smallest distance, over
    every token, of the skip's square norm from the limit and of the sum's at beta = 1 from it
    (relative to the limit): an unscanned float64 Post-Norm forward under the budget, each beta
    from ``numpy_largest_beta``."""
    numpy_params = jax.tree.map(lambda v: np.asarray(v, np.float64), params)
    c, eps, d = spec.residual_budget_c, spec.norm_eps, spec.d_model
    betas = {kind: np.zeros((spec.n_layers, *tokens_BxL.shape)) for kind in ("attn", "ffn")}
    margin = np.inf
    for b, tokens_L in enumerate(tokens_BxL):
        x = numpy_params["embedding"][tokens_L]
        x = x / np.maximum(1, np.sqrt(np.mean(x**2, axis=-1, keepdims=True)))  # the cap
        for layer in range(spec.n_layers):
            p = ref.layer_params(numpy_params, layer)
            for kind, fn in (("attn", lambda z, p=p: ref.attention(z, p["attn"], 4, "none", 1e4)),
                             ("ffn", lambda z, p=p: ref.swiglu(z, p["ffn"]))):
                scale = p[f"norm_{kind}"]["scale"]
                limit_sq = d * (np.mean(scale**2) / c**2 - eps)
                f = fn(x)
                beta = np.array([numpy_largest_beta(x[t], f[t], limit_sq) for t in range(len(x))])
                betas[kind][layer, b] = beta
                over_at_0 = np.sum(x**2, -1) - limit_sq
                over_at_1 = np.sum((x + f) ** 2, -1) - limit_sq
                margin = min(margin, np.abs(over_at_0).min() / limit_sq,
                             np.abs(over_at_1).min() / limit_sq)
                x = ref.rms_norm(x + beta[:, None] * f, scale, eps)
    return {**betas, "numpy_margin": margin}


def test_the_logged_branch_scale_fractions_against_numpy(tmp_path):
    """diag/budget_scaled_<kind> (beta < 1) and diag/budget_off_<kind> (beta = 0) per layer, as
    the diagnostic step computes them and metrics.jsonl holds them, against the fractions of an
    unscanned numpy forward's beta. The branch matrices are the initial ones scaled 2x, and each
    norm's gain a vector drawn per layer around a level in [0.75, 1.15], so that some skips (the
    previous norm's output, RMS about that norm's gain) are over the budget and some are not."""
    spec = ModelSpec(**TINY, norm="post", positions="none", residual_budget="scale",
                     residual_budget_c=0.9)
    params = nn.unbox(Decoder(spec).init(jax.random.key(0), jnp.zeros((1, 12), jnp.int32))[
        "params"])
    rng = np.random.default_rng(4)
    for kind in ("attn", "ffn"):
        params["layers"][kind] = jax.tree.map(lambda w: 2 * w, params["layers"][kind])
        level_Lx1 = rng.uniform(0.75, 1.15, size=(spec.n_layers, 1))
        gains_LxD = level_Lx1 * rng.uniform(0.6, 1.4, size=(spec.n_layers, spec.d_model))
        params["layers"][f"norm_{kind}"]["scale"] = jnp.asarray(gains_LxD, jnp.float32)
    tokens = rng.integers(0, 50, size=(4, 12))
    want = numpy_branch_scales(spec, params, tokens)
    assert want["numpy_margin"] > 1e-4  # no token lies on a boundary float32 could cross
    state = TrainState.create(apply_fn=Decoder(spec).apply, params=params, tx=optax.sgd(0.0))
    step = functools.partial(diag_step, schedule=optax.constant_schedule(0.0),
                             loss=make_loss(get_config("model.residual_budget=scale")))
    _, _, diagnostics = jax.device_get(jax.jit(step)(
        state, {"inputs": jnp.asarray(tokens), "targets": jnp.asarray(tokens)}))
    writer = MetricWriter(str(tmp_path))
    writer.write_scalars(1, flatten_diagnostics(diagnostics))
    writer.close()
    series = layer_series(read_jsonl(str(tmp_path / "metrics.jsonl")))
    for name, is_counted in (("budget_scaled", lambda b: b < 1), ("budget_off", lambda b: b == 0)):
        fractions = []
        for kind in ("attn", "ffn"):
            fraction_L = np.mean(is_counted(want[kind]), axis=(1, 2))
            steps, got_Lx1 = series[f"{name}_{kind}"]
            assert list(steps) == [1]
            np.testing.assert_allclose(got_Lx1[:, 0], fraction_L, rtol=0, atol=1e-7,
                                       err_msg=f"{name}_{kind}")
            fractions.append(fraction_L)
        fractions = np.concatenate(fractions)  # the case has partial fractions, unlike ones
        assert ((fractions > 0) & (fractions < 1)).any() and len(set(fractions)) > 2, name
    plain = ModelSpec(**TINY, norm="post", positions="none")
    (_, unbudgeted), _ = diag_forward(plain, params, jnp.asarray(tokens))
    assert not any(key.startswith("budget_") for key in unbudgeted)
