"""Model tests: shapes, parameter count, causality, numpy reference forward, sublayers, init."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from postnorm.model import Decoder, ModelSpec, param_counts
from postnorm.model.initializers import embedding_init, kernel_init
from postnorm.model.layers import CausalSelfAttention, RMSNorm, SwiGLU, causal_attention_weights
from postnorm.theory import INIT_SCHEMES, kernel_variance
from tests import numpy_reference as ref

TINY = dict(vocab_size=50, max_len=12, n_layers=3, d_model=16, n_heads=4, d_ff=24)


def params_by_hand(spec: ModelSpec) -> dict[str, int]:
    """The parameter groups of the architecture, counted from its definition."""
    d, f = spec.d_model, spec.d_ff
    norms_per_layer = 4 if spec.norm in ("mixln", "sandwich", "periln", "adaptive") else 2
    qk = 2 * (d // spec.n_heads) if spec.qk_norm else 0
    counts = {"embedding": spec.vocab_size * d,
              "layers": spec.n_layers * (4 * d * d + 3 * d * f + norms_per_layer * d + qk)}
    if spec.positions == "learned":
        counts["pos_embedding"] = spec.max_len * d
    if spec.norm == "periln":
        counts["embedding_norm"] = d
    if spec.norm in ("pre", "mixln", "sandwich", "periln", "adaptive"):
        counts["final_norm"] = d
    if not spec.tie_embeddings:
        counts["lm_head"] = d * spec.vocab_size
    return {**counts, "total": sum(counts.values())}


def init_params(spec: ModelSpec, seed: int = 0):
    tokens = jnp.zeros((1, spec.max_len), jnp.int32)
    return nn.unbox(jax.jit(Decoder(spec).init)(jax.random.key(seed), tokens)["params"])


NORMS_QK = [("post", False), ("pre", False), ("deepnorm", True), ("mixln", False),
            ("sandwich", True), ("periln", False), ("b2t", False), ("adaptive", True)]


def _shape_cases() -> list:
    """Every arrangement with every position scheme and head; by default post in full and each
    other arrangement once (its groups are what differs), the rest with -m slow."""
    cases = []
    for norm, qk_norm in NORMS_QK:
        for positions in ("rope", "learned", "none"):
            for tie in (False, True):
                full = norm == "post" or (positions, tie) == ("learned", False)
                cases.append(pytest.param(norm, qk_norm, positions, tie,
                                          marks=() if full else pytest.mark.slow))
    return cases


@pytest.mark.parametrize("norm,qk_norm,positions,tie", _shape_cases())
def test_shapes_and_param_count(norm, qk_norm, positions, tie):
    spec = ModelSpec(**TINY, norm=norm, positions=positions, tie_embeddings=tie, qk_norm=qk_norm)
    params = init_params(spec)
    counted = param_counts(spec)
    assert counted["total"] == sum(x.size for x in jax.tree.leaves(params))
    assert counted == params_by_hand(spec)
    assert params["layers"]["attn"]["w_q"].shape == (3, 16, 16)
    assert params["layers"]["ffn"]["w_down"].shape == (3, 24, 16)
    tokens = jnp.arange(2 * 12).reshape(2, 12) % 50
    assert Decoder(spec).apply({"params": params}, tokens).shape == (2, 12, 50)


def test_paper_param_count():
    spec = ModelSpec(vocab_size=32128, max_len=2048, n_layers=48, d_model=512, n_heads=4,
                     d_ff=1536, tie_embeddings=True)
    counts = param_counts(spec)
    assert counts == params_by_hand(spec)
    assert counts["layers"] == 48 * (4 * 512**2 + 3 * 512 * 1536 + 2 * 512)
    assert 175e6 < counts["total"] < 185e6


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_causal_gradients_through_positions(norm):
    """d logits_i / d pos_embedding_j is zero for every j > i (and nonzero for j <= i)."""
    spec = ModelSpec(**TINY, norm=norm, positions="learned")
    params = init_params(spec)
    tokens = jnp.arange(12)[None] % 50
    model = Decoder(spec)
    for i in (0, 5, 11):
        def logit_sum(pos, i=i):
            p = {**params, "pos_embedding": pos}
            return model.apply({"params": p}, tokens)[0, i].sum()
        grad_LxD = jax.grad(logit_sum)(params["pos_embedding"])
        norms = np.linalg.norm(np.asarray(grad_LxD), axis=1)
        assert np.all(norms[i + 1:] == 0.0)
        assert np.all(norms[: i + 1] > 0.0)


def test_causal_token_perturbation_rope():
    spec = ModelSpec(**TINY, norm="post", positions="rope")
    params = init_params(spec)
    model = Decoder(spec)
    tokens = jnp.arange(12)[None] % 50
    base = model.apply({"params": params}, tokens)
    changed = model.apply({"params": params}, tokens.at[0, 7].set(42))
    np.testing.assert_array_equal(base[0, :7], changed[0, :7])
    assert not np.allclose(base[0, 7:], changed[0, 7:])


@pytest.mark.parametrize("norm", ["post", "pre"])
@pytest.mark.parametrize("positions,tie", [("rope", False), ("learned", True), ("none", False)])
def test_matches_numpy_forward(norm, positions, tie):
    """Against the float64 numpy forward, with random norm gains (at init they are all 1, which
    would hide a gain applied at the wrong norm)."""
    spec = ModelSpec(**TINY, norm=norm, positions=positions, tie_embeddings=tie)
    rng = np.random.default_rng(4)
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: (jnp.asarray(rng.uniform(0.5, 1.5, x.shape), x.dtype)
                         if getattr(path[-1], "key", None) == "scale" else x),
        init_params(spec, seed=3))
    tokens = np.random.default_rng(0).integers(0, 50, size=(2, 12))
    logits = np.asarray(Decoder(spec).apply({"params": params}, jnp.asarray(tokens)))
    for b in range(2):
        expected = ref.forward(jax.tree.map(np.asarray, params), tokens[b], n_layers=3,
                               n_heads=4, norm=norm, positions=positions, eps=spec.norm_eps,
                               rope_base=spec.rope_base, tie=tie)
        np.testing.assert_allclose(logits[b], expected, rtol=1e-4, atol=1e-4)


def test_rms_norm_unit():
    y = np.random.default_rng(1).normal(size=(2, 3, 8)).astype(np.float32) * 5
    scale = np.linspace(0.5, 2.0, 8).astype(np.float32)
    out = RMSNorm(eps=1e-6).apply({"params": {"scale": scale}}, jnp.asarray(y))
    np.testing.assert_allclose(out, ref.rms_norm(y.astype(np.float64), scale, 1e-6), rtol=1e-5)
    unit = RMSNorm(eps=0.0).apply({"params": {"scale": np.ones(8, np.float32)}}, jnp.asarray(y))
    np.testing.assert_allclose(np.sqrt(np.mean(np.square(unit), -1)), 1.0, rtol=1e-5)


def test_rms_norm_eps_sits_inside_the_square_root():
    """eps comparable to mean(y^2), where its placement matters (at 1e-6 it cannot)."""
    y = np.random.default_rng(2).normal(size=(2, 3, 8)).astype(np.float32) * 0.3
    scale = np.linspace(0.5, 2.0, 8).astype(np.float32)
    out = RMSNorm(eps=0.1).apply({"params": {"scale": scale}}, jnp.asarray(y))
    np.testing.assert_allclose(out, ref.rms_norm(y.astype(np.float64), scale, 0.1), rtol=1e-5)


def test_swiglu_unit():
    module = SwiGLU(d_ff=12, init_scheme="lecun_normal", dtype=jnp.float32)
    x = jax.random.normal(jax.random.key(0), (2, 5, 8))
    params = nn.unbox(module.init(jax.random.key(1), x)["params"])
    expected = ref.swiglu(np.asarray(x, np.float64),
                          {k: np.asarray(v, np.float64) for k, v in params.items()})
    np.testing.assert_allclose(module.apply({"params": params}, x), expected, rtol=1e-5,
                               atol=1e-6)


def test_attention_is_causal_softmax_and_uniform_on_identical_tokens():
    q = jax.random.normal(jax.random.key(0), (1, 6, 2, 4))
    k = jax.random.normal(jax.random.key(1), (1, 6, 2, 4))
    probs = np.asarray(causal_attention_weights(q, k))
    np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-6)
    assert np.all(np.triu(probs[0, 0], k=1) == 0)
    same_k = jnp.broadcast_to(k[:, :1], k.shape)  # identical keys -> prefix averaging P
    uniform = np.asarray(causal_attention_weights(q, same_k))[0, 0]
    np.testing.assert_allclose(uniform, np.tril(np.ones((6, 6))) / np.arange(1, 7)[:, None],
                               rtol=1e-6)


@pytest.mark.parametrize("scheme", INIT_SCHEMES)
def test_init_variance(scheme):
    fan_in, fan_out = 512, 1536
    w = np.asarray(kernel_init(scheme)(jax.random.key(0), (fan_in, fan_out), jnp.float32))
    expected = kernel_variance(scheme, fan_in, fan_out)
    # The sample variance of 786k iid entries has relative std ~ sqrt(2/N) < 0.2%.
    np.testing.assert_allclose(w.var(), expected, rtol=0.01)
    assert abs(w.mean()) < 5 * np.sqrt(expected / w.size)
    if scheme == "torch_default":
        assert np.abs(w).max() <= 1 / np.sqrt(fan_in)


@pytest.mark.parametrize("scheme", INIT_SCHEMES)
def test_layers_are_initialised_independently_with_the_schemes_variance(scheme):
    """Every stacked layer weight: its own draw (no correlation between layers) with the
    scheme's variance for its fan-in and fan-out."""
    spec = ModelSpec(**{**TINY, "n_layers": 4, "d_model": 64, "d_ff": 96}, init=scheme)
    params = init_params(spec)
    for group in ("attn", "ffn"):
        for name, w in params["layers"][group].items():
            w_Lxrest = np.asarray(w, np.float64).reshape(w.shape[0], -1)
            between = np.corrcoef(w_Lxrest)[np.triu_indices(w.shape[0], 1)]
            assert np.abs(between).max() < 0.1, (name, between)  # ~0.02 if independent
            np.testing.assert_allclose(w_Lxrest.var(1), kernel_variance(scheme, *w.shape[1:]),
                                       rtol=0.15, err_msg=name)


