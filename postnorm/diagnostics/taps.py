"""Backward taps: statistics of g = dL/dX at residual-stream boundaries, with no extra buffers.

``tap(x, probe)`` is the identity in the forward pass. Its backward pass returns ``g``
unchanged as the cotangent of ``x`` and, as the cotangent of the small zero ``probe``, the
statistics of ``g`` (docs/MATH.md §4), summed over the batch:

* ``grad_sq``   ||g||_F^2
* ``mean_sq``   ||Pi_1 g||_F^2, the token-mean component (per sequence)
* ``repair_sq`` ||g - Pi_1 g||_F^2, the zero-mean "repair" component

So ``jax.grad`` of the loss with respect to a stack of probes *is* the stack of statistics.
Probes are float32 ``[N_TAP_STATS]`` arrays, one per tap; under ``nn.scan`` they are scanned
inputs of shape ``[n_layers, ...]``.
"""

import jax
import jax.numpy as jnp

from postnorm.diagnostics.stats import in_stats_scope

TAP_STATS = ("grad_sq", "mean_sq", "repair_sq")
# Their square roots as the diagnostics name them: ||g||_F, ||Pi_1 g||_F, ||(I - Pi_1) g||_F.
TAP_NORM_NAMES = ("dldx_norm", "dldx_mean_norm", "dldx_repair_norm")
N_TAP_STATS = len(TAP_STATS)


@in_stats_scope
def gradient_stats(g_BxLxD: jax.Array) -> jax.Array:
    """[||g||^2, ||Pi_1 g||^2, ||g - Pi_1 g||^2] in float32."""
    g = g_BxLxD.astype(jnp.float32)
    mean_Bx1xD = jnp.mean(g, axis=1, keepdims=True)
    length = g.shape[1]
    return jnp.stack([jnp.sum(g * g), length * jnp.sum(mean_Bx1xD * mean_Bx1xD),
                      jnp.sum((g - mean_Bx1xD) ** 2)])


@jax.custom_vjp
def tap(x_BxLxD: jax.Array, probe_S: jax.Array) -> jax.Array:
    """Identity on ``x``; the cotangent of ``probe_S`` becomes ``gradient_stats(dL/dx)``."""
    del probe_S
    return x_BxLxD


def _tap_fwd(x_BxLxD: jax.Array, probe_S: jax.Array) -> tuple[jax.Array, None]:
    del probe_S
    return x_BxLxD, None


def _tap_bwd(_: None, g_BxLxD: jax.Array) -> tuple[jax.Array, jax.Array]:
    return g_BxLxD, gradient_stats(g_BxLxD)


tap.defvjp(_tap_fwd, _tap_bwd)


def zero_probes(n_layers: int) -> dict[str, jax.Array]:
    """Probes for the attention and FFN inputs of every layer and for the final hidden state."""
    return {"layers": jnp.zeros((n_layers, 2, N_TAP_STATS), jnp.float32),
            "final": jnp.zeros((N_TAP_STATS,), jnp.float32)}
