"""Backward taps against jax.vjp cotangents of an unscanned forward; diag_step vs train_step."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training.train_state import TrainState

from postnorm.diagnostics.taps import gradient_stats, zero_probes
from postnorm.model import Decoder, ModelSpec
from postnorm.model.placements import PLACEMENTS
from postnorm.train.losses import Loss, cross_entropy
from postnorm.train.steps import diag_step, train_step, with_update_norms
from postnorm.workdir.metrics import flatten_diagnostics, layer_key
from tests import jax_reference as ref

SPEC = dict(vocab_size=40, max_len=16, n_layers=3, d_model=16, n_heads=4, d_ff=24,
            positions="none")


KERNELS = {"einsum": {}, "blocked": dict(attention="blocked", attention_block=5),
           "cpu": dict(attention="cpu"),
           # as configs/default.py runs it: RoPE, the CPU kernel, full rematerialisation
           "default": dict(attention="cpu", positions="rope", remat="full")}
# Both placements with the einsum kernel; the blocked kernel (which shares the placement code)
# with Post-Norm, to keep the suite's compile time down.
NORMS_AND_KERNELS = [("post", "einsum"), ("pre", "einsum"),
                     pytest.param("post", "blocked", marks=pytest.mark.slow)]
# Every registered arrangement with the einsum kernel; the other kernels' repeats are slow.
TAPPED = [*((norm, "einsum") for norm in PLACEMENTS),
          pytest.param("post", "blocked", marks=pytest.mark.slow), ("pre", "default"),
          pytest.param("b2t", "default", marks=pytest.mark.slow)]


@functools.cache
def setup(norm: str, seed: int = 0, kernel: str = "einsum", batch: int = 3):
    """The spec, model, initial parameters, inputs and targets of a small model (cached: its
    arrays are immutable)."""
    spec = ModelSpec(**{**SPEC, **KERNELS[kernel]}, norm=norm)
    tokens = jax.random.randint(jax.random.key(seed + 1), (batch, 17), 0, 40)
    model = Decoder(spec)
    params = nn.unbox(jax.jit(model.init)(jax.random.key(seed), tokens[:, :-1])["params"])
    return spec, model, params, tokens[:, :-1], tokens[:, 1:]


def rope_base(spec):
    return spec.rope_base if spec.positions == "rope" else None


@functools.partial(jax.jit, static_argnums=0)
def reference_cotangents(spec, params, inputs, targets):
    """The unscanned reference's logits, and dL/dX_k at every sublayer input and at the final
    hidden state via jax.vjp: at a layer's input, through every use of it (B2T's layer skip
    included); at an FFN input h, with the layer's input held fixed."""
    maps = ref.sublayers(params, spec)
    post_mix_Lx2 = PLACEMENTS[spec.norm].post_mix(spec)

    def loss_of(x):
        logits = ref.head(params, x, norm=spec.norm, eps=spec.norm_eps,
                          post_mix_Lx2=post_mix_Lx2)
        return cross_entropy(logits, targets)

    inputs_k, last = ref.stream(maps, ref.embed(params, inputs, spec))
    cotangents = []
    for k, (x, layer_input) in [*enumerate(inputs_k), (len(maps), (last, None))]:
        _, vjp = jax.vjp(lambda x, k=k, layer_input=layer_input:
                         loss_of(ref.run_from(maps, k, x, layer_input)), x)
        cotangents.append(vjp(jnp.ones(()))[0])
    logits = ref.head(params, last, norm=spec.norm, eps=spec.norm_eps, post_mix_Lx2=post_mix_Lx2)
    return logits, cotangents


@functools.cache
def reference_of(norm: str, kernel: str) -> tuple[np.ndarray, list[np.ndarray]]:
    """reference_cotangents of setup(norm, kernel=kernel), in float64."""
    spec, _, params, inputs, targets = setup(norm, kernel=kernel)
    logits, cotangents = reference_cotangents(spec, params, inputs, targets)
    return np.asarray(logits, np.float64), [np.asarray(g, np.float64) for g in cotangents]