@pytest.mark.parametrize("scheme", INIT_SCHEMES)
def test_embedding_std(scheme):
    w = np.asarray(embedding_init(scheme)(jax.random.key(0), (1000, 256), jnp.float32))
    np.testing.assert_allclose(w.std(), 0.02 if scheme == "normal_0.02" else 1.0, rtol=0.01)


def test_bounded_init_schemes_respect_their_support():
    """xavier is uniform on +-sqrt(6 / (fan_in + fan_out)); lecun_normal is truncated at two
    standard deviations of the untruncated normal it rescales."""
    fan_in, fan_out = 512, 1536
    xavier = np.asarray(kernel_init("xavier")(jax.random.key(0), (fan_in, fan_out), jnp.float32))
    assert np.abs(xavier).max() <= np.sqrt(6 / (fan_in + fan_out))
    assert np.abs(xavier).max() > 0.99 * np.sqrt(6 / (fan_in + fan_out))
    lecun = np.asarray(kernel_init("lecun_normal")(jax.random.key(0), (fan_in, fan_out),
                                                   jnp.float32))
    assert np.abs(lecun).max() <= 2 * np.sqrt(1 / fan_in) / 0.87962566103423978 * (1 + 1e-6)


def test_xavier_normal_is_an_untruncated_normal():
    """DeepNet's draw (torch.nn.init.xavier_normal_): N(0, 2 / (fan_in + fan_out)), so the
    share of entries beyond two standard deviations is the normal's 4.55%, not 0."""
    fan_in, fan_out = 512, 1536
    w = np.asarray(kernel_init("xavier_normal")(jax.random.key(0), (fan_in, fan_out),
                                                jnp.float32))
    beyond = np.mean(np.abs(w) > 2 * np.sqrt(2 / (fan_in + fan_out)))
    assert abs(beyond - 0.0455) < 0.002


