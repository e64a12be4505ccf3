"""The training objective, built once from the config and shared by the train, diagnostic and
eval steps."""

import dataclasses
from collections.abc import Callable

import jax
import ml_collections
import optax

# An extra term of the objective: (logits [B, L, V], targets [B, L]) -> a scalar.
Term = Callable[[jax.Array, jax.Array], jax.Array]


def cross_entropy(logits_BxLxV: jax.Array, targets_BxL: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy in nats."""
    return optax.softmax_cross_entropy_with_integer_labels(logits_BxLxV, targets_BxL).mean()


@dataclasses.dataclass(frozen=True)
class Loss:
    """The objective: cross-entropy plus ``weight * term`` for each ``(name, weight, term)``.

    ``loss(logits, targets) -> (objective, parts)``: ``parts`` holds ``ce`` and each term by
    name; the train and diagnostic steps minimise and log the objective, and an evaluation
    reads the cross-entropy alone.
    """

    terms: tuple[tuple[str, float, Term], ...] = ()

    def __call__(self, logits_BxLxV: jax.Array,
                 targets_BxL: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        ce = cross_entropy(logits_BxLxV, targets_BxL)
        objective, parts = ce, {"ce": ce}
        for name, weight, term in self.terms:
            parts[name] = term(logits_BxLxV, targets_BxL)
            objective = objective + weight * parts[name]
        return objective, parts


def make_loss(config: ml_collections.ConfigDict) -> Loss:
    """The objective ``config`` trains: cross-entropy (no extra term is configured yet)."""
    del config
    return Loss()
