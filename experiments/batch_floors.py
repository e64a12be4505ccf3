"""The frequency floor of each training batch, from the data pipeline alone (no model).

    python -m experiments.batch_floors --config configs/default.py --seeds 0,1,2 [--steps N]
        [--next 32,128,512]

For each seed (data order) it reads the first ``--steps`` (default ``train.steps``) global
batches exactly as the trainer does and prints JSON: the mean and sd of their floors
(``postnorm.data.lfreq.frequency_floor``), the mean floor of the last three logged steps (the
batches a run's final loss is averaged over) and L_freq. It shows how far one batch's floor
scatters around L_freq, which is why the collapse rule compares a loss with its own batches'
floor (``postnorm.analysis.collapse``). With ``--next``, also the mean floor of the first K
batches after ``--steps`` for each K: the batches ``experiments/collapse.py --train_batches K``
scores a final checkpoint on.
"""

import itertools

import numpy as np
from absl import app, flags
from ml_collections import config_flags

from postnorm.config.args import parse_flags
from postnorm.config.list_flags import integer_list
from postnorm.data import check_data_config, load_data
from postnorm.data.lfreq import frequency_floor
from postnorm.errors import exit_on_error
from postnorm.files import dumps
from postnorm.train.validate import check_train

config_flags.DEFINE_config_file("config", "configs/default.py", "Config whose data is read.")
flags.DEFINE_list("seeds", ["0"], "Data-order seeds (integers in [0, 2**31)).")
flags.DEFINE_integer("steps", None, "Batches per seed (at least 2); default train.steps.",
                     lower_bound=2)
flags.DEFINE_list("next", [], "Counts K >= 1 of batches after --steps whose mean floor to "
                  "print.")
FLAGS = flags.FLAGS


def floors_per_step(config, seed: int, steps: int) -> np.ndarray:
    """float64[steps]: the floor of the global batch of steps 1..steps for data order ``seed``."""
    data = load_data(config.data, seed=seed)
    batches = data.train_iterator(batch_size=config.data.batch_size, seed=seed)
    return np.array([frequency_floor(batch["targets"], data.unigram_counts)
                     for batch in itertools.islice(batches, steps)])


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    config = FLAGS.config
    check_data_config(config.data)  # only the data and the logging schedule are read
    check_train(config)
    steps = FLAGS.steps or config.train.steps
    if steps < 2:
        raise app.UsageError(f"train.steps={steps}: the floors' sd needs --steps >= 2")
    seeds = integer_list("seeds", FLAGS.seeds, 0)
    next_counts = integer_list("next", FLAGS.next, 1) if FLAGS.next else []  # optional
    every = config.train.log_every
    # the trainer logs every log_every steps, the first and the last
    last_logged = [s for s in range(steps, 0, -1) if s % every == 0 or s in (1, steps)][:3]
    out = {"lfreq": load_data(config.data).lfreq, "steps": steps, "seeds": {}}
    for seed in seeds:
        floors_all = floors_per_step(config, seed, steps + max(next_counts, default=0))
        floors_S, floors_next = floors_all[:steps], floors_all[steps:]
        out["seeds"][seed] = {
            "mean_next": {k: float(floors_next[:k].mean()) for k in next_counts},
            "mean": float(floors_S.mean()), "sd": float(floors_S.std(ddof=1)),
            "min": float(floors_S.min()), "max": float(floors_S.max()),
            "last_logged_steps": sorted(last_logged),
            "mean_last_logged": float(floors_S[[s - 1 for s in last_logged]].mean())}
    print(dumps(out, indent=2))


if __name__ == "__main__":
    app.run(exit_on_error(main), flags_parser=parse_flags)
