"""Entry point: ``python main.py --config configs/default.py[:variant,key=value] --workdir DIR``.

Modes: ``train`` (default; resumes from the latest checkpoint in the workdir), ``eval``
(evaluate the latest checkpoint on the validation split), ``plots`` (render the run's figures
into ``<workdir>/plots``) and ``params`` (print the parameter count of the config's model
without loading data).
"""

import os
import sys

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from postnorm import train
from postnorm.checkpoint import CheckpointError
from postnorm.data import DataError
from postnorm.data.tokenizers import read_user_sentencepiece
from postnorm.model import ModelSpec, param_count_formula
from postnorm.plots import render_run_plots
from postnorm.validation import ConfigError, check_model

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/default.py:pre.",
                                lock_config=True)
flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and plots.")
flags.DEFINE_enum("mode", "train", ["train", "eval", "plots", "params"], "What to run.")
flags.mark_flags_as_required(["config"])


def print_param_count(config) -> None:
    """Parameter counts by group. The vocabulary is data.tokenizer_path's when that file
    exists, else data.vocab_size."""
    check_model(config)
    vocab_size, origin = config.data.vocab_size, "data.vocab_size"
    if os.path.isfile(os.path.expanduser(config.data.tokenizer_path)):
        vocab_size = read_user_sentencepiece(config.data.tokenizer_path).vocab_size
        origin = config.data.tokenizer_path
    print(f"vocabulary: {vocab_size:,} (from {origin})")
    spec = ModelSpec.from_config(config.model, vocab_size=vocab_size,
                                 max_len=config.data.seq_len)
    for group, count in param_count_formula(spec).items():
        print(f"{group:>14}: {count:>13,} ({count / 1e6:.1f}M)")


def main(argv: list[str]) -> None:
    try:
        run(argv)
    except (ConfigError, DataError, CheckpointError) as err:
        print(f"postnorm: error: {err}", file=sys.stderr)
        sys.exit(2)


def run(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    config = FLAGS.config
    if FLAGS.mode == "params":
        print_param_count(config)
        return
    if FLAGS.workdir is None:
        raise app.UsageError(f"--workdir is required for --mode={FLAGS.mode}")
    if FLAGS.mode == "plots":
        for path in render_run_plots(FLAGS.workdir):
            print(path)
        return
    logging.info("JAX %s: process %d of %d, %d local / %d global devices: %s", jax.__version__,
                 jax.process_index(), jax.process_count(), jax.local_device_count(),
                 jax.device_count(), jax.devices())
    if FLAGS.mode == "train":
        train.train_and_evaluate(config, FLAGS.workdir)
    else:
        train.evaluate_checkpoint(config, FLAGS.workdir)


if __name__ == "__main__":
    app.run(main)
