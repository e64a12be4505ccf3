"""Collapse detection from a run's ``metrics.jsonl`` records (docs/MATH.md §4, §5).

The rule (``CollapseRule``; defaults in brackets), evaluated on the diagnostic steps only:

* A diagnostic step **meets the criterion** when tsim(X_k) at the attention input is
  >= ``tsim_threshold`` [0.99] in at least ``layer_fraction`` [0.5] of the layers AND the train
  loss there is within ``loss_rtol`` [5%] of the frequency floor: |loss - floor| <= loss_rtol *
  floor. The loss there is the mean of the last ``loss_smoothing`` [3] train losses (their
  cross-entropy, where the objective adds terms to it) logged at or before the step (as
  ``run_summary``'s final loss), and the floor is the mean of the same batches' frequency
  floors (``postnorm.data.lfreq``): what a model predicting the unigram distribution scores on
  exactly those batches. One batch's floor scatters around L_freq by
  0.4-0.6 nats on the default corpus, more than the tolerance (0.29 nats at L_freq = 5.87).
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

from postnorm.workdir.metrics import MetricsFileError, layer_series


@dataclasses.dataclass(frozen=True)
class CollapseRule:
    """Thresholds of the collapse criterion (see the module docstring)."""

    tsim_threshold: float = 0.99
    layer_fraction: float = 0.5
    loss_rtol: float = 0.05
    loss_smoothing: int = 3
    early_layers: int = 4


DEFAULT_RULE = CollapseRule()


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


def train_loss_and_floor(records: list[dict]) -> list[tuple[int, float, float]]:
    """(step, train loss, frequency floor of that batch) per logged train step, in step order;
    the loss is the cross-entropy (``train/ce``) where the objective logged other terms beside
    it, and the floor is L_freq where the records hold none."""
    lfreq = lfreq_of(records)
    return sorted((int(r["step"]), float(r.get("train/ce", r["train/loss"])),
                   float(r.get("train/freq_floor", lfreq)))
                  for r in records if "train/loss" in r)


def loss_and_floor_at(train_S: list[tuple[int, float, float]], step: int,
                      smoothing: int) -> tuple[float, float]:
    """Means of the last ``smoothing`` train losses logged at or before ``step`` and of their
    batches' floors (NaN if none)."""
    before = [(loss, floor) for s, loss, floor in train_S if s <= step][-smoothing:]
    if not before:
        return float("nan"), float("nan")
    loss, floor = np.mean(before, axis=0)
    return float(loss), float(floor)


def lfreq_of(records: list[dict]) -> float:
    """L_freq as logged with the train (or else the eval) metrics."""
    for key in ("train/lfreq", "eval/lfreq"):
        for record in records:
            if key in record:
                return float(record[key])
    raise MetricsFileError("metrics.jsonl holds no train/lfreq or eval/lfreq record, which the "
                           "trainer logs with every train step and eval: it was not written by "
                           "the trainer, or was edited; restore it or train again")


def detect_collapse(records: list[dict], rule: CollapseRule = DEFAULT_RULE) -> Collapse:
    """Apply ``rule`` to a run's metric records (``postnorm.workdir.metrics.read_metrics``)."""
    series = layer_series(records)
    if "tsim_attn" not in series:
        raise ValueError("the metrics hold no per-layer diag/tsim_attn: no diagnostic step ran")
    steps_S, tsim_LxS = series["tsim_attn"]
    train_S = train_loss_and_floor(records)
    hit_LxS = tsim_LxS >= rule.tsim_threshold
    fraction_S = hit_LxS.mean(axis=0)
    losses_Sx2 = np.array([loss_and_floor_at(train_S, int(s), rule.loss_smoothing)
                           for s in steps_S]).reshape(-1, 2)
    loss_S, floor_S = losses_Sx2[:, 0], losses_Sx2[:, 1]
    near_floor_S = np.abs(loss_S - floor_S) <= rule.loss_rtol * floor_S
    meets_S = (fraction_S >= rule.layer_fraction) & near_floor_S

    first_hit = _first(steps_S, meets_S)
    similar = _first(steps_S, fraction_S >= rule.layer_fraction)
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


def _first(steps_S: np.ndarray, mask_S: np.ndarray) -> int | None:
    hits = np.flatnonzero(mask_S)
    return int(steps_S[hits[0]]) if hits.size else None


def _column(steps_S: np.ndarray, step: int) -> int:
    (index,) = np.flatnonzero(steps_S == step)
    return int(index)
