"""The config's declarations (postnorm.config.fields): one per field, each rule applied, and the
schema's history (what each version added, what a resume may change) derived from them."""

import dataclasses

import pytest

from configs.default import get_config
from postnorm.config import base_config, config_data
from postnorm.config.checks import ChoiceInCode, number
from postnorm.config.fields import (
    DEFAULTS,
    FIELDS,
    METHODS,
    RESUMABLE_SECTIONS,
    SECTIONS,
    VERSIONS,
)
from postnorm.config.identity import (
    FIELDS_ADDED,
    PROCESS_SECTIONS,
    RESUMABLE_FIELDS,
    earlier_versions,
    flatten_fields,
    matches,
)
from postnorm.config.schema import ConfigError
from postnorm.model import ModelSpec
from postnorm.train.validate import CHOICES, check_all_but_data, declared_check

CHECKED = [f for f in FIELDS if f.check is not None]

# What each earlier schema version lacked: history, fixed once a version has recorded runs (a
# change here would let an old record resume as another config, or refuse it).
HISTORY = [
    {"model.qk_norm", "model.mixln_post_fraction", "model.b2t_rescaled_init",
     "model.init_tsim_target", "model.init_tsim_input", "model.residual_budget",
     "model.residual_budget_c", "model.residual_budget_weight", "model.adaptive_initial_mix",
     "train.placement_controller", "train.placement_c_min", "train.placement_tsim_max",
     "train.placement_rate_down", "train.placement_rate_up"},
    {"opt.z_loss", "opt.diversity_weight", "opt.diversity_cap", "train.grad_repair",
     "train.grad_repair_max", "train.grad_repair_threshold", "opt.optimizer", "opt.momentum",
     *(f"monitor.{name}" for name in ("warn_persistence", "warn_loss_rtol", "action", "rollback",
                                       "max_actions", "lr_factor", "layer_lr_factor",
                                       "clip_norm", "clip_factor"))},
    {"diag.dense_every", "diag.dense_until"},
    {"train.placement_signal", "train.placement_gain_min", "model.adaptive_profile"},
]


def test_each_field_is_declared_once_and_the_config_holds_them_in_order():
    paths = [f.path for f in FIELDS]
    assert len(paths) == len(set(paths))
    assert list(flatten_fields(config_data(base_config()))) == paths
    assert {f.section for f in FIELDS} == {"", *SECTIONS}
    assert all(f.help for f in FIELDS)
    assert all(m.help for m in METHODS.values())


def test_every_rule_passes_its_default_and_rejects_a_bad_value_naming_the_field():
    assert set(CHOICES) == {f.path for f in FIELDS if isinstance(f.check, ChoiceInCode)}
    for field in CHECKED:
        check = declared_check(field)
        assert check.problem(field.path, field.default) is None, field.path
        bad = next(v for v in (-1, 0, 1.5, 2**31, "?", None) if not check.ok(v))
        assert check.problem(field.path, bad).startswith(f"{field.path}={bad!r} is invalid: ")


@pytest.mark.parametrize("field", CHECKED, ids=[f.path for f in CHECKED])
def test_validation_applies_every_declared_rule(field):
    check = declared_check(field)
    bad = next(v for v in (-1, 0, 1.5, 2**31, "?", None) if not check.ok(v))
    config = get_config()
    *section, name = field.path.split(".")
    node = config[section[0]] if section else config
    del node[name]  # re-added untyped, as a config file could define it
    node[name] = bad
    with pytest.raises(ConfigError) as error:
        check_all_but_data(config, device_count=1, platform="cpu")
    assert str(error.value) == check.problem(field.path, bad)


def test_number_states_its_range_as_its_error_says_it():
    half_open = number("in (0, 1]")
    assert [half_open.ok(v) for v in (0, 1e-9, 1, 1.0 + 1e-9, True)] == [0, 1, 1, 0, 0]
    open_ = number("a number in (0, 1)")
    assert [open_.ok(v) for v in (0.0, 0.5, 1.0)] == [0, 1, 0]
    integer = number("an integer >= 0 (0: no dense phase)")
    assert [integer.ok(v) for v in (-1, 0, 3, 3.0)] == [0, 1, 1, 0]
    above = number("a number > 1")
    assert [above.ok(v) for v in (1, 1.5, float("inf"))] == [0, 1, 0]
    assert above.problem("x", float("inf")) == "x=inf is invalid: must be finite and a number > 1"
    with pytest.raises(ValueError, match="state"):
        number("between 0 and 1")


def test_resumable_fields_are_those_declared_resumable():
    assert all(f.resumable for f in FIELDS if f.section in RESUMABLE_SECTIONS)
    assert {f"{s}.*" for s in RESUMABLE_SECTIONS} <= set(RESUMABLE_FIELDS)
    for field in FIELDS:
        if field.section not in PROCESS_SECTIONS:
            assert matches(field.path, RESUMABLE_FIELDS) == field.resumable, field.path


def test_each_version_added_the_fields_that_history_records():
    """Later versions append groups; the recorded ones stay as they were."""
    assert [set(group) for group in FIELDS_ADDED[:len(HISTORY)]] == HISTORY
    assert {f.added for f in FIELDS} - {None} == set(VERSIONS)


def test_a_field_away_from_its_default_rules_out_the_versions_before_it():
    defaults = flatten_fields(config_data(base_config()))
    versions = earlier_versions(config_data(base_config()), defaults)
    order = list(VERSIONS)
    for since, older in enumerate(versions):
        lacks = set(defaults) - set(flatten_fields(older))
        assert lacks == {f.path for f in FIELDS if f.added and order.index(f.added) >= since}
    for field in FIELDS:
        if field.added:
            config = get_config()
            value = (not field.default if isinstance(field.default, bool)
                     else field.default + "x" if isinstance(field.default, str)
                     else field.default + 1)
            *section, name = field.path.split(".")
            config[section[0]][name] = value
            since = order.index(field.added)
            kept = earlier_versions(config_data(config), defaults)
            assert len(kept) == len(VERSIONS) - since - 1, field.path


def test_a_methods_options_live_in_the_sections_it_reads():
    for name, method in METHODS.items():
        assert {f.section for f in method.options} == set(method.reads), name


def test_the_model_spec_takes_the_declared_defaults_and_every_model_field_it_names():
    spec_defaults = {f.name: f.default for f in dataclasses.fields(ModelSpec)}
    options = [f for m in METHODS.values() for f in m.options if f.section == "model"]
    for field in options:
        name = field.path.split(".")[1]
        if name in spec_defaults:
            assert spec_defaults[name] == DEFAULTS[field.path], field.path
    model = get_config("model.attention=einsum,model.mixln_post_fraction=0.5").model
    spec = ModelSpec.from_config(model, vocab_size=8, max_len=4)
    for name in spec_defaults.keys() & model.keys():
        assert getattr(spec, name) == model[name], name
