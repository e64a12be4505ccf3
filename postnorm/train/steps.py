"""The pure steps: ``train`` and ``diag`` (the same update plus per-layer statistics), ``eval``."""

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax.training.train_state import TrainState

from postnorm.diagnostics.stats import in_stats_scope, layer_norms
from postnorm.diagnostics.taps import TAP_NORM_NAMES, zero_probes
from postnorm.model.layers import BUDGET_COLLECTION
from postnorm.train.losses import Loss, cross_entropy
from postnorm.train.placement_control import PlacementControl

Batch = dict[str, jax.Array]
DiagStep = Callable[[TrainState, Batch],
                    tuple[TrainState, dict[str, jax.Array], dict[str, jax.Array]]]


def _step_metrics(objective: jax.Array, parts: dict[str, jax.Array], grads, state: TrainState,
                  schedule: optax.Schedule) -> dict[str, jax.Array]:
    """``train/loss`` (the objective), and where the objective has terms besides the
    cross-entropy, each part (``train/ce``, ``train/<term>``)."""
    metrics = {"train/loss": objective, "train/grad_norm": optax.tree.norm(grads),
               "train/lr": schedule(state.step)}
    if len(parts) > 1:
        metrics.update({f"train/{name}": value for name, value in parts.items()})
    return metrics


def _mix(state: TrainState) -> dict[str, jax.Array]:
    """The model's lambda argument where the state carries it (``GuardedState.post_mix``)."""
    post_mix = getattr(state, "post_mix", None)
    return {} if post_mix is None else {"post_mix_Lx2": post_mix}


def train_step(state: TrainState, batch: Batch, schedule: optax.Schedule,
               loss: Loss) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer step on ``loss`` over ``batch``."""

    def objective_fn(params):
        logits, sown = state.apply_fn({"params": params}, batch["inputs"], **_mix(state),
                                      mutable=[BUDGET_COLLECTION])
        return loss(logits, batch["targets"], sown)

    (objective, parts), grads = jax.value_and_grad(objective_fn, has_aux=True)(state.params)
    return (state.apply_gradients(grads=grads),
            _step_metrics(objective, parts, grads, state, schedule))


def diag_step(state: TrainState, batch: Batch, schedule: optax.Schedule, loss: Loss,
              placement: PlacementControl | None = None
              ) -> tuple[TrainState, dict[str, jax.Array], dict[str, jax.Array]]:
    """One optimizer step, identical to ``train_step``, plus the diagnostics of this batch
    (the update norms are added after the non-finite guard: ``with_update_norms``). With
    ``placement``, lambda then moves by this step's statistics, and is reported per layer."""
    n_layers = jax.tree.leaves(state.params["layers"])[0].shape[0]

    def objective_fn(params, probes):
        (logits, forward), sown = state.apply_fn({"params": params}, batch["inputs"],
                                                 probes=probes, **_mix(state),
                                                 mutable=[BUDGET_COLLECTION])
        objective, parts = loss(logits, batch["targets"], sown)
        return objective, (forward, parts)

    (objective, (forward, parts)), (grads, probe_grads) = jax.value_and_grad(
        objective_fn, argnums=(0, 1), has_aux=True)(state.params, zero_probes(n_layers))
    new_state = state.apply_gradients(grads=grads)
    diagnostics = gather_diagnostics(forward, probe_grads, state, grads)
    if getattr(state, "post_mix", None) is not None:
        diagnostics["post_mix_attn"] = state.post_mix[:, 0]  # the lambda this step ran with
        diagnostics["post_mix_ffn"] = state.post_mix[:, 1]
        if placement is not None:
            new_state = new_state.replace(post_mix=placement(state.post_mix, forward))
    return new_state, _step_metrics(objective, parts, grads, state, schedule), diagnostics


def eval_step(state: TrainState, batch: Batch) -> jax.Array:
    """Mean cross-entropy of ``batch`` under the current parameters (an evaluation reads the
    cross-entropy alone, whatever else the objective adds)."""
    logits = state.apply_fn({"params": state.params}, batch["inputs"], **_mix(state))
    return cross_entropy(logits, batch["targets"])


def with_update_norms(step_fn: DiagStep) -> DiagStep:
    """``step_fn(state, batch) -> (state, metrics, diagnostics)``, a diagnostic step wrapped
    by the non-finite guard, with the per-layer norms of the update it applied added: zero on
    a step the guard skipped, whose computed update was thrown away."""

    @functools.wraps(step_fn)  # the program keeps the wrapped step's name (logs, caches)
    def step(state: TrainState, batch: Batch
             ) -> tuple[TrainState, dict[str, jax.Array], dict[str, jax.Array]]:
        new_state, metrics, diagnostics = step_fn(state, batch)
        return new_state, metrics, {**diagnostics, **update_norms(state, new_state)}

    return step


@in_stats_scope
def update_norms(state: TrainState, new_state: TrainState) -> dict[str, jax.Array]:
    """``update_norm_<group>``: the per-layer norms of ``new_state.params - state.params``."""
    updates = jax.tree.map(jnp.subtract, new_state.params["layers"], state.params["layers"])
    return {f"update_norm_{group}": norms for group, norms in layer_norms(updates).items()}


@in_stats_scope
def gather_diagnostics(forward: dict[str, jax.Array], probe_grads: dict[str, jax.Array],
                       state: TrainState, grads) -> dict[str, jax.Array]:
    """The forward statistics, the taps' gradient norms and the per-layer parameter and
    gradient norms of one step (its update norms: ``with_update_norms``)."""
    diagnostics = dict(forward)
    tap_norms = jax.tree.map(jnp.sqrt, probe_grads)  # squared statistics -> Frobenius norms
    for s, name in enumerate(TAP_NORM_NAMES):
        diagnostics[f"{name}_attn"] = tap_norms["layers"][:, 0, s]
        diagnostics[f"{name}_ffn"] = tap_norms["layers"][:, 1, s]
        diagnostics[f"{name}_final"] = tap_norms["final"][s]
    for prefix, tree in (("param_norm", state.params["layers"]), ("grad_norm", grads["layers"])):
        for group, norms in layer_norms(tree).items():
            diagnostics[f"{prefix}_{group}"] = norms
    return diagnostics
