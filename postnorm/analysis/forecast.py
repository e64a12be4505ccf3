"""The collapse forecast before training (docs/FORECAST.md): inputs from the theory at init and
the config, small L2 logistic and ridge models fitted on archived runs by a nested
cross-validation (``fit_selected``), and their scores.

Inputs, never outcomes (``step0_inputs``):

* ``tsim_max`` / ``tsim_mean``: the mean-field Gram recursion's token similarity at init for the
  run's arrangement (``PLACEMENTS[norm].gram_maps``), its largest after any sublayer and its mean
  at the layers' attention inputs, from an equicorrelated input of ``model.init_tsim_input``;
* ``log_skip_gain``: log of the product over the layers of the skip paths' backward gain at init
  (``MeanFieldTrace.skip_gain``): Stage II's product of contractions c;
* ``post_share``: the share of sublayers whose skip path passes a norm (skip-path gain under 1
  at init, ``MeanFieldTrace.sublayer_skip_gain``): where c multiplies the skip path, so where
  the growth of ||y|| that the learning rate drives in Stage II reaches the early layers;
* ``log_lr_on_post``: ``post_share`` x ``log_lr``, the learning rate acting through those
  sublayers (a Pre-Norm arrangement's rate does not enter Stage II's product);
* ``log_erase_fraction``: log of the step at which Adam has moved W_V or W_O (the matrices of
  the attention amount s) by its init scale, lr per step summed over the schedule, over
  ``train.steps``: how much of the run the init's similarity profile governs;
* ``log2_layers``, ``log_lr``, ``warmup_fraction``;
* the training-time methods, which the theory at init cannot see, as config flags:
  ``qk_norm``, ``grad_repair``, ``z_loss``, ``diversity``, ``monitor_action`` and
  ``residual_budget``. The adaptive placement's lambda controller is no flag: the theory's
  inputs above are read at the profile it settles at under the mean-field theory
  (``settled_spec``), as a fixed profile (``model.adaptive_profile``) is read as given;
* ``clipped``: whether the optimizer clips the global gradient norm (``opt.clip_norm`` > 0). A
  flag, not the norm: whether a clip acts depends on the gradient's norm during training, which
  the theory at init does not give, and the archive holds two norms only (B2T's 0.1, the
  protocol's 1.0).

The onset step is ``half_alike_step`` (``postnorm.analysis.collapse``), the first diagnostic
step with half the layers alike.
"""

import dataclasses
import functools
import json
import math
import os

import jax.numpy as jnp
import ml_collections
import numpy as np

from postnorm import theory
from postnorm.analysis.collapse import DEFAULT_RULE, half_alike_step
from postnorm.config.schema import base_config
from postnorm.diagnostics.schedule import diagnostic_steps
from postnorm.errors import UserError
from postnorm.model.placements import PLACEMENTS, init_gains, profile_text
from postnorm.model.similarity_init import with_similarity_init
from postnorm.model.spec import ModelSpec
from postnorm.train.optim import learning_rate_schedule
from postnorm.train.placement_control import PlacementControl, placement_control

MODEL_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "results", "figures", "forecast", "model.json")
THEORY = ("tsim_max", "tsim_mean", "log_skip_gain", "post_share", "log_erase_fraction")
SCHEDULE = ("log2_layers", "log_lr", "log_lr_on_post", "warmup_fraction")
SKIP_NORMED = 1 - 1e-6  # a sublayer skip-path gain under this passes a norm (c < 1)
TRAINING_FLAGS = ("qk_norm", "grad_repair", "z_loss", "diversity", "monitor_action",
                  "residual_budget", "clipped")
STEP0 = THEORY + SCHEDULE + TRAINING_FLAGS
EARLY = STEP0 + ("alike_fraction_early",)  # + the diagnostics of the first EARLY_STEPS steps
BASELINE = ("log2_layers", "log_lr")
EARLY_STEPS = 30
FLOOR_RATIO = 0.95  # "at the floor": loss >= 0.95 x its batches' frequency floor (archive_row)
L2 = 1.0  # the penalty 1/2 L2 |w|^2 on the standardised weights: the onset's, the "fixed" variant's


