"""Config validation, run before anything is built or compiled.

Each failure raises ``ConfigError`` naming the field, its value and what is allowed.
"""

import difflib
import math
from collections.abc import Callable

import jax
import ml_collections
from absl import logging

from configs.default import base_config
from postnorm.allocator import ALLOCATORS
from postnorm.data import check_data_config
from postnorm.initializers import INIT_SCHEMES
from postnorm.kernels.build import register_attention_kernels
from postnorm.kernels.causal_attention import HEAD_DIMS
from postnorm.layers import ATTENTION_KERNELS
from postnorm.model import DTYPES, NORM_PLACEMENTS, POSITION_SCHEMES, REMAT_POLICIES
from postnorm.nonfinite import NONFINITE_POLICIES
from postnorm.run_config import config_data, flatten_fields
from postnorm.sharding import mesh_shape
from postnorm.xla_options import XlaOptionsError, parse_xla_options

SCHEDULES = ("cosine", "constant")


class ConfigError(ValueError):
    """An invalid config field; the message names the field and the allowed values."""


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
    _one_of(config, "model.norm", NORM_PLACEMENTS)
    _one_of(config, "model.positions", POSITION_SCHEMES)
    _one_of(config, "model.init", INIT_SCHEMES)
    _one_of(config, "model.dtype", tuple(DTYPES))
    _one_of(config, "model.attention", ATTENTION_KERNELS)
    _positive_int(config, "model.attention_block")
    _positive_int(config, "model.scan_unroll")
    _one_of(config, "model.remat", tuple(REMAT_POLICIES))
    if config.model.attention == "cudnn" and config.model.dtype != "bfloat16":
        raise ConfigError("model.attention='cudnn' needs model.dtype='bfloat16' (cuDNN attention "
                          "has no float32 kernel); set model.dtype=bfloat16 or "
                          "model.attention=xla")
    _require(config, "model.tie_embeddings", lambda v: isinstance(v, bool), "true or false")
    _require(config, "model.norm_eps", lambda v: _is_num(v) and 0 <= v < 1, "in [0, 1)")
    _require(config, "model.rope_base", lambda v: _is_num(v) and v > 1, "a number > 1")
    d, heads = config.model.d_model, config.model.n_heads
    if d % heads:
        raise ConfigError(f"model.d_model={d} is not divisible by model.n_heads={heads}")
    if config.model.positions == "rope" and (d // heads) % 2:
        raise ConfigError(f"model.positions='rope' needs an even head dim, but "
                          f"model.d_model/model.n_heads = {d}/{heads} = {d // heads}")
    if config.model.attention == "cpu":
        check_cpu_kernel(config)


def check_cpu_kernel(config: ml_collections.ConfigDict) -> None:
    """The shapes and dtype the C++ kernel of ``model.attention='cpu'`` is built for."""
    d, heads = config.model.d_model, config.model.n_heads
    if config.model.dtype != "float32":
        raise ConfigError(f"model.attention='cpu' computes in float32, but model.dtype="
                          f"{config.model.dtype!r}; set model.dtype=float32 or "
                          "model.attention=blocked")
    if d // heads > HEAD_DIMS[-1]:
        raise ConfigError(f"model.attention='cpu' takes head dims up to {HEAD_DIMS[-1]}, but "
                          f"model.d_model/model.n_heads = {d}/{heads} = {d // heads}; change "
                          "them or set model.attention=blocked")


def check_opt(config: ml_collections.ConfigDict) -> None:
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


def check_train(config: ml_collections.ConfigDict) -> None:
    for path in ("train.steps", "train.log_every", "train.eval_every", "train.eval_batches",
                 "train.ckpt_every", "train.keep_ckpts", "train.max_rollbacks", "diag.every"):
        _positive_int(config, path)
    _one_of(config, "train.nonfinite", NONFINITE_POLICIES)
    _require(config, "train.rollback_lr_factor", lambda v: _is_num(v) and 0 < v < 1,
             "a number in (0, 1)")
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
    # Parameter axes split over the mesh (postnorm.sharding): embed over fsdp; heads (the
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
    if config.model.attention == "cudnn" and platform != "gpu":
        raise ConfigError(f"model.attention='cudnn' needs a GPU, but JAX runs on {platform!r}; "
                          "set model.attention=xla or einsum")
    if config.model.attention == "cpu" and platform != "cpu":
        raise ConfigError(f"model.attention='cpu' is a CPU kernel, but JAX runs on {platform!r}; "
                          "set model.attention=xla (or cudnn on a GPU)")
    if config.model.attention == "cpu":
        register_attention_kernels()


def check_runtime(config: ml_collections.ConfigDict) -> None:
    """Process settings: the heap allocator (``postnorm.allocator``), the compilation cache
    directory (``postnorm.compilation_cache``) and the XLA compile options' syntax
    (``postnorm.xla_options``; whether XLA knows them is checked before compiling)."""
    _one_of(config, "runtime.allocator", ALLOCATORS)
    _require(config, "runtime.compilation_cache_dir", lambda v: isinstance(v, str),
             "a directory path, or '' for no cache")
    _require(config, "runtime.xla_options", lambda v: isinstance(v, str),
             "a string of XLA compile options (name=value, separated by spaces), or '' for "
             "XLA's defaults")
    try:
        parse_xla_options(config.runtime.xla_options)
    except XlaOptionsError as err:
        raise ConfigError(str(err)) from None


def check_fields(config: ml_collections.ConfigDict) -> None:
    """Every field is one the trainer reads: those of ``configs/default.py``'s base config
    (a misspelt field would otherwise be ignored, and its default used)."""
    known = flatten_fields(config_data(base_config()))
    unknown = [k for k in flatten_fields(config_data(config)) if k not in known]
    if unknown:
        close = difflib.get_close_matches(unknown[0], known, n=1, cutoff=0.8)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ConfigError(f"unknown config field {unknown[0]}{hint}: the fields are those of "
                          "configs/default.py's base_config(); rename or remove it"
                          + (f" (also unknown: {', '.join(unknown[1:])})" if unknown[1:] else ""))


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
