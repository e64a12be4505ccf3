"""The training objective, built once from the config and shared by the train, diagnostic and
eval steps."""

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_collections
import optax

from postnorm.model.layers import BUDGET_COLLECTION

# An extra term of the objective: (logits [B, L, V], targets [B, L], sown) -> a scalar, where
# ``sown`` holds what the model sowed into its collections on this forward (e.g. the residual
# budget's hinge penalties).
Term = Callable[[jax.Array, jax.Array, dict], jax.Array]


def cross_entropy(logits_BxLxV: jax.Array, targets_BxL: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy in nats."""
    return optax.softmax_cross_entropy_with_integer_labels(logits_BxLxV, targets_BxL).mean()


@dataclasses.dataclass(frozen=True)
class Loss:
    """The objective: cross-entropy plus ``weight * term`` for each ``(name, weight, term)``.

    ``loss(logits, targets) -> (objective, parts)``: ``parts`` holds ``ce`` and each term by
    name; the train and diagnostic steps minimise and log the objective, and an evaluation
    reads the cross-entropy alone (``cross_entropy``).
    """

    terms: tuple[tuple[str, float, Term], ...] = ()

    def __call__(self, logits_BxLxV: jax.Array, targets_BxL: jax.Array,
                 sown: dict | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
        ce = cross_entropy(logits_BxLxV, targets_BxL)
        objective, parts = ce, {"ce": ce}
        for name, weight, term in self.terms:
            parts[name] = term(logits_BxLxV, targets_BxL, sown or {})
            objective = objective + weight * parts[name]
        return objective, parts


def residual_budget_hinge(logits_BxLxV: jax.Array, targets_BxL: jax.Array,
                          sown: dict) -> jax.Array:
    """The residual budget's penalty: the mean over every budgeted norm (layers and sublayers)
    of its sown hinge (``postnorm.model.layers.ResidualNorm``)."""
    del logits_BxLxV, targets_BxL
    leaves = [leaf.reshape(-1) for leaf in jax.tree.leaves(sown.get(BUDGET_COLLECTION, {}))]
    if not leaves:
        raise ValueError("the residual budget's penalty found no sown hinge: the model was "
                         "applied without model.residual_budget='penalty' or without the "
                         f"mutable {BUDGET_COLLECTION!r} collection")
    return jnp.mean(jnp.concatenate(leaves))


def make_loss(config: ml_collections.ConfigDict) -> Loss:
    """The objective ``config`` trains: cross-entropy, plus the residual budget's hinge penalty
    weighted by ``model.residual_budget_weight`` with ``model.residual_budget=penalty``."""
    if config.model.residual_budget == "penalty":
        return Loss((("residual_budget", float(config.model.residual_budget_weight),
                      residual_budget_hinge),))
    return Loss()
