"""What the early-warning monitor does on a new warn (``monitor.action``): the change to the
train state, and the record of every action in ``monitor_actions.json``.

A change lives in the state, so a checkpoint holds it and a resume continues with it:
``lr_scale`` in ``GuardedState.lr_scale`` (which multiplies every update), ``layer_lr`` and
``clip`` in the optimizer state (``postnorm.train.optim.scale_by_layer``, ``clip_when_warned``).
Each change compounds on the state it is applied to; ``GuardedState.monitor_actions`` counts
them against ``monitor.max_actions``.
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
    opt_state = state.opt_state
    if monitor.action == "lr_scale":
        lr_scale = changed_from.lr_scale * monitor.lr_factor
        state = state.replace(lr_scale=jax.device_put(lr_scale, state.lr_scale.sharding))
    elif monitor.action == "layer_lr":
        current_L = np.asarray(tree_utils.tree_get(changed_from.opt_state, "layer_lr_scale"))
        flagged_L = np.asarray(tsim_L) >= DEFAULT_RULE.tsim_threshold
        opt_state = _set_like(opt_state, layer_lr_scale=np.where(
            flagged_L, current_L * monitor.layer_lr_factor, current_L))
    elif monitor.action == "clip":
        opt_state = _set_like(opt_state, warned_clip_norm=monitor.clip_norm)
    actions = changed_from.monitor_actions + 1
    return state.replace(opt_state=opt_state, rollbacks=changed_from.rollbacks,
                         monitor_actions=jax.device_put(actions,
                                                        state.monitor_actions.sharding))


def record_action(workdir: str, entry: dict) -> None:
    """Add ``entry`` to the workdir's list of actions (process 0), unless a resumed run that
    repeats an action already recorded it (same step and count)."""
    path = Workdir(workdir).monitor_actions
    entries = []
    if os.path.exists(path):
        with open(path) as f:
            entries = json.load(f)["actions"]
    if not any(e["step"] == entry["step"] and e["actions"] == entry["actions"] for e in entries):
        write_json_atomic(path, {"actions": [*entries, entry]})
