"""Config validation, run before anything is built or compiled.

Each failure raises ``ConfigError`` naming the field, its value and what is allowed.
"""

import jax
import ml_collections
import numpy as np
from absl import logging

from postnorm.config.checks import Check, ChoiceInCode, Field
from postnorm.config.fields import FIELDS
from postnorm.config.schema import ConfigError, check_fields
from postnorm.data import check_data_config
from postnorm.kernels.build import register_attention_kernels
from postnorm.model import DTYPES, PLACEMENTS, POSITION_SCHEMES, REMAT_POLICIES
from postnorm.model.attention_choice import ALTERNATIVES, AUTO, backend_refusal, config_refusal
from postnorm.model.layers import ATTENTION_KERNELS, BUDGET_MODES
from postnorm.model.placements import profile_values
from postnorm.runtime.allocator import ALLOCATORS
from postnorm.runtime.console import LOG_LEVELS
from postnorm.runtime.mesh import mesh_shape
from postnorm.runtime.xla_options import XlaOptionsError, parse_xla_options
from postnorm.theory import INIT_SCHEMES
from postnorm.train.optim import MONITOR_ACTIONS, OPTIMIZERS
from postnorm.train.placement_control import SIGNALS
from postnorm.train.state import NONFINITE_POLICIES


def _get(config: ml_collections.ConfigDict, path: str):
    node = config
    for part in path.split("."):
        if part not in node:
            raise ConfigError(f"config field {path} is missing")
        node = node[part]
    return node


# The choices of the fields declared ``one_of_code``, defined by the code that implements them.
CHOICES = {
    "model.norm": tuple(PLACEMENTS),
    "model.positions": POSITION_SCHEMES,
    "model.init": INIT_SCHEMES,
    "model.dtype": tuple(DTYPES),
    "model.attention": (AUTO, *ATTENTION_KERNELS),
    "model.remat": tuple(REMAT_POLICIES),
    "model.residual_budget": BUDGET_MODES,
    "opt.optimizer": OPTIMIZERS,
    "train.nonfinite": NONFINITE_POLICIES,
    "train.placement_signal": SIGNALS,
    "monitor.action": MONITOR_ACTIONS,
    "runtime.allocator": ALLOCATORS,
    "runtime.log_level": tuple(LOG_LEVELS),
}


def declared_check(field: Field) -> Check | None:
    """The rule ``field`` declares, its choices from ``CHOICES`` where the code defines them."""
    if isinstance(field.check, ChoiceInCode):
        return field.check.bind(CHOICES[field.path])
    return field.check


def _check_declared(config: ml_collections.ConfigDict, *sections: str) -> None:
    """Each field of ``sections`` ('' for the top-level ones) against its declared rule."""
    for field in FIELDS:
        check = declared_check(field) if field.section in sections else None
        if check and (problem := check.problem(field.path, _get(config, field.path))):
            raise ConfigError(problem)


