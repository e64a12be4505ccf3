"""Collapse detection from a run's ``metrics.jsonl`` records (docs/MATH.md §4, §5).

The rule (``CollapseRule``; defaults in brackets), evaluated on the diagnostic steps only:

* A diagnostic step **meets the criterion** when tsim(X_k) at the attention input is
  >= ``tsim_threshold`` [0.99] in at least ``layer_fraction`` [0.5] of the layers AND the train
  loss there is within ``loss_rtol`` [5%] of the frequency floor: |loss - floor| <= loss_rtol *
  floor. The loss there is the mean of the last ``loss_smoothing`` [3] train losses (their
  cross-entropy, where the objective adds terms to it) logged at or before the step (as
  ``run_summary``'s final loss), and the floor is the mean of the same batches' frequency
  floors (``postnorm.data.lfreq``): what a model predicting the unigram distribution scores on
  exactly those batches. One batch's floor scatters around L_freq by more than the tolerance
  on the default corpus (results/figures/batch_floors/table.md).
  Records without floors (older runs) are compared with L_freq.
* The run **collapsed** when its last diagnostic step meets the criterion. The **collapse step**
  is the first diagnostic step from which every later diagnostic step meets it, so a transient
  crossing is not a collapse (``first_hit_step`` records the first crossing anyway).
* The **onset** is the first diagnostic step at which any layer has tsim >= ``tsim_threshold``:
  the first fully collapsed layer. Since the criterion needs such layers, onset <= collapse step,
  and the **transition window** is [onset, collapse step]. Inside it, ``similar_layers_step`` is
  the first diagnostic step at which the tsim part of the criterion holds (loss ignored).
* Gradient ratios across the transition: ||dL/dX_k|| at the attention input at the last
  diagnostic step before the onset (the onset itself if there is none) divided by its value at
  the collapse step, for layers 0 .. ``early_layers`` - 1 and for the last layer.
"""

import dataclasses

import numpy as np

from postnorm.diagnostics.early_warning import (
    DEFAULT_MONITOR,
    DEFAULT_RULE,
    Alarm,
    CollapseRule,
    MonitorRule,
    MonitorState,
    loss_and_floor_at,
    near_floor,
    replay,
    similar_fraction,
)
from postnorm.workdir.metrics import layer_series, lfreq_of, train_loss_and_floor

__all__ = ["DEFAULT_RULE", "Collapse", "CollapseRule", "detect_collapse", "half_alike_step",
           "lfreq_of", "loss_and_floor_at", "replay_monitor", "train_loss_and_floor"]


@dataclasses.dataclass(frozen=True)
class Collapse:
    """What ``detect_collapse`` found in one run. Steps are ``None`` where they do not exist."""

    collapsed: bool
    collapse_step: int | None
    onset_step: int | None
    first_hit_step: int | None
    similar_layers_step: int | None
    pre_window_step: int | None  # the step the gradient ratios are taken from
    grad_ratio_early: list[float] | None  # layers 0 .. early_layers - 1
    grad_ratio_last: float | None
    diag_steps: list[int]
    fraction_collapsed: list[float]  # fraction of layers with tsim >= threshold, per diag step
    meets_criterion: list[bool]  # per diag step

    @property
    def window(self) -> tuple[int, int] | None:
        """[onset, collapse step], or ``None`` if the run did not collapse."""
        return (self.onset_step, self.collapse_step) if self.collapsed else None

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "window": self.window}


def detect_collapse(records: list[dict], rule: CollapseRule = DEFAULT_RULE) -> Collapse:
    """Apply ``rule`` to a run's metric records (``postnorm.workdir.metrics.read_metrics``)."""
    series = layer_series(records)
    if "tsim_attn" not in series:
        raise ValueError("the metrics hold no per-layer diag/tsim_attn: no diagnostic step ran")
    steps_S, tsim_LxS = series["tsim_attn"]
    train_S = train_loss_and_floor(records)
    hit_LxS = tsim_LxS >= rule.tsim_threshold
    fraction_S = similar_fraction(tsim_LxS, rule)
    losses_Sx2 = np.array([loss_and_floor_at(train_S, int(s), rule.loss_smoothing)
                           for s in steps_S]).reshape(-1, 2)
    loss_S, floor_S = losses_Sx2[:, 0], losses_Sx2[:, 1]
    meets_S = (fraction_S >= rule.layer_fraction) & near_floor(loss_S, floor_S, rule.loss_rtol)

    first_hit = _first(steps_S, meets_S)
    similar = half_alike_step(steps_S, fraction_S, rule)
    any_layer = _first(steps_S, hit_LxS.any(axis=0))
    collapsed = bool(meets_S[-1])
    collapse_step = onset = pre = ratio_early = ratio_last = None
    if collapsed:
        failing = np.flatnonzero(~meets_S)
        collapse_step = int(steps_S[failing[-1] + 1 if failing.size else 0])
        onset = any_layer
        before = steps_S[steps_S < onset]
        pre = int(before[-1]) if before.size else onset
        if "dldx_norm_attn" in series:
            grad_steps_S, grad_LxS = series["dldx_norm_attn"]
            g_pre = grad_LxS[:, _column(grad_steps_S, pre)]
            g_end = grad_LxS[:, _column(grad_steps_S, collapse_step)]
            ratio_LxS = g_pre / g_end
            ratio_early = ratio_LxS[: rule.early_layers].tolist()
            ratio_last = float(ratio_LxS[-1])
    return Collapse(
        collapsed=collapsed, collapse_step=collapse_step, onset_step=onset,
        first_hit_step=first_hit, similar_layers_step=similar, pre_window_step=pre,
        grad_ratio_early=ratio_early, grad_ratio_last=ratio_last,
        diag_steps=[int(s) for s in steps_S],
        fraction_collapsed=fraction_S.tolist(), meets_criterion=meets_S.tolist())


def half_alike_step(steps_S, fraction_S, rule: CollapseRule = DEFAULT_RULE) -> int | None:
    """The first diagnostic step at which >= ``rule.layer_fraction`` of the layers are alike
    (tsim >= the threshold; ``fraction_S`` as ``Collapse.fraction_collapsed``), loss ignored:
    ``similar_layers_step``, and the onset step the collapse forecast predicts
    (``postnorm.analysis.forecast``); None if there is none."""
    return _first(np.asarray(steps_S), np.asarray(fraction_S) >= rule.layer_fraction)


def _first(steps_S: np.ndarray, mask_S: np.ndarray) -> int | None:
    hits = np.flatnonzero(mask_S)
    return int(steps_S[hits[0]]) if hits.size else None


def _column(steps_S: np.ndarray, step: int) -> int:
    (index,) = np.flatnonzero(steps_S == step)
    return int(index)


def replay_monitor(records: list[dict], rule: MonitorRule = DEFAULT_MONITOR,
                   until_step: int | None = None) -> tuple[list[Alarm], MonitorState]:
    """The early-warning monitor's alarm at every diagnostic step of a run's records (up to
    ``until_step``), read as the live monitor reads them, and its state after the last."""
    series = layer_series(records)
    if "tsim_attn" not in series:
        return [], MonitorState()
    steps_S, tsim_LxS = series["tsim_attn"]
    return replay(steps_S, tsim_LxS, train_loss_and_floor(records), rule, until_step)
