"""Weight initialisation schemes (their entry variances: ``postnorm.theory.kernel_variance``).

Every matrix is stored as ``[fan_in, fan_out]`` and drawn i.i.d. with zero mean. The entry
variance of each scheme (docs/MATH.md §2e) is

=================  =====================================  ==========================================
scheme             distribution                           entry variance
=================  =====================================  ==========================================
``torch_default``  U(-1/sqrt(fan_in), 1/sqrt(fan_in))     1 / (3 fan_in)   (PyTorch nn.Linear)
``normal_0.02``    N(0, 0.02^2)                           4e-4
``lecun_normal``   truncated normal                       1 / fan_in
``xavier``         U(-b, b), b = sqrt(6/(fan_in+fan_out))  2 / (fan_in + fan_out)
``xavier_normal``  N(0, 2/(fan_in+fan_out))              2 / (fan_in + fan_out)   (DeepNet's draw)
=================  =====================================  ==========================================

``torch_default`` gives attention amount s = d^2 sigma_V^2 sigma_O^2 = 1/9 and FFN amount
xi = d d_ff sigma_up^2 sigma_down^2 = 1/9 with gate scale a = 1/sqrt(3), so xi*m(1) ~= 0.011:
the paper's value.

Token embeddings are N(0, 1) (PyTorch nn.Embedding), so the residual stream starts at RMS 1,
the scale RMSNorm keeps it at; ``normal_0.02`` uses N(0, 0.02^2) for embeddings too.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp

from postnorm.theory import INIT_SCHEMES

Initializer = Callable[..., jax.Array]


def _torch_default(key: jax.Array, shape: tuple[int, ...], dtype=jnp.float32) -> jax.Array:
    bound = 1.0 / jnp.sqrt(shape[0])
    return jax.random.uniform(key, shape, dtype, -bound, bound)


def kernel_init(scheme: str, gain: float = 1.0) -> Initializer:
    """Initializer for a ``[fan_in, fan_out]`` matrix under ``scheme``, times ``gain``."""
    if scheme == "torch_default":
        base = _torch_default
    elif scheme == "normal_0.02":
        base = jax.nn.initializers.normal(0.02)
    elif scheme == "lecun_normal":
        base = jax.nn.initializers.lecun_normal()
    elif scheme == "xavier":
        base = jax.nn.initializers.xavier_uniform()
    elif scheme == "xavier_normal":  # untruncated, as torch.nn.init.xavier_normal_
        base = jax.nn.initializers.variance_scaling(1.0, "fan_avg", "normal")
    else:
        raise ValueError(f"model.init={scheme!r} is not one of {INIT_SCHEMES}")
    if gain == 1.0:
        return base
    return lambda key, shape, dtype=jnp.float32: base(key, shape, dtype) * jnp.asarray(gain, dtype)


def embedding_init(scheme: str) -> Initializer:
    """Initializer for the ``[vocab, d_model]`` token embedding under ``scheme``."""
    if scheme not in INIT_SCHEMES:
        raise ValueError(f"model.init={scheme!r} is not one of {INIT_SCHEMES}")
    return jax.nn.initializers.normal(0.02 if scheme == "normal_0.02" else 1.0)
