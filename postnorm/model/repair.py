"""Gradient repair (the paper's improvement 2): undo the RMSNorm contraction on the backward
signal at the input y of every residual norm.

A residual norm N(y) passes dL/dy = c (I - n n^T / d) dL/dN back, with c = rms(gain) / r(y),
r(y) = sqrt(||y||^2 / d + eps) per token (the diagnostics' c). In Post-Norm every path from
layer k to the loss passes the norms above it, so these factors compound towards early layers.
``repair_gradient`` is the identity forward; backward it multiplies dL/dy per token by

    f = min(1 / c, cap)   where c < threshold,   1 elsewhere,

and ``cap = max_total^(1 / (2 n_layers))``: over the stack's 2 n_layers residual norms the
factors multiply to at most ``max_total`` (``train.grad_repair_max``), which bounds the
amplification any layer's gradient receives. The factor is computed from the forward's values
and is not differentiated. The repaired gradient is not the loss's gradient: the diagnostic
step reports its cosine with the true one (``postnorm.train.steps``).
"""

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class GradRepair:
    """Gradient repair's rule: the cumulative bound ``max_total`` on the factors over the stack
    and the contraction ``threshold`` under which a token's factor applies."""

    max_total: float
    threshold: float = 1.0

    def sublayer_cap(self, n_layers: int) -> float:
        """Each residual norm's cap: ``max_total`` spread evenly over 2 n_layers norms."""
        return self.max_total ** (1.0 / (2 * n_layers))


def repair_factor(y_BxLxD: jax.Array, scale_D: jax.Array, eps: float, cap: float,
                  threshold: float) -> jax.Array:
    """f per token, [B, L, 1], in float32 and outside the gradient."""
    y = jax.lax.stop_gradient(y_BxLxD).astype(jnp.float32)
    scale = jax.lax.stop_gradient(scale_D).astype(jnp.float32)
    r_BxLx1 = jnp.sqrt(jnp.mean(y * y, axis=-1, keepdims=True) + eps)
    c_BxLx1 = jnp.sqrt(jnp.mean(scale * scale)) / r_BxLx1
    return jnp.where(c_BxLx1 < threshold, jnp.minimum(1.0 / c_BxLx1, cap), 1.0)


@jax.custom_vjp
def repair_gradient(y_BxLxD: jax.Array, factor_BxLx1: jax.Array) -> jax.Array:
    """Identity on ``y``; backward, ``dL/dy * factor`` (and no gradient for ``factor``)."""
    del factor_BxLx1
    return y_BxLxD


def _repair_fwd(y_BxLxD: jax.Array, factor_BxLx1: jax.Array) -> tuple[jax.Array, jax.Array]:
    return y_BxLxD, factor_BxLx1


def _repair_bwd(factor_BxLx1: jax.Array, g_BxLxD: jax.Array) -> tuple[jax.Array, jax.Array]:
    return g_BxLxD * factor_BxLx1.astype(g_BxLxD.dtype), jnp.zeros_like(factor_BxLx1)


repair_gradient.defvjp(_repair_fwd, _repair_bwd)


def repaired(y_BxLxD: jax.Array, scale_D: jax.Array, eps: float, cap: float,
             threshold: float) -> jax.Array:
    """``y`` with its backward signal repaired by the factor of a norm of gain ``scale_D``."""
    return repair_gradient(y_BxLxD, repair_factor(y_BxLxD, scale_D, eps, cap, threshold))


def grad_repair_from_config(train_cfg) -> GradRepair | None:
    """The rule of ``train.grad_repair``, ``train.grad_repair_max`` and
    ``train.grad_repair_threshold``; None when repair is off."""
    if not train_cfg.grad_repair:
        return None
    return GradRepair(float(train_cfg.grad_repair_max), float(train_cfg.grad_repair_threshold))
