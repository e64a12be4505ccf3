"""AdamW (or SGD with momentum, a control for methods that act on gradients) with linear warmup
then cosine or constant learning rate, optional clipping.

Weight decay applies to the weight matrices only; norm gains (Admin's skip weight omega with
them), token and position embeddings are excluded unless ``opt.decay_norms_and_embeddings`` is
set.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import optax

NO_DECAY_NAMES = ("scale", "admin_omega", "embedding", "pos_embedding")
OPTIMIZERS = ("adamw", "sgd")
# what the early-warning monitor may change on a warn (postnorm.train.monitor_actions)
MONITOR_ACTIONS = ("none", "lr_scale", "layer_lr", "clip")


def learning_rate_schedule(opt_cfg: ml_collections.ConfigDict, total_steps: int) -> optax.Schedule:
    """Linear warmup from 0 to ``lr``, then cosine decay to ``lr * min_lr_ratio`` or constant."""
    warmup = optax.linear_schedule(0.0, opt_cfg.lr, max(opt_cfg.warmup_steps, 1))
    if opt_cfg.schedule == "constant":
        after = optax.constant_schedule(opt_cfg.lr)
    else:
        after = optax.cosine_decay_schedule(
            opt_cfg.lr, max(total_steps - opt_cfg.warmup_steps, 1), alpha=opt_cfg.min_lr_ratio)
    return optax.join_schedules([warmup, after], [opt_cfg.warmup_steps])


def weight_decay_mask(params, decay_all: bool):
    """True for leaves that get weight decay."""

    def decays(path, _) -> bool:
        name = getattr(path[-1], "key", str(path[-1]))
        return decay_all or name not in NO_DECAY_NAMES

    return jax.tree_util.tree_map_with_path(decays, params)


class LayerLrState(NamedTuple):
    """Per-layer learning-rate factors (1 until the early-warning monitor changes them)."""

    layer_lr_scale: jax.Array  # float32 [n_layers]


def scale_by_layer(n_layers: int) -> optax.GradientTransformation:
    """Multiplies the updates of the scanned layers (``updates["layers"]``, layer axis first) by
    the state's per-layer factor; the other parameters' updates pass unchanged."""

    def init(params) -> LayerLrState:
        del params
        return LayerLrState(jnp.ones((n_layers,), jnp.float32))

    def update(updates, state: LayerLrState, params=None):
        del params

        def scaled(u: jax.Array) -> jax.Array:
            return u * state.layer_lr_scale.reshape(-1, *(1,) * (u.ndim - 1)).astype(u.dtype)

        return {**updates, "layers": jax.tree.map(scaled, updates["layers"])}, state

    return optax.GradientTransformation(init, update)


class WarnedLrState(NamedTuple):
    """The learning-rate factor the early-warning monitor set (1 until it acts)."""

    warned_lr_scale: jax.Array  # float32 scalar


def scale_when_warned() -> optax.GradientTransformation:
    """Multiplies every update by the state's factor, which starts at 1. Kept apart from
    ``GuardedState.lr_scale`` (the non-finite rollbacks'), so that each mechanism undoes or
    keeps only its own changes."""

    def init(params) -> WarnedLrState:
        del params
        return WarnedLrState(jnp.ones((), jnp.float32))

    def update(updates, state: WarnedLrState, params=None):
        del params
        return jax.tree.map(lambda u: u * state.warned_lr_scale.astype(u.dtype), updates), state

    return optax.GradientTransformation(init, update)


class WarnedClipState(NamedTuple):
    """The global-norm clip the early-warning monitor set (inf: none yet)."""

    warned_clip_norm: jax.Array  # float32 scalar


def clip_when_warned() -> optax.GradientTransformation:
    """Global-norm clipping to the state's threshold, which starts at inf (no clipping)."""

    def init(params) -> WarnedClipState:
        del params
        return WarnedClipState(jnp.full((), jnp.inf, jnp.float32))

    def update(updates, state: WarnedClipState, params=None):
        del params
        norm = optax.tree.norm(updates)
        factor = jnp.minimum(1.0, state.warned_clip_norm / jnp.maximum(norm, 1e-30))
        return jax.tree.map(lambda u: u * factor.astype(u.dtype), updates), state

    return optax.GradientTransformation(init, update)


def make_optimizer(opt_cfg: ml_collections.ConfigDict, total_steps: int, *,
                   monitor_action: str = "none", n_layers: int = 0
                   ) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """The optimizer and its schedule (the schedule is also logged as ``train/lr``). With an
    early-warning monitor's action, its state also holds what the action changes
    (``scale_when_warned`` or ``scale_by_layer`` after the optimizer, ``clip_when_warned``
    before it)."""
    schedule = learning_rate_schedule(opt_cfg, total_steps)

    def mask(params):
        return weight_decay_mask(params, opt_cfg.decay_norms_and_embeddings)

    if opt_cfg.optimizer == "sgd":  # weight decay as PyTorch's SGD: wd * w joins the gradient
        tx = optax.chain(optax.add_decayed_weights(opt_cfg.weight_decay, mask),
                         optax.sgd(schedule, momentum=opt_cfg.momentum))
    else:
        tx = optax.adamw(schedule, b1=opt_cfg.b1, b2=opt_cfg.b2, eps=opt_cfg.eps,
                         weight_decay=opt_cfg.weight_decay, mask=mask)
    if opt_cfg.clip_norm > 0:
        tx = optax.chain(optax.clip_by_global_norm(opt_cfg.clip_norm), tx)
    if monitor_action == "clip":
        tx = optax.chain(clip_when_warned(), tx)
    elif monitor_action == "layer_lr":
        tx = optax.chain(tx, scale_by_layer(n_layers))
    elif monitor_action == "lr_scale":
        tx = optax.chain(tx, scale_when_warned())
    return tx, schedule
