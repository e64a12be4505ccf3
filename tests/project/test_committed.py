"""The comparison of regenerated results with committed ones (tests/committed.py)."""

import math

import numpy as np

from tests.committed import REL_TOL, differences, text_differences


def test_floats_a_few_ulps_apart_match_and_real_changes_do_not():
    committed = {"cells": [{"step_time_vs_post": 0.958682161050505, "done": 3, "runs": ["a"]}]}
    recomputed = {"cells": [{"step_time_vs_post": 0.9586821610505051, "done": 3, "runs": ["a"]}]}
    assert differences(recomputed, committed) == []
    value = 0.958682161050505
    assert differences(np.nextafter(value, 2.0, dtype=np.float64).item() * (1 + 5 * 2 ** -52),
                       value) == []
    assert differences(value * (1 + 10 * REL_TOL), value) != []
    assert differences(float("nan"), float("nan")) == []
    assert differences(math.nan, 0.0) != []


def test_anything_but_a_float_must_be_equal():
    assert differences({"a": 1}, {"a": 2}) != []
    assert differences({"a": 1}, {"b": 1}) != []
    assert differences([1.0], [1.0, 2.0]) != []
    assert differences({"v": True}, {"v": 1}) != []
    assert differences({"s": "yes"}, {"s": "no"}) != []
    assert differences(None, 0.0) != []


def test_text_tolerates_one_unit_of_the_last_printed_digit_only():
    committed = "| b2t | 3/3 | 0.959 | +0.012 | 1.2e-05 |\n"
    assert text_differences("| b2t | 3/3 | 0.958 | +0.012 | 1.2e-05 |\n", committed) == []
    assert text_differences("| b2t | 3/3 | 0.959 | +0.013 | 1.3e-05 |\n", committed) == []
    assert text_differences("| b2t | 3/3 | 0.957 | +0.012 | 1.2e-05 |\n", committed) != []
    assert text_differences("| b2t | 3/3 | 0.9590 | +0.012 | 1.2e-05 |\n", committed) != []
    assert text_differences("| b2t | 2/3 | 0.959 | +0.012 | 1.2e-05 |\n", committed) != []
    assert text_differences("| pre | 3/3 | 0.959 | +0.012 | 1.2e-05 |\n", committed) != []
    assert text_differences(committed + "| extra |\n", committed) != []
