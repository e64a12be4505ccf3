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
              placement: PlacementControl | None = None, repair: bool = False
              ) -> tuple[TrainState, dict[str, jax.Array], dict[str, jax.Array]]:
    """One optimizer step, identical to ``train_step``, plus the diagnostics of this batch
    (the update norms are added after the non-finite guard: ``with_update_norms``). With
    ``placement``, lambda then moves by this step's statistics (forward and taps), and is
    reported per layer.

    With ``repair`` (the model repairs its gradient: ``postnorm.model.repair``) a second
    backward pass without it gives the loss's own gradient: the taps' ``dldx_*`` are of that
    one, ``repaired_dldx_*`` of the repaired signal the update used, and ``repair_cos`` is the
    cosine of the two parameter gradients per layer (``repair_cos_all``: over every parameter).
    """
    n_layers = jax.tree.leaves(state.params["layers"])[0].shape[0]

    def objective_fn(params, probes, **apply_kwargs):
        (logits, forward), sown = state.apply_fn({"params": params}, batch["inputs"],
                                                 probes=probes, **_mix(state), **apply_kwargs,
                                                 mutable=[BUDGET_COLLECTION])
        objective, parts = loss(logits, batch["targets"], sown)
        return objective, (forward, parts)

    (objective, (forward, parts)), (grads, probe_grads) = jax.value_and_grad(
        objective_fn, argnums=(0, 1), has_aux=True)(state.params, zero_probes(n_layers))
    new_state = state.apply_gradients(grads=grads)
    if repair:
        _, (true_grads, true_probe_grads) = jax.value_and_grad(
            functools.partial(objective_fn, repair=False), argnums=(0, 1), has_aux=True)(
            state.params, zero_probes(n_layers))
        diagnostics = gather_diagnostics(forward, true_probe_grads, state, grads)
        diagnostics.update(repair_diagnostics(probe_grads, grads, true_grads))
    else:
        diagnostics = gather_diagnostics(forward, probe_grads, state, grads)
    if getattr(state, "post_mix", None) is not None:
        diagnostics["post_mix_attn"] = state.post_mix[:, 0]  # the lambda this step ran with
        diagnostics["post_mix_ffn"] = state.post_mix[:, 1]
        if placement is not None:
            new_state = new_state.replace(post_mix=placement(state.post_mix, diagnostics))
    return new_state, _step_metrics(objective, parts, grads, state, schedule), diagnostics


def eval_step(state: TrainState, batch: Batch) -> jax.Array:
    """Mean cross-entropy of ``batch`` under the current parameters (an evaluation reads the
    cross-entropy alone, whatever else the objective adds)."""
    logits = state.apply_fn({"params": state.params}, batch["inputs"], **_mix(state))
    return cross_entropy(logits, batch["targets"])


def with_update_norms(step_fn: DiagStep) -> DiagStep:
    """``step_fn(state, batch) -> (state, metrics, diagnostics)``, a diagnostic step wrapped
    by the non-finite guard, with the per-layer norms of the update it applied added: zero on
    a step the guard skipped, whose computed update was thrown away. Where the state carries
    lambda, ``post_mix_next_*`` is the lambda kept for the steps after this one."""

    @functools.wraps(step_fn)  # the program keeps the wrapped step's name (logs, caches)
    def step(state: TrainState, batch: Batch
             ) -> tuple[TrainState, dict[str, jax.Array], dict[str, jax.Array]]:
        new_state, metrics, diagnostics = step_fn(state, batch)
        diagnostics = {**diagnostics, **update_norms(state, new_state)}
        if getattr(new_state, "post_mix", None) is not None:
            diagnostics["post_mix_next_attn"] = new_state.post_mix[:, 0]
            diagnostics["post_mix_next_ffn"] = new_state.post_mix[:, 1]
        return new_state, metrics, diagnostics

    return step


@in_stats_scope
def update_norms(state: TrainState, new_state: TrainState) -> dict[str, jax.Array]:
    """``update_norm_<group>``: the per-layer norms of ``new_state.params - state.params``."""
    updates = jax.tree.map(jnp.subtract, new_state.params["layers"], state.params["layers"])
    return {f"update_norm_{group}": norms for group, norms in layer_norms(updates).items()}


def tap_norms(probe_grads: dict[str, jax.Array], prefix: str = "") -> dict[str, jax.Array]:
    """The taps' statistics as norms, ``<prefix><name>_<attn|ffn|final>``."""
    norms = jax.tree.map(jnp.sqrt, probe_grads)  # squared statistics -> Frobenius norms
    out = {}
    for s, name in enumerate(TAP_NORM_NAMES):
        out[f"{prefix}{name}_attn"] = norms["layers"][:, 0, s]
        out[f"{prefix}{name}_ffn"] = norms["layers"][:, 1, s]
        out[f"{prefix}{name}_final"] = norms["final"][s]
    return out


@in_stats_scope
def gather_diagnostics(forward: dict[str, jax.Array], probe_grads: dict[str, jax.Array],
                       state: TrainState, grads) -> dict[str, jax.Array]:
    """The forward statistics, the taps' gradient norms and the per-layer parameter and
    gradient norms of one step (its update norms: ``with_update_norms``)."""
    diagnostics = {**forward, **tap_norms(probe_grads)}
    for prefix, tree in (("param_norm", state.params["layers"]), ("grad_norm", grads["layers"])):
        for group, norms in layer_norms(tree).items():
            diagnostics[f"{prefix}_{group}"] = norms
    return diagnostics


def _per_layer_dot(a, b) -> jax.Array:
    """sum over each layer's parameters of a * b: [n_layers]."""
    return sum(jnp.sum((x * y).astype(jnp.float32), axis=tuple(range(1, x.ndim)))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def _tree_dot(a, b) -> jax.Array:
    return sum(jnp.sum((x * y).astype(jnp.float32))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


@in_stats_scope
def repair_diagnostics(repaired_probe_grads: dict[str, jax.Array], repaired, true
                       ) -> dict[str, jax.Array]:
    """The repaired signal's tap norms, the true gradient's per-layer norms and the cosine of
    the repaired and the true parameter gradient, per layer and over every parameter."""
    out = tap_norms(repaired_probe_grads, prefix="repaired_")
    for group, norms in layer_norms(true["layers"]).items():
        out[f"true_grad_norm_{group}"] = norms
    a, b = repaired["layers"], true["layers"]
    out["repair_cos"] = _per_layer_dot(a, b) / jnp.sqrt(_per_layer_dot(a, a) * _per_layer_dot(b, b))
    out["repair_cos_all"] = _tree_dot(repaired, true) / jnp.sqrt(
        _tree_dot(repaired, repaired) * _tree_dot(true, true))
    return out
