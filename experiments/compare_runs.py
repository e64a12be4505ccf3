"""Compare two runs' ``metrics.jsonl`` value for value (a resume, a refactor, another kernel).

    python -m experiments.compare_runs RUN_A RUN_B [--after STEP]

Prints JSON: the steps both runs logged, how many of their values are equal (exactly, as
floats), the first differences, the steps only one run logged, and the number of timing
values left out (``train/tokens_per_s`` measures the machine, not the run). ``--after STEP``
compares only the steps after STEP (a run resumed from a checkpoint at STEP against an
uninterrupted one). Exits 1 when a shared value differs.
"""

import sys

from absl import app, flags

from postnorm.errors import exit_on_error
from postnorm.files import dumps
from postnorm.workdir.layout import Workdir
from postnorm.workdir.metrics import read_jsonl

flags.DEFINE_integer("after", 0, "Compare only the steps after this one.")
FLAGS = flags.FLAGS
TIMING = ("train/tokens_per_s",)
SHOWN = 10  # differences printed


def by_step(workdir: str, after: int) -> dict[int, dict[str, float]]:
    """{step: every value logged at it} of the run in ``workdir``, steps after ``after``."""
    steps: dict[int, dict[str, float]] = {}
    for record in read_jsonl(Workdir(workdir).metrics):
        step = record.pop("step")
        if step > after:
            steps.setdefault(step, {}).update(record)
    return steps


def _same(x: float | None, y: float | None) -> bool:
    """Equal as floats; NaN (a skipped step's loss) equals NaN."""
    return x == y or (isinstance(x, float) and isinstance(y, float) and x != x and y != y)


def compare(a: dict[int, dict[str, float]], b: dict[int, dict[str, float]]) -> dict:
    """The comparison ``main`` prints, of two ``by_step`` results."""
    common = sorted(set(a) & set(b))
    equal, differing, timing = 0, [], 0
    for step in common:
        for key in sorted(set(a[step]) | set(b[step])):
            if key in TIMING:
                timing += 1
            elif _same(a[step].get(key), b[step].get(key)):
                equal += 1
            else:
                differing.append({"step": step, "key": key, "a": a[step].get(key),
                                  "b": b[step].get(key)})
    return {"common_steps": len(common), "equal_values": equal,
            "differing_values": len(differing), "first_differences": differing[:SHOWN],
            "steps_only_in_a": sorted(set(a) - set(b)), "steps_only_in_b": sorted(set(b) - set(a)),
            "timing_values_left_out": timing}


def main(argv: list[str]) -> None:
    if len(argv) != 3:
        raise app.UsageError("give two run directories: RUN_A RUN_B")
    result = compare(by_step(argv[1], FLAGS.after), by_step(argv[2], FLAGS.after))
    print(dumps(result, indent=1))
    sys.exit(1 if result["differing_values"] else 0)


if __name__ == "__main__":
    app.run(exit_on_error(main))
