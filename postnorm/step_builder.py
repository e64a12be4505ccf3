"""Jitted, sharded train / diagnostic / eval steps and the sharded state initializer.

Parameter shardings come from the params' logical axes; the optimizer state mirrors them.
Both update steps take ``(state, batch)``, donate the old state and return the new one with
the same shardings, so the loop can alternate between them freely. Both are guarded against
non-finite steps (``postnorm.nonfinite``).
"""

import dataclasses
import functools
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from postnorm.diag_step import diag_step, with_update_norms
from postnorm.model import Decoder, ModelSpec
from postnorm.nonfinite import GuardedState, guard
from postnorm.sharding import batch_sharding, tree_shardings
from postnorm.steps import Batch, eval_step, train_step
from postnorm.xla_options import XlaOptions


@dataclasses.dataclass(frozen=True)
class CompiledSteps:
    """The state's shardings, a sharded initializer and the jitted steps."""

    state_shardings: GuardedState
    abstract_state: GuardedState
    init: Callable[[int], GuardedState]
    train: Callable[[GuardedState, Batch], tuple[GuardedState, dict[str, jax.Array]]]
    diag: Callable[[GuardedState, Batch], tuple[GuardedState, dict[str, jax.Array], dict]]
    evaluate: Callable[[GuardedState, Batch], jax.Array]


def compile_steps(spec: ModelSpec, tx: optax.GradientTransformation, schedule: optax.Schedule,
                  mesh: Mesh, *, halt_on_nonfinite: bool = True,
                  compiler_options: XlaOptions | None = None) -> CompiledSteps:
    """Build the shardings of the state and jit every step against ``mesh``.

    ``halt_on_nonfinite``: freeze the state at the first non-finite step (policies ``abort``
    and ``rollback``) rather than only skipping that step's update (``skip``).
    ``compiler_options``: XLA options for every step's compilation (``postnorm.xla_options``).
    """
    jit = functools.partial(jax.jit, compiler_options=compiler_options or None)
    model = Decoder(spec)
    tokens_1xL = jnp.zeros((1, spec.max_len), jnp.int32)

    def init_params(rng: jax.Array):
        return model.init(rng, tokens_1xL)["params"]

    def init_state(seed: int) -> GuardedState:
        params = nn.unbox(init_params(jax.random.key(seed)))
        return GuardedState.create_guarded(apply_fn=model.apply, params=params, tx=tx)

    param_shardings = tree_shardings(mesh, jax.eval_shape(init_params, jax.random.key(0)))
    abstract = jax.eval_shape(init_state, 0)
    replicated = NamedSharding(mesh, PartitionSpec())
    opt_shardings = optax.tree_map_params(
        tx, lambda _, sharding: sharding, abstract.opt_state, param_shardings,
        transform_non_params=lambda _: replicated)
    shardings = abstract.replace(step=replicated, params=param_shardings, opt_state=opt_shardings,
                                 skipped_steps=replicated, halted_at=replicated,
                                 lr_scale=replicated, rollbacks=replicated)
    abstract_state = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)

    data_sharding = batch_sharding(mesh)
    batch_shardings = {"inputs": data_sharding, "targets": data_sharding}
    return CompiledSteps(
        state_shardings=shardings,
        abstract_state=abstract_state,
        init=jit(init_state, static_argnums=0, out_shardings=shardings),
        train=jit(guard(functools.partial(train_step, schedule=schedule),
                        halt=halt_on_nonfinite),
                  in_shardings=(shardings, batch_shardings),
                  out_shardings=(shardings, replicated), donate_argnums=0),
        diag=jit(with_update_norms(guard(functools.partial(diag_step, schedule=schedule),
                                         halt=halt_on_nonfinite)),
                 in_shardings=(shardings, batch_shardings),
                 out_shardings=(shardings, replicated, replicated), donate_argnums=0),
        evaluate=jit(eval_step, in_shardings=(shardings, batch_shardings),
                     out_shardings=replicated),
    )
