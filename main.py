"""Entry point: ``python main.py --config configs/default.py[:variant,key=value] --workdir DIR``.

Modes: ``train`` (default; resumes from the latest checkpoint in the workdir, which must have
been trained with the same config up to the fields ``postnorm.run_config`` lets a resume
change), ``eval`` (evaluate the latest checkpoint on the validation split; --config must have
the run's model and data sections), ``plots`` (render the run's figures
into ``<workdir>/plots``), ``report`` (write a self-contained ``<workdir>/report.html``; the
config is the run's ``config.json``, else --config) and ``params`` (print the parameter count
of the config's model without loading data).

Multi-process runs pass ``--coordinator_address HOST:PORT --num_processes N --process_id I``
to every process (``jax.distributed.initialize`` is called only when they are given).

``runtime.allocator`` (``postnorm.allocator``) may re-execute the command once, with tcmalloc
preloaded, before anything is computed.

Exit status: 0 when done or preempted (SIGTERM: a checkpoint was saved; rerun to resume), 130
after a Ctrl-C (the first one saves a checkpoint at the end of the step, as SIGTERM does),
1 for bad flags, 2 for a config, allocator, compilation cache, data or checkpoint error, a
workdir that holds another config's run, a missing or damaged ``metrics.jsonl`` or an output
that cannot be written, 3 when a non-finite step stopped training.
"""

import os
import sys

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from postnorm import train
from postnorm.allocator import use_allocator
from postnorm.config_args import parse_flags
from postnorm.data.tokenizers import ByteTokenizer, read_user_sentencepiece
from postnorm.model import ModelSpec, param_count_formula
from postnorm.nonfinite import NonFiniteError
from postnorm.plots import render_run_plots
from postnorm.report import write_report
from postnorm.run_config import WorkdirError, config_data
from postnorm.user_errors import exit_2_on_user_error
from postnorm.validation import check_fields, check_model

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/default.py:pre.",
                                lock_config=True)
flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and plots.")
flags.DEFINE_enum("mode", "train", ["train", "eval", "plots", "report", "params"],
                  "What to run.")
flags.DEFINE_string("coordinator_address", None,
                    "Multi-process runs: HOST:PORT of process 0's coordinator.")
flags.DEFINE_integer("num_processes", None, "Multi-process runs: the number of processes.")
flags.DEFINE_integer("process_id", None, "Multi-process runs: this process's index.")
flags.mark_flags_as_required(["config"])


def print_param_count(config) -> None:
    """Parameter counts by group. The vocabulary is the byte tokenizer's, data.tokenizer_path's
    when that file exists, else data.vocab_size."""
    check_fields(config)
    check_model(config)
    vocab_size, origin = config.data.vocab_size, "data.vocab_size"
    if config.data.tokenizer == "byte":
        vocab_size, origin = ByteTokenizer.vocab_size, "data.tokenizer='byte'"
    elif os.path.isfile(os.path.expanduser(config.data.tokenizer_path)):
        vocab_size = read_user_sentencepiece(config.data.tokenizer_path).vocab_size
        origin = config.data.tokenizer_path
    print(f"vocabulary: {vocab_size:,} (from {origin})")
    spec = ModelSpec.from_config(config.model, vocab_size=vocab_size,
                                 max_len=config.data.seq_len)
    for group, count in param_count_formula(spec).items():
        print(f"{group:>14}: {count:>13,} ({count / 1e6:.1f}M)")


def init_distributed() -> None:
    """``jax.distributed.initialize`` from the three multi-process flags, if given."""
    given = [FLAGS[name].value is not None
             for name in ("coordinator_address", "num_processes", "process_id")]
    if not any(given):
        return
    if not all(given):
        raise app.UsageError("--coordinator_address, --num_processes and --process_id go "
                             "together: give all three or none")
    if not 0 <= FLAGS.process_id < FLAGS.num_processes:
        raise app.UsageError(f"--process_id={FLAGS.process_id} must be in "
                             f"[0, --num_processes={FLAGS.num_processes})")
    jax.distributed.initialize(coordinator_address=FLAGS.coordinator_address,
                               num_processes=FLAGS.num_processes, process_id=FLAGS.process_id)


class OutputError(WorkdirError):
    """A plots or report output that could not be written (a user error: exit 2)."""


@exit_2_on_user_error  # also prints a Stopped run's message: exit 0, or 130 after Ctrl-C
def main(argv: list[str]) -> None:
    try:
        run(argv)
    except NonFiniteError as err:
        print(f"postnorm: error: {err}", file=sys.stderr)
        sys.exit(3)


def run(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    config = FLAGS.config
    if FLAGS.mode == "params":
        print_param_count(config)
        return
    if FLAGS.workdir is None or not FLAGS.workdir.strip():
        raise app.UsageError(f"--workdir is required for --mode={FLAGS.mode} (a directory path)")
    workdir = os.path.expanduser(FLAGS.workdir)
    if FLAGS.mode in ("plots", "report"):
        try:
            if FLAGS.mode == "plots":
                for path in render_run_plots(workdir):
                    print(path)
            else:
                print(write_report(workdir, config_data(config)))
        except OSError as err:
            raise OutputError(f"--mode={FLAGS.mode} could not write under {workdir} "
                              f"({err}); make it writable or copy the run elsewhere") from err
        return
    allocator = use_allocator(config.runtime.allocator)  # may re-execute this command
    init_distributed()
    logging.info("JAX %s: process %d of %d, %d local / %d global devices: %s; allocator: %s",
                 jax.__version__, jax.process_index(), jax.process_count(),
                 jax.local_device_count(), jax.device_count(), jax.devices(), allocator)
    if FLAGS.mode == "train":
        train.train_and_evaluate(config, workdir)
    else:
        train.evaluate_checkpoint(config, workdir)


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
