"""The residual/norm arrangements and qk-norm: each against the numpy forward written out rule by
rule, their constants against DeepNet's formulas at two depths, their init gains; and every
method (arrangement, option, budget, init) resuming bit for bit."""

import math
import shutil

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.default import get_config
from postnorm import theory
from postnorm.analysis import monte_carlo
from postnorm.config.schema import ConfigError
from postnorm.diagnostics.taps import zero_probes
from postnorm.model import PLACEMENTS, Decoder, ModelSpec
from postnorm.model.admin import profiled_params
from postnorm.model.placements import deepnorm_alpha, deepnorm_beta, mixln_post_layers
from postnorm.train import experiment
from postnorm.train.validate import check_model
from tests import numpy_reference as ref
from tests.reliability_helpers import read_losses, tiny_config, write_corpus

TINY = dict(vocab_size=50, max_len=12, d_model=16, n_heads=4, d_ff=24)


def init_params(spec: ModelSpec, seed: int = 0) -> dict:
    tokens = jnp.zeros((1, spec.max_len), jnp.int32)
    return nn.unbox(jax.jit(Decoder(spec).init)(jax.random.key(seed), tokens)["params"])


def random_gains(params: dict, seed: int) -> dict:
    """Every norm gain drawn from U(0.5, 1.5): at init they are all 1, which would hide a gain
    applied at the wrong norm."""
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map_with_path(
        lambda path, x: (jnp.asarray(rng.uniform(0.5, 1.5, x.shape), x.dtype)
                         if getattr(path[-1], "key", None) == "scale" else x), params)


def assert_matches_numpy(spec: ModelSpec, seed: int = 3) -> None:
    params = random_gains(init_params(spec, seed), seed + 1)
    tokens = np.random.default_rng(seed).integers(0, spec.vocab_size, size=(2, spec.max_len))
    logits = np.asarray(Decoder(spec).apply({"params": params}, jnp.asarray(tokens)))
    post_layers = mixln_post_layers(spec) if spec.norm == "mixln" else 0
    profile = PLACEMENTS[spec.norm].post_mix(spec)
    for b in range(2):
        expected = ref.forward(jax.tree.map(np.asarray, params), tokens[b],
                               n_layers=spec.n_layers, n_heads=spec.n_heads, norm=spec.norm,
                               positions=spec.positions, eps=spec.norm_eps,
                               rope_base=spec.rope_base, tie=spec.tie_embeddings,
                               mixln_post_layers=post_layers, post_mix=profile)
        np.testing.assert_allclose(logits[b], expected, rtol=1e-4, atol=1e-4)


# admin has its own numpy forward, with its profiling pass: test_admin_matches_the_numpy_forward
@pytest.mark.parametrize("norm", sorted(set(PLACEMENTS) - {"admin"}))
@pytest.mark.parametrize("qk_norm", [False, True])
def test_every_arrangement_matches_the_numpy_forward(norm, qk_norm):
    assert_matches_numpy(ModelSpec(**TINY, n_layers=3, norm=norm, qk_norm=qk_norm))


@pytest.mark.parametrize("fraction,post_layers", [(0.0, 0), (0.25, 1), (0.5, 2), (0.67, 3),
                                                  (1.0, 4)])
def test_mixln_boundary_after_every_layer(fraction, post_layers):
    """ceil(rho L) Post layers, then Pre: every placement of the boundary in a 4-layer stack,
    the all-Pre and all-Post ends included, against the numpy forward."""
    spec = ModelSpec(**TINY, n_layers=4, norm="mixln", mixln_post_fraction=fraction)
    assert mixln_post_layers(spec) == post_layers
    assert_matches_numpy(spec)


def test_mixln_ends_compute_post_and_pre_exactly():
    """All-Post Mix-LN is Post-Norm and all-Pre Mix-LN is Pre-Norm from the same parameters
    (lambda in {0, 1} mixes nothing in; XLA fuses the two programs differently, so they agree to
    float32 rounding, not bit for bit)."""
    base = dict(**TINY, n_layers=3)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 50, size=(2, 12)))
    mixed = random_gains(init_params(ModelSpec(**base, norm="mixln")), 1)
    layers = mixed["layers"]
    post_params = {"embedding": mixed["embedding"], "lm_head": mixed["lm_head"],
                   "layers": {k: layers[k] for k in ("attn", "ffn", "norm_attn", "norm_ffn")}}
    pre_params = {**post_params, "final_norm": mixed["final_norm"],
                  "layers": {"attn": layers["attn"], "ffn": layers["ffn"],
                             "norm_attn": layers["norm_attn_in"],
                             "norm_ffn": layers["norm_ffn_in"]}}
    for fraction, norm, params in ((1.0, "post", post_params), (0.0, "pre", pre_params)):
        got = Decoder(ModelSpec(**base, norm="mixln", mixln_post_fraction=fraction)).apply(
            {"params": mixed}, tokens)
        want = Decoder(ModelSpec(**base, norm=norm)).apply({"params": params}, tokens)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n_layers", [3, 12])
