"""Gradient repair: the backward of ``repair_gradient`` and its factor against numpy, the
repaired model's parameter gradient against a hand-written unscanned forward that scales each
residual norm's cotangent by the stated factor, the identity when disabled or without residual
norms, the cumulative bound, and what the diagnostic step reports."""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.default import get_config
from postnorm.model import Decoder, ModelSpec
from postnorm.model.repair import (
    GradRepair,
    grad_repair_from_config,
    repair_factor,
    repair_gradient,
)
from postnorm.runtime.mesh import make_mesh
from postnorm.train.losses import Loss, cross_entropy
from postnorm.train.optim import make_optimizer
from postnorm.train.programs import compile_steps
from tests import jax_reference as ref

SPEC = dict(vocab_size=40, max_len=16, n_layers=3, d_model=16, n_heads=4, d_ff=24,
            positions="none", attention="einsum")
# cap = 1.77^(1/6) ~ 1.10 per residual norm; with the threshold at 0.97 the test's tokens fall
# in all three regimes: no repair (c >= 0.97), 1/c, and the cap (c < 1/1.10)
RULE = GradRepair(max_total=1.77, threshold=0.97)


def numpy_factor(y_BxLxD: np.ndarray, scale_D: np.ndarray, eps: float, cap: float,
                 threshold: float) -> np.ndarray:
    c = np.sqrt(np.mean(scale_D.astype(np.float64) ** 2)) / np.sqrt(
        np.mean(y_BxLxD.astype(np.float64) ** 2, axis=-1, keepdims=True) + eps)
    return np.where(c < threshold, np.minimum(1 / c, cap), 1.0)


def test_the_factor_and_the_backward_against_numpy():
    rng = np.random.default_rng(0)
    y = (rng.standard_normal((2, 5, 8)) * rng.uniform(0.5, 2.0, (2, 5, 1))).astype(np.float32)
    scale = rng.uniform(0.5, 1.5, 8).astype(np.float32)
    want = numpy_factor(y, scale, 1e-6, 1.3, 0.9)
    # all three regimes: no repair, 1/c and the cap
    assert ((want > 1) & (want < 1.3)).any() and (want == 1).any() and (want == 1.3).any()
    factor = repair_factor(jnp.asarray(y), jnp.asarray(scale), 1e-6, 1.3, 0.9)
    np.testing.assert_allclose(factor, want, rtol=1e-6)
    g = rng.standard_normal(y.shape).astype(np.float32)
    out, vjp = jax.vjp(repair_gradient, jnp.asarray(y), factor)
    np.testing.assert_array_equal(out, y)
    g_y, g_factor = vjp(jnp.asarray(g))
    np.testing.assert_allclose(g_y, g * want, rtol=1e-6)
    np.testing.assert_array_equal(g_factor, np.zeros_like(want))


def test_the_caps_multiply_to_the_cumulative_bound():
    for n_layers in (3, 48, 96):
        rule = GradRepair(max_total=1e4)
        assert rule.sublayer_cap(n_layers) ** (2 * n_layers) == pytest.approx(1e4, rel=1e-9)
    assert grad_repair_from_config(get_config().train) is None
    config = get_config("train.grad_repair=true,train.grad_repair_max=50,"
                        "train.grad_repair_threshold=0.9")
    assert grad_repair_from_config(config.train) == GradRepair(50.0, 0.9)


@functools.cache
def setup(budget: str = "none"):
    """A small Post-Norm model whose norm gains vary, so that c spreads over the three
    regimes, with its inputs and targets."""
    spec = ModelSpec(**SPEC, norm="post", residual_budget=budget, grad_repair=RULE)
    tokens = jax.random.randint(jax.random.key(1), (3, 17), 0, 40)
    params = nn.unbox(Decoder(spec).init(jax.random.key(0), tokens[:, :-1])["params"])
    rng = np.random.default_rng(2)
    for kind in ("norm_attn", "norm_ffn"):
        scale = params["layers"][kind]["scale"]
        params["layers"][kind]["scale"] = jnp.asarray(
            rng.uniform(0.8, 1.15, scale.shape), jnp.float32)
    return spec, params, tokens[:, :-1], tokens[:, 1:]


