"""benchmarks.op_groups on real compiled steps: the diagnostic step's statistics (forward
statistics, backward taps, per-layer norms) form their own group; the train step has none."""

import collections

from benchmarks.op_groups import hlo_op_names, op_group
from benchmarks.programs import timed_programs
from configs.default import get_config


def _groups(program) -> collections.Counter:
    names = hlo_op_names(program.compiled.as_text())
    return collections.Counter(op_group(op_name, hlo_name)[:2]
                               for hlo_name, op_name in names.items())


def test_the_diagnostic_statistics_are_a_group_of_their_own():
    config = get_config("model.n_layers=2,model.d_model=32,model.d_ff=64,data.seq_len=32,"
                        "data.batch_size=8")
    programs, _ = timed_programs(config, ["train", "diag"], vocab=64)
    train, diag = _groups(programs["train"]), _groups(programs["diag"])
    assert not [g for g in train if g[0] == "diag_stats"], train
    assert diag[("diag_stats", "forward")] > 0, diag  # tsim, c, attention rows, effective rank
    assert diag[("diag_stats", "backward")] > 0, diag  # the taps' gradient statistics
    # Everything else the two steps share is grouped the same way.
    for group in ("attn", "attn_core", "ffn", "norm_attn", "norm_ffn", "Decoder.logits"):
        for direction in ("forward", "backward"):
            assert (train[(group, direction)] > 0) == (diag[(group, direction)] > 0)
