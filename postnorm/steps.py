"""The pure train and eval steps: ``train_step(state, batch) -> (state, metrics)``.

``postnorm.step_builder`` jits them with explicit shardings and donation.
"""


import jax
import optax
from flax.training.train_state import TrainState

Batch = dict[str, jax.Array]


def cross_entropy(logits_BxLxV: jax.Array, targets_BxL: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy in nats."""
    return optax.softmax_cross_entropy_with_integer_labels(logits_BxLxV, targets_BxL).mean()


def train_step(state: TrainState, batch: Batch,
               schedule: optax.Schedule) -> tuple[TrainState, dict[str, jax.Array]]:
    """One AdamW step on the mean cross-entropy of ``batch``."""

    def loss_fn(params):
        logits = state.apply_fn({"params": params}, batch["inputs"])
        return cross_entropy(logits, batch["targets"])

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    metrics = {"train/loss": loss, "train/grad_norm": optax.tree.norm(grads),
               "train/lr": schedule(state.step)}
    return state.apply_gradients(grads=grads), metrics


def eval_step(state: TrainState, batch: Batch) -> jax.Array:
    """Mean cross-entropy of ``batch`` under the current parameters."""
    logits = state.apply_fn({"params": state.params}, batch["inputs"])
    return cross_entropy(logits, batch["targets"])