def reference_cotangents_of(norm: str, kernel: str) -> list[np.ndarray]:
    return reference_of(norm, kernel)[1]


@functools.cache
def diag_step_of(norm: str, kernel: str = "einsum"):
    """The jitted diag_step's new state, metrics and statistics (update norms included) on
    setup(norm, kernel=kernel) with AdamW at lr 1e-3, on the host."""
    _, model, params, inputs, targets = setup(norm, kernel=kernel)
    state = TrainState.create(apply_fn=model.apply, params=params, tx=optax.adamw(1e-3))
    step = with_update_norms(functools.partial(diag_step, schedule=optax.constant_schedule(1e-3),
                                               loss=Loss()))
    return jax.device_get(jax.jit(step)(state, {"inputs": inputs, "targets": targets}))


@pytest.mark.parametrize(("norm", "kernel"), TAPPED)
def test_tap_statistics_match_vjp_cotangents(norm, kernel):
    """For every arrangement in the registry: the reference computes the model's logits, and
    each tap reports the statistics of its sublayer input's whole cotangent."""
    spec, model, params, inputs, targets = setup(norm, kernel=kernel)

    def loss_fn(probes):
        logits, _ = model.apply({"params": params}, inputs, probes=probes)
        return cross_entropy(logits, targets), logits

    probe_grads, logits = jax.jit(jax.grad(loss_fn, has_aux=True))(zero_probes(spec.n_layers))
    want_logits, cotangents = reference_of(norm, kernel)
    np.testing.assert_allclose(logits, want_logits, rtol=1e-5, atol=1e-5,
                               err_msg="the reference is not the model's forward")
    got_Kx3 = np.concatenate([np.asarray(probe_grads["layers"]).reshape(-1, 3),
                              np.asarray(probe_grads["final"])[None]])
    for k, g in enumerate(cotangents):
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


@pytest.mark.parametrize(("norm", "kernel"), [*NORMS_AND_KERNELS, ("post", "default")])
def test_diag_step_makes_the_same_update_bitwise(norm, kernel):
    """Also with the default config's C++ kernel, whose diagnostic step calls its forward with
    statistics instead of the plain forward."""
    _, model, params, inputs, targets = setup(norm, kernel=kernel)
    state = TrainState.create(apply_fn=model.apply, params=params, tx=optax.adamw(1e-3))
    plain, plain_metrics = jax.jit(train_step, static_argnums=(2, 3))(
        state, {"inputs": inputs, "targets": targets}, optax.constant_schedule(1e-3), Loss())
    diag, diag_metrics, _ = diag_step_of(norm, kernel)
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(diag), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert float(plain_metrics["train/loss"]) == float(diag_metrics["train/loss"])


