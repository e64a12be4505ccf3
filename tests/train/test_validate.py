"""Config validation: one case per rule, each error naming the field and what is allowed.

The data fields' rules (``postnorm.data.config``) are tested in tests/data/test_config.py and
tests/cli/test_main.py; ``test_every_config_field_has_a_rule`` checks that every field of the
default config is covered by a case here or there.
"""

import ml_collections
import pytest

from configs.default import get_config
from postnorm.config import base_config
from postnorm.config.schema import ConfigError
from postnorm.data import DataError
from postnorm.train.loop import train_and_evaluate
from postnorm.train.validate import check_config, check_vocab_layout
from tests.reliability_helpers import tiny_config, write_corpus

POSITIVE_INT = "must be an integer >= 1"
UNIT = r"must be in \[0, 1\)"

# (field, bad value, expected message); every rule of postnorm.train.validate.
CASES = [
    ("model.n_layers", 0, POSITIVE_INT),
    ("model.n_layers", "4", POSITIVE_INT),
    ("model.d_model", -8, POSITIVE_INT),
    ("model.n_heads", 2.0, POSITIVE_INT),
    ("model.d_ff", True, POSITIVE_INT),
    ("model.norm", "rezero", r"must be one of \['post', 'pre', 'deepnorm', 'mixln', 'sandwich', "
                             r"'periln', 'b2t', 'adaptive', 'admin'\]"),
    ("model.adaptive_initial_mix", 1.5, r"must be in \[0, 1\]"),
    ("train.placement_controller", "on", "must be true or false"),
    ("train.placement_c_min", 0.0, r"must be in \(0, 1\]"),
    ("train.placement_tsim_max", 1.5, r"must be in \(0, 1\]"),
    ("train.placement_rate_down", -0.1, r"must be in \[0, 1\]"),
    ("train.placement_rate_up", 2, r"must be in \[0, 1\]"),
    ("train.placement_signal", "both", r"must be one of \['post_input_c', 'two_way'\]"),
    ("train.placement_gain_min", 0.0, r"must be in \(0, 1\]"),
    ("model.adaptive_profile", "1 1", "is an option of model.norm='adaptive', not of 'post'"),
    ("model.mixln_post_fraction", 1.5, r"must be in \[0, 1\]"),
    ("model.b2t_rescaled_init", "yes", "must be true or false"),
    ("model.b2t_rescaled_init", True, "is an option of model.norm='b2t'"),
    ("model.qk_norm", 1, "must be true or false"),
    ("model.init_tsim_target", 1.0, r"in \[0, 1\) \(0 disables"),
    ("model.init_tsim_input", -0.1, UNIT),
    ("model.residual_budget", "clip", r"must be one of \['none', 'scale', 'penalty'\]"),
    ("model.residual_budget_c", 1.5, r"must be in \(0, 1\]"),
    ("model.residual_budget_weight", -1.0, "must be a number >= 0"),
    ("model.positions", "alibi", r"must be one of \['rope', 'learned', 'none'\]"),
    ("model.init", "he", "model.init='he' is invalid: must be one of"),
    ("model.dtype", "float16", r"must be one of \['float32', 'bfloat16'\]"),
    ("model.attention", "flash",
     r"must be one of \['auto', 'einsum', 'blocked', 'xla', 'cudnn', 'cpu'\]"),
    ("model.attention_block", 0, POSITIVE_INT),
    ("model.scan_unroll", 0, POSITIVE_INT),
    ("model.attention", "cudnn", "needs model.dtype='bfloat16'"),
    ("model.remat", "some", r"must be one of \['none', 'dots', 'dots_no_batch', 'full'\]"),
    ("model.tie_embeddings", 1, "must be true or false"),
    ("model.norm_eps", 1.0, UNIT),
    ("model.rope_base", 1, "must be a number > 1"),
    ("model.n_heads", 5, "model.d_model=36 is not divisible by model.n_heads=5"),
    ("model.n_heads", 4, "needs an even head dim"),
    ("opt.lr", 0.0, "must be a number > 0"),
    ("opt.schedule", "linear", r"must be one of \['cosine', 'constant'\]"),
    ("opt.warmup_steps", -1, "must be an integer >= 0"),
    ("opt.min_lr_ratio", 1.5, r"must be in \[0, 1\]"),
    ("opt.b1", 1.0, UNIT),
    ("opt.b2", -0.1, UNIT),
    ("opt.eps", 0, "must be a number > 0"),
    ("opt.weight_decay", -0.1, "must be a number >= 0"),
    ("opt.clip_norm", -1.0, "must be a number >= 0"),
    ("opt.z_loss", -1e-4, "must be a number >= 0"),
    ("monitor.warn_persistence", 0, POSITIVE_INT),
    ("monitor.warn_loss_rtol", -0.1, "must be a number > 0"),
    ("monitor.action", "rollback", r"must be one of \['none', 'lr_scale', 'layer_lr', 'clip'\]"),
    ("monitor.rollback", "yes", "must be true or false"),
    ("monitor.max_actions", 0, POSITIVE_INT),
    ("monitor.lr_factor", 1.5, r"must be in \(0, 1\]"),
    ("monitor.layer_lr_factor", 0, "must be a number > 0"),
    ("monitor.clip_norm", -1, "must be a number > 0"),
    ("monitor.clip_factor", 0, r"must be in \(0, 1\]"),
    ("opt.optimizer", "lion", r"must be one of \['adamw', 'sgd'\]"),
    ("opt.momentum", 1.0, r"must be in \[0, 1\)"),
    ("train.grad_repair", 1, "must be true or false"),
    ("train.grad_repair_max", 0.5, "must be a number >= 1"),
    ("train.grad_repair_threshold", 1.5, r"must be in \(0, 1\]"),
    ("opt.diversity_weight", "0.1", "must be a number >= 0"),
    ("opt.diversity_cap", 0.0, "must be a number > 0"),
    ("opt.decay_norms_and_embeddings", "no", "must be true or false"),
    ("train.steps", 0, POSITIVE_INT),
    ("train.log_every", 0, POSITIVE_INT),
    ("train.eval_every", 0, POSITIVE_INT),
    ("train.eval_batches", 0, POSITIVE_INT),
    ("train.ckpt_every", 0, POSITIVE_INT),
    ("train.keep_ckpts", 0, POSITIVE_INT),
    ("train.max_rollbacks", 0, POSITIVE_INT),
    ("train.nonfinite", "ignore", r"must be one of \['abort', 'skip', 'rollback'\]"),
    ("train.rollback_lr_factor", 1.0, r"must be a number in \(0, 1\)"),
    ("train.rollback_lr_factor", 0, r"must be a number in \(0, 1\)"),
    ("diag.every", 0, POSITIVE_INT),
    ("diag.dense_every", 0, POSITIVE_INT),
    ("diag.dense_until", -1, r"must be an integer >= 0 \(0: no dense phase\)"),
    ("seed", 1.5, "must be an integer"),
    ("seed", -1, r"must be an integer in \[0, 2\*\*31\)"),
    ("opt.lr", float("inf"), "opt.lr=inf is invalid: must be finite and a number > 0"),
    ("opt.eps", float("inf"), "must be finite and a number > 0"),
    ("opt.weight_decay", float("inf"), "must be finite and a number >= 0"),
    ("model.rope_base", float("inf"), "must be finite and a number > 1"),
    ("mesh.fsdp", 0, POSITIVE_INT),
    ("runtime.allocator", "jemalloc", r"must be one of \['auto', 'system', 'tcmalloc'\]"),
    ("runtime.log_level", "loud", r"must be one of \['debug', 'info', 'warning', 'error'\]"),
    ("runtime.compilation_cache_dir", None, "must be a directory path, or '' for no cache"),
    ("runtime.xla_options", None, r"must be a string of XLA compile options \(name=value, "),
    ("runtime.xla_options", "xla_cpu_enable_fast_math", "runtime.xla_options="
     "'xla_cpu_enable_fast_math': 'xla_cpu_enable_fast_math' is not name=value"),
    ("mesh.tensor", -1, POSITIVE_INT),
    ("mesh.data", -2, "must be an integer >= 1, or -1"),
    ("mesh.data", 3, "give 3 devices but 8 are available"),
    ("mesh.tensor", 16, r"mesh.fsdp=1 x mesh.tensor=16 = 16 must divide the 8 devices "
                        r"available \(mesh.data=-1 takes the rest\)"),
    ("mesh.fsdp", 3, "mesh.fsdp=3 x mesh.tensor=1 = 3 must divide the 8 devices"),
    ("mesh.fsdp", 8, "model.d_model=36 must be divisible by mesh.fsdp=8"),
    ("mesh.tensor", 8, "model.d_model=36 must be divisible by mesh.tensor=8"),
    ("mesh.tensor", 2, "model.d_ff=191 must be divisible by mesh.tensor=2"),
    ("data.batch_size", 0, POSITIVE_INT),
    ("data.batch_size", 12, "divisible by mesh data x fsdp = 8 x 1 = 8"),
]

