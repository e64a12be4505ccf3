"""The adaptive norm placement's controller (the paper's improvement 1): how each sublayer's
Post-Norm share lambda moves, from the diagnostic step's own statistics.

It runs inside the diagnostic step (``postnorm.train.steps.diag_step``), so lambda moves at the
diagnostic steps (``postnorm.diagnostics.schedule``), without a host round trip, identically on
every process, and is kept or thrown away with the rest of the step by the non-finite guard.
lambda is part of the training state, so a checkpoint holds it and a resume continues from it.

Signals (``train.placement_signal``): ``post_input_c``, c of the Post norm's input y = X + F (and
the input's tsim), is one way: at lambda = 0, y is the growing Pre stream, c only falls, lambda
never returns. ``two_way`` reads the backward gain r = ||dL/dX_in|| / ||dL/dX_out|| (the taps;
Thm 3.6): r ~ c at lambda = 1 where collapse looms, ~ (1 - lambda) + lambda c between, ~ 1 at
lambda = 0 (the skip bypasses the norm), so it clears there and lambda climbs back to where the
sublayer's gain meets ``placement_gain_min``.
"""

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from postnorm.workdir.metrics import layer_series

SIGNALS = ("post_input_c", "two_way")


def backward_gain(diagnostics: dict[str, jax.Array]) -> jax.Array:
    """r per (layer, sublayer) [L, 2]: ||dL/dX|| at the sublayer's input over that at its
    output (the next sublayer's input, or the stack's output for the last one), from the taps'
    ``dldx_norm_*``; 0 where the output's is 0 (the signal vanished above: no gain to read)."""
    in_attn_L, in_ffn_L = diagnostics["dldx_norm_attn"], diagnostics["dldx_norm_ffn"]
    out_ffn_L = jnp.concatenate([in_attn_L[1:], diagnostics["dldx_norm_final"][None]])
    in_Lx2 = jnp.stack([in_attn_L, in_ffn_L], axis=1)
    out_Lx2 = jnp.stack([in_ffn_L, out_ffn_L], axis=1)
    known = out_Lx2 > 0
    return jnp.where(known, in_Lx2 / jnp.where(known, out_Lx2, 1.0), 0.0)


@dataclasses.dataclass(frozen=True)
class PlacementControl:
    """Per sublayer: lambda <- lambda - rate_down where its signal alarms, else lambda + rate_up;
    clipped to [0, 1]. ``post_input_c`` alarms where the mean contraction c of its Post norm is
    under ``c_min`` or the token similarity at its input is over ``tsim_max``; ``two_way`` where
    its backward gain (``backward_gain``) is under ``gain_min``."""

    signal: str
    c_min: float
    tsim_max: float
    gain_min: float
    rate_down: float
    rate_up: float

    def alarm(self, diagnostics: dict[str, jax.Array]) -> jax.Array:
        """[L, 2] booleans, from the diagnostic step's forward statistics and tap norms."""
        if self.signal == "two_way":
            return backward_gain(diagnostics) < self.gain_min
        c_Lx2 = jnp.stack([diagnostics["c_mean_attn"], diagnostics["c_mean_ffn"]], axis=1)
        tsim_Lx2 = jnp.stack([diagnostics["tsim_attn"], diagnostics["tsim_ffn"]], axis=1)
        return (c_Lx2 < self.c_min) | (tsim_Lx2 > self.tsim_max)

    def __call__(self, mix_Lx2: jax.Array, diagnostics: dict[str, jax.Array]) -> jax.Array:
        moved = jnp.where(self.alarm(diagnostics), mix_Lx2 - self.rate_down,
                          mix_Lx2 + self.rate_up)
        return jnp.clip(moved, 0.0, 1.0).astype(mix_Lx2.dtype)


def placement_control(config: ml_collections.ConfigDict) -> PlacementControl | None:
    """The controller ``config`` trains with: None unless model.norm is ``adaptive`` with
    ``train.placement_controller`` (without it lambda stays at its initial profile)."""
    t = config.train
    if config.model.norm != "adaptive" or not t.placement_controller:
        return None
    return PlacementControl(t.placement_signal, float(t.placement_c_min),
                            float(t.placement_tsim_max), float(t.placement_gain_min),
                            float(t.placement_rate_down), float(t.placement_rate_up))


def final_profile(records: list[dict]) -> np.ndarray | None:
    """lambda [L, 2] the run ended with: ``post_mix_next_*`` of its last diagnostic step (lambda
    moves only there); None where the records hold none (no adaptive placement)."""
    series = layer_series(records)
    if "post_mix_next_attn" not in series:
        return None
    return np.stack([series["post_mix_next_attn"][1][:, -1],
                     series["post_mix_next_ffn"][1][:, -1]], axis=1)
