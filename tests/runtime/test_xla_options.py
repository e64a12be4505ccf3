"""runtime.xla_options: parsing, refusal of unknown options, and identical numbers."""

import subprocess
import sys

import jax
import numpy as np
import pytest

from configs.default import get_config
from postnorm.config.schema import ConfigError
from postnorm.model import ModelSpec
from postnorm.runtime import xla_options
from postnorm.runtime.mesh import make_mesh
from postnorm.runtime.xla_options import XlaOptionsError, compiler_options, parse_xla_options
from postnorm.train.losses import Loss
from postnorm.train.optim import make_optimizer
from postnorm.train.programs import compile_steps
from postnorm.train.validate import check_runtime
from tests.reliability_helpers import REPO, config_flag, subprocess_env, write_corpus


def test_values_are_typed_and_empty_is_no_options():
    assert parse_xla_options("") == {}
    assert parse_xla_options(" a=true b=FALSE  c=3 d=0.5\te=fast f=-2 ") == {
        "a": True, "b": False, "c": 3, "d": 0.5, "e": "fast", "f": -2}


@pytest.mark.parametrize("text,item", [("fast", "fast"), ("a=1 =2", "=2"), ("a=", "a="),
                                       ("a=1,b=2", "a=1,b=2"), ("a=b=c", "a=b=c")])
def test_a_malformed_item_is_named(text, item):
    with pytest.raises(XlaOptionsError, match=f"runtime.xla_options='{text}': '{item}' is not "
                                              "name=value"):
        parse_xla_options(text)


def test_the_config_check_refuses_bad_syntax_and_xla_refuses_unknown_names():
    config = get_config()
    config.runtime.xla_options = "xla_cpu_enable_fast_math"
    with pytest.raises(ConfigError, match="'xla_cpu_enable_fast_math' is not name=value"):
        check_runtime(config)
    with pytest.raises(XlaOptionsError, match="runtime.xla_options='xla_cpu_bogus=1': "
                                              ".*No such compile option: 'xla_cpu_bogus'"):
        compiler_options("xla_cpu_bogus=1")
    assert compiler_options("xla_cpu_enable_fast_math=false") == {
        "xla_cpu_enable_fast_math": False}
    with pytest.raises(XlaOptionsError, match="'exec_time_optimization_effort=x': a value of "
                                              "the wrong type for a build option"):
        compiler_options("exec_time_optimization_effort=x")  # JAX sets it: a TypeError
    with pytest.raises(XlaOptionsError, match="'abc' is not a valid float value; remove"):
        compiler_options("xla_gpu_auto_spmd_partitioning_memory_budget_ratio=abc")


def test_a_number_for_a_float_or_string_option_is_passed_as_that_type():
    assert compiler_options("xla_gpu_auto_spmd_partitioning_memory_budget_ratio=1 "
                            "xla_dump_hlo_pass_re=2 xla_cpu_enable_fast_math=false") == {
        "xla_gpu_auto_spmd_partitioning_memory_budget_ratio": 1.0,
        "xla_dump_hlo_pass_re": "2", "xla_cpu_enable_fast_math": False}


def test_a_setting_that_passed_is_checked_once_per_process(monkeypatch):
    xla_options._checked_options.cache_clear()
    compiled = []
    real = xla_options._compile_trivial
    monkeypatch.setattr(xla_options, "_compile_trivial", lambda o: (compiled.append(o), real(o)))
    text = "xla_cpu_enable_fast_math=false xla_cpu_fast_math_honor_nans=true"
    first = compiler_options(text)
    first["xla_cpu_enable_fast_math"] = True  # the caller's copy, not the cached setting
    assert compiler_options(text) == {"xla_cpu_enable_fast_math": False,
                                      "xla_cpu_fast_math_honor_nans": True}
    assert len(compiled) == 1
    for _ in range(2):  # a refusal is not cached: it is checked, and raised, again
        with pytest.raises(XlaOptionsError):
            compiler_options("xla_cpu_bogus_twice=1")
    assert len(compiled) == 3


def _train(options, steps: int = 3):
    config = get_config("model.n_layers=3,model.d_model=32,model.d_ff=96,data.seq_len=32,"
                        "data.batch_size=8,model.attention=cpu")
    spec = ModelSpec.from_config(config.model, vocab_size=64, max_len=config.data.seq_len)
    tx, schedule = make_optimizer(config.opt, config.train.steps)
    compiled = compile_steps(spec, tx, schedule, make_mesh(config.mesh), Loss(),
                             xla_options=options)
    tokens = np.random.default_rng(0).integers(0, 64, (8, 33), np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    state, losses = compiled.init(0), []
    temp = compiled.train.lower(state, batch).compile().memory_analysis().temp_size_in_bytes
    for step in range(steps):
        step_fn = compiled.diag if step == 1 else compiled.train
        state, metrics, *_ = step_fn(state, batch)
        losses.append(float(metrics["train/loss"]))
    return losses, jax.device_get(state.params), temp


@pytest.mark.slow
def test_the_default_options_leave_every_number_unchanged():
    """The default options change which buffers XLA copies, not what it computes."""
    default = compiler_options(get_config().runtime.xla_options)
    losses, params, temp = _train(default)
    plain_losses, plain_params, plain_temp = _train({})
    assert temp < plain_temp  # the options reached the compilation
    assert losses == plain_losses
    jax.tree.map(np.testing.assert_array_equal, params, plain_params)


def test_main_stops_on_an_unknown_option_before_the_workdir(tmp_path):
    config = config_flag(write_corpus(tmp_path / "corpus"), tmp_path / "tfds",
                         runtime__xla_options="xla_cpu_enable_fast_math=false xla_cpu_bogus=true")
    result = subprocess.run([sys.executable, "main.py", "--config", config, "--workdir",
                             str(tmp_path / "run")], cwd=REPO, capture_output=True, text=True,
                            timeout=300, env=subprocess_env(None))
    assert result.returncode == 2, result.stderr[-3000:]
    assert ("postnorm: error: runtime.xla_options='xla_cpu_enable_fast_math=false xla_cpu_bogus="
            "true': INVALID_ARGUMENT: No such compile option: 'xla_cpu_bogus'; remove or correct "
            "the option") in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()