# Data fields: their rules' tests in tests/data/test_config.py and tests/cli/test_main.py.
DATA_FIELD_TESTS = {
    "data.source": "tests/data/test_config.py::test_bad_fields_are_named",
    "data.data_dir": "tests/data/test_config.py::test_data_dir_that_is_a_file",
    "data.text_files": "tests/data/test_config.py::test_glob_matching_nothing",
    "data.c4_version": "tests/cli/test_main.py::test_cli_missing_c4_says_where_it_looked",
    "data.seq_len": "tests/data/test_config.py::test_bad_fields_are_named",
    "data.batch_size": "CASES above",
    "data.tokenizer": "tests/data/test_config.py::test_bad_fields_are_named",
    "data.vocab_size": "tests/data/test_config.py::test_bad_fields_are_named",
    "data.tokenizer_path": "tests/data/test_config.py::test_invalid_tokenizer_file",
    "data.lfreq_sample_docs": "tests/data/test_config.py::test_bad_fields_are_named",
}


def _valid_config():
    """The default config with d_model=36 (2 heads of 18) and d_ff=191, so divisibility by
    the mesh can fail."""
    config = get_config()
    config.model.d_model, config.model.n_heads, config.model.d_ff = 36, 2, 191
    return config


def test_a_valid_config_passes():
    check_config(_valid_config(), device_count=8)