def reference_loss(params, inputs, targets, spec, repair: bool) -> tuple[jax.Array, list]:
    """Cross-entropy of a hand-written unscanned Post-Norm forward, and the repair factors. With
    ``repair`` each residual norm's input carries the factor in its backward pass only:
    f y + stop_gradient((1 - f) y)."""
    factors = []
    x = params["embedding"][inputs]
    if spec.residual_budget != "none":  # a budget caps the embedding rows' RMS at 1
        x = x / jnp.maximum(1.0, jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True)))
    cap = RULE.sublayer_cap(spec.n_layers)
    for layer in range(spec.n_layers):
        p = jax.tree.map(lambda a, layer=layer: a[layer], params["layers"])
        for kind, branch in (("attn", lambda z, p=p: ref.attention(z, p["attn"], spec.n_heads)),
                             ("ffn", lambda z, p=p: ref.swiglu(z, p["ffn"]))):
            scale = p[f"norm_{kind}"]["scale"]
            y = x + branch(x)
            if repair:
                y_, scale_ = jax.lax.stop_gradient(y), jax.lax.stop_gradient(scale)
                c = jnp.linalg.norm(scale_) / jnp.linalg.norm(y_, axis=-1, keepdims=True) * \
                    jnp.sqrt(y.shape[-1] / scale.shape[-1])  # eps (1e-6) left out: rtol 1e-4
                f = jnp.where(c < RULE.threshold, jnp.minimum(1 / c, cap), 1.0)
                factors.append(f)
                y = f * y + jax.lax.stop_gradient((1 - f) * y)
            x = ref.rms_norm(y, scale, spec.norm_eps)
    return cross_entropy(ref.head(params, x, norm="post", eps=spec.norm_eps), targets), factors


@functools.partial(jax.jit, static_argnums=(3, 4))
def reference_grads(params, inputs, targets, spec, repair: bool) -> tuple[dict, list]:
    """The hand-written forward's parameter gradient (compiled), and its repair factors."""
    return jax.grad(reference_loss, has_aux=True)(params, inputs, targets, spec, repair)


def model_grads(spec, params, inputs, targets, **apply_kwargs):
    return _model_grad_fn(spec, tuple(sorted(apply_kwargs.items())))(params, inputs, targets)


@functools.cache
def _model_grad_fn(spec, apply_kwargs: tuple):
    """The Decoder's compiled parameter gradient, once per spec and apply arguments."""
    def loss(p, inputs, targets):
        return cross_entropy(Decoder(spec).apply({"params": p}, inputs, **dict(apply_kwargs)),
                             targets)
    return jax.jit(jax.grad(loss))


def assert_trees_close(got, want, rtol):
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want),
                            strict=True):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=1e-7, err_msg=jax.tree_util.keystr(path))


