"""Config validation, run before anything is built or compiled.

Each failure raises ``ConfigError`` naming the field, its value and what is allowed.
"""

import math
from collections.abc import Callable

import jax
import ml_collections
import numpy as np
from absl import logging

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

SCHEDULES = ("cosine", "constant")


def _get(config: ml_collections.ConfigDict, path: str):
    node = config
    for part in path.split("."):
        if part not in node:
            raise ConfigError(f"config field {path} is missing")
        node = node[part]
    return node


def _require(config, path: str, ok: Callable[[object], bool], allowed: str) -> None:
    value = _get(config, path)
    if not ok(value):
        finite = "finite and " if isinstance(value, float) and not math.isfinite(value) else ""
        raise ConfigError(f"{path}={value!r} is invalid: must be {finite}{allowed}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    """A finite int or float (not a bool)."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return False
    return isinstance(v, int) or math.isfinite(v)


def _positive_int(config, path: str) -> None:
    _require(config, path, lambda v: _is_int(v) and v >= 1, "an integer >= 1")


def _one_of(config, path: str, choices: tuple[str, ...]) -> None:
    _require(config, path, lambda v: v in choices, f"one of {list(choices)}")


def check_model(config: ml_collections.ConfigDict) -> None:
    for path in ("model.n_layers", "model.d_model", "model.n_heads", "model.d_ff"):
        _positive_int(config, path)
    _one_of(config, "model.norm", tuple(PLACEMENTS))
    _one_of(config, "model.positions", POSITION_SCHEMES)
    _one_of(config, "model.init", INIT_SCHEMES)
    _one_of(config, "model.dtype", tuple(DTYPES))
    _one_of(config, "model.attention", (AUTO, *ATTENTION_KERNELS))
    _positive_int(config, "model.attention_block")
    _positive_int(config, "model.scan_unroll")
    _one_of(config, "model.remat", tuple(REMAT_POLICIES))
    _require(config, "model.tie_embeddings", lambda v: isinstance(v, bool), "true or false")
    _require(config, "model.norm_eps", lambda v: _is_num(v) and 0 <= v < 1, "in [0, 1)")
    _require(config, "model.rope_base", lambda v: _is_num(v) and v > 1, "a number > 1")
    _require(config, "model.qk_norm", lambda v: isinstance(v, bool), "true or false")
    _require(config, "model.mixln_post_fraction", lambda v: _is_num(v) and 0 <= v <= 1,
             "in [0, 1]")
    _require(config, "model.b2t_rescaled_init", lambda v: isinstance(v, bool), "true or false")
    _require(config, "model.adaptive_initial_mix", lambda v: _is_num(v) and 0 <= v <= 1,
             "in [0, 1]")
    _check_adaptive_profile(config)
    if config.model.b2t_rescaled_init and config.model.norm != "b2t":
        raise ConfigError(f"model.b2t_rescaled_init=True is an option of model.norm='b2t', not "
                          f"of {config.model.norm!r}: set it False or model.norm='b2t'")
    _require(config, "model.init_tsim_target", lambda v: _is_num(v) and 0 <= v < 1,
             "in [0, 1) (0 disables the similarity-aware init)")
    _require(config, "model.init_tsim_input", lambda v: _is_num(v) and 0 <= v < 1, "in [0, 1)")
    _one_of(config, "model.residual_budget", BUDGET_MODES)
    _require(config, "model.residual_budget_c", lambda v: _is_num(v) and 0 < v <= 1, "in (0, 1]")
    _require(config, "model.residual_budget_weight", lambda v: _is_num(v) and v >= 0,
             "a number >= 0")
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
    _require(config, "model.adaptive_profile", lambda v: isinstance(v, str),
             "a text of numbers separated by spaces, or ''")
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
    _one_of(config, "opt.optimizer", OPTIMIZERS)
    _require(config, "opt.momentum", lambda v: _is_num(v) and 0 <= v < 1, "in [0, 1)")
    _require(config, "opt.lr", lambda v: _is_num(v) and v > 0, "a number > 0")
    _one_of(config, "opt.schedule", SCHEDULES)
    _require(config, "opt.warmup_steps", lambda v: _is_int(v) and v >= 0, "an integer >= 0")
    _require(config, "opt.min_lr_ratio", lambda v: _is_num(v) and 0 <= v <= 1, "in [0, 1]")
    for path in ("opt.b1", "opt.b2"):
        _require(config, path, lambda v: _is_num(v) and 0 <= v < 1, "in [0, 1)")
    _require(config, "opt.eps", lambda v: _is_num(v) and v > 0, "a number > 0")
    _require(config, "opt.weight_decay", lambda v: _is_num(v) and v >= 0, "a number >= 0")
    _require(config, "opt.clip_norm", lambda v: _is_num(v) and v >= 0,
             "a number >= 0 (0 disables clipping)")
    _require(config, "opt.decay_norms_and_embeddings", lambda v: isinstance(v, bool),
             "true or false")
    for path in ("opt.z_loss", "opt.diversity_weight"):
        _require(config, path, lambda v: _is_num(v) and v >= 0, "a number >= 0 (0 disables it)")
    _require(config, "opt.diversity_cap", lambda v: _is_num(v) and v > 0, "a number > 0")


def check_train(config: ml_collections.ConfigDict) -> None:
    for path in ("train.steps", "train.log_every", "train.eval_every", "train.eval_batches",
                 "train.ckpt_every", "train.keep_ckpts", "train.max_rollbacks", "diag.every",
                 "diag.dense_every"):
        _positive_int(config, path)
    _require(config, "diag.dense_until", lambda v: _is_int(v) and v >= 0,
             "an integer >= 0 (0: no dense phase)")
    _one_of(config, "train.nonfinite", NONFINITE_POLICIES)
    _require(config, "train.rollback_lr_factor", lambda v: _is_num(v) and 0 < v < 1,
             "a number in (0, 1)")
    _require(config, "train.placement_controller", lambda v: isinstance(v, bool),
             "true or false")
    _one_of(config, "train.placement_signal", SIGNALS)
    _require(config, "train.placement_c_min", lambda v: _is_num(v) and 0 < v <= 1, "in (0, 1]")
    _require(config, "train.placement_gain_min", lambda v: _is_num(v) and 0 < v <= 1,
             "in (0, 1] (a Pre-Norm sublayer's backward gain is about 1)")
    _require(config, "train.placement_tsim_max", lambda v: _is_num(v) and 0 < v <= 1,
             "in (0, 1]")
    for path in ("train.placement_rate_down", "train.placement_rate_up"):
        _require(config, path, lambda v: _is_num(v) and 0 <= v <= 1, "in [0, 1]")
    _require(config, "train.grad_repair", lambda v: isinstance(v, bool), "true or false")
    _require(config, "train.grad_repair_max", lambda v: _is_num(v) and v >= 1,
             "a number >= 1 (the most the factors may multiply to over the stack)")
    _require(config, "train.grad_repair_threshold", lambda v: _is_num(v) and 0 < v <= 1,
             "in (0, 1] (the contraction c under which a token is repaired)")
    _positive_int(config, "monitor.warn_persistence")
    _require(config, "monitor.warn_loss_rtol", lambda v: _is_num(v) and v > 0, "a number > 0")
    _one_of(config, "monitor.action", MONITOR_ACTIONS)
    _require(config, "monitor.rollback", lambda v: isinstance(v, bool), "true or false")
    _positive_int(config, "monitor.max_actions")
    for path in ("monitor.lr_factor", "monitor.clip_factor"):
        _require(config, path, lambda v: _is_num(v) and 0 < v <= 1, "in (0, 1]")
    for path in ("monitor.layer_lr_factor", "monitor.clip_norm"):
        _require(config, path, lambda v: _is_num(v) and v > 0, "a number > 0")
    # the data pipeline's shuffle seeds (seed + epoch) must fit in 32 bits
    _require(config, "seed", lambda v: _is_int(v) and 0 <= v < 2**31, "an integer in [0, 2**31)")


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
    for path in ("mesh.fsdp", "mesh.tensor"):
        _positive_int(config, path)
    _require(config, "mesh.data", lambda v: _is_int(v) and (v >= 1 or v == -1),
             "an integer >= 1, or -1 to use every remaining device")
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
    _positive_int(config, "data.batch_size")
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
    _one_of(config, "runtime.allocator", ALLOCATORS)
    _one_of(config, "runtime.log_level", tuple(LOG_LEVELS))
    _require(config, "runtime.compilation_cache_dir", lambda v: isinstance(v, str),
             "a directory path, or '' for no cache")
    _require(config, "runtime.xla_options", lambda v: isinstance(v, str),
             "a string of XLA compile options (name=value, separated by spaces), or '' for "
             "XLA's defaults")
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
