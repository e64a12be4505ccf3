"""Steps with a NaN/Inf loss or gradient: the guarded train state and the in-step guard."""

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax.training.train_state import TrainState
from optax import tree_utils

NONFINITE_POLICIES = ("abort", "skip", "rollback")


class GuardedState(TrainState):
    """A ``TrainState`` with a skip counter, a halt marker, an lr scale and a rollback counter.

    ``step`` counts applied updates; ``step + skipped_steps`` is the loop's step.
    """

    skipped_steps: jax.Array  # int32: steps whose update was not applied
    halted_at: jax.Array  # int32: the first non-finite loop step when halted, else 0
    lr_scale: jax.Array  # float32: multiplies every update (the learning rate)
    rollbacks: jax.Array  # int32: rollbacks done so far
    # float32 [n_layers, 2]: each sublayer's Post-Norm share lambda where the arrangement keeps
    # it as state (model.norm=adaptive), else None (no leaf: the checkpoint is unchanged)
    post_mix: jax.Array | None = None
    # int32: the early-warning monitor's actions so far where it acts (monitor.action), else
    # None (no leaf)
    monitor_actions: jax.Array | None = None

    @classmethod
    def create_guarded(cls, *, apply_fn, params, tx: optax.GradientTransformation,
                       post_mix: jax.Array | None = None,
                       monitor_acts: bool = False) -> "GuardedState":
        """A fresh state: nothing skipped, not halted, lr scale 1, no rollbacks, lambda
        ``post_mix``, no monitor action yet (a counter only where ``monitor_acts``).

        ``step`` is a strongly typed int32, like a restored one, so that a resumed run's
        steps compile to the same programs as a fresh run's.
        """
        state = cls.create(apply_fn=apply_fn, params=params, tx=tx,
                           skipped_steps=jnp.zeros((), jnp.int32),
                           halted_at=jnp.zeros((), jnp.int32),
                           lr_scale=jnp.ones((), jnp.float32),
                           rollbacks=jnp.zeros((), jnp.int32), post_mix=post_mix,
                           monitor_actions=jnp.zeros((), jnp.int32) if monitor_acts else None)
        return state.replace(step=jnp.zeros((), jnp.int32))

    def apply_gradients(self, *, grads, **kwargs) -> "GuardedState":
        """``TrainState.apply_gradients`` with the updates multiplied by ``lr_scale``."""
        updates, opt_state = self.tx.update(grads, self.opt_state, self.params)
        updates = jax.tree.map(lambda u: u * self.lr_scale.astype(u.dtype), updates)
        return self.replace(step=self.step + 1, params=optax.apply_updates(self.params, updates),
                            opt_state=opt_state, **kwargs)


def guard(step_fn: Callable, *, halt: bool) -> Callable:
    """Wrap ``step_fn(state, batch) -> (state, metrics, *extra)`` so that a non-finite step
    keeps the old state (and, with ``halt``, so does every step after one).

    Adds ``train/skipped_steps`` and ``train/rollbacks`` to the metrics and scales ``train/lr``
    by ``lr_scale`` (and by the early-warning monitor's factor where it has one).
    """

    def guarded(state: GuardedState, batch):
        new_state, metrics, *extra = step_fn(state, batch)
        finite = jnp.isfinite(metrics["train/loss"]) & jnp.isfinite(metrics["train/grad_norm"])
        apply = finite & (state.halted_at == 0) if halt else finite
        kept = jax.tree.map(lambda new, old: jnp.where(apply, new, old), new_state, state)
        kept = kept.replace(skipped_steps=state.skipped_steps + (~apply).astype(jnp.int32))
        if halt:
            loop_step = state.step + state.skipped_steps + 1
            first = jnp.where(apply, 0, loop_step)
            kept = kept.replace(halted_at=jnp.where(state.halted_at > 0, state.halted_at, first))
        warned = tree_utils.tree_get(state.opt_state, "warned_lr_scale", 1.0)
        metrics = {**metrics, "train/lr": metrics["train/lr"] * state.lr_scale * warned,
                   "train/skipped_steps": kept.skipped_steps, "train/rollbacks": state.rollbacks}
        return (kept, metrics, *extra)

    return guarded
