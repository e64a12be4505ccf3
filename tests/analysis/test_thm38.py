"""Theorem 3.8 measurements (postnorm.analysis.thm38) on a tiny Decoder, against numpy."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from postnorm.analysis import monte_carlo, thm38
from postnorm.data import load_data
from postnorm.data.lfreq import frequency_floor
from postnorm.model import Decoder, ModelSpec
from postnorm.train.experiment import restore_run
from postnorm.train.loop import train_and_evaluate
from tests import numpy_reference as ref
from tests.reliability_helpers import tiny_config, write_corpus

VOCAB, N, D = 16, 32, 16


def tiny(norm: str, **kwargs) -> tuple[ModelSpec, dict]:
    spec = ModelSpec(vocab_size=VOCAB, max_len=N, n_layers=2, d_model=D, n_heads=2, d_ff=32,
                     norm=norm, **kwargs)
    params = nn.unbox(Decoder(spec).init(jax.random.key(1), jnp.zeros((1, N), jnp.int32))
                      ["params"])
    return spec, params


def numpy_rmsnorm(x: np.ndarray, scale: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * scale


def batch(seed: int, size: int = 4) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"inputs": rng.integers(0, VOCAB, (size, N)).astype(np.int32),
            "targets": rng.integers(0, VOCAB, (size, N)).astype(np.int32)}


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_hidden_states_are_the_layer_stack_output_and_give_the_logits(norm):
    spec, params = tiny(norm)
    tokens = batch(0)["inputs"]
    hidden, logits = thm38.hidden_and_logits(spec)(params, tokens)
    stack_out = monte_carlo.LayerStack(spec).apply({"params": {"layers": params["layers"]}},
                                                 params["embedding"][tokens], None)[0]
    expected = np.asarray(stack_out, np.float64)
    if norm == "pre":
        expected = numpy_rmsnorm(expected, np.asarray(params["final_norm"]["scale"]),
                                 spec.norm_eps)
    np.testing.assert_allclose(hidden, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(logits, Decoder(spec).apply({"params": params}, tokens),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        logits, np.asarray(hidden, np.float64) @ thm38.lm_head_matrix(params, spec).T,
        rtol=1e-4, atol=1e-4)


def test_lm_head_matrix_of_a_tied_head_gives_the_logits():
    spec, params = tiny("post", tie_embeddings=True)
    tokens = batch(0)["inputs"]
    hidden, logits = thm38.hidden_and_logits(spec)(params, tokens)
    np.testing.assert_allclose(
        logits, np.asarray(hidden, np.float64) @ thm38.lm_head_matrix(params, spec).T,
        rtol=1e-4, atol=1e-4)


def numpy_bound(hidden_NxD, logits_NxV, targets_N, w_VxD) -> dict[str, float]:
    """Thm 3.8(i) from its definitions, directly in numpy."""
    z = logits_NxV - logits_NxV.max(1, keepdims=True)
    log_p = z - np.log(np.exp(z).sum(1, keepdims=True))
    loss = -log_p[np.arange(N), targets_N].mean()
    p_hat = np.bincount(targets_N, minlength=VOCAB) / N
    lfreq = -np.sum(p_hat[p_hat > 0] * np.log(p_hat[p_hat > 0]))
    eps = np.sqrt(np.sum((hidden_NxD - hidden_NxD.mean(0)) ** 2))
    sigma_max = np.linalg.svd(w_VxD, compute_uv=False)[0]
    tsim = np.sum(hidden_NxD.sum(0) ** 2) / (N * np.sum(hidden_NxD**2))
    return {"loss": loss, "lfreq_seq": lfreq, "eps": eps,
            "bound": lfreq - 2 / np.sqrt(N) * sigma_max * eps, "tsim": tsim}


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_bound_matches_numpy_and_holds(norm):
    spec, params = tiny(norm)
    batches = [batch(1), batch(2)]
    counts_V = np.arange(1, VOCAB + 1, dtype=np.int64)
    out = thm38.measure_bound(spec, params, batches, counts_V)
    w_VxD = np.asarray(params["lm_head"], np.float64).T
    expected, q_sum = [], np.zeros(VOCAB)
    for b in batches:
        hidden, logits = thm38.hidden_and_logits(spec)(params, b["inputs"])
        hidden, logits = np.asarray(hidden, np.float64), np.asarray(logits, np.float64)
        for i in range(len(b["inputs"])):
            expected.append(numpy_bound(hidden[i], logits[i], b["targets"][i], w_VxD))
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        q_sum += (probs / probs.sum(-1, keepdims=True)).sum((0, 1))
    for key in ("loss", "lfreq_seq", "eps", "bound", "tsim"):
        np.testing.assert_allclose(out["per_sequence"][key], [e[key] for e in expected],
                                   rtol=1e-5, err_msg=key)
        np.testing.assert_allclose(out["mean"][key], np.mean([e[key] for e in expected]),
                                   rtol=1e-5, err_msg=key)
    assert (out["n"], out["sequences"]) == (N, 8)
    np.testing.assert_allclose(out["w_lm_spectral_norm"],
                               np.linalg.svd(w_VxD, compute_uv=False)[0], rtol=1e-10)
    assert out["bound_holds_fraction"] == 1.0 and out["min_slack"] > 0
    p, q = counts_V / counts_V.sum(), q_sum / q_sum.sum()
    np.testing.assert_allclose(out["kl_pfreq_qbar"], np.sum(p * np.log(p / q)), rtol=1e-6)
    np.testing.assert_allclose(out["lfreq_corpus"], -np.sum(p * np.log(p)), rtol=1e-12)


def test_collapsed_prediction_kl_and_entropy_of_q_bar_against_numpy():
    """The fully collapsed prediction softmax(W_lm x_bar) per sequence, KL(eval targets' p || q_bar)
    and H(q_bar), q_bar the mean predicted distribution, from the model's hidden states and
    logits in numpy."""
    spec, params = tiny("post")
    batches = [batch(1), batch(2)]
    out = thm38.measure_bound(spec, params, batches,
                                      np.arange(1, VOCAB + 1, dtype=np.int64))
    w_VxD = np.asarray(params["lm_head"], np.float64).T
    shared, q_sum_V, eval_counts_V = [], np.zeros(VOCAB), np.zeros(VOCAB)
    for b in batches:
        hidden, logits = thm38.hidden_and_logits(spec)(params, b["inputs"])
        hidden, logits = np.asarray(hidden, np.float64), np.asarray(logits, np.float64)
        for h_NxD, t_N in zip(hidden, b["targets"], strict=True):
            z_V = w_VxD @ h_NxD.mean(0)
            log_q_V = z_V - z_V.max() - np.log(np.exp(z_V - z_V.max()).sum())
            shared.append(-log_q_V[t_N].mean())
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        q_sum_V += (probs / probs.sum(-1, keepdims=True)).sum((0, 1))
        eval_counts_V += np.bincount(b["targets"].ravel(), minlength=VOCAB)
    np.testing.assert_allclose(out["per_sequence"]["collapsed_prediction_loss"], shared,
                               rtol=1e-6)
    q_V, p_V = q_sum_V / q_sum_V.sum(), eval_counts_V / eval_counts_V.sum()
    seen = p_V > 0
    np.testing.assert_allclose(out["kl_eval_targets_qbar"],
                               np.sum(p_V[seen] * np.log(p_V[seen] / q_V[seen])), rtol=1e-6)
    np.testing.assert_allclose(out["entropy_qbar"], -np.sum(q_V * np.log(q_V)), rtol=1e-6)


def numpy_pfreq_point(spec: ModelSpec, params: dict, targets_BxL: np.ndarray,
                      token_id: int) -> dict:
    """The parameters at the constructed point, from its definition: W_lm = x_bar log(p_hat)^T /
    ||x_bar||^2, x_bar the mean final hidden state of a sequence of ``token_id`` only (an absent
    token's p_hat: ``ABSENT_PROB``)."""
    tokens = np.full_like(targets_BxL, token_id)
    hidden, _ = thm38.hidden_and_logits(spec)(params, tokens)
    x_bar = np.asarray(hidden, np.float64).reshape(-1, spec.d_model).mean(0)
    counts = np.bincount(targets_BxL.ravel(), minlength=spec.vocab_size)
    log_p = np.log(np.maximum(counts / counts.sum(), thm38.ABSENT_PROB))
    return {**params, "lm_head": jnp.asarray(np.outer(x_bar, log_p) / (x_bar @ x_bar),
                                             jnp.float32)}


@pytest.mark.parametrize("norm,targets_from", [
    pytest.param("post", VOCAB, marks=pytest.mark.slow),
    pytest.param("pre", VOCAB, marks=pytest.mark.slow),
    ("post", 5)])
def test_constructed_pfreq_point_is_collapsed_at_lfreq_and_stationary(norm, targets_from):
    """Targets from all ``VOCAB`` tokens, or from 5 of them (most of the vocabulary absent from
    the batch, as in a real batch)."""
    spec, params = tiny(norm)
    b = batch(3, size=2)
    b["targets"] = b["targets"] % targets_from
    out = thm38.stationary_point(spec, params, b["inputs"], b["targets"], token_id=5)
    counts = np.bincount(b["targets"].ravel(), minlength=VOCAB)
    p = counts[counts > 0] / counts.sum()
    np.testing.assert_allclose(out["lfreq_batch"], -np.sum(p * np.log(p)), rtol=1e-12)
    np.testing.assert_allclose(out["loss"], out["lfreq_batch"], rtol=1e-5)
    assert out["hidden_eps_max"] < 1e-4 and out["hidden_tsim_min"] > 1 - 1e-9
    assert out["at_point"]["max_abs_grad"] < 1e-5
    assert out["control"]["max_abs_grad"] > 1e-2
    assert len(out["at_point"]["grad_norm_attn"]) == spec.n_layers
    assert max(out["at_point"]["grad_norm_ffn"]) < 1e-5 < min(out["control"]["grad_norm_ffn"])
    point = numpy_pfreq_point(spec, params, b["targets"], token_id=5)

    def loss(p):
        logits = Decoder(spec).apply({"params": p}, b["inputs"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["targets"]).mean()

    control_loss, grads = jax.value_and_grad(loss)(point)
    np.testing.assert_allclose(out["control_loss"], control_loss, rtol=1e-5)
    for name in ("lm_head", "embedding"):
        np.testing.assert_allclose(out["control"][f"grad_norm_{name}"],
                                   np.linalg.norm(np.asarray(grads[name], np.float64)),
                                   rtol=1e-4, err_msg=name)


def test_constructed_point_unties_a_tied_head():
    """A tied head is replaced by the constructed W_lm (the embedding keeps its trained value):
    the point's loss is L_freq(p_hat), it is stationary, and its control gradient is that of the
    untied network with the same parameters."""
    spec, params = tiny("post", tie_embeddings=True)
    assert "lm_head" not in params
    b = batch(3, size=2)
    b["targets"] = b["targets"] % 5
    out = thm38.stationary_point(spec, params, b["inputs"], b["targets"], token_id=5)
    assert out["untied_head"]
    np.testing.assert_allclose(out["loss"], out["lfreq_batch"], rtol=1e-5)
    assert out["at_point"]["max_abs_grad"] < 1e-5 < 1e-2 < out["control"]["max_abs_grad"]
    point = numpy_pfreq_point(spec, params, b["targets"], token_id=5)  # x_bar: the tied trunk
    untied = dataclasses.replace(spec, tie_embeddings=False)

    def loss(p):
        logits = Decoder(untied).apply({"params": p}, b["inputs"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["targets"]).mean()

    control_loss, grads = jax.value_and_grad(loss)(point)
    np.testing.assert_allclose(out["control_loss"], control_loss, rtol=1e-5)
    np.testing.assert_allclose(out["control"]["grad_norm_embedding"],
                               np.linalg.norm(np.asarray(grads["embedding"], np.float64)),
                               rtol=1e-4)


def test_constructed_point_refuses_learned_positions():
    spec, params = tiny("post", positions="learned")
    b = batch(3)
    assert "identical input tokens" in thm38.point_unavailable(spec)
    with pytest.raises(ValueError, match="learned position embeddings"):
        thm38.stationary_point(spec, params, b["inputs"], b["targets"], token_id=5)


@pytest.mark.slow
def test_next_batches_loss_scores_the_batches_after_the_checkpoint(tmp_path):
    """The loss on the next training batches: the batches that follow the checkpoint's step in
    the run's data order, scored by a numpy forward of the restored parameters."""
    config = tiny_config(write_corpus(tmp_path / "corpus"), tmp_path / "tfds", train__steps=6,
                         train__ckpt_every=6, train__eval_every=100)
    train_and_evaluate(config, str(tmp_path / "run"))
    exp, state, step, batches = restore_run(config, str(tmp_path / "run"), "measure",
                                            data_position=True)
    measured = thm38.next_batches_loss(exp, state, batches, num_batches=3)

    data = load_data(config.data, seed=config.seed)
    order = data.train_iterator(batch_size=config.data.batch_size, seed=config.seed)
    expected = [next(order) for _ in range(step + 3)][step:]
    params = jax.tree.map(np.asarray, jax.device_get(state.params))
    m = config.model
    losses, floors = [], []
    for b in expected:
        token_losses = []
        for tokens_L, targets_L in zip(b["inputs"], b["targets"], strict=True):
            logits = ref.forward(params, tokens_L, n_layers=m.n_layers, n_heads=m.n_heads,
                                 norm=m.norm, positions=m.positions, eps=m.norm_eps,
                                 rope_base=m.rope_base, tie=m.tie_embeddings)
            log_probs = logits - logits.max(-1, keepdims=True)
            log_probs -= np.log(np.exp(log_probs).sum(-1, keepdims=True))
            token_losses.append(-log_probs[np.arange(len(targets_L)), targets_L])
        losses.append(np.mean(token_losses))
        floors.append(frequency_floor(b["targets"], data.unigram_counts))
    assert step == 6 and measured["batches"] == 3
    np.testing.assert_allclose(measured["losses"], losses, rtol=1e-5)
    np.testing.assert_allclose(measured["floors"], floors, rtol=1e-12)
    assert measured["loss"] == pytest.approx(np.mean(losses), rel=1e-5)
    assert measured["loss_over_lfreq"] == pytest.approx(np.mean(losses) / data.lfreq, rel=1e-5)
    assert measured["loss_over_floor"] == pytest.approx(np.mean(losses) / np.mean(floors),
                                                        rel=1e-5)
