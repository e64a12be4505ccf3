"""The objective's regularisers: the z-loss and the position diversity D against numpy, the
objective CE - w min(D, cap) + z log Z^2 they build, the parts the steps log, and the collapse
rule's cross-entropy (the fields they refuse: tests/train/test_validate.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.default import get_config
from postnorm.analysis.collapse import train_loss_and_floor
from postnorm.model import ModelSpec
from postnorm.runtime.mesh import make_mesh
from postnorm.sweep.record import objective_parts
from postnorm.train.losses import TERM_NAMES, make_loss, position_diversity, z_loss
from postnorm.train.optim import make_optimizer
from postnorm.train.programs import compile_steps


def numpy_log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def numpy_diversity(logits_BxLxV: np.ndarray) -> float:
    """(1/n) sum_i KL(q_i || q_bar) per sequence, averaged over sequences, in float64."""
    q = np.exp(numpy_log_softmax(logits_BxLxV.astype(np.float64)))
    values = []
    for q_LxV in q:
        q_bar = q_LxV.mean(0)
        values.append(np.mean([np.sum(qi * (np.log(qi) - np.log(q_bar))) for qi in q_LxV]))
    return float(np.mean(values))


def numpy_cross_entropy(logits: np.ndarray, targets: np.ndarray) -> float:
    log_q = numpy_log_softmax(logits.astype(np.float64))
    return float(-np.take_along_axis(log_q, targets[..., None], -1).mean())


@pytest.fixture(scope="module")
def logits_and_targets():
    rng = np.random.default_rng(0)
    logits = (3 * rng.standard_normal((3, 7, 11))).astype(np.float32)
    return logits, rng.integers(0, 11, size=(3, 7)).astype(np.int32)


def test_z_loss_against_numpy(logits_and_targets):
    logits, targets = logits_and_targets
    want = np.mean(np.log(np.exp(logits.astype(np.float64)).sum(-1)) ** 2)
    got = z_loss(jnp.asarray(logits), jnp.asarray(targets), {})
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_position_diversity_against_numpy(logits_and_targets):
    logits, targets = logits_and_targets
    got = position_diversity(jnp.asarray(logits), jnp.asarray(targets), {})
    np.testing.assert_allclose(got, numpy_diversity(logits), rtol=1e-5)


def test_position_diversity_is_zero_for_one_distribution_and_log_n_for_distinct_ones():
    """A collapsed network's predictions (one distribution at every position) have D = 0;
    n near-one-hot predictions on n distinct tokens have D -> log n, its maximum."""
    same = np.tile(np.random.default_rng(1).standard_normal(11), (2, 7, 1)).astype(np.float32)
    assert float(position_diversity(jnp.asarray(same), None, {})) == pytest.approx(0, abs=1e-6)
    distinct = np.full((2, 7, 11), -30.0, np.float32)
    distinct[:, np.arange(7), np.arange(7)] = 30.0
    np.testing.assert_allclose(position_diversity(jnp.asarray(distinct), None, {}), np.log(7),
                               rtol=1e-5)


def test_position_diversity_has_no_gradient_at_a_collapsed_prediction():
    """D's minimum (0) is where every position predicts alike, so its gradient vanishes there
    and grows with the distance from it: the regulariser pushes a network towards diversity
    only as far as its predictions already differ (central differences in float64, and jax)."""
    rng = np.random.default_rng(2)
    base = np.tile(rng.standard_normal(11), (1, 7, 1))
    direction = rng.standard_normal((1, 7, 11))

    def grad_norm(logits, h=1e-5):
        grad = np.zeros_like(logits)
        for index in np.ndindex(logits.shape):
            step = np.zeros_like(logits)
            step[index] = h
            grad[index] = (numpy_diversity(logits + step)
                           - numpy_diversity(logits - step)) / (2 * h)
        return np.linalg.norm(grad)

    norms = [grad_norm(base + eps * direction) for eps in (0.0, 1e-2, 1e-1)]
    assert norms[0] < 1e-8
    assert norms[1] == pytest.approx(norms[2] / 10, rel=0.05)  # linear in the distance
    at_collapse = jax.grad(lambda x: position_diversity(x, None, {}))(
        jnp.asarray(base, jnp.float32))
    assert float(jnp.linalg.norm(at_collapse)) < 1e-6


@pytest.mark.parametrize("weight,cap", [(0.3, 10.0), (0.3, 0.05)])
def test_the_objective_subtracts_the_capped_diversity_and_adds_the_z_loss(
        logits_and_targets, weight, cap):
    logits, targets = logits_and_targets
    config = get_config(f"opt.diversity_weight={weight},opt.diversity_cap={cap},opt.z_loss=1e-3")
    objective, parts = make_loss(config)(jnp.asarray(logits), jnp.asarray(targets))
    ce, d = numpy_cross_entropy(logits, targets), numpy_diversity(logits)
    z = np.mean(np.log(np.exp(logits.astype(np.float64)).sum(-1)) ** 2)
    assert d > 0.05  # the second case's cap binds
    np.testing.assert_allclose(parts["ce"], ce, rtol=1e-5)
    np.testing.assert_allclose(parts["diversity"], d, rtol=1e-5)  # logged uncapped
    np.testing.assert_allclose(parts["z_loss"], z, rtol=1e-5)
    np.testing.assert_allclose(objective, ce - weight * min(d, cap) + 1e-3 * z, rtol=1e-5)
    # past the cap the diversity term has no gradient
    grad = jax.grad(lambda lg: make_loss(config)(lg, jnp.asarray(targets))[0])(jnp.asarray(logits))
    grad_ce_z = jax.grad(lambda lg: make_loss(get_config("opt.z_loss=1e-3"))(
        lg, jnp.asarray(targets))[0])(jnp.asarray(logits))
    assert np.isfinite(grad).all()
    assert np.allclose(grad, grad_ce_z, atol=1e-7) == (cap < d)


@pytest.mark.parametrize("program", ["train", pytest.param("diag", marks=pytest.mark.slow)])
def test_the_steps_log_each_part_of_a_regularised_objective(program):
    """The train and diagnostic steps log train/ce, train/diversity and train/z_loss beside
    train/loss (the objective), and the plain objective logs train/loss alone."""
    config = get_config("layers=2,model.attention=einsum,opt.diversity_weight=0.5,"
                        "opt.z_loss=1e-2")
    config.model.d_model, config.model.n_heads, config.model.d_ff = 16, 2, 24
    spec = ModelSpec.from_config(config.model, vocab_size=32, max_len=16)
    tx, schedule = make_optimizer(config.opt, 10)
    mesh = make_mesh(config.mesh, jax.devices()[:1])
    tokens = np.random.default_rng(0).integers(0, 32, size=(2, 17)).astype(np.int32)
    batch = {"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:])}
    steps = compile_steps(spec, tx, schedule, mesh, make_loss(config))
    state = steps.init(0)
    logits = state.apply_fn({"params": state.params}, batch["inputs"])
    _, want = make_loss(config)(logits, batch["targets"])
    metrics = getattr(steps, program)(state, batch)[1]
    for name in ("ce", "diversity", "z_loss"):
        np.testing.assert_allclose(metrics[f"train/{name}"], want[name], rtol=1e-5)
    np.testing.assert_allclose(metrics["train/loss"], want["ce"] - 0.5 * min(
        float(want["diversity"]), 1.0) + 1e-2 * want["z_loss"], rtol=1e-5)
    plain = compile_steps(spec, tx, schedule, mesh, make_loss(get_config()))
    plain_metrics = getattr(plain, program)(plain.init(0), batch)[1]
    assert "train/loss" in plain_metrics
    assert not any(k.startswith(("train/ce", "train/diversity", "train/z_loss"))
                   for k in plain_metrics)


def test_the_collapse_rule_reads_the_cross_entropy_where_it_is_logged():
    records = [{"step": 1, "train/loss": 5.0, "train/lfreq": 6.0},
               {"step": 2, "train/loss": 4.0, "train/ce": 4.5, "train/lfreq": 6.0}]
    assert train_loss_and_floor(records) == [(1, 5.0, 6.0), (2, 4.5, 6.0)]


def test_a_run_record_keeps_each_part_of_the_objective_over_the_last_steps():
    """``objective_parts``: per part the mean of its last ``tail`` logged values; none for a
    plain objective. ``TERM_NAMES`` are the terms the objective can have."""
    rng = np.random.default_rng(0)
    ce, d = rng.uniform(4, 6, 7), rng.uniform(0, 1, 7)
    records = [{"step": s, "train/loss": c - 0.1 * x, "train/ce": c, "train/diversity": x}
               for s, (c, x) in enumerate(zip(ce, d, strict=True), 1)]
    records.insert(3, {"step": 3, "eval/loss": 5.0})
    assert objective_parts(records, tail=3) == pytest.approx(
        {"ce": ce[-3:].sum() / 3, "diversity": d[-3:].sum() / 3}, rel=1e-12)
    assert objective_parts([{"step": 1, "train/loss": 5.0}], tail=3) == {}
    every_term = get_config("opt.diversity_weight=0.1,opt.z_loss=1e-4,"
                            "model.residual_budget=penalty")
    assert sorted(t.name for t in make_loss(every_term).terms) == sorted(TERM_NAMES)