def test_attention_energy_on_identical_tokens_is_s():
    """With identical tokens attention is x W_V W_O, so E||Attn(X)||^2/||X||^2 = d^2 s_V^2 s_O^2."""
    d, n = 128, 8
    module = CausalSelfAttention(n_heads=4, init_scheme="torch_default", positions="rope",
                                 rope_base=1e4, dtype=jnp.float32)
    ratios = []
    for seed in range(32):
        x_D = jax.random.normal(jax.random.key(1000 + seed), (d,))
        x_1xNxD = jnp.broadcast_to(x_D, (1, n, d))
        params = module.init(jax.random.key(seed), x_1xNxD)
        out = module.apply(params, x_1xNxD)
        ratios.append(float(jnp.sum(out**2) / jnp.sum(x_1xNxD**2)))
    s = d**2 * kernel_variance("torch_default", d, d) ** 2
    np.testing.assert_allclose(np.mean(ratios), s, rtol=0.1)


@functools.partial(jax.jit, static_argnums=0)
def _loss_and_grads(spec: ModelSpec, params, tokens):
    def loss(p):
        logits = Decoder(spec).apply({"params": p}, tokens[:, :-1])
        return jnp.mean(jax.nn.logsumexp(logits, -1)
                        - jnp.take_along_axis(logits, tokens[:, 1:, None], -1)[..., 0])
    return jax.value_and_grad(loss)(params)


