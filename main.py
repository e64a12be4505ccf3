"""``python main.py --config configs/default.py[:variant,key=value] --workdir DIR [--mode=...]``.

Modes: train (resumes), eval, plots, report, params; README.md describes each, the multi-process
flags and the exit statuses.
"""

import os

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from postnorm.analysis.closing import finish_run
from postnorm.analysis.figures import render_run_plots
from postnorm.analysis.forecast import forecast_line
from postnorm.analysis.report import write_report
from postnorm.config import check_fields, config_data, parse_flags
from postnorm.data.tokenizers import ByteTokenizer, read_user_sentencepiece
from postnorm.errors import exit_on_error
from postnorm.model import ModelSpec, param_counts
from postnorm.runtime.allocator import use_allocator
from postnorm.runtime.console import set_log_level
from postnorm.train.loop import evaluate_checkpoint, train_and_evaluate
from postnorm.train.validate import check_model, check_runtime
from postnorm.workdir.layout import WorkdirError

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


class OutputError(WorkdirError):
    """A plots or report output that could not be written (a user error: exit 2)."""


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
    model = config.model.to_dict() | {"attention": "einsum"}  # the parameters of every kernel
    spec = ModelSpec.from_config(model, vocab_size=vocab_size, max_len=config.data.seq_len)
    for group, count in param_counts(spec).items():
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


def write_outputs(workdir: str, config) -> None:
    """``--mode=plots`` or ``report``: the run's figures, or its HTML report."""
    try:
        if FLAGS.mode == "plots":
            for path in render_run_plots(workdir):
                print(path)
        else:
            print(write_report(workdir, config_data(config)))
    except OSError as err:
        raise OutputError(f"--mode={FLAGS.mode} could not write under {workdir} "
                          f"({err}); make it writable or copy the run elsewhere") from err


@exit_on_error
def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    config = FLAGS.config
    if FLAGS.mode == "params":
        print_param_count(config)
        return
    check_runtime(config)
    set_log_level(config.runtime.log_level)  # before the first line other libraries log
    if FLAGS.workdir is None or not FLAGS.workdir.strip():
        raise app.UsageError(f"--workdir is required for --mode={FLAGS.mode} (a directory path)")
    workdir = os.path.expanduser(FLAGS.workdir)
    if FLAGS.mode in ("plots", "report"):
        write_outputs(workdir, config)
        return
    allocator = use_allocator(config.runtime.allocator)  # may re-execute this command
    init_distributed()
    logging.info("JAX %s: process %d of %d, %d local / %d global devices: %s; allocator: %s",
                 jax.__version__, jax.process_index(), jax.process_count(),
                 jax.local_device_count(), jax.device_count(), jax.devices(), allocator)
    if FLAGS.mode == "train":
        # forecast_line never raises: it says why where it has no forecast
        train_and_evaluate(config, workdir, lambda: logging.info("%s", forecast_line(config)))
        for line in finish_run(os.path.abspath(workdir)):  # plots, report.html, the summary
            print(line, flush=True)
    else:
        evaluate_checkpoint(config, workdir)


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
