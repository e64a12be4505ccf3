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

from postnorm.model import PLACEMENTS, Decoder, ModelSpec
from postnorm.model.placements import deepnorm_alpha, deepnorm_beta, mixln_post_layers
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


@pytest.mark.parametrize("norm", sorted(PLACEMENTS))
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
    pytest.param(dict(norm="post", residual_budget="penalty", residual_budget_c=0.95),
                 marks=pytest.mark.slow),
    pytest.param(dict(norm="post", residual_budget="scale"), marks=pytest.mark.slow),
    pytest.param(dict(norm="post", init_tsim_target=0.3), marks=pytest.mark.slow),
    pytest.param(dict(norm="adaptive", train__placement_c_min=0.99, train__placement_rate_down=0.3),
                 marks=pytest.mark.slow),
], ids=lambda m: "-".join(f"{v}" for v in m.values()))
def test_a_method_resumes_bitwise(corpus, tmp_path, model):
    resume_matches(corpus, tmp_path, **model)