def check_model(config: ml_collections.ConfigDict) -> None:
    _check_declared(config, "model")
    _check_adaptive_profile(config)
    if config.model.b2t_rescaled_init and config.model.norm != "b2t":
        raise ConfigError(f"model.b2t_rescaled_init=True is an option of model.norm='b2t', not "
                          f"of {config.model.norm!r}: set it False or model.norm='b2t'")
    budget, norm = config.model.residual_budget, config.model.norm
    if budget != "none" and not PLACEMENTS[norm].budgetable:
        raise ConfigError(f"model.residual_budget={budget!r} bounds the contraction c of the norm "
                          "on each residual sum X + F by scaling F, which model.norm="
                          f"{norm!r} does not allow (postnorm.model.placements, budgetable): set "
                          "it to 'none' or use "
                          + ", ".join(k for k, v in PLACEMENTS.items() if v.budgetable))
    target, t_input = config.model.init_tsim_target, config.model.init_tsim_input
    if (target and config.model.norm == "adaptive"
            and config.model.adaptive_initial_mix not in (0, 1)):
        raise ConfigError(f"model.init_tsim_target={target} solves with the mean-field "
                          "recursion, exact for lambda = 0 or 1 only (a mixture's FFN input is "
                          "taken as rows of RMS 1): set "
                          "model.adaptive_initial_mix to 0 or 1, or the target to 0")
    if target and config.model.adaptive_profile and not np.isin(
            profile_values(config.model.adaptive_profile, config.model.n_layers), (0, 1)).all():
        raise ConfigError(f"model.init_tsim_target={target} solves with the mean-field "
                          "recursion, exact for lambda = 0 or 1 only (a mixture's FFN input is "
                          "taken as rows of RMS 1): give "
                          "model.adaptive_profile 0s and 1s alone, or set the target to 0")
    if target and PLACEMENTS[config.model.norm].branch_output_norm:
        raise ConfigError(f"model.init_tsim_target={target} sets a gain on W_O, which "
                          f"model.norm={config.model.norm!r} undoes with the norm on each "
                          "branch's output: set it to 0 for this arrangement")
    if target and target <= t_input:
        raise ConfigError(f"model.init_tsim_target={target} is not above the input's token "
                          f"similarity model.init_tsim_input={t_input}: no attention gain keeps "
                          "tsim under it; raise the target or lower init_tsim_input")
    d, heads = config.model.d_model, config.model.n_heads
    if d % heads:
        raise ConfigError(f"model.d_model={d} is not divisible by model.n_heads={heads}")
    if config.model.positions == "rope" and (d // heads) % 2:
        raise ConfigError(f"model.positions='rope' needs an even head dim, but "
                          f"model.d_model/model.n_heads = {d}/{heads} = {d // heads}")
    kernel = config.model.attention
    if why := config_refusal(kernel, dtype=config.model.dtype, d_model=d, n_heads=heads):
        raise ConfigError(f"{why}; change that or set {ALTERNATIVES[kernel]}")


def _check_adaptive_profile(config: ml_collections.ConfigDict) -> None:
    """``model.adaptive_profile``: '' or 2 n_layers values in [0, 1], of ``model.norm=adaptive``
    alone, which then replace ``model.adaptive_initial_mix`` (left at its default)."""
    text = config.model.adaptive_profile
    if not text:
        return
    if config.model.norm != "adaptive":
        raise ConfigError(f"model.adaptive_profile is an option of model.norm='adaptive', not "
                          f"of {config.model.norm!r}: set it to '' or model.norm='adaptive'")
    if config.model.adaptive_initial_mix != 1:
        raise ConfigError("model.adaptive_profile gives lambda at init in place of "
                          "model.adaptive_initial_mix="
                          f"{config.model.adaptive_initial_mix}: leave that at 1 (its default)")
    try:
        profile_values(text, config.model.n_layers)
    except ValueError as err:
        raise ConfigError(f"{err}; give a run's final_post_mix as "
                          "postnorm.model.placements.profile_text writes it") from err


def check_opt(config: ml_collections.ConfigDict) -> None:
    _check_declared(config, "opt")


def check_train(config: ml_collections.ConfigDict) -> None:
    _check_declared(config, "train", "diag", "monitor", "")


def warn_about_the_schedule(config: ml_collections.ConfigDict) -> None:
    """Logs a warning when the warmup outlasts the run (valid, but seldom meant: the learning
    rate never reaches opt.lr)."""
    warmup, steps = config.opt.warmup_steps, config.train.steps
    if warmup > steps:
        logging.warning("opt.warmup_steps=%d exceeds train.steps=%d: the learning rate rises to "
                        "only %.3g of opt.lr=%g and the %s schedule after the warmup never "
                        "starts", warmup, steps, steps / warmup, config.opt.lr,
                        config.opt.schedule)


def check_layout(config: ml_collections.ConfigDict, *, device_count: int,
                 process_count: int) -> None:
    """Mesh shape against the devices, and batch divisibility over the mesh and processes."""
    _check_declared(config, "mesh")
    try:
        data, fsdp, tensor = mesh_shape(config.mesh, device_count)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    # Parameter axes split over the mesh (postnorm.runtime.mesh): embed over fsdp; heads (the
    # d_model-wide projection axis) and mlp over tensor.
    for field, size, axis, ways in (("model.d_model", config.model.d_model, "mesh.fsdp", fsdp),
                                    ("model.d_model", config.model.d_model, "mesh.tensor", tensor),
                                    ("model.d_ff", config.model.d_ff, "mesh.tensor", tensor)):
        if size % ways:
            raise ConfigError(f"{field}={size} must be divisible by {axis}={ways}, which "
                              "splits it across devices")
    _check_declared(config, "data")  # data.batch_size: the rest are postnorm.data's
    batch = config.data.batch_size
    if batch % (data * fsdp):
        raise ConfigError(f"data.batch_size={batch} must be divisible by mesh data x fsdp = "
                          f"{data} x {fsdp} = {data * fsdp}")
    if batch % process_count:
        raise ConfigError(f"data.batch_size={batch} must be divisible by the number of "
                          f"processes ({process_count})")


def check_vocab_layout(config: ml_collections.ConfigDict, *, vocab_size: int,
                       device_count: int) -> None:
    """The tokenizer's vocabulary (known once the data is loaded) against mesh.tensor."""
    _, _, tensor = mesh_shape(config.mesh, device_count)
    if vocab_size % tensor:
        raise ConfigError(
            f"the vocabulary size {vocab_size} (data.tokenizer={config.data.tokenizer!r}) must "
            f"be divisible by mesh.tensor={tensor}, which splits it across devices; pick a "
            "mesh.tensor that divides it or a tokenizer whose vocabulary it divides")


def check_backend(config: ml_collections.ConfigDict, *, platform: str) -> None:
    """Fields that need a particular accelerator (``platform``: ``jax.default_backend()``).

    ``model.attention='cpu'`` also builds its kernel here, so a missing compiler is reported
    (``KernelBuildError``) before any work starts.
    """
    kernel = config.model.attention
    if why := backend_refusal(kernel, platform=platform):
        raise ConfigError(f"{why}; set {ALTERNATIVES[kernel]}")
    if kernel == "cpu":
        register_attention_kernels()


def check_runtime(config: ml_collections.ConfigDict) -> None:
    """Process settings: the heap allocator (``postnorm.runtime.allocator``), the console's log
    level (``postnorm.runtime.console``), the compilation cache
    directory (``postnorm.runtime.compilation_cache``) and the XLA compile options' syntax
    (``postnorm.runtime.xla_options``; whether XLA knows them is checked before compiling)."""
    _check_declared(config, "runtime")
    try:
        parse_xla_options(config.runtime.xla_options)
    except XlaOptionsError as err:
        raise ConfigError(str(err)) from None


def check_config(config: ml_collections.ConfigDict, *, device_count: int,
                 process_count: int = 1, platform: str | None = None) -> None:
    """Validate every field the trainer reads (data fields: ``postnorm.data``).

    ``platform`` defaults to the running JAX backend.
    """
    check_all_but_data(config, device_count=device_count, process_count=process_count,
                       platform=platform)
    check_data_config(config.data)


def check_all_but_data(config: ml_collections.ConfigDict, *, device_count: int,
                       process_count: int = 1, platform: str | None = None) -> None:
    """``check_config`` less the data source's fields (for programs fed random tokens)."""
    check_fields(config)
    check_runtime(config)
    check_model(config)
    check_backend(config, platform=platform or jax.default_backend())
    check_opt(config)
    check_train(config)
    warn_about_the_schedule(config)
    check_layout(config, device_count=device_count, process_count=process_count)
