"""Admin's profiling pass (Liu et al. 2020): every sublayer's skip weight omega from a forward.

Admin's sublayer is X_i = N(omega_i * X_{i-1} + F_i(X_{i-1})). Its released code
(Transformer-Clinic, ``fairseq/modules/transformer_layer.py``, ``--init-type
adaptive-profiling``) sets omega in one forward at init, sublayer by sublayer through the whole
stack: omega_1 = 1, and omega_{i+1} = sqrt(Var[omega_i X_{i-1}] + Var[F_i(X_{i-1})]), each
variance over all entries of the batch, F_i computed in that same pass from X_{i-1} =
N(omega_{i-1} X_{i-2} + F_{i-1}), which used the omega just set. Since a norm's output has
variance about 1, omega_i^2 is about Var[X_0] + sum_{j<i} Var[F_j]: the paper's rule, with the
embedding's variance as the first term. Every feature of omega_i starts at that value, and
omega is then trained with the other parameters.
"""

import dataclasses

import jax
import jax.numpy as jnp
from flax import traverse_util

from postnorm.model.decoder import Decoder
from postnorm.model.layers import ADMIN_CARRY, ADMIN_PROFILE
from postnorm.model.placements import PLACEMENTS
from postnorm.model.spec import ModelSpec


def profiled_params(spec: ModelSpec, params: dict, tokens_BxL: jax.Array) -> dict:
    """``params`` (unboxed) with every ``admin_omega`` set by Admin's profiling pass on the batch
    ``tokens_BxL``: one forward of the decoder (jittable; deterministic)."""
    if not PLACEMENTS[spec.norm].profiled:
        raise ValueError(f"model.norm={spec.norm!r} has no profiling pass")
    model = Decoder(dataclasses.replace(spec, remat="none"))  # a forward only
    start = {"layers": {"ratio": jnp.ones((), jnp.float32)}}  # omega_1 = 1 (Block's variable)
    _, found = model.apply({"params": params, ADMIN_CARRY: start}, tokens_BxL,
                           mutable=[ADMIN_CARRY, ADMIN_PROFILE])
    flat = traverse_util.flatten_dict(params)
    omegas = traverse_util.flatten_dict(found[ADMIN_PROFILE])
    if not omegas or set(omegas) - set(flat):
        raise ValueError(f"the profiling pass set {sorted(omegas)}, which are not all "
                         "parameters of the model")
    return traverse_util.unflatten_dict({**flat, **omegas})