@pytest.mark.parametrize("field,value,message", CASES,
                         ids=[f"{f}={v!r}" for f, v, _ in CASES])
def test_each_rule_names_the_field_and_what_is_allowed(field, value, message):
    config = _valid_config()
    *section, name = field.split(".")
    node = config[section[0]] if section else config
    del node[name]  # re-added untyped, as a config file could define it
    node[name] = value
    with pytest.raises(ConfigError, match=message) as error:
        check_config(config, device_count=8)
    assert field in str(error.value)


def test_missing_field_is_named():
    config = _valid_config()
    del config.train["nonfinite"]
    with pytest.raises(ConfigError, match="config field train.nonfinite is missing"):
        check_config(config, device_count=8)


def test_an_unknown_field_is_named_with_the_nearest_known_one():
    config = _valid_config()
    config.model.n_layer = 2  # a config file's typo for n_layers
    config.extra = ml_collections.ConfigDict({"x": 1})
    with pytest.raises(ConfigError, match=r"unknown config field model.n_layer \(did you mean "
                                          r"model.n_layers\?\): .*\(also unknown: extra.x\)"):
        check_config(config, device_count=8)


def test_batch_must_split_over_processes():
    config = _valid_config()
    config.data.batch_size, config.mesh.data = 9, 1
    with pytest.raises(ConfigError, match=r"data.batch_size=9 .* processes \(2\)"):
        check_config(config, device_count=1, process_count=2)


def test_vocabulary_must_split_over_tensor():
    config = _valid_config()
    config.mesh.tensor, config.data.tokenizer = 2, "byte"
    with pytest.raises(ConfigError, match="vocabulary size 259 .*'byte'.* mesh.tensor=2"):
        check_vocab_layout(config, vocab_size=259, device_count=8)
    check_vocab_layout(config, vocab_size=258, device_count=8)


def test_validation_split_too_small_fails_before_training(tmp_path):
    config = tiny_config(write_corpus(tmp_path / "corpus"), tmp_path / "tfds",
                         train__eval_batches=1000)
    workdir = tmp_path / "run"
    with pytest.raises(DataError, match="gives only .* batches .* not 1000"):
        train_and_evaluate(config, str(workdir))
    assert not (workdir / "metrics.jsonl").exists()
    assert not list((workdir / "checkpoints").iterdir())


def _leaf_fields(config: ml_collections.ConfigDict, prefix: str = "") -> set[str]:
    fields = set()
    for key, value in config.items():
        if isinstance(value, ml_collections.ConfigDict):
            fields |= _leaf_fields(value, f"{prefix}{key}.")
        else:
            fields.add(f"{prefix}{key}")
    return fields


def test_every_config_field_has_a_rule():
    covered = {field for field, _, _ in CASES} | set(DATA_FIELD_TESTS)
    assert _leaf_fields(base_config()) - covered == set()


def test_cudnn_attention_needs_a_gpu():
    config = _valid_config()
    config.model.attention, config.model.dtype = "cudnn", "bfloat16"
    with pytest.raises(ConfigError, match="model.attention='cudnn' needs a GPU, but JAX runs on"):
        check_config(config, device_count=8, platform="cpu")
    check_config(config, device_count=8, platform="gpu")


def test_a_warmup_longer_than_the_run_is_warned_about(caplog):
    config = _valid_config()
    config.train.steps, config.opt.warmup_steps = 10, 40
    check_config(config, device_count=8)
    assert "opt.warmup_steps=40 exceeds train.steps=10: the learning rate rises to only 0.25 " \
        "of opt.lr=0.001" in caplog.text
    caplog.clear()
    config.opt.warmup_steps = 10
    check_config(config, device_count=8)
    assert "warmup" not in caplog.text