# the plain norm, and (slow) the budgeted one
@pytest.mark.parametrize("budget", ["none", pytest.param("penalty", marks=pytest.mark.slow)])
def test_the_repaired_gradient_against_a_hand_written_forward(budget):
    spec, params, inputs, targets = setup(budget)
    want, factors = reference_grads(params, inputs, targets, spec, True)
    all_factors = np.concatenate([np.asarray(f).ravel() for f in factors])
    cap = RULE.sublayer_cap(spec.n_layers)
    assert (all_factors == 1).any() and np.isclose(all_factors, cap).any()
    assert ((all_factors > 1) & (all_factors < cap - 1e-6)).any()
    assert_trees_close(model_grads(spec, params, inputs, targets), want, rtol=2e-4)
    # repair off: the loss's own gradient, and the forward is the same either way
    plain = dataclasses.replace(spec, grad_repair=None)
    true = reference_grads(params, inputs, targets, spec, False)[0]
    assert_trees_close(model_grads(spec, params, inputs, targets, repair=False), true, rtol=2e-4)
    for a, b in zip(jax.tree.leaves(model_grads(spec, params, inputs, targets, repair=False)),
                    jax.tree.leaves(model_grads(plain, params, inputs, targets)), strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(Decoder(spec).apply({"params": params}, inputs),
                                  Decoder(plain).apply({"params": params}, inputs))
    early = np.linalg.norm(model_grads(spec, params, inputs, targets)["layers"]["attn"]["w_q"][0])
    assert early > np.linalg.norm(true["layers"]["attn"]["w_q"][0])


def test_pre_norm_has_nothing_to_repair():
    """Pre-Norm's norms sit on the branches, none on a residual sum: the gradient is unchanged."""
    spec = ModelSpec(**SPEC, norm="pre", grad_repair=GradRepair(1e4))
    tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, 40)
    params = nn.unbox(Decoder(spec).init(jax.random.key(0), tokens[:, :-1])["params"])
    got = model_grads(spec, params, tokens[:, :-1], tokens[:, 1:])
    want = model_grads(dataclasses.replace(spec, grad_repair=None), params, tokens[:, :-1],
                       tokens[:, 1:])
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)


def _cosine(a, b) -> float:
    a, b = np.concatenate([x.ravel() for x in a]), np.concatenate([x.ravel() for x in b])
    return float(a @ b / np.sqrt((a @ a) * (b @ b)))


def test_the_diagnostic_step_reports_the_true_and_the_repaired_gradient():
    """``dldx_*`` are the loss's own (as without repair), ``repaired_dldx_*`` the repaired
    signal's, the update uses the repaired gradient, and ``repair_cos`` is the cosine of the two
    parameter gradients against the hand-written forward's."""
    spec, params, inputs, targets = setup()
    config = get_config()
    tx, schedule = make_optimizer(config.opt, 10)
    mesh = make_mesh(config.mesh, jax.devices()[:1])
    batch = {"inputs": inputs, "targets": targets}
    diags = {}
    for name, s in (("repair", spec), ("plain", dataclasses.replace(spec, grad_repair=None))):
        steps = compile_steps(s, tx, schedule, mesh, Loss())
        state = steps.init(0).replace(params=jax.tree.map(jnp.array, params))  # donated
        diags[name] = jax.device_get(steps.diag(state, batch)[2])
    got, plain = diags["repair"], diags["plain"]
    for key in ("dldx_norm_attn", "dldx_norm_ffn", "dldx_norm_final", "tsim_attn", "c_min_attn"):
        np.testing.assert_allclose(got[key], plain[key], rtol=1e-5, err_msg=key)
    assert (got["repaired_dldx_norm_attn"][0] > got["dldx_norm_attn"][0])
    np.testing.assert_allclose(got["repaired_dldx_norm_final"], got["dldx_norm_final"],
                               rtol=1e-6)  # above every norm: nothing repaired yet
    repaired = reference_grads(params, inputs, targets, spec, True)[0]
    true = reference_grads(params, inputs, targets, spec, False)[0]
    for layer in range(spec.n_layers):
        per_layer = [jax.tree.leaves(jax.tree.map(lambda a, layer=layer: a[layer], g["layers"]))
                     for g in (repaired, true)]
        np.testing.assert_allclose(got["repair_cos"][layer], _cosine(*per_layer), rtol=1e-4)
    np.testing.assert_allclose(got["repair_cos_all"], _cosine(jax.tree.leaves(repaired),
                                                              jax.tree.leaves(true)), rtol=1e-4)
    assert got["repair_cos"].min() < 0.9999  # the repair changed the direction somewhere
    np.testing.assert_allclose(got["true_grad_norm_attn"], plain["grad_norm_attn"], rtol=1e-5)
    np.testing.assert_allclose(got["grad_norm_attn"], [np.sqrt(sum(
        np.sum(np.asarray(v[layer]) ** 2) for v in jax.tree.leaves(repaired["layers"]["attn"])))
        for layer in range(spec.n_layers)], rtol=1e-4)
