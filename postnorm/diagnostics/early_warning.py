"""The collapse rule's criterion, and the early-warning monitor built on the same thresholds
(the paper's improvement 4): a pure function of one diagnostic step and the monitor's state.

The offline detector (``postnorm.analysis.collapse``) calls a run collapsed when, at its last
diagnostic step, a fraction >= ``layer_fraction`` of the layers has tsim >= ``tsim_threshold``
at the attention input and the smoothed train loss is within ``loss_rtol`` of its batches'
frequency floor. The monitor reads the same two signals step by step:

* **watch**: some layer has tsim >= ``tsim_threshold`` (the detector's onset);
* **warn**: the similarity part of the criterion has held at ``persistence`` consecutive
  diagnostic steps, this one included, and the loss is within ``warn_loss_rtol`` (looser than
  ``loss_rtol``) of the floor: the network is heading for the floor with most layers alike.

A transient spike of similarity early in training (Pre-Norm, Mix-LN, sandwich and Peri-LN at
lr 3e-3 show one lasting one or two diagnostic steps) is left at watch by the persistence;
``docs/DIAGNOSTICS.md`` has how the default was chosen and the measured lead times.
"""

import dataclasses
from collections.abc import Mapping

import numpy as np

LEVELS = ("none", "watch", "warn")


@dataclasses.dataclass(frozen=True)
class CollapseRule:
    """Thresholds of the collapse criterion (``postnorm.analysis.collapse``)."""

    tsim_threshold: float = 0.99
    layer_fraction: float = 0.5
    loss_rtol: float = 0.05
    loss_smoothing: int = 3
    early_layers: int = 4


DEFAULT_RULE = CollapseRule()


def similar_fraction(tsim_LxS: np.ndarray, rule: CollapseRule) -> np.ndarray:
    """Per step (or for one step's ``[L]``), the fraction of layers with tsim >= the threshold."""
    return np.mean(np.asarray(tsim_LxS) >= rule.tsim_threshold, axis=0)


def near_floor(loss: np.ndarray, floor: np.ndarray, rtol: float) -> np.ndarray:
    """|loss - floor| <= rtol * floor."""
    return np.abs(np.asarray(loss) - floor) <= rtol * np.asarray(floor)


@dataclasses.dataclass(frozen=True)
class MonitorRule:
    """The monitor's thresholds: the collapse rule's, and its own two."""

    collapse: CollapseRule = DEFAULT_RULE
    persistence: int = 3
    warn_loss_rtol: float = 0.25


DEFAULT_MONITOR = MonitorRule()


def monitor_rule_from(monitor_cfg: Mapping | None) -> MonitorRule:
    """The rule of a config's ``monitor`` section (defaults where a field is absent)."""
    cfg = monitor_cfg or {}
    return MonitorRule(
        persistence=int(cfg.get("warn_persistence", DEFAULT_MONITOR.persistence)),
        warn_loss_rtol=float(cfg.get("warn_loss_rtol", DEFAULT_MONITOR.warn_loss_rtol)))


@dataclasses.dataclass(frozen=True)
class MonitorState:
    """What the monitor carries between diagnostic steps."""

    streak: int = 0  # consecutive diagnostic steps at which the similarity part held
    first_watch: int | None = None
    first_warn: int | None = None


@dataclasses.dataclass(frozen=True)
class Alarm:
    """The monitor's reading of one diagnostic step."""

    step: int
    level: int  # an index of LEVELS
    reason: str
    layers: tuple[int, ...]  # the layers with tsim >= the threshold
    fraction: float
    loss_over_floor: float

    @property
    def name(self) -> str:
        return LEVELS[self.level]


def assess(step: int, tsim_L: np.ndarray, loss: float, floor: float, state: MonitorState,
           rule: MonitorRule = DEFAULT_MONITOR) -> tuple[Alarm, MonitorState]:
    """The alarm of diagnostic step ``step`` (tsim at each layer's attention input, the smoothed
    train loss and its batches' floor, as the collapse rule reads them) and the next state."""
    tsim_L = np.asarray(tsim_L, np.float64)
    layers = tuple(int(i) for i in np.flatnonzero(tsim_L >= rule.collapse.tsim_threshold))
    fraction = float(similar_fraction(tsim_L, rule.collapse))
    streak = state.streak + 1 if fraction >= rule.collapse.layer_fraction else 0
    heading = bool(near_floor(loss, floor, rule.warn_loss_rtol))
    ratio = loss / floor if floor else float("nan")
    if streak >= rule.persistence and heading:
        level = 2
        reason = (f"{len(layers)} of {tsim_L.size} layers have tsim >= "
                  f"{rule.collapse.tsim_threshold} for {streak} diagnostic steps and the loss "
                  f"is {ratio:.3f} x its floor (within {rule.warn_loss_rtol:.0%})")
    elif layers:
        level = 1
        reason = (f"layers {_ranges(layers)} have tsim >= {rule.collapse.tsim_threshold} "
                  f"({fraction:.0%} of the layers; loss {ratio:.3f} x its floor)")
    else:
        level, reason = 0, ""
    new_state = MonitorState(
        streak=streak,
        first_watch=state.first_watch if state.first_watch is not None or level < 1 else step,
        first_warn=state.first_warn if state.first_warn is not None or level < 2 else step)
    return Alarm(step, level, reason, layers, fraction, ratio), new_state


def loss_and_floor_at(train_S: list[tuple[int, float, float]], step: int,
                      smoothing: int) -> tuple[float, float]:
    """Means of the last ``smoothing`` train losses logged at or before ``step`` and of their
    batches' floors (NaN if none)."""
    before = [(loss, floor) for s, loss, floor in train_S if s <= step][-smoothing:]
    if not before:
        return float("nan"), float("nan")
    loss, floor = np.mean(before, axis=0)
    return float(loss), float(floor)


def replay(steps_S: np.ndarray, tsim_LxS: np.ndarray, train_S: list[tuple[int, float, float]],
           rule: MonitorRule = DEFAULT_MONITOR, until_step: int | None = None
           ) -> tuple[list[Alarm], MonitorState]:
    """``assess`` at each diagnostic step (tsim ``[L, S]`` at ``steps_S``) up to ``until_step``,
    the loss smoothed over ``train_S`` ((step, loss, floor) per logged train step) as the
    collapse rule smooths it; the alarms and the state after the last."""
    state, alarms = MonitorState(), []
    for column, step in enumerate(steps_S):
        if until_step is not None and step > until_step:
            break
        loss, floor = loss_and_floor_at(train_S, int(step), rule.collapse.loss_smoothing)
        alarm, state = assess(int(step), tsim_LxS[:, column], loss, floor, state, rule)
        alarms.append(alarm)
    return alarms, state


def _ranges(indices: tuple[int, ...]) -> str:
    """'0-3, 7, 9-10' for (0, 1, 2, 3, 7, 9, 10)."""
    parts = []
    start = prev = indices[0]
    for i in indices[1:]:
        if i != prev + 1:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = i
        prev = i
    parts.append(str(start) if start == prev else f"{start}-{prev}")
    return ", ".join(parts)
