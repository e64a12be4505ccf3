"""The training objective, built once from the config and shared by the train, diagnostic and
eval steps."""

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_collections
import optax

from postnorm.model.layers import BUDGET_COLLECTION

# An extra term of the objective: (logits [B, L, V], targets [B, L], sown) -> a scalar, where
# ``sown`` holds what the model sowed into its collections on this forward (e.g. the residual
# budget's hinge penalties).
TermFn = Callable[[jax.Array, jax.Array, dict], jax.Array]


@dataclasses.dataclass(frozen=True)
class Term:
    """``weight * min(fn(...), cap)`` enters the objective; ``fn(...)`` itself is logged."""

    name: str
    weight: float
    fn: TermFn
    cap: float = math.inf


def cross_entropy(logits_BxLxV: jax.Array, targets_BxL: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy in nats."""
    return optax.softmax_cross_entropy_with_integer_labels(logits_BxLxV, targets_BxL).mean()


@dataclasses.dataclass(frozen=True)
class Loss:
    """The objective: cross-entropy plus ``weight * min(value, cap)`` for each ``Term``.

    ``loss(logits, targets) -> (objective, parts)``: ``parts`` holds ``ce`` and each term's
    uncapped value by name; the train and diagnostic steps minimise the objective and log the
    parts, and an evaluation reads the cross-entropy alone (``cross_entropy``).
    """

    terms: tuple[Term, ...] = ()

    def __call__(self, logits_BxLxV: jax.Array, targets_BxL: jax.Array,
                 sown: dict | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
        ce = cross_entropy(logits_BxLxV, targets_BxL)
        objective, parts = ce, {"ce": ce}
        for term in self.terms:
            parts[term.name] = term.fn(logits_BxLxV, targets_BxL, sown or {})
            objective = objective + term.weight * jnp.minimum(parts[term.name], term.cap)
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


def z_loss(logits_BxLxV: jax.Array, targets_BxL: jax.Array, sown: dict) -> jax.Array:
    """mean(log Z^2) over positions, Z the softmax normaliser (PaLM, Chowdhery et al. 2022)."""
    del targets_BxL, sown
    log_z_BxL = jax.nn.logsumexp(logits_BxLxV.astype(jnp.float32), axis=-1)
    return jnp.mean(log_z_BxL**2)


def position_diversity(logits_BxLxV: jax.Array, targets_BxL: jax.Array,
                       sown: dict) -> jax.Array:
    """D = (1/n) sum_i KL(q_i || q_bar) per sequence, averaged over the batch: q_i the predicted
    distribution at position i, q_bar their mean over the sequence's n positions.

    D is the mutual information between position and predicted token: 0 when every position
    predicts the same distribution (a collapsed network predicts the unigram one at every
    position), at most log n. The frequency-loss regulariser subtracts it from the objective.
    """
    del targets_BxL, sown
    log_q_BxLxV = jax.nn.log_softmax(logits_BxLxV.astype(jnp.float32), axis=-1)
    q_BxLxV = jnp.exp(log_q_BxLxV)
    n = logits_BxLxV.shape[1]
    log_q_bar_Bx1xV = jax.nn.logsumexp(log_q_BxLxV, axis=1, keepdims=True) - math.log(n)
    kl_BxL = jnp.sum(q_BxLxV * (log_q_BxLxV - log_q_bar_Bx1xV), axis=-1)
    return jnp.mean(kl_BxL)


TERM_NAMES = ("residual_budget", "z_loss", "diversity")  # every term make_loss may add


def make_loss(config: ml_collections.ConfigDict) -> Loss:
    """The objective ``config`` trains: cross-entropy, plus the residual budget's hinge penalty
    (``model.residual_budget=penalty``, weighted by ``model.residual_budget_weight``), the z-loss
    (``opt.z_loss``) and minus the position diversity capped at ``opt.diversity_cap``
    (``opt.diversity_weight``), each where its weight is set."""
    terms = []
    if config.model.residual_budget == "penalty":
        terms.append(Term("residual_budget", float(config.model.residual_budget_weight),
                          residual_budget_hinge))
    if config.opt.z_loss > 0:
        terms.append(Term("z_loss", float(config.opt.z_loss), z_loss))
    if config.opt.diversity_weight > 0:
        terms.append(Term("diversity", -float(config.opt.diversity_weight), position_diversity,
                          cap=float(config.opt.diversity_cap)))
    return Loss(tuple(terms))