def test_deepnorm_constants_follow_the_depth(n_layers):
    """alpha = (2L)^(1/4) in the forward (the numpy reference computes it itself) and
    beta = (8L)^(-1/4) on W_V, W_O, W_up and W_down at init, W_Q, W_K and W_gate untouched."""
    assert deepnorm_alpha(n_layers) == pytest.approx(math.pow(2 * n_layers, 0.25))
    assert deepnorm_beta(n_layers) == pytest.approx(math.pow(8 * n_layers, -0.25))
    spec = ModelSpec(**{**TINY, "d_model": 64, "d_ff": 96}, n_layers=n_layers, norm="deepnorm")
    if n_layers == 3:
        assert_matches_numpy(spec)
    deep = init_params(spec)["layers"]
    plain = init_params(ModelSpec(**{**TINY, "d_model": 64, "d_ff": 96}, n_layers=n_layers))
    beta = (8 * n_layers) ** -0.25
    for group, name, gain in (("attn", "w_q", 1), ("attn", "w_k", 1), ("attn", "w_v", beta),
                              ("attn", "w_o", beta), ("ffn", "w_gate", 1), ("ffn", "w_up", beta),
                              ("ffn", "w_down", beta)):
        np.testing.assert_allclose(np.asarray(deep[group][name]),
                                   gain * np.asarray(plain["layers"][group][name]), rtol=1e-6)


def test_deepnorm_is_post_norm():
    """The last operation before the LM head is the last FFN sublayer's norm: doubling its gain
    doubles the logits. (A DeepNorm that stayed Pre-Norm would end in a final norm instead.)"""
    spec = ModelSpec(**TINY, n_layers=3, norm="deepnorm")
    params = init_params(spec)
    assert "final_norm" not in params
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 50, size=(2, 12)))
    doubled = jax.tree.map(lambda x: x, params)
    doubled["layers"]["norm_ffn"]["scale"] = params["layers"]["norm_ffn"]["scale"].at[-1].mul(2)
    base = np.asarray(Decoder(spec).apply({"params": params}, tokens))
    np.testing.assert_allclose(np.asarray(Decoder(spec).apply({"params": doubled}, tokens)),
                               2 * base, rtol=1e-5, atol=1e-6)


def test_b2t_rescaled_init_scales_every_layer_matrix():
    spec = ModelSpec(**TINY, n_layers=4, norm="b2t", b2t_rescaled_init=True)
    assert_matches_numpy(spec)
    scaled, plain = init_params(spec), init_params(ModelSpec(**TINY, n_layers=4, norm="b2t"))
    for group in ("attn", "ffn"):
        for name, w in scaled["layers"][group].items():
            np.testing.assert_allclose(np.asarray(w),
                                       0.5 * np.asarray(plain["layers"][group][name]), rtol=1e-6)
    np.testing.assert_array_equal(scaled["embedding"], plain["embedding"])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def resume_matches(corpus, tmp_path, **fields) -> None:
    """Steps 5..8 resumed from the step-4 checkpoint equal the uninterrupted run's, bit for bit
    (``fields``: model fields, or ``section__field`` for others)."""
    from postnorm.train.loop import train_and_evaluate
    overrides = {(k if "__" in k else f"model__{k}"): v for k, v in fields.items()}
    config = tiny_config(corpus, tmp_path / "tfds", train__steps=8, train__ckpt_every=4,
                         diag__every=3, **overrides)
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    train_and_evaluate(config, str(full))
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(full / "checkpoints" / "4", resumed / "checkpoints" / "4")
    shutil.copy(full / "config.json", resumed / "config.json")
    train_and_evaluate(config, str(resumed))
    want, got = read_losses(full), read_losses(resumed)
    assert sorted(got) == [5, 6, 7, 8]
    assert all(np.isfinite(v) for v in want.values())
    for step in got:
        assert got[step] == want[step], (step, got[step], want[step])


