"""The adaptive norm placement's controller (the paper's improvement 1): how each sublayer's
Post-Norm share lambda moves, from the diagnostic step's own statistics.

It runs inside the diagnostic step (``postnorm.train.steps.diag_step``), so lambda moves at the
diagnostic steps (``postnorm.diagnostics.schedule``), without a host round trip, identically on
every process, and is kept or thrown away with the rest of the step by the non-finite guard.
lambda is part of the training state, so a checkpoint holds it and a resume continues from it.
"""

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections


@dataclasses.dataclass(frozen=True)
class PlacementControl:
    """Per sublayer: lambda <- lambda - rate_down where the mean contraction c of its Post norm
    is under ``c_min`` or the token similarity at its input is over ``tsim_max`` (the collapse's
    two signatures), else lambda + rate_up; clipped to [0, 1]."""

    c_min: float
    tsim_max: float
    rate_down: float
    rate_up: float

    def __call__(self, mix_Lx2: jax.Array, forward: dict[str, jax.Array]) -> jax.Array:
        c_Lx2 = jnp.stack([forward["c_mean_attn"], forward["c_mean_ffn"]], axis=1)
        tsim_Lx2 = jnp.stack([forward["tsim_attn"], forward["tsim_ffn"]], axis=1)
        alarm = (c_Lx2 < self.c_min) | (tsim_Lx2 > self.tsim_max)
        moved = jnp.where(alarm, mix_Lx2 - self.rate_down, mix_Lx2 + self.rate_up)
        return jnp.clip(moved, 0.0, 1.0).astype(mix_Lx2.dtype)


def placement_control(config: ml_collections.ConfigDict) -> PlacementControl | None:
    """The controller ``config`` trains with: None unless model.norm is ``adaptive`` with
    ``train.placement_controller`` (without it lambda stays at its initial profile)."""
    t = config.train
    if config.model.norm != "adaptive" or not t.placement_controller:
        return None
    return PlacementControl(float(t.placement_c_min), float(t.placement_tsim_max),
                            float(t.placement_rate_down), float(t.placement_rate_up))