class ForecastError(UserError, ValueError):
    """A config the forecast cannot read (the message names the field)."""


def full_config(data: dict | ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """``base_config()`` with the fields of ``data`` (a config, or an archived record's config
    data, which may predate some fields: those keep their defaults)."""
    config = base_config()
    if isinstance(data, ml_collections.ConfigDict):
        data = data.to_dict()
    for section, fields in data.items():
        if isinstance(fields, dict):
            config[section].update(fields)
        else:
            config[section] = fields
    return config


@functools.lru_cache(maxsize=1024)
def _init_trace(spec: ModelSpec, t_input: float) -> theory.MeanFieldTrace:
    amt = theory.amounts(spec.d_model, spec.d_ff, spec.init).with_gains(init_gains(spec))
    n = spec.max_len
    rho = float(theory.ec_rho(t_input, n))
    return theory.mean_field_recursion((1 - rho) * np.eye(n) + rho, spec.n_layers, amt,
                                       PLACEMENTS[spec.norm].gram_maps(spec))


def mean_field_alarm(control: PlacementControl, trace: theory.MeanFieldTrace) -> np.ndarray:
    """``PlacementControl.alarm`` [L, 2] on the mean-field trace's statistics: c (its
    ``c_mean``) under c_min or the sublayer's input tsim over tsim_max for ``post_input_c``;
    the backward gain (its ``sublayer_skip_gain``) under gain_min for ``two_way``."""
    if control.signal == "two_way":
        return trace.sublayer_skip_gain < control.gain_min
    tsim_in_Lx2 = np.stack([trace.tsim_in, trace.tsim_after[:, 0]], axis=1)
    return (trace.c_mean < control.c_min) | (tsim_in_Lx2 > control.tsim_max)


@functools.lru_cache(maxsize=64)
def settled_spec(spec: ModelSpec, t_input: float, control: PlacementControl | None,
                 acts: int) -> ModelSpec:
    """``spec`` with the lambda profile the controller leaves after ``acts`` diagnostic steps
    under the mean-field theory at init: from the init profile, at each step the controller's
    rule (lambda - rate_down where ``mean_field_alarm`` on the current profile's trace, else
    lambda + rate_up, clipped to [0, 1]), stopping at a fixed point; ``spec`` itself without a
    controller. The weights stay at init: the profile the init's statistics drive lambda to."""
    if control is None:
        return spec
    mix_Lx2 = PLACEMENTS[spec.norm].post_mix(spec)
    for _ in range(acts):
        trace = _init_trace(dataclasses.replace(spec, adaptive_profile=profile_text(mix_Lx2)),
                            t_input)
        down, up = (np.asarray(r, mix_Lx2.dtype) for r in (control.rate_down, control.rate_up))
        moved_Lx2 = np.clip(np.where(mean_field_alarm(control, trace), mix_Lx2 - down,
                                     mix_Lx2 + up), 0, 1).astype(mix_Lx2.dtype)
        if np.array_equal(moved_Lx2, mix_Lx2):
            break
        mix_Lx2 = moved_Lx2
    return dataclasses.replace(spec, adaptive_profile=profile_text(mix_Lx2))


def model_spec(config: ml_collections.ConfigDict) -> ModelSpec:
    """The run's ModelSpec at init (W_O's gain solved where the similarity-aware init is on)."""
    model = config.model.to_dict() | {"attention": "einsum"}
    try:
        spec = ModelSpec.from_config(model, vocab_size=config.data.vocab_size,
                                     max_len=config.data.seq_len)
    except (TypeError, ValueError) as err:
        raise ForecastError(f"the config's model section builds no network: {err}") from err
    if spec.norm not in PLACEMENTS:
        raise ForecastError(f"model.norm={spec.norm!r} is not an arrangement of "
                            f"postnorm.model.placements: {', '.join(PLACEMENTS)}")
    return with_similarity_init(spec, config.model.init_tsim_target,
                                config.model.init_tsim_input)


def erase_step(opt_cfg: ml_collections.ConfigDict, steps: int, scale: float) -> float:
    """The first step by which the learning rates summed over the schedule reach ``scale``
    (Adam moves each entry by about lr per step), ``steps`` x the ratio past the run's end."""
    lr_S = np.asarray(learning_rate_schedule(opt_cfg, steps)(jnp.arange(steps)), np.float64)
    moved_S = np.cumsum(lr_S)
    reached = np.flatnonzero(moved_S >= scale)
    return float(reached[0] + 1) if reached.size else steps * scale / float(moved_S[-1])


def init_scale(spec: ModelSpec, name: str) -> float:
    """The init standard deviation of layer matrix ``name`` (its gain included)."""
    shapes = {"w_v": (spec.d_model, spec.d_model), "w_o": (spec.d_model, spec.d_model)}
    fan_in, fan_out = shapes[name]
    var = theory.kernel_variance(spec.init, fan_in, fan_out)
    return float(np.sqrt(var) * init_gains(spec).get(name, 1.0))


def step0_inputs(data: dict | ml_collections.ConfigDict) -> dict[str, float]:
    """The forecast's inputs (``STEP0``) for a config, from the theory at init and the config
    alone. ``ForecastError`` for a config they cannot be computed for."""
    config = full_config(data)
    if config.opt.optimizer != "adamw":
        raise ForecastError(f"opt.optimizer={config.opt.optimizer!r}: the forecast's erase time "
                            "is Adam's (lr per step), and every archived run trained with adamw")
    if config.train.steps < 1 or config.opt.lr <= 0:
        raise ForecastError("train.steps and opt.lr must be positive for a forecast")
    spec = model_spec(config)
    steps = int(config.train.steps)
    t_input = float(config.model.init_tsim_input)
    acts = len(diagnostic_steps(steps, config.diag))
    trace = _init_trace(settled_spec(spec, t_input, placement_control(config), acts), t_input)
    erase = min(erase_step(config.opt, steps, init_scale(spec, name)) for name in ("w_v", "w_o"))
    post_share = float(np.mean(trace.sublayer_skip_gain < SKIP_NORMED))
    return {
        "tsim_max": float(trace.tsim_after.max()),
        "tsim_mean": float(trace.tsim_in.mean()),
        "log_skip_gain": float(np.sum(np.log(trace.skip_gain))),
        "post_share": post_share,
        "log_erase_fraction": math.log(erase / steps),
        "log2_layers": math.log2(spec.n_layers),
        "log_lr": math.log(config.opt.lr),
        "log_lr_on_post": post_share * math.log(config.opt.lr),
        "warmup_fraction": config.opt.warmup_steps / steps,
        "qk_norm": float(spec.qk_norm),
        "grad_repair": float(bool(config.train.grad_repair)),
        "z_loss": float(config.opt.z_loss > 0),
        "diversity": float(config.opt.diversity_weight > 0),
        "monitor_action": float(config.monitor.action != "none"),
        "residual_budget": float(spec.residual_budget != "none"),
        "clipped": float(config.opt.clip_norm > 0),
    }


def early_inputs(diag_steps: list[int], fraction: list[float]) -> dict[str, float]:
    """The diagnostics of the first ``EARLY_STEPS`` steps: the fraction of the layers alike
    at the last diagnostic step by then."""
    early = [f for s, f in zip(diag_steps, fraction, strict=True) if s <= EARLY_STEPS]
    return {"alike_fraction_early": float(early[-1]) if early else 0.0}


# the models ----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Linear:
    """A linear score on standardised inputs: w . (x - mean) / scale + bias."""

    names: tuple[str, ...]
    mean: tuple[float, ...]
    scale: tuple[float, ...]
    weights: tuple[float, ...]
    bias: float

    def score(self, x_NxF: np.ndarray) -> np.ndarray:
        z_NxF = (np.asarray(x_NxF, np.float64) - np.array(self.mean)) / np.array(self.scale)
        return z_NxF @ np.array(self.weights) + self.bias

    def recalibrated(self, a: float, b: float) -> "Linear":
        """The score a s + b (Platt's map folded into the weights)."""
        return dataclasses.replace(self, weights=tuple(a * w for w in self.weights),
                                   bias=a * self.bias + b)

    def contributions(self, x_F: np.ndarray) -> dict[str, float]:
        z_F = (np.asarray(x_F, np.float64) - np.array(self.mean)) / np.array(self.scale)
        return dict(zip(self.names, (z_F * np.array(self.weights)).tolist(), strict=True))

    def to_json(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v
                for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_json(cls, data: dict) -> "Linear":
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})