@functools.cache
def _plain_model_loss_and_grads(norm: str):
    """The plain model's parameters, tokens, loss and gradients: the variants' reference."""
    plain = ModelSpec(**{**TINY, "max_len": 11}, norm=norm)
    params = init_params(plain)
    tokens = jax.random.randint(jax.random.key(3), (2, 12), 0, 50)
    return params, tokens, *_loss_and_grads(plain, params, tokens)


VARIANTS = [dict(remat="dots"), dict(remat="dots_no_batch"), dict(remat="full"),
            dict(attention="xla"), dict(attention="blocked", attention_block=3),
            dict(attention="blocked", attention_block=4, remat="full"), dict(scan_unroll=3),
            dict(scan_unroll=2, remat="dots"), dict(attention="xla", remat="dots"),
            dict(attention="cpu"), dict(attention="cpu", remat="full"),
            dict(attention="cpu", remat="dots", scan_unroll=3)]
# By default Post-Norm with every remat policy, kernel and unrolling at least once, Pre-Norm with
# two combined variants (blocked + full remat, cpu + dots + unroll); every pair with -m slow
DEFAULT_VARIANTS = {"post": (1, 2, 5, 7, 8, 9, 11), "pre": (5, 11)}


@pytest.mark.parametrize("norm,variant", [
    pytest.param(norm, v, marks=() if i in DEFAULT_VARIANTS[norm] else pytest.mark.slow)
    for norm in ("post", "pre") for i, v in enumerate(VARIANTS)])
def test_remat_attention_kernels_and_unrolling_do_not_change_the_function(norm, variant):
    """Every remat policy, attention kernel and unroll gives the plain model's loss and grads."""
    params, tokens, loss, grads = _plain_model_loss_and_grads(norm)
    other_loss, other_grads = _loss_and_grads(ModelSpec(**{**TINY, "max_len": 11}, norm=norm,
                                                        **variant), params, tokens)
    np.testing.assert_allclose(other_loss, loss, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(other_grads), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6 * float(jnp.abs(b).max()))


def test_bfloat16_compute_keeps_float32_params_and_tracks_float32():
    spec = ModelSpec(**TINY, dtype="bfloat16")
    params = init_params(spec)
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
    tokens = jax.random.randint(jax.random.key(4), (2, 12), 0, 50)
    logits_bf16 = Decoder(spec).apply({"params": params}, tokens)
    logits_f32 = Decoder(ModelSpec(**TINY)).apply({"params": params}, tokens)
    assert logits_bf16.dtype == jnp.float32
    rel = float(jnp.linalg.norm(logits_bf16 - logits_f32) / jnp.linalg.norm(logits_f32))
    assert 0 < rel < 0.05
