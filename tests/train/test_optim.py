"""The optimizer and its schedule against float64 numpy AdamW and SGD with momentum written from
the definitions."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from postnorm.train.optim import make_optimizer


def numpy_lr(opt: ml_collections.ConfigDict, total_steps: int, step: int) -> float:
    """Linear warmup from 0, then cosine from lr to lr * min_lr_ratio over the remaining steps
    (held there after them), or constant."""
    if step < opt.warmup_steps:
        return opt.lr * step / opt.warmup_steps
    if opt.schedule == "constant":
        return opt.lr
    frac = min((step - opt.warmup_steps) / (total_steps - opt.warmup_steps), 1.0)
    cosine = 0.5 * (1 + np.cos(np.pi * frac))
    return opt.lr * ((1 - opt.min_lr_ratio) * cosine + opt.min_lr_ratio)


# Leaves named as in the model; the weight matrices always decay, the gains and embeddings only
# with opt.decay_norms_and_embeddings.
SHAPES = {"embedding": (5, 4), "pos_embedding": (3, 4), "lm_head": (4, 5),
          "layers": {"attn": {"w_q": (2, 4, 4)}, "norm_attn": {"scale": (2, 4)}}}
ALWAYS_DECAYS = {"embedding": False, "pos_embedding": False, "lm_head": True,
                 "layers": {"attn": {"w_q": True}, "norm_attn": {"scale": False}}}


@pytest.mark.parametrize("grad_scale", [3.0, 3e-9])
@pytest.mark.parametrize("decay_all", [False, True])
@pytest.mark.parametrize("schedule,clip", [("cosine", 1.0), ("constant", 0.0)])
def test_optimizer_matches_numpy_adamw(decay_all, schedule, clip, grad_scale):
    """Global-norm clipping, bias-corrected moments with eps outside the square root, decoupled
    weight decay on the masked leaves, and the schedule, for two steps past its end. Gradients
    of order 1e-9, as in collapsed layers, are below eps = 1e-8: there eps outside the root
    gives updates of order 0.1, where eps inside it would give 1e-5."""
    opt = ml_collections.ConfigDict(dict(
        optimizer="adamw", momentum=0.9, lr=1e-2, schedule=schedule, warmup_steps=3,
        min_lr_ratio=0.1, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1,
        decay_norms_and_embeddings=decay_all, clip_norm=clip))
    total = 8
    tx, schedule_fn = make_optimizer(opt, total)
    rng = np.random.default_rng(0)
    is_shape = lambda s: isinstance(s, tuple)  # noqa: E731
    params = jax.tree.map(lambda s: jnp.asarray(rng.normal(size=s), jnp.float32), SHAPES,
                          is_leaf=is_shape)
    decays = jax.tree.map(lambda always: always or decay_all, ALWAYS_DECAYS)
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    m = jax.tree.map(np.zeros_like, p)
    v = jax.tree.map(np.zeros_like, p)
    state = tx.init(params)
    for t in range(1, total + 3):
        lr = numpy_lr(opt, total, t - 1)
        assert float(schedule_fn(t - 1)) == pytest.approx(lr, rel=1e-6, abs=1e-12)
        grads = jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape) * grad_scale,
                                                 jnp.float32),
                             params)
        g = jax.tree.map(lambda a: np.asarray(a, np.float64), grads)
        if clip > 0:
            norm = np.sqrt(sum(np.sum(x**2) for x in jax.tree.leaves(g)))
            g = jax.tree.map(lambda x, norm=norm: x * min(1.0, clip / norm), g)
        m = jax.tree.map(lambda m_, g_: opt.b1 * m_ + (1 - opt.b1) * g_, m, g)
        v = jax.tree.map(lambda v_, g_: opt.b2 * v_ + (1 - opt.b2) * g_**2, v, g)
        p = jax.tree.map(
            lambda p_, m_, v_, d_, lr=lr, t=t: p_ - lr * (
                (m_ / (1 - opt.b1**t)) / (np.sqrt(v_ / (1 - opt.b2**t)) + opt.eps)
                + opt.weight_decay * d_ * p_),
            p, m, v, decays)
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(p), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6, err_msg=f"step {t}")


@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_sgd_with_momentum_matches_numpy(clip):
    """The control optimizer: m <- momentum m + g + wd * w (on the masked leaves), w <- w - lr m,
    after global-norm clipping of g, under the same schedule."""
    opt = ml_collections.ConfigDict(dict(
        optimizer="sgd", momentum=0.8, lr=0.1, schedule="cosine", warmup_steps=2,
        min_lr_ratio=0.1, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1,
        decay_norms_and_embeddings=False, clip_norm=clip))
    total = 6
    tx, _ = make_optimizer(opt, total)
    rng = np.random.default_rng(1)
    params = jax.tree.map(lambda s: jnp.asarray(rng.normal(size=s), jnp.float32), SHAPES,
                          is_leaf=lambda s: isinstance(s, tuple))
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    m = jax.tree.map(np.zeros_like, p)
    state = tx.init(params)
    for t in range(1, total + 2):
        lr = numpy_lr(opt, total, t - 1)
        grads = jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape), jnp.float32), params)
        g = jax.tree.map(lambda a: np.asarray(a, np.float64), grads)
        if clip > 0:
            norm = np.sqrt(sum(np.sum(x**2) for x in jax.tree.leaves(g)))
            g = jax.tree.map(lambda x, norm=norm: x * min(1.0, clip / norm), g)
        m = jax.tree.map(lambda m_, g_, p_, d_: opt.momentum * m_ + g_ + opt.weight_decay * d_
                         * p_, m, g, p, ALWAYS_DECAYS)
        p = jax.tree.map(lambda p_, m_, lr=lr: p_ - lr * m_, p, m)
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(p), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6, err_msg=f"step {t}")
