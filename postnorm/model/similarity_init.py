"""Similarity-aware initialisation: W_O's init gain solved so that token similarity stays under a
target at init (the paper's improvement 3).

The attention amount s = d^2 sigma_V^2 sigma_O^2 sets how fast prefix averaging raises tsim with
depth (Thm 3.2). A gain g on W_O scales it to g^2 s. The gain is solved with the mean-field Gram
recursion (``postnorm.theory.mean_field_recursion``), not the scalar EC closure, which
underestimates the growth with depth several-fold and would under-correct: the largest
g <= 1 whose predicted tsim after every sublayer, from an equicorrelated input Gram of token
similarity ``t_input`` at the run's sequence length, is at most ``target``.
"""

import dataclasses
import functools

import numpy as np

from postnorm import theory
from postnorm.config.schema import ConfigError
from postnorm.model.placements import PLACEMENTS, init_gains
from postnorm.model.spec import ModelSpec

GAIN_FLOOR = 1e-4  # the smallest gain searched: s shrinks by 1e-8
RELATIVE_TOLERANCE = 0.01  # the solved gain is within 1% of the largest that meets the target


def _max_tsim(spec: ModelSpec, gain: float, t_input: float) -> float:
    """The largest tsim after any sublayer that the mean-field recursion predicts with W_O's
    gain ``gain``."""
    amt = theory.amounts(spec.d_model, spec.d_ff, spec.init).with_gains(
        init_gains(dataclasses.replace(spec, attn_out_gain=gain)))
    n = spec.max_len
    rho = float(theory.ec_rho(t_input, n))
    trace = theory.mean_field_recursion((1 - rho) * np.eye(n) + rho, spec.n_layers, amt,
                                        PLACEMENTS[spec.norm].gram_maps(spec))
    return float(trace.tsim_after.max())


@functools.lru_cache(maxsize=16)
def solve_attention_gain(spec: ModelSpec, target: float, t_input: float) -> float:
    """The largest W_O gain in [GAIN_FLOOR, 1] that keeps the predicted tsim <= ``target``
    (1 when the plain init already does), to ``RELATIVE_TOLERANCE``.

    The predicted tsim rises with log g, so the root of tsim - target is bracketed and found by
    regula falsi with the Illinois modification (a few recursions; each costs O(n^2 L)).
    Raises ``ConfigError`` when even ``GAIN_FLOOR`` does not meet the target (the FFN's own growth,
    or the input's similarity, is above it).
    """
    def excess(log_gain: float) -> float:
        return _max_tsim(spec, float(np.exp(log_gain)), t_input) - target

    high, f_high = 0.0, excess(0.0)
    if f_high <= 0:
        return 1.0
    low, f_low = float(np.log(GAIN_FLOOR)), excess(float(np.log(GAIN_FLOOR)))
    if f_low > 0:
        raise ConfigError(f"model.init_tsim_target={target}: even a W_O gain of {GAIN_FLOOR} "
                         "leaves the predicted tsim above it (the FFN's growth or the input's "
                         "similarity alone exceed it); raise the target")
    side = 0
    while high - low > np.log1p(RELATIVE_TOLERANCE):
        mid = (low * f_high - high * f_low) / (f_high - f_low)
        mid = min(max(mid, low + 0.01 * (high - low)), high - 0.01 * (high - low))
        f_mid = excess(mid)
        if f_mid <= 0:  # meets the target: the answer is at least mid
            low, f_low = mid, f_mid
            f_high, side = (f_high / 2, 0) if side == -1 else (f_high, -1)
        else:
            high, f_high = mid, f_mid
            f_low, side = (f_low / 2, 0) if side == 1 else (f_low, 1)
    return float(np.exp(low))


def with_similarity_init(spec: ModelSpec, target: float, t_input: float) -> ModelSpec:
    """``spec`` with ``attn_out_gain`` solved for ``target`` (``spec`` itself when target is 0,
    which disables the similarity-aware init)."""
    if not target:
        return spec
    return dataclasses.replace(spec, attn_out_gain=solve_attention_gain(
        dataclasses.replace(spec, attention="einsum", attn_out_gain=1.0), target, t_input))