@pytest.mark.parametrize("model", [
    pytest.param(dict(norm="mixln", mixln_post_fraction=0.5, qk_norm=True),
                 marks=pytest.mark.slow),
    pytest.param(dict(norm="deepnorm"), marks=pytest.mark.slow),
    pytest.param(dict(norm="sandwich"), marks=pytest.mark.slow),
    pytest.param(dict(norm="periln"), marks=pytest.mark.slow),
    pytest.param(dict(norm="b2t", b2t_rescaled_init=True), marks=pytest.mark.slow),
    pytest.param(dict(norm="admin"), marks=pytest.mark.slow),  # the resume does not re-profile
    pytest.param(dict(norm="post", residual_budget="penalty", residual_budget_c=0.95),
                 marks=pytest.mark.slow),
    pytest.param(dict(norm="post", residual_budget="scale"), marks=pytest.mark.slow),
    pytest.param(dict(norm="post", init_tsim_target=0.3), marks=pytest.mark.slow),
    pytest.param(dict(norm="adaptive", train__placement_c_min=0.99, train__placement_rate_down=0.3),
                 marks=pytest.mark.slow),
], ids=lambda m: "-".join(f"{v}" for v in m.values()))
def test_a_method_resumes_bitwise(corpus, tmp_path, model):
    resume_matches(corpus, tmp_path, **model)


ADMIN = dict(**TINY, n_layers=3, norm="admin")


def admin_reference(spec: ModelSpec, params: dict, tokens_BxL, profile: bool = False):
    return ref.admin_forward(jax.tree.map(np.asarray, params), np.asarray(tokens_BxL),
                             n_layers=spec.n_layers, n_heads=spec.n_heads,
                             positions=spec.positions, eps=spec.norm_eps,
                             rope_base=spec.rope_base, tie=spec.tie_embeddings, profile=profile)


def random_omegas(params: dict, seed: int) -> dict:
    """Every ``admin_omega`` drawn from U(0.5, 2.5) per feature: at init they are all 1."""
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map_with_path(
        lambda path, x: (jnp.asarray(rng.uniform(0.5, 2.5, x.shape), x.dtype)
                         if getattr(path[-1], "key", None) == "admin_omega" else x), params)


def random_tokens(spec: ModelSpec, batch: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, spec.vocab_size, size=(batch, spec.max_len))


@pytest.mark.parametrize("qk_norm,positions,tie", [(False, "rope", False),
                                                   (True, "learned", True)])
def test_admin_matches_the_numpy_forward(qk_norm, positions, tie):
    """X <- N(omega * X + F(X)) with each norm's own per-feature omega and gain (random, so that
    one applied at the wrong sublayer or feature shows), no final norm."""
    spec = ModelSpec(**ADMIN, qk_norm=qk_norm, positions=positions, tie_embeddings=tie)
    params = random_omegas(random_gains(init_params(spec, 3), 4), 5)
    assert "final_norm" not in params
    tokens = random_tokens(spec, 2)
    logits = np.asarray(Decoder(spec).apply({"params": params}, jnp.asarray(tokens)))
    np.testing.assert_allclose(logits, admin_reference(spec, params, tokens), rtol=1e-4,
                               atol=1e-4)


def test_admin_profiling_sets_omega_by_the_released_rule():
    """The profiled omega equals the released code's rule computed in numpy on the same batch
    (omega_1 = 1, then sqrt(var(omega X) + var(F)) over every entry of the batch, the forward
    using each omega as it is set), at every feature; nothing else changes, and the profiled
    decoder is the numpy forward with those omegas. lecun_normal init, so that the branch
    variances move omega well away from 1; learned positions, so that the embedding's variance
    is not 1."""
    spec = ModelSpec(**{**ADMIN, "n_layers": 4}, init="lecun_normal", positions="learned")
    params = random_gains(init_params(spec, 0), 1)
    tokens = random_tokens(spec, 3, seed=2)
    profiled = jax.jit(profiled_params, static_argnums=0)(spec, params, jnp.asarray(tokens))
    _, want_Lx2 = admin_reference(spec, params, tokens, profile=True)
    assert want_Lx2[0, 0] == 1 and want_Lx2[-1, 1] > 1.5
    for sub, name in enumerate(("attn", "ffn")):
        got_LxD = np.asarray(profiled["layers"][f"norm_{name}"]["admin_omega"])
        np.testing.assert_allclose(got_LxD, np.repeat(want_Lx2[:, sub, None], spec.d_model, 1),
                                   rtol=1e-5)
    unchanged = jax.tree_util.tree_leaves_with_path(params)
    for (path, before), after in zip(unchanged, jax.tree.leaves(profiled), strict=True):
        if getattr(path[-1], "key", None) != "admin_omega":
            np.testing.assert_array_equal(before, after)
    np.testing.assert_allclose(
        np.asarray(Decoder(spec).apply({"params": profiled}, jnp.asarray(tokens))),
        admin_reference(spec, profiled, tokens), rtol=1e-4, atol=1e-4)