def _standardise(x_NxF: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Means and scales; a column constant over the runs gets scale 1 (and so weight 0)."""
    mean_F = x_NxF.mean(axis=0)
    std_F = x_NxF.std(axis=0)
    return mean_F, np.where(std_F > 1e-12, std_F, 1.0)


def fit_logistic(x_NxF: np.ndarray, y_N: np.ndarray, names: tuple[str, ...],
                 l2: float = L2) -> Linear:
    """L2-penalised logistic regression (the bias unpenalised) by Newton's method to
    convergence: deterministic, and unique since the objective is strictly convex."""
    x_NxF, y_N = np.asarray(x_NxF, np.float64), np.asarray(y_N, np.float64)
    mean_F, scale_F = _standardise(x_NxF)
    z_NxF = np.hstack([(x_NxF - mean_F) / scale_F, np.ones((len(y_N), 1))])
    penalty_F = np.full(z_NxF.shape[1], l2)
    penalty_F[-1] = 0.0
    w_F = _newton_logistic(z_NxF, y_N, penalty_F)
    return Linear(names, tuple(mean_F.tolist()), tuple(scale_F.tolist()),
                  tuple(w_F[:-1].tolist()), float(w_F[-1]))


def _newton_logistic(z_NxF: np.ndarray, y_N: np.ndarray, penalty_F: np.ndarray) -> np.ndarray:
    """The weights minimising the logistic loss of y on z plus 1/2 sum penalty w^2."""
    w_F = np.zeros(z_NxF.shape[1])
    for _ in range(100):
        p_N = _sigmoid(z_NxF @ w_F)
        grad_F = z_NxF.T @ (p_N - y_N) + penalty_F * w_F
        hess_FxF = (z_NxF.T * (p_N * (1 - p_N))) @ z_NxF + np.diag(penalty_F) + 1e-9 * np.eye(
            len(w_F))
        step_F = np.linalg.solve(hess_FxF, grad_F)
        w_F = w_F - step_F
        if np.max(np.abs(step_F)) < 1e-10:
            break
    return w_F


def _sigmoid(s_N: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * np.asarray(s_N, np.float64)))  # no overflow


def fit_platt(score_N: np.ndarray, y_N: np.ndarray) -> tuple[float, float]:
    """Platt's recalibration of held-out log-odds s: the (a, b) maximising the likelihood of
    y under sigmoid(a s + b), unpenalised, by Newton's method."""
    z_Nx2 = np.stack([np.asarray(score_N, np.float64), np.ones(len(score_N))], axis=1)
    a, b = _newton_logistic(z_Nx2, np.asarray(y_N, np.float64), np.zeros(2))
    return float(a), float(b)


def fit_ridge(x_NxF: np.ndarray, y_N: np.ndarray, names: tuple[str, ...],
              l2: float = L2) -> Linear:
    """Ridge regression (the bias unpenalised), in closed form."""
    x_NxF, y_N = np.asarray(x_NxF, np.float64), np.asarray(y_N, np.float64)
    mean_F, scale_F = _standardise(x_NxF)
    z_NxF = (x_NxF - mean_F) / scale_F
    w_F = np.linalg.solve(z_NxF.T @ z_NxF + l2 * np.eye(len(names)),
                          z_NxF.T @ (y_N - y_N.mean()))
    return Linear(names, tuple(mean_F.tolist()), tuple(scale_F.tolist()), tuple(w_F.tolist()),
                  float(y_N.mean()))


def probability(model: Linear, x_NxF: np.ndarray) -> np.ndarray:
    return _sigmoid(model.score(x_NxF))


# the fitting procedure: nested cross-validation inside the training runs ----------------------

L2_GRID = (0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0)
# each variant: (penalty chosen by inner cross-validation from L2_GRID, else L2; Platt's map
# fitted on the inner held-out log-odds). The rule, fixed before any outer-fold score was seen:
# on every training set the forecast fits the variant whose inner leave-one-method-out Brier
# score is lowest (ties: the first listed), every fitted quantity refitted inside each inner fold
VARIANTS = {"fixed": (False, False), "inner_l2": (True, False), "platt": (False, True),
            "inner_l2_platt": (True, True)}


class Folds:
    """Logistic fits of ``y_N`` on ``x_NxF`` over the rows outside sets of groups, memoised by
    their rows, for the nested cross-validation. ``tags_N``: each row's groups as (kind, value)
    pairs; an inner fold leaves out one group of kind ``inner`` (the run's method)."""

    def __init__(self, x_NxF: np.ndarray, y_N, tags_N: list[set], names: tuple[str, ...],
                 inner: str = "inner"):
        self.x_NxF, self.y_N = np.asarray(x_NxF, np.float64), np.asarray(y_N, np.float64)
        self.names, self.inner = names, inner
        self._members = {tag: np.array([tag in tags for tags in tags_N])
                         for tag in sorted({t for tags in tags_N for t in tags}, key=str)}
        self._fits: dict = {}
        self._scores: dict = {}

    def members(self, tag: tuple) -> np.ndarray:
        return self._members[tag]

    def train(self, excluded: frozenset) -> np.ndarray:
        """The indices of the rows with none of the ``excluded`` tags."""
        out_N = np.zeros(len(self.y_N), bool)
        for tag in excluded:
            out_N |= self._members[tag]
        return np.flatnonzero(~out_N)

    def inner_groups(self, excluded: frozenset) -> list[tuple]:
        train_M = self.train(excluded)
        return [t for t, m in self._members.items() if t[0] == self.inner and m[train_M].any()]

    def fit(self, excluded: frozenset, l2: float) -> Linear:
        train_M = self.train(excluded)
        key = (train_M.tobytes(), l2)
        if key not in self._fits:
            self._fits[key] = fit_logistic(self.x_NxF[train_M], self.y_N[train_M], self.names,
                                           l2)
        return self._fits[key]

    def inner_scores(self, excluded: frozenset, l2: float) -> np.ndarray:
        """The log-odds of each training row (in ``train`` order) from the fit on the training
        rows outside its inner group."""
        train_M = self.train(excluded)
        key = (train_M.tobytes(), l2)
        if key not in self._scores:
            s_M = np.zeros(len(train_M))
            for group in self.inner_groups(excluded):
                held_M = self._members[group][train_M]
                s_M[held_M] = self.fit(excluded | {group}, l2).score(self.x_NxF[train_M[held_M]])
            self._scores[key] = s_M
        return self._scores[key]


def fit_variant(folds: Folds, excluded: frozenset, variant: str) -> tuple[Linear, dict]:
    """``variant`` fitted on the rows outside ``excluded``: the penalty (``L2``, or the grid's
    with the lowest inner Brier), then Platt's map on the inner held-out log-odds folded into
    the weights. Without two inner groups and both outcomes there is no inner fold: ``L2``, no
    map."""
    inner_l2, platt = VARIANTS[variant]
    y_M = folds.y_N[folds.train(excluded)]
    inner = len(folds.inner_groups(excluded)) >= 2 and 0 < y_M.sum() < len(y_M)
    l2 = L2
    if inner_l2 and inner:
        l2 = min(L2_GRID, key=lambda v: brier(y_M, _sigmoid(folds.inner_scores(excluded, v))))
    a, b = fit_platt(folds.inner_scores(excluded, l2), y_M) if platt and inner else (1.0, 0.0)
    return folds.fit(excluded, l2).recalibrated(a, b), {"variant": variant, "l2": l2,
                                                        "platt": [a, b]}


def inner_brier(folds: Folds, excluded: frozenset, variant: str) -> float:
    """The Brier score over the rows outside ``excluded`` of ``variant`` fitted (every fitted
    quantity included) without each row's inner group."""
    train_M = folds.train(excluded)
    p_M = np.zeros(len(train_M))
    for group in folds.inner_groups(excluded):
        held_M = folds.members(group)[train_M]
        model, _ = fit_variant(folds, excluded | {group}, variant)
        p_M[held_M] = probability(model, folds.x_NxF[train_M[held_M]])
    return brier(folds.y_N[train_M], p_M)


def fit_selected(folds: Folds, excluded: frozenset = frozenset()) -> tuple[Linear, dict]:
    """The forecast's procedure on the rows outside ``excluded``: the variant with the lowest
    ``inner_brier`` (``VARIANTS``' rule), fitted; ``fixed`` where there are no inner folds."""
    if len(folds.inner_groups(excluded)) < 2:
        return fit_variant(folds, excluded, "fixed")
    briers = {v: inner_brier(folds, excluded, v) for v in VARIANTS}
    model, info = fit_variant(folds, excluded, min(VARIANTS, key=briers.__getitem__))
    return model, info | {"inner_brier": briers}


def snap_to_diagnostic_step(step: float, config: ml_collections.ConfigDict) -> int:
    """A predicted step as the nearest diagnostic step of the config's run (its schedule: dense
    steps included, the last step at most; of two as near, the earlier)."""
    return min(diagnostic_steps(int(config.train.steps), config.diag),
               key=lambda s: abs(s - step))


# the archive ----------------------------------------------------------------------------------

def archive_row(entry: dict) -> dict | None:
    """One archived run as the forecast reads it: its config, its labels (collapsed by the
    project's rule, at the floor, the onset step) and its monitor's first warn (``monitored``
    False and ``first_warn`` None for a record without the monitor's replay); None for a run
    without a verdict or a loss to label (not ``done``, or neither measured nor evaluated).

    The floor label (``floor_loss`` names its loss) is the loss on fresh training batches over
    L_freq where the record was measured (the leaderboard's measures), else the last held-out
    loss (``final_eval_loss``) over its validation batches' own frequency floor (``eval_floor``:
    L_freq's unigram scored on those batches). Not over L_freq: the validation batches' floor
    lies several per cent off L_freq, either way (by the batches drawn); the fresh batches' does
    not.
    """
    result, measures = entry["result"], entry.get("measures") or {}
    if result.get("status") != "done" or "collapse" not in result:
        return None
    if "fresh_loss_over_lfreq" in measures:
        floor_loss, loss_over_floor = "fresh", measures["fresh_loss_over_lfreq"]
    elif result.get("final_eval_loss") is not None and result.get("eval_floor"):
        floor_loss, loss_over_floor = "eval", result["final_eval_loss"] / result["eval_floor"]
    else:
        return None
    collapse = result["collapse"]
    return {
        "run_id": entry["run_id"], "config": entry["config"],
        "inputs": step0_inputs(entry["config"]),
        "collapsed": bool(collapse["collapsed"]),
        "floor": bool(loss_over_floor >= FLOOR_RATIO),
        "floor_loss": floor_loss, "loss_over_floor": float(loss_over_floor),
        "onset_step": half_alike_step(collapse["diag_steps"], collapse["fraction_collapsed"],
                                      DEFAULT_RULE),
        "collapse_step": collapse["collapse_step"],
        "diag_steps": collapse["diag_steps"],
        "monitored": "first_warn" in measures,
        "first_warn": measures.get("first_warn"),
        "early": early_inputs(collapse["diag_steps"], collapse["fraction_collapsed"]),
    }


def design(rows: list[dict], names: tuple[str, ...]) -> np.ndarray:
    """The inputs ``names`` of each row (its ``inputs`` with its ``early`` diagnostics)."""
    return np.array([[{**r["inputs"], **r["early"]}[n] for n in names] for r in rows], np.float64)


# the forecast ---------------------------------------------------------------------------------

def fit_forecast(rows: list[dict], groups: list[object]) -> dict:
    """The three step-0 models fitted on archived rows (each with ``inputs``; ``groups``: each
    row's method, the inner folds): collapse and floor (logistic, by ``fit_selected``) and the
    onset step's log on the collapsing runs (ridge, penalty ``L2``); with the runs' ids."""
    x_NxF = design(rows, STEP0)
    collapsing = [i for i, r in enumerate(rows) if r["collapsed"]]
    onsets = np.log([rows[i]["onset_step"] for i in collapsing])
    tags = [{("inner", g)} for g in groups]
    models, selection = {}, {}
    for target, key in (("collapse", "collapsed"), ("floor", "floor")):
        model, selection[target] = fit_selected(Folds(x_NxF, [r[key] for r in rows], tags,
                                                      STEP0))
        models[target] = model.to_json()
    return models | {
        "log_onset": fit_ridge(x_NxF[collapsing], onsets, STEP0).to_json(),
        "selection": selection, "runs": len(rows), "collapsed": len(collapsing),
        "run_ids": sorted(r["run_id"] for r in rows),
        "range": {n: [float(x_NxF[:, i].min()), float(x_NxF[:, i].max())]
                  for i, n in enumerate(STEP0)},
    }


def forecast(models: dict, inputs: dict[str, float], config: ml_collections.ConfigDict) -> dict:
    """The forecast of one (full) config from its ``step0_inputs``: p_collapse, p_floor, the onset
    step (None when a collapse is not the likelier outcome) and each input with its
    contribution to the collapse's log-odds and whether it lies in the fitted runs' range
    (outside it the forecast extrapolates)."""
    x_F = np.array([inputs[n] for n in STEP0])
    collapse, floor = Linear.from_json(models["collapse"]), Linear.from_json(models["floor"])
    onset = Linear.from_json(models["log_onset"])
    p_collapse = float(probability(collapse, x_F[None])[0])
    contributions = collapse.contributions(x_F)
    return {
        "p_collapse": p_collapse,
        "p_floor": float(probability(floor, x_F[None])[0]),
        "onset_step": (snap_to_diagnostic_step(float(np.exp(onset.score(x_F[None])[0])), config)
                       if p_collapse >= 0.5 else None),
        "inputs": {n: {"value": inputs[n], "log_odds": contributions[n],
                       "in_fitted_range": bool(models["range"][n][0] <= inputs[n]
                                               <= models["range"][n][1])} for n in STEP0},
    }


def forecast_config(config: ml_collections.ConfigDict | dict, models: dict) -> dict:
    """``forecast`` of a config (``ForecastError`` where its inputs cannot be computed)."""
    full = full_config(config)
    return forecast(models, step0_inputs(full), full)


# scores ---------------------------------------------------------------------------------------

def auc(y_N, p_N) -> float:
    """The probability that a positive run scores above a negative one (ties count half)."""
    y_N, p_N = np.asarray(y_N, bool), np.asarray(p_N, np.float64)
    pos, neg = p_N[y_N], p_N[~y_N]
    if not pos.size or not neg.size:
        return float("nan")
    greater = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return float(greater / (pos.size * neg.size))


def brier(y_N, p_N) -> float:
    return float(np.mean((np.asarray(p_N, np.float64) - np.asarray(y_N, np.float64)) ** 2))


def calibration(y_N, p_N, bins: int = 10) -> list[dict]:
    """Per decile of the stated probability: its runs, mean probability and observed rate."""
    y_N, p_N = np.asarray(y_N, np.float64), np.asarray(p_N, np.float64)
    index_N = np.minimum((p_N * bins).astype(int), bins - 1)
    out = []
    for b in range(bins):
        members = index_N == b
        if members.any():
            out.append({"bin": [b / bins, (b + 1) / bins], "runs": int(members.sum()),
                        "mean_p": float(p_N[members].mean()),
                        "observed": float(y_N[members].mean())})
    return out


# cross-validation -----------------------------------------------------------------------------

def held_out(x_NxF: np.ndarray, y_N, outer: list[object], inner: list[object],
             names: tuple[str, ...]) -> tuple[np.ndarray, dict[str, np.ndarray], list[dict]]:
    """Each row's probability from the forecast's procedure (``fit_selected``, its inner folds
    leaving out one ``inner`` group) fitted on the rows of the other ``outer`` groups; the
    same from each of ``VARIANTS``; and each outer fold's model and selection."""
    folds = Folds(x_NxF, y_N, [{("outer", o), ("inner", i)}
                               for o, i in zip(outer, inner, strict=True)], names)
    p_N = np.zeros(len(outer))
    p_VxN = {v: np.zeros(len(outer)) for v in VARIANTS}
    models = []
    for group in sorted(set(outer), key=str):
        excluded = frozenset({("outer", group)})
        test_N = folds.members(("outer", group))
        model, selection = fit_selected(folds, excluded)
        p_N[test_N] = probability(model, folds.x_NxF[test_N])
        for variant in VARIANTS:
            p_VxN[variant][test_N] = probability(fit_variant(folds, excluded, variant)[0],
                                                 folds.x_NxF[test_N])
        models.append({"held_out": group, "selection": selection, "model": model.to_json()})
    return p_N, p_VxN, models


def held_out_onsets(rows: list[dict], groups: list[object]) -> list[int | None]:
    """Per row, the onset step the step-0 ridge model predicts for it when fitted on the
    collapsing rows of the other groups (None for a row that did not collapse)."""
    onsets: list[int | None] = [None] * len(rows)
    for group in sorted(set(groups), key=str):
        train = [r for r, g in zip(rows, groups, strict=True) if g != group and r["collapsed"]]
        model = fit_ridge(design(train, STEP0), np.log([r["onset_step"] for r in train]), STEP0)
        for i, g in enumerate(groups):
            if g == group and rows[i]["collapsed"]:
                step = float(np.exp(model.score(design([rows[i]], STEP0))[0]))
                onsets[i] = snap_to_diagnostic_step(step, full_config(rows[i]["config"]))
    return onsets


def forecast_line(config: ml_collections.ConfigDict, model_path: str = MODEL_PATH) -> str:
    """The step-0 forecast as one log line; where it cannot be computed (an exotic config, a
    missing or damaged model file) the line says why instead of raising."""
    try:
        with open(model_path) as f:
            models = json.load(f)
        result = forecast_config(config, models)
    except (OSError, ValueError, KeyError, TypeError) as err:  # ForecastError is a ValueError
        return f"collapse forecast: none ({type(err).__name__}: {err})"
    outside = [n for n, e in result["inputs"].items() if not e["in_fitted_range"]]
    onset = result["onset_step"]
    return (f"collapse forecast at step 0: p_collapse {result['p_collapse']:.2f}, p_floor "
            f"{result['p_floor']:.2f}, onset step {onset if onset is not None else 'none'}"
            + (f" (extrapolated: {', '.join(outside)} outside the fitted runs)" if outside else "")
            + " (docs/FORECAST.md)")
