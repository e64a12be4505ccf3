"""Backward taps against jax.vjp cotangents of an unscanned forward; diag_step vs train_step."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training.train_state import TrainState

from postnorm.diag_step import diag_step, flatten_diagnostics
from postnorm.model import Decoder, ModelSpec
from postnorm.steps import cross_entropy, train_step
from postnorm.taps import gradient_stats, zero_probes
from tests import jax_reference as ref

SPEC = dict(vocab_size=40, max_len=16, n_layers=3, d_model=16, n_heads=4, d_ff=24,
            positions="none")


KERNELS = {"einsum": {}, "blocked": dict(attention="blocked", attention_block=5)}
# Both placements with the einsum kernel; the blocked kernel (which shares the placement code)
# with Post-Norm, to keep the suite's compile time down.
NORMS_AND_KERNELS = [("post", "einsum"), ("pre", "einsum"), ("post", "blocked")]


def setup(norm: str, seed: int = 0, kernel: str = "einsum"):
    spec = ModelSpec(**SPEC, norm=norm, **KERNELS[kernel])
    tokens = jax.random.randint(jax.random.key(seed + 1), (3, 17), 0, 40)
    model = Decoder(spec)
    params = nn.unbox(model.init(jax.random.key(seed), tokens[:, :-1])["params"])
    return spec, model, params, tokens[:, :-1], tokens[:, 1:]


def reference_cotangents(spec, params, inputs, targets):
    """dL/dX_k at every sublayer input and at the final hidden state, via jax.vjp."""
    maps = ref.sublayers(params, n_layers=spec.n_layers, n_heads=spec.n_heads, norm=spec.norm,
                         eps=spec.norm_eps)
    xs = [params["embedding"][inputs]]
    for f in maps:
        xs.append(f(xs[-1]))

    def loss_from(k):
        def run(x):
            for f in maps[k:]:
                x = f(x)
            return cross_entropy(ref.head(params, x, norm=spec.norm, eps=spec.norm_eps), targets)
        return run

    cotangents = []
    for k in range(len(maps) + 1):
        _, vjp = jax.vjp(loss_from(k), xs[k])
        cotangents.append(vjp(jnp.ones(()))[0])
    return cotangents


@pytest.mark.parametrize(("norm", "kernel"), NORMS_AND_KERNELS)
def test_tap_statistics_match_vjp_cotangents(norm, kernel):
    spec, model, params, inputs, targets = setup(norm, kernel=kernel)

    def loss_fn(probes):
        logits, _ = model.apply({"params": params}, inputs, probes=probes)
        return cross_entropy(logits, targets)

    probe_grads = jax.grad(loss_fn)(zero_probes(spec.n_layers))
    got_Kx3 = np.concatenate([np.asarray(probe_grads["layers"]).reshape(-1, 3),
                              np.asarray(probe_grads["final"])[None]])
    for k, g in enumerate(reference_cotangents(spec, params, inputs, targets)):
        g = np.asarray(g, np.float64)
        mean = g.mean(axis=1, keepdims=True)
        want = [np.sum(g**2), g.shape[1] * np.sum(mean**2), np.sum((g - mean) ** 2)]
        np.testing.assert_allclose(got_Kx3[k], want, rtol=1e-5, err_msg=f"tap {k}")
        assert want[2] > 0 and want[1] > 0


def test_gradient_stats_decompose_the_norm():
    g = jax.random.normal(jax.random.key(0), (2, 7, 5))
    total, mean_sq, repair_sq = np.asarray(gradient_stats(g))
    np.testing.assert_allclose(total, mean_sq + repair_sq, rtol=1e-5)
    constant = jnp.broadcast_to(g[:, :1], g.shape)  # identical tokens: all mean, no repair
    _, mean_sq, repair_sq = np.asarray(gradient_stats(constant))
    assert repair_sq < 1e-10 * mean_sq


@pytest.mark.parametrize(("norm", "kernel"), NORMS_AND_KERNELS)
def test_diag_step_makes_the_same_update_bitwise(norm, kernel):
    spec, model, params, inputs, targets = setup(norm, kernel=kernel)
    tx = optax.adamw(1e-3)
    schedule = optax.constant_schedule(1e-3)
    batch = {"inputs": inputs, "targets": targets}
    make = lambda: TrainState.create(apply_fn=model.apply, params=params, tx=tx)  # noqa: E731
    plain, plain_metrics = jax.jit(train_step, static_argnums=2)(make(), batch, schedule)
    diag, diag_metrics, stats = jax.jit(diag_step, static_argnums=2)(make(), batch, schedule)
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(diag), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert float(plain_metrics["train/loss"]) == float(diag_metrics["train/loss"])


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_every_statistic_is_finite_and_nonzero(norm):
    spec, model, params, inputs, targets = setup(norm)
    tx = optax.adamw(1e-3)
    state = TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    _, _, stats = diag_step(state, {"inputs": inputs, "targets": targets},
                            optax.constant_schedule(1e-3))
    flat = flatten_diagnostics(jax.device_get(stats))
    assert "diag/tsim_attn/layer_02" in flat and "diag/dldx_norm_final" in flat
    names = {key.split("/")[1] for key in flat}
    for name in names:
        values = np.array([v for k, v in flat.items() if k.split("/")[1] == name])
        assert np.all(np.isfinite(values)), name
        assert np.any(values != 0), name


def test_blocked_kernel_gives_the_einsum_kernels_statistics():
    """Blocks of 5 query rows over n = 16 (5, 5, 5, 1): every per-layer statistic, attention
    entropy, KL and TV included, matches the materialised-probabilities kernel's (Post-Norm;
    the kernel does not depend on the placement)."""
    batch_stats = {}
    for kernel in KERNELS:
        spec, model, params, inputs, targets = setup("post", kernel=kernel)
        state = TrainState.create(apply_fn=model.apply, params=params, tx=optax.adamw(1e-3))
        _, _, stats = diag_step(state, {"inputs": inputs, "targets": targets},
                                optax.constant_schedule(1e-3))
        batch_stats[kernel] = flatten_diagnostics(jax.device_get(stats))
    einsum, blocked = batch_stats["einsum"], batch_stats["blocked"]
    assert set(blocked) == set(einsum) and "diag/attn_tv_uniform/layer_02" in einsum
    for key, value in einsum.items():
        np.testing.assert_allclose(blocked[key], value, rtol=2e-4, atol=1e-6, err_msg=key)


def test_per_layer_parameter_gradient_and_update_norms_against_numpy():
    spec, model, params, inputs, targets = setup("post")
    tx = optax.adamw(1e-3)
    state = TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    batch = {"inputs": inputs, "targets": targets}
    new_state, _, stats = diag_step(state, batch, optax.constant_schedule(1e-3))

    def loss_fn(p):
        return cross_entropy(model.apply({"params": p}, inputs), targets)

    grads = jax.grad(loss_fn)(params)["layers"]
    trees = {"param_norm": params["layers"], "grad_norm": grads,
             "update_norm": jax.tree.map(np.subtract, new_state.params["layers"],
                                         params["layers"])}
    groups = {"attn": ["attn"], "ffn": ["ffn"], "norm": ["norm_attn", "norm_ffn"]}
    for prefix, tree in trees.items():
        for group, names in groups.items():
            want = [np.sqrt(sum(np.sum(np.asarray(leaf[layer], np.float64) ** 2)
                                for name in names for leaf in jax.tree.leaves(tree[name])))
                    for layer in range(spec.n_layers)]
            np.testing.assert_allclose(stats[f"{prefix}_{group}"], want, rtol=1e-4,
                                       err_msg=f"{prefix}_{group}")