def test_admin_profiling_is_deterministic_and_refuses_other_arrangements():
    spec = ModelSpec(**ADMIN)
    params, tokens = init_params(spec), jnp.asarray(random_tokens(spec, 2))
    first, again = (profiled_params(spec, params, tokens) for _ in range(2))
    jax.tree.map(np.testing.assert_array_equal, first, again)
    with pytest.raises(ValueError, match="has no profiling pass"):
        profiled_params(ModelSpec(**{**ADMIN, "norm": "post"}), params, tokens)


def test_admin_mean_field_tracks_a_profiled_stack():
    """Admin's Gram maps (omega tracked as the profiling pass sets it, variances as mean squares)
    against the decoder profiled on its own batch, with uniform attention (the recursion's
    assumption): tsim after every sublayer, mean over 3 weight draws, within 15%; Post-Norm's
    maps (omega = 1) are 40% off by the last layer. Distinct tokens per sequence, so that the
    input Gram is about the identity."""
    n, d, n_layers = 64, 128, 24
    spec = ModelSpec(vocab_size=1024, max_len=n, n_layers=n_layers, d_model=d, n_heads=4,
                     d_ff=3 * d, norm="admin", positions="none", init="lecun_normal")
    probes = zero_probes(n_layers)

    @jax.jit
    def measured_tsim(params, tokens_BxL):
        with monte_carlo.attention_mode("uniform"):
            profiled = profiled_params(spec, params, tokens_BxL)
            _, stats = Decoder(spec).apply({"params": profiled}, tokens_BxL, probes=probes)
        after_ffn = jnp.append(stats["tsim_attn"][1:], stats["tsim_final"])
        return jnp.stack([stats["tsim_ffn"], after_ffn], 1)

    rng = np.random.default_rng(0)
    measured = [measured_tsim(init_params(spec, seed), jnp.asarray(
        np.stack([rng.permutation(spec.vocab_size)[:n] for _ in range(8)])))
        for seed in range(3)]
    amt = theory.amounts(d, 3 * d, spec.init)
    admin = theory.mean_field_recursion(np.eye(n), n_layers, amt,
                                        PLACEMENTS["admin"].gram_maps(spec)).tsim_after
    post = theory.mean_field_recursion(np.eye(n), n_layers, amt, theory.POST_GRAM).tsim_after
    mean_Lx2 = np.mean(measured, 0)
    np.testing.assert_allclose(mean_Lx2, admin, rtol=0.15)
    assert post[-1, 1] > 1.4 * mean_Lx2[-1, 1]


def test_admin_validates_as_a_model_norm():
    config = get_config()
    config.model.norm = "admin"
    check_model(config)
    config.model.residual_budget = "scale"
    with pytest.raises(ConfigError, match="does not allow"):
        check_model(config)


def test_a_fresh_admin_run_profiles_its_first_training_batch(corpus, tmp_path):
    """``initial_state`` sets omega by the profiling pass on the batch step 1 trains on, and
    leaves the data iterator there."""
    config = tiny_config(corpus, tmp_path / "tfds", model__norm="admin")
    exp = experiment.build_experiment(config)
    batches = experiment.train_iterator(exp)
    state = experiment.initial_state(exp, batches)
    first = next(batches)
    np.testing.assert_array_equal(first["inputs"], next(experiment.train_iterator(exp))["inputs"])
    want = profiled_params(exp.spec, exp.steps.init(config.seed).params, first["inputs"])
    for name in ("norm_attn", "norm_ffn"):
        omega_LxD = np.asarray(state.params["layers"][name]["admin_omega"])
        assert np.any(omega_LxD != 1)  # profiled: not the placeholder 1
        np.testing.assert_allclose(omega_LxD, np.asarray(want["layers"][name]["admin_omega"]),
                                   rtol=1e-6)
