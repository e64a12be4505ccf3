"""A config's programs: ``build_programs`` is the one way from a config to the jitted steps."""

import copy
import dataclasses
import functools
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import optax
from absl import logging
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from postnorm.config.schema import ConfigError
from postnorm.model import PLACEMENTS, Decoder, ModelSpec, param_counts
from postnorm.model.admin import profiled_params
from postnorm.model.attention_choice import AUTO, choose_attention, unrunnable
from postnorm.model.layers import ATTENTION_KERNELS
from postnorm.model.repair import grad_repair_from_config
from postnorm.model.similarity_init import with_similarity_init
from postnorm.runtime.mesh import batch_sharding, make_mesh, mesh_shape, tree_shardings
from postnorm.runtime.multihost import from_process_0, stop_together
from postnorm.runtime.xla_options import XlaOptions, compiler_options
from postnorm.train.losses import Loss, make_loss
from postnorm.train.optim import make_optimizer
from postnorm.train.placement_control import PlacementControl, placement_control
from postnorm.train.state import GuardedState, guard
from postnorm.train.steps import Batch, diag_step, eval_step, train_step, with_update_norms


@dataclasses.dataclass(frozen=True)
class CompiledSteps:
    """The state's shardings, a sharded initializer and the jitted steps.

    ``profile``: the arrangement's profiling pass on a batch (Admin's omega,
    ``postnorm.model.admin``), which a fresh state takes before its first step
    (``train.experiment.initial_state``); None for an arrangement without one.
    """

    state_shardings: GuardedState
    abstract_state: GuardedState
    init: Callable[[int], GuardedState]
    profile: Callable[[GuardedState, Batch], GuardedState] | None
    train: Callable[[GuardedState, Batch], tuple[GuardedState, dict[str, jax.Array]]]
    diag: Callable[[GuardedState, Batch], tuple[GuardedState, dict[str, jax.Array], dict]]
    evaluate: Callable[[GuardedState, Batch], jax.Array]


def compile_steps(spec: ModelSpec, tx: optax.GradientTransformation, schedule: optax.Schedule,
                  mesh: Mesh, loss: Loss, *, halt_on_nonfinite: bool = True,
                  xla_options: XlaOptions | None = None,
                  placement: PlacementControl | None = None,
                  monitor_acts: bool = False) -> CompiledSteps:
    """Build the shardings of the state and jit every step against ``mesh``.

    ``halt_on_nonfinite``: freeze the state at the first non-finite step (policies ``abort``
    and ``rollback``) rather than only skipping that step's update (``skip``).
    ``xla_options``: XLA options for every step's compilation (``runtime.xla_options``).
    ``placement``: the adaptive placement's controller, run by the diagnostic step.
    ``monitor_acts``: the state counts the early-warning monitor's actions.
    """
    jit = functools.partial(jax.jit, compiler_options=xla_options or None)
    model = Decoder(spec)
    tokens_1xL = jnp.zeros((1, spec.max_len), jnp.int32)

    def init_params(rng: jax.Array):
        return model.init(rng, tokens_1xL)["params"]

    arrangement = PLACEMENTS[spec.norm]
    initial_mix = (jnp.asarray(arrangement.post_mix(spec)) if arrangement.stateful_mix
                   else None)

    def init_state(seed: int) -> GuardedState:
        params = nn.unbox(init_params(jax.random.key(seed)))
        return GuardedState.create_guarded(apply_fn=model.apply, params=params, tx=tx,
                                           post_mix=initial_mix, monitor_acts=monitor_acts)

    param_shardings = tree_shardings(mesh, jax.eval_shape(init_params, jax.random.key(0)))
    abstract = jax.eval_shape(init_state, 0)
    replicated = NamedSharding(mesh, PartitionSpec())
    opt_shardings = optax.tree_map_params(
        tx, lambda _, sharding: sharding, abstract.opt_state, param_shardings,
        transform_non_params=lambda _: replicated)
    shardings = abstract.replace(step=replicated, params=param_shardings, opt_state=opt_shardings,
                                 skipped_steps=replicated, halted_at=replicated,
                                 lr_scale=replicated, rollbacks=replicated,
                                 post_mix=None if initial_mix is None else replicated,
                                 monitor_actions=replicated if monitor_acts else None)
    abstract_state = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)

    data_sharding = batch_sharding(mesh)
    batch_shardings = {"inputs": data_sharding, "targets": data_sharding}

    def profile_state(state: GuardedState, batch: Batch) -> GuardedState:
        return state.replace(params=profiled_params(spec, state.params, batch["inputs"]))

    return CompiledSteps(
        state_shardings=shardings,
        abstract_state=abstract_state,
        init=jit(init_state, static_argnums=0, out_shardings=shardings),
        profile=(jit(profile_state, in_shardings=(shardings, batch_shardings),
                     out_shardings=shardings, donate_argnums=0)
                 if arrangement.profiled else None),
        train=jit(guard(functools.partial(train_step, schedule=schedule, loss=loss),
                        halt=halt_on_nonfinite),
                  in_shardings=(shardings, batch_shardings),
                  out_shardings=(shardings, replicated), donate_argnums=0),
        diag=jit(with_update_norms(guard(functools.partial(diag_step, schedule=schedule,
                                                           loss=loss, placement=placement,
                                                           repair=spec.grad_repair is not None),
                                         halt=halt_on_nonfinite)),
                 in_shardings=(shardings, batch_shardings),
                 out_shardings=(shardings, replicated, replicated), donate_argnums=0),
        evaluate=jit(eval_step, in_shardings=(shardings, batch_shardings),
                     out_shardings=replicated),
    )


