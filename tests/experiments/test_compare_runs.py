"""experiments.compare_runs: two runs' metrics compared value for value."""

import json
import math

from experiments.compare_runs import by_step, compare
from postnorm.files import dumps


def write_run(path, records):
    path.mkdir()
    (path / "metrics.jsonl").write_text("".join(dumps(r) + "\n" for r in records))
    return str(path)


def test_equal_runs_and_one_changed_value(tmp_path):
    records = [{"step": 1, "train/loss": 5.0, "train/tokens_per_s": 10.0},
               {"step": 2, "train/loss": math.nan, "diag/tsim_attn/layer_00": 0.25}]
    a = write_run(tmp_path / "a", records)
    b_records = json.loads(json.dumps(records).replace("10.0", "99.0").replace("NaN", '"nan"'))
    b = write_run(tmp_path / "b", b_records + [{"step": 3, "train/loss": 4.0}])
    same = compare(by_step(a, 0), by_step(b, 0))
    assert (same["common_steps"], same["equal_values"], same["differing_values"]) == (2, 3, 0)
    assert same["timing_values_left_out"] == 1 and same["steps_only_in_b"] == [3]
    b_records[1]["diag/tsim_attn/layer_00"] = 0.25000003
    c = write_run(tmp_path / "c", b_records)
    changed = compare(by_step(a, 0), by_step(c, 0))
    assert changed["differing_values"] == 1
    assert changed["first_differences"] == [{"step": 2, "key": "diag/tsim_attn/layer_00",
                                             "a": 0.25, "b": 0.25000003}]
    assert compare(by_step(a, 1), by_step(c, 1))["common_steps"] == 1
