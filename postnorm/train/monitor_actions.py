"""What the early-warning monitor does on a new warn (``monitor.action``): the change to the
train state, and the record of every action in effect in ``monitor_actions.json``.

A change lives in the optimizer state, so a checkpoint holds it and a resume continues with it:
``lr_scale`` in ``optim.scale_when_warned``, ``layer_lr`` in ``optim.scale_by_layer``, ``clip``
in ``optim.clip_when_warned``. Each change compounds on the values at the warn (the clip starts
at ``monitor.clip_norm``, then shrinks by ``monitor.clip_factor``), and
``GuardedState.monitor_actions`` counts the actions in effect against ``monitor.max_actions``.
A non-finite rollback restores these with the checkpoint (the monitor, rebuilt from the records
kept, then meets its warns again); a monitor rollback keeps the non-finite policy's own
``lr_scale`` and ``rollbacks``.
"""

import json
import os

import jax
import ml_collections
import numpy as np
from optax import tree_utils

from postnorm.diagnostics.early_warning import DEFAULT_RULE
from postnorm.files import write_json_atomic
from postnorm.train.state import GuardedState
from postnorm.workdir.layout import Workdir


def _set_like(tree, **values):
    """``tree`` with the named leaves replaced, each placed as the leaf it replaces."""
    placed = {name: jax.device_put(np.asarray(value, np.float32),
                                   tree_utils.tree_get(tree, name).sharding)
              for name, value in values.items()}
    return tree_utils.tree_set(tree, **placed)


def apply_change(state: GuardedState, changed_from: GuardedState,
                 monitor: ml_collections.ConfigDict, tsim_L: np.ndarray) -> GuardedState:
    """``state`` with ``monitor.action``'s change applied to ``changed_from``'s values (the
    state at the warn; after a rollback, ``state`` is the restored one) and one more action
    counted. ``tsim_L``: tsim at each layer's attention input at the warn (``layer_lr`` scales
    the layers at or above the collapse rule's threshold)."""
    before = changed_from.opt_state
    if monitor.action == "lr_scale":
        change = {"warned_lr_scale": tree_utils.tree_get(before, "warned_lr_scale")
                  * monitor.lr_factor}
    elif monitor.action == "layer_lr":
        current_L = np.asarray(tree_utils.tree_get(before, "layer_lr_scale"))
        flagged_L = np.asarray(tsim_L) >= DEFAULT_RULE.tsim_threshold
        change = {"layer_lr_scale": np.where(flagged_L, current_L * monitor.layer_lr_factor,
                                             current_L)}
    else:  # clip
        current = float(tree_utils.tree_get(before, "warned_clip_norm"))
        change = {"warned_clip_norm": monitor.clip_norm if np.isinf(current)
                  else current * monitor.clip_factor}
    actions = changed_from.monitor_actions + 1
    return state.replace(
        opt_state=_set_like(state.opt_state, **change),
        lr_scale=changed_from.lr_scale, rollbacks=changed_from.rollbacks,
        monitor_actions=jax.device_put(actions, state.monitor_actions.sharding))


def changed_values(state: GuardedState) -> dict:
    """The values the monitor's actions set in ``state``, for the record."""
    values = {}
    for name in ("warned_lr_scale", "layer_lr_scale", "warned_clip_norm"):
        value = tree_utils.tree_get(state.opt_state, name)
        if value is not None:
            value = np.asarray(value)
            values[name] = value.tolist() if value.ndim else float(value)
    return values


def recorded_actions(workdir: str) -> list[dict]:
    """The actions in effect that ``monitor_actions.json`` records (none without the file)."""
    path = Workdir(workdir).monitor_actions
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return json.load(f)["actions"]


def record_action(workdir: str, entry: dict) -> None:
    """Add ``entry`` (the action numbered ``entry["actions"]``) to the workdir's actions in
    effect, in place of any earlier record of that number or later (process 0)."""
    kept = [e for e in recorded_actions(workdir) if e["actions"] < entry["actions"]]
    write_json_atomic(Workdir(workdir).monitor_actions, {"actions": [*kept, entry]})


def keep_actions(workdir: str, in_effect: int) -> None:
    """Drop the records of actions after the first ``in_effect`` (a state restored from before
    them no longer holds their change), process 0."""
    entries = recorded_actions(workdir)
    if len(kept := [e for e in entries if e["actions"] <= in_effect]) < len(entries):
        write_json_atomic(Workdir(workdir).monitor_actions, {"actions": kept})