def resolve_attention(config: ml_collections.ConfigDict, recorded: str | None = None,
                      xla_options: XlaOptions | None = None) -> ml_collections.ConfigDict:
    """``config`` itself, or with ``model.attention=auto`` a copy naming the kernel to run:
    ``choose_attention``'s on process 0 (``recorded``, the kernel a resumed run started with,
    where it can run; else the fastest that can), logged with the reason, and the same on
    every process. When process 0 cannot choose, or another host cannot run its choice, every
    process raises."""
    if config.model.attention != AUTO:
        return config
    config = copy.deepcopy(config)
    config.model.attention = "blocked"  # a placeholder: the probe sets each kernel
    spec = ModelSpec.from_config(config.model, vocab_size=2, max_len=config.data.seq_len)
    data, fsdp, _ = mesh_shape(config.mesh, jax.device_count())
    batch = max(config.data.batch_size // (data * fsdp), 1)  # per device
    index, why, failure = -1, "process 0's choice", None
    if jax.process_index() == 0:
        try:
            kernel, why = choose_attention(spec, batch=batch, platform=jax.default_backend(),
                                           recorded=recorded, xla_options=xla_options)
            index = ATTENTION_KERNELS.index(kernel)
        except Exception as err:  # every process raises below, none waits for process 0
            failure = err
    index = from_process_0(index)
    if failure is not None:
        raise failure
    if index < 0:
        raise ConfigError("model.attention=auto: process 0 could not choose a kernel; its log "
                          "says why")
    kernel = ATTENTION_KERNELS[index]

    def runnable_here() -> None:
        if why_not := unrunnable(kernel, spec, jax.default_backend()):
            raise ConfigError(f"model.attention=auto chose {kernel!r} on process 0, which "
                              f"cannot run on this host ({why_not}): set model.attention for "
                              "every host")

    stop_together(runnable_here, lambda: ConfigError(
        f"model.attention=auto chose {kernel!r}, which another host cannot run: its log says "
        "why; set model.attention for every host"))
    logging.info("model.attention=auto -> %s: %s", kernel, why)
    config.model.attention = kernel
    return config


@dataclasses.dataclass(frozen=True)
class Programs:
    """What a config compiles to: the config it was built from (``model.attention`` resolved),
    the model's spec, the device mesh, the jitted steps and the XLA options they compile with."""

    config: ml_collections.ConfigDict
    spec: ModelSpec
    mesh: Mesh
    steps: CompiledSteps
    xla_options: XlaOptions


def build_programs(config: ml_collections.ConfigDict, vocab_size: int, *,
                   recorded_attention: str | None = None,
                   xla_options: XlaOptions | None = None) -> Programs:
    """The programs of a validated ``config`` for a vocabulary of ``vocab_size``: the
    attention kernel resolved (``resolve_attention``), the spec, the mesh over every device,
    the optimizer, the loss and the jitted steps, compiled with ``xla_options`` (default: the
    config's ``runtime.xla_options``)."""
    if xla_options is None:
        xla_options = compiler_options(config.runtime.xla_options)
    config = resolve_attention(config, recorded_attention, xla_options)
    spec = with_similarity_init(
        ModelSpec.from_config(config.model, vocab_size=vocab_size, max_len=config.data.seq_len,
                              grad_repair=grad_repair_from_config(config.train)),
        config.model.init_tsim_target, config.model.init_tsim_input)
    if spec.grad_repair is not None:
        logging.info("gradient repair: factor min(1/c, %.4f) per residual norm where c < %g "
                     "(train.grad_repair_max=%g over the stack)",
                     spec.grad_repair.sublayer_cap(spec.n_layers), spec.grad_repair.threshold,
                     spec.grad_repair.max_total)
    if config.model.init_tsim_target:
        logging.info("similarity-aware init: W_O gain %.4f (the mean-field recursion's tsim "
                     "<= model.init_tsim_target=%g from input tsim %g)", spec.attn_out_gain,
                     config.model.init_tsim_target, config.model.init_tsim_input)
    logging.info("parameters: %s", ", ".join(f"{k}={v:,}" for k, v in param_counts(spec).items()))
    mesh = make_mesh(config.mesh)
    logging.info("mesh: %s", ", ".join(f"{axis}={size}" for axis, size in mesh.shape.items()))
    tx, schedule = make_optimizer(config.opt, config.train.steps,
                                  monitor_action=config.monitor.action,
                                  n_layers=config.model.n_layers)
    steps = compile_steps(spec, tx, schedule, mesh, make_loss(config),
                          halt_on_nonfinite=config.train.nonfinite != "skip",
                          xla_options=xla_options, placement=placement_control(config),
                          monitor_acts=config.monitor.action != "none")
    return Programs(config, spec, mesh, steps, xla_options)
