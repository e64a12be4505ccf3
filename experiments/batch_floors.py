"""The frequency floor of each training batch, from the data pipeline alone (no model).

    python -m experiments.batch_floors --config configs/default.py --seeds 0,1,2 [--steps N]
        [--next 32,128,512] [--out_dir DIR [--report_only]]

For each seed (data order) it reads the first ``--steps`` (default ``train.steps``) global
batches exactly as the trainer does and prints JSON: the mean and sd of their floors
(``postnorm.data.lfreq.frequency_floor``), the mean floor of the last three logged steps (the
batches a run's final loss is averaged over), L_freq and the data's fingerprint. It shows how
far one batch's floor scatters around L_freq, which is why the collapse rule compares a loss
with its own batches' floor (``postnorm.analysis.collapse``). With ``--next``, also the mean
floor of the first K batches after ``--steps`` for each K: the batches
``experiments/collapse.py --train_batches K`` scores a final checkpoint on.

With ``--out_dir DIR`` it also writes ``DIR/summary.json`` (that JSON, with each seed's floor of
every step 1..steps) and ``DIR/table.md`` (``floors_table``, the table the docs include).
``--report_only`` reads no data: it rewrites ``table.md`` from ``DIR/summary.json``.
"""

import itertools
import json
import os

import numpy as np
from absl import app, flags
from ml_collections import config_flags

from postnorm.analysis.tables import markdown_table
from postnorm.config.args import parse_flags
from postnorm.config.list_flags import integer_list
from postnorm.data import check_data_config, load_data
from postnorm.data.lfreq import frequency_floor
from postnorm.errors import exit_on_error
from postnorm.files import (
    dumps,
    from_text,
    make_output_dir,
    write_bytes_atomic,
    write_json_atomic,
)
from postnorm.train.validate import check_train

config_flags.DEFINE_config_file("config", "configs/default.py", "Config whose data is read.")
flags.DEFINE_list("seeds", ["0"], "Data-order seeds (integers in [0, 2**31)).")
flags.DEFINE_integer("steps", None, "Batches per seed (at least 2); default train.steps.",
                     lower_bound=2)
flags.DEFINE_list("next", [], "Counts K >= 1 of batches after --steps whose mean floor to "
                  "print.")
flags.DEFINE_string("out_dir", None, "Also write summary.json (with every step's floor) and "
                    "table.md here.")
flags.DEFINE_bool("report_only", False, "Read no data: rewrite --out_dir's table.md from its "
                  "summary.json.")
FLAGS = flags.FLAGS


def floors_per_step(config, seed: int, steps: int) -> np.ndarray:
    """float64[steps]: the floor of the global batch of steps 1..steps for data order ``seed``."""
    data = load_data(config.data, seed=seed)
    batches = data.train_iterator(batch_size=config.data.batch_size, seed=seed)
    return np.array([frequency_floor(batch["targets"], data.unigram_counts)
                     for batch in itertools.islice(batches, steps)])


def floors_table(summary: dict) -> str:
    """``table.md`` from a ``summary.json``: per data order the mean, sd and range of the floors
    of steps 1..steps, the mean floor of the last three logged steps and of each ``--next``
    count of batches after them; the data's fingerprint and L_freq below."""
    seeds = summary["seeds"]
    first = next(iter(seeds.values()))
    counts = sorted(first["mean_next"], key=int)
    header = ["data order (seed)", f"mean floor, steps 1–{summary['steps']}", "sd per batch",
              "range", "mean of steps " + "/".join(map(str, first["last_logged_steps"])),
              *(f"mean of the next {k} batches" for k in counts)]
    rows = [[str(seed), f"{s['mean']:.3f}", f"{s['sd']:.3f}", f"{s['min']:.2f}–{s['max']:.2f}",
             f"{s['mean_last_logged']:.3f}", *(f"{s['mean_next'][k]:.3f}" for k in counts)]
            for seed, s in seeds.items()]
    data, digest = summary["data"], summary["data"]["fingerprint"]
    corpus = f", {data['corpus_bytes']:,} corpus bytes" if data.get("corpus_bytes") else ""
    return "\n".join([*markdown_table(header, rows), "",
                      f"Data sha256 `{digest[:8]}…{digest[-7:]}`{corpus}, vocabulary "
                      f"{data['vocab_size']}; L_freq, the floor of the whole training stream: "
                      f"{summary['lfreq']:.4f} nats/token."]) + "\n"


def write_table(out_dir: str) -> None:
    """``out_dir/table.md`` from ``out_dir/summary.json``."""
    with open(os.path.join(out_dir, "summary.json")) as f:
        summary = from_text(json.load(f))
    write_bytes_atomic(os.path.join(out_dir, "table.md"), floors_table(summary).encode())


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if FLAGS.report_only:
        if FLAGS.out_dir is None:
            raise app.UsageError("--report_only rewrites --out_dir's table.md: give --out_dir")
        path = os.path.join(FLAGS.out_dir, "summary.json")
        if not os.path.exists(path):
            raise app.UsageError(f"--report_only reads {path}, which does not exist")
        write_table(FLAGS.out_dir)
        return
    config = FLAGS.config
    check_data_config(config.data)  # only the data and the logging schedule are read
    check_train(config)
    steps = FLAGS.steps or config.train.steps
    if steps < 2:
        raise app.UsageError(f"train.steps={steps}: the floors' sd needs --steps >= 2")
    seeds = integer_list("seeds", FLAGS.seeds, 0)
    next_counts = integer_list("next", FLAGS.next, 1) if FLAGS.next else []  # optional
    out_dir = make_output_dir(FLAGS.out_dir, "--out_dir") if FLAGS.out_dir else None
    every = config.train.log_every
    # the trainer logs every log_every steps, the first and the last
    last_logged = [s for s in range(steps, 0, -1) if s % every == 0 or s in (1, steps)][:3]
    data = load_data(config.data)
    out = {"lfreq": data.lfreq, "steps": steps, "seeds": {},
           "data": {"fingerprint": data.fingerprint, "vocab_size": data.tokenizer.vocab_size,
                    "corpus_bytes": data.info.get("corpus_bytes")}}
    floors = {}
    for seed in seeds:
        floors_all = floors_per_step(config, seed, steps + max(next_counts, default=0))
        floors_S, floors_next = floors_all[:steps], floors_all[steps:]
        floors[seed] = floors_S.tolist()
        out["seeds"][seed] = {
            "mean_next": {k: float(floors_next[:k].mean()) for k in next_counts},
            "mean": float(floors_S.mean()), "sd": float(floors_S.std(ddof=1)),
            "min": float(floors_S.min()), "max": float(floors_S.max()),
            "last_logged_steps": sorted(last_logged),
            "mean_last_logged": float(floors_S[[s - 1 for s in last_logged]].mean())}
    if out_dir:
        summary = {**out, "seeds": {seed: {**s, "floors": floors[seed]}
                                    for seed, s in out["seeds"].items()}}
        write_json_atomic(os.path.join(out_dir, "summary.json"), summary)
        write_table(out_dir)
    print(dumps(out, indent=2))


if __name__ == "__main__":
    app.run(exit_on_error(main), flags_parser=parse_flags)