def test_the_logged_gradient_norm_is_the_global_norm_of_the_gradients():
    """train/grad_norm against the float64 root of the summed squares of jax.grad's leaves."""
    _, model, params, inputs, targets = setup("post", kernel="einsum")
    state = TrainState.create(apply_fn=model.apply, params=params, tx=optax.adamw(1e-3))
    _, metrics = jax.jit(train_step, static_argnums=(2, 3))(
        state, {"inputs": inputs, "targets": targets}, optax.constant_schedule(1e-3), Loss())
    grads = jax.grad(lambda p: cross_entropy(model.apply({"params": p}, inputs), targets))(params)
    want = np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in jax.tree.leaves(grads)))
    np.testing.assert_allclose(float(metrics["train/grad_norm"]), want, rtol=1e-5)


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_diag_step_reports_the_norms_of_the_reference_cotangents(norm):
    """diag/dldx_{norm,mean_norm,repair_norm}_{attn,ffn,final}: Frobenius norms (not squares)
    of the jax.vjp cotangents at each sublayer's input on the unscanned reference forward, in
    layer order, each under its own name."""
    _, _, stats = diag_step_of(norm)
    cotangents = reference_cotangents_of(norm, "einsum")
    for k, g in enumerate(cotangents):
        mean = g.mean(axis=1, keepdims=True)
        want = {"dldx_norm": np.sqrt(np.sum(g**2)),
                "dldx_mean_norm": np.sqrt(g.shape[1] * np.sum(mean**2)),
                "dldx_repair_norm": np.sqrt(np.sum((g - mean) ** 2))}
        for name, value in want.items():
            got = (stats[f"{name}_final"] if k == len(cotangents) - 1
                   else stats[f"{name}_{('attn', 'ffn')[k % 2]}"][k // 2])
            np.testing.assert_allclose(got, value, rtol=1e-5, err_msg=f"{name}, tap {k}")


def test_flattened_diagnostics_keep_the_layer_index():
    values = np.arange(12, dtype=np.float32) / 10
    flat = flatten_diagnostics({"tsim_attn": values, "tsim_final": np.float32(0.5)})
    assert flat["diag/tsim_final"] == 0.5
    for layer in range(12):
        assert flat[layer_key("diag/tsim_attn", layer, 12)] == float(values[layer])


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_every_statistic_is_finite_and_nonzero(norm):
    flat = flatten_diagnostics(diag_step_of(norm)[2])
    assert "diag/tsim_attn/layer_02" in flat and "diag/dldx_norm_final" in flat
    names = {key.split("/")[1] for key in flat}
    for name in names:
        values = np.array([v for k, v in flat.items() if k.split("/")[1] == name])
        assert np.all(np.isfinite(values)), name
        assert np.any(values != 0), name


def numpy_tsim(a):
    """tsim per sequence of a [B, L, D] array, averaged over the batch."""
    return np.mean(np.sum(a.sum(1) ** 2, -1) / (a.shape[1] * np.sum(a**2, (1, 2))))


def numpy_sublayer_stats(x, f, y, scale, eps):
    """DIAGNOSTICS.md's statistics of one sublayer in float64: input X, branch F, norm input y."""
    def erank(a):
        sigma = np.linalg.svd(a, compute_uv=False)
        p = sigma / sigma.sum()
        return np.exp(-np.sum(p * np.log(p)))

    rms = np.sqrt(np.mean(y**2, -1))
    r = np.sqrt(rms**2 + eps)
    c, c_bound = np.sqrt(np.mean(scale**2)) / r, np.abs(scale).max() / r
    return {"tsim": numpy_tsim(x), "tsim_branch": numpy_tsim(f),
            "energy_ratio": np.sum(f**2) / np.sum(x**2),
            "erank": np.mean([erank(x[b]) for b in range(min(4, len(x)))]),
            "y_rms_mean": rms.mean(), "y_rms_max": rms.max(), "c_mean": c.mean(),
            "c_min": c.min(), "c_bound_mean": c_bound.mean(), "c_bound_min": c_bound.min()}


def numpy_attention_stats(x, p, n_heads, base):
    """Mean entropy of causal attention rows and their KL and TV to prefix averaging."""
    b, n, d = x.shape
    q, k = ((x @ p[w]).reshape(b, n, n_heads, d // n_heads) for w in ("w_q", "w_k"))
    if base is not None:
        q, k = (np.asarray(ref.rope(a, base), np.float64) for a in (q, k))
    logits = np.einsum("bihk,bjhk->bhij", q, k) / np.sqrt(d // n_heads)
    causal = np.tril(np.ones((n, n))) > 0
    logits = np.where(causal, logits, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    entropy = -np.sum(np.where(probs > 0, probs * np.log(np.where(probs > 0, probs, 1)), 0), -1)
    row_len = np.arange(1, n + 1)
    uniform = causal / row_len[:, None]
    return {"attn_entropy": entropy.mean(), "attn_kl_uniform": (np.log(row_len) - entropy).mean(),
            "attn_tv_uniform": 0.5 * np.abs(probs - uniform).sum(-1).mean()}


@pytest.mark.parametrize(("norm", "kernel"), [("post", "einsum"), ("pre", "einsum"),
                                            ("post", "default")])
def test_forward_statistics_match_numpy_on_the_reference_forward(norm, kernel):
    """Every forward statistic the model returns per layer, from the X_k, F and y of the
    hand-written forward (tests/jax_reference.py) in float64 numpy, with gains that vary by
    entry (so the RMS and the max of the gain differ) and a trained-looking residual stream.
    Six sequences, so that the effective rank's mean over the first four is tested; and the
    residual stream leaving the last layer (before Pre-Norm's final norm)."""
    spec, model, params, inputs, _ = setup(norm, kernel=kernel, batch=6)
    rng = np.random.default_rng(7)
    params = jax.tree_util.tree_map_with_path(
        lambda path, a: jnp.asarray(rng.uniform(0.3, 2.0, a.shape), a.dtype)
        if "scale" in jax.tree_util.keystr(path) else a, params)
    _, stats = model.apply({"params": params}, inputs, probes=zero_probes(spec.n_layers))
    host = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    x = host["embedding"][np.asarray(inputs)]
    for layer in range(spec.n_layers):
        p = jax.tree.map(lambda a, layer=layer: a[layer], host["layers"])
        for kind in ("attn", "ffn"):
            scale = p[f"norm_{kind}"]["scale"]
            normed = x if norm == "post" else np.asarray(ref.rms_norm(x, scale, spec.norm_eps))
            if kind == "attn":
                want = numpy_attention_stats(normed, p["attn"], spec.n_heads, rope_base(spec))
                f = np.asarray(ref.attention(normed, p["attn"], spec.n_heads, rope_base(spec)),
                               np.float64)
            else:
                want = {}
                f = np.asarray(ref.swiglu(normed, p["ffn"]), np.float64)
            y = x + f if norm == "post" else x
            want.update({f"{k}_{kind}": v for k, v in
                         numpy_sublayer_stats(x, f, y, scale, spec.norm_eps).items()})
            for key, value in want.items():
                np.testing.assert_allclose(stats[key][layer], value, rtol=2e-5,
                                           err_msg=f"{key}, layer {layer}")
            x = np.asarray(ref.rms_norm(x + f, scale, spec.norm_eps)) if norm == "post" else x + f
    np.testing.assert_allclose(stats["tsim_final"], numpy_tsim(x), rtol=2e-5)


@pytest.mark.parametrize("kernel", ["blocked", "cpu"])
def test_the_blocked_and_cpu_kernels_give_the_einsum_kernels_statistics(kernel):
    """Every per-layer statistic, attention entropy, KL and TV included, matches the
    materialised-probabilities kernel's: blocks of 5 query rows over n = 16 (5, 5, 5, 1), and
    the C++ kernel's own statistics (Post-Norm; the kernels do not depend on the placement)."""
    einsum = flatten_diagnostics(diag_step_of("post", "einsum")[2])
    other = flatten_diagnostics(diag_step_of("post", kernel)[2])
    assert set(other) == set(einsum) and "diag/attn_tv_uniform/layer_02" in einsum
    for key, value in einsum.items():
        np.testing.assert_allclose(other[key], value, rtol=2e-4, atol=1e-6, err_msg=key)


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_per_layer_parameter_gradient_and_update_norms_against_numpy(norm):
    spec, model, params, inputs, targets = setup(norm)
    _, _, stats = diag_step_of(norm)

    def loss_fn(p):
        return cross_entropy(model.apply({"params": p}, inputs), targets)

    grads = jax.grad(loss_fn)(params)
    tx = optax.adamw(1e-3)  # the first AdamW update of these gradients, outside the step
    updates, _ = tx.update(grads, tx.init(params), params)
    trees = {"param_norm": params["layers"], "grad_norm": grads["layers"],
             "update_norm": updates["layers"]}
    groups = {"attn": ["attn"], "ffn": ["ffn"], "norm": ["norm_attn", "norm_ffn"]}
    for prefix, tree in trees.items():
        for group, names in groups.items():
            want = [np.sqrt(sum(np.sum(np.asarray(leaf[layer], np.float64) ** 2)
                                for name in names for leaf in jax.tree.leaves(tree[name])))
                    for layer in range(spec.n_layers)]
            np.testing.assert_allclose(stats[f"{prefix}_{group}"], want, rtol=1e-4,
                                       err_msg=f"{prefix}_{group}")
