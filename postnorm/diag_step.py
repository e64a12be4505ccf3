"""The diagnostic step: the same update as ``train_step`` plus per-layer statistics.

Backward statistics come from the taps (``postnorm.taps``), forward statistics leave the
layer scan as stacked ``[n_layers]`` outputs, and per-layer parameter, gradient and update
norms are read off the stacked parameters. ``flatten_diagnostics`` turns the result into
metric keys with zero-padded layer indices (``diag/tsim_attn/layer_07``).
"""

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training.train_state import TrainState

from postnorm.diagnostics import in_stats_scope
from postnorm.metrics import layer_key
from postnorm.steps import Batch, cross_entropy
from postnorm.taps import zero_probes

# ||dL/dX||_F, ||Pi_1 dL/dX||_F and ||(I - Pi_1) dL/dX||_F, in the order of taps.TAP_STATS.
TAP_NORM_NAMES = ("dldx_norm", "dldx_mean_norm", "dldx_repair_norm")
PARAM_GROUPS = {"attn": ("attn",), "ffn": ("ffn",), "norm": ("norm_attn", "norm_ffn")}
DiagStep = Callable[[TrainState, Batch],
                    tuple[TrainState, dict[str, jax.Array], dict[str, jax.Array]]]


def layer_norms(layer_params: dict) -> dict[str, jax.Array]:
    """||.|| per layer of the attention, FFN and norm-gain parameters: {group: [n_layers]}."""

    def group_norm(names: tuple[str, ...]) -> jax.Array:
        leaves = jax.tree.leaves([layer_params[name] for name in names])
        squares = [jnp.sum(jnp.square(x.astype(jnp.float32)), axis=tuple(range(1, x.ndim)))
                   for x in leaves]
        return jnp.sqrt(sum(squares))

    return {group: group_norm(names) for group, names in PARAM_GROUPS.items()}


def diag_step(state: TrainState, batch: Batch, schedule: optax.Schedule
              ) -> tuple[TrainState, dict[str, jax.Array], dict[str, jax.Array]]:
    """One AdamW step, identical to ``train_step``, plus the diagnostics of this batch (the
    update norms are added after the non-finite guard: ``with_update_norms``)."""
    n_layers = jax.tree.leaves(state.params["layers"])[0].shape[0]

    def loss_fn(params, probes):
        logits, forward = state.apply_fn({"params": params}, batch["inputs"], probes=probes)
        return cross_entropy(logits, batch["targets"]), forward

    (loss, forward), (grads, probe_grads) = jax.value_and_grad(
        loss_fn, argnums=(0, 1), has_aux=True)(state.params, zero_probes(n_layers))
    new_state = state.apply_gradients(grads=grads)
    metrics = {"train/loss": loss, "train/grad_norm": optax.tree.norm(grads),
               "train/lr": schedule(state.step)}

    return new_state, metrics, gather_diagnostics(forward, probe_grads, state, grads)


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


def flatten_diagnostics(diagnostics: dict[str, np.ndarray]) -> dict[str, float]:
    """Host-side: each ``[n_layers]`` array becomes one key per layer."""
    flat = {}
    for name, value in diagnostics.items():
        value = np.asarray(value, np.float64)
        if value.ndim == 0:
            flat[f"diag/{name}"] = float(value)
        else:
            for layer, v in enumerate(value):
                flat[layer_key(f"diag/{name}", layer, len(value))] = float(v)
    return flat
