"""An experiment: one preflight of a config, then its data, programs and evaluation batches."""

import dataclasses
import os
from collections.abc import Callable

import jax
import ml_collections
import numpy as np

from postnorm.config.schema import ConfigError
from postnorm.data import DataError, LMData, load_data
from postnorm.data.lfreq import frequency_floor
from postnorm.model import ModelSpec
from postnorm.model.attention_choice import AUTO
from postnorm.runtime.compilation_cache import use_compilation_cache
from postnorm.runtime.mesh import batch_sharding
from postnorm.runtime.multihost import process_mean, stop_together
from postnorm.runtime.xla_options import compiler_options
from postnorm.train.programs import CompiledSteps, build_programs
from postnorm.train.validate import check_config, check_vocab_layout
from postnorm.workdir.checkpoint import CheckpointError, CheckpointReader
from postnorm.workdir.config_record import (
    WorkdirConfigError,
    check_eval_config,
    read_run_config,
)
from postnorm.workdir.data_record import check_run_data
from postnorm.workdir.layout import Workdir, WorkdirError, latest_checkpoint_step


@dataclasses.dataclass
class Experiment:
    """Everything built from a config before the first step."""

    config: ml_collections.ConfigDict  # model.attention resolved (train.programs)
    data: LMData
    spec: ModelSpec
    steps: CompiledSteps
    mesh: jax.sharding.Mesh
    eval_batches: list[dict[str, np.ndarray]]  # this process's share of the validation batches
    eval_floor: float  # frequency floor of all processes' validation batches


def unusable_elsewhere() -> WorkdirError:
    """What the other processes raise when one found the workdir unusable."""
    return WorkdirError("another process found the workdir unusable when this run started: its "
                        "log says why")


def _data_failed_elsewhere() -> DataError:
    return DataError("another process could not load the data when this run started: its log "
                     "says why")


def preflight(config: ml_collections.ConfigDict, workdir: str,
              check_workdir: Callable[[str], None]) -> str:
    """The checks that need nothing built, on every process and agreed on, before anything is
    written: the config (part of it depends on the host: the backend, and the C++ kernel that
    ``model.attention='cpu'`` builds there), the compilation cache, the XLA options, and
    ``check_workdir`` of the absolute workdir, which this returns."""
    stop_together(lambda: check_config(config, device_count=jax.device_count(),
                                       process_count=jax.process_count()),
                  lambda: ConfigError("another process found the config unusable on its host "
                                      "when this run started: its log says why"))
    use_compilation_cache(config.runtime.compilation_cache_dir)
    compiler_options(config.runtime.xla_options)  # an option XLA does not know: before the workdir
    workdir = os.path.abspath(os.path.expanduser(workdir))
    stop_together(lambda: check_workdir(workdir), unusable_elsewhere)
    return workdir


def _no_checkpoint(workdir: str) -> CheckpointError:
    return CheckpointError(f"no checkpoint in {Workdir(workdir).checkpoints}: train first "
                           "(--mode=train) or point --workdir at a trained run")


def _check_trained_run(workdir: str, config: ml_collections.ConfigDict) -> None:
    """``workdir`` holds a checkpoint of a run of ``config``'s model and data."""
    check_eval_config(workdir, config)
    if latest_checkpoint_step(workdir) is None:
        raise _no_checkpoint(workdir)


def global_frequency_floor(local_targets: np.ndarray, counts_V: np.ndarray) -> float:
    """The frequency floor (``postnorm.data.lfreq``) of the global batch whose share on this
    process is ``local_targets``; every process holds an equal share."""
    return process_mean(frequency_floor(local_targets, counts_V))


def load_data_once(config: ml_collections.ConfigDict) -> LMData:
    """Process 0 prepares the dataset, tokenizer and L_freq caches; the others then read them.
    An error on any process stops every process."""
    loaded: list[LMData] = []

    def load() -> None:
        loaded.append(load_data(config.data, seed=config.seed))

    first = jax.process_index() == 0
    stop_together(load if first else lambda: None, _data_failed_elsewhere)
    stop_together(lambda: None if first else load(), _data_failed_elsewhere)
    return loaded[0]


def recorded_attention(config: ml_collections.ConfigDict, workdir: str | None) -> str | None:
    """With ``model.attention=auto``, the kernel ``workdir``'s recorded run started with (None:
    no record, or one that cannot be read, which the trainer overwrites or refuses itself)."""
    if workdir is None or config.model.attention != AUTO:
        return None
    try:
        recorded = read_run_config(workdir)
    except WorkdirConfigError:
        return None
    return recorded["model"].get("attention") if recorded else None


def build_experiment(config: ml_collections.ConfigDict,
                     check_data: Callable[[LMData], None] | None = None,
                     workdir: str | None = None) -> Experiment:
    """Load data and build the programs (``train.programs.build_programs``) of a validated
    config; with ``workdir``, ``model.attention=auto`` keeps the kernel its recorded run started
    with, where it can run here.

    ``check_data`` vets the loaded data before anything is compiled (every process stops if
    it raises on one). The validation batches are read here, so a split too small for them
    fails before training. An XLA option XLA does not know fails before the data is loaded.
    """
    xla_options = compiler_options(config.runtime.xla_options)
    data = load_data_once(config)
    if check_data is not None:
        stop_together(lambda: check_data(data), unusable_elsewhere)
    check_vocab_layout(config, vocab_size=data.tokenizer.vocab_size,
                       device_count=jax.device_count())
    eval_batches: list[dict[str, np.ndarray]] = []
    stop_together(lambda: eval_batches.extend(data.eval_batches(
        batch_size=config.data.batch_size // jax.process_count(),
        num_batches=config.train.eval_batches, process_index=jax.process_index(),
        process_count=jax.process_count())), _data_failed_elsewhere)
    programs = build_programs(config, data.tokenizer.vocab_size,
                              recorded_attention=recorded_attention(config, workdir),
                              xla_options=xla_options)
    eval_floor = global_frequency_floor(np.stack([b["targets"] for b in eval_batches]),
                                        data.unigram_counts)
    return Experiment(programs.config, data, programs.spec, programs.steps, programs.mesh,
                      eval_batches, eval_floor)


def global_batch(local: dict[str, np.ndarray], sharding) -> dict[str, jax.Array]:
    """This process's share of a batch as global arrays with ``sharding``."""
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in local.items()}


def train_iterator(exp: Experiment):
    """A fresh iterator over this process's shard of the training batches (position 0)."""
    return exp.data.train_iterator(
        batch_size=exp.config.data.batch_size // jax.process_count(), seed=exp.config.seed,
        process_index=jax.process_index(), process_count=jax.process_count())


def initial_state(exp: Experiment, data_iter):
    """The state of step 0: ``steps.init``, then the arrangement's profiling pass where it has
    one (Admin's), on the run's first training batch: the one ``data_iter``, at position 0,
    yields next, and still yields after this."""
    state = exp.steps.init(exp.config.seed)
    if exp.steps.profile is None:
        return state
    position = data_iter.get_state()
    first = next(data_iter)
    data_iter.set_state(position)
    return exp.steps.profile(state, global_batch(first, batch_sharding(exp.mesh)))


def batch_losses(exp: Experiment, state, local_batches: list[dict[str, np.ndarray]]) -> list:
    """Mean cross-entropy of ``state`` on each batch (this process's shares), all dispatched
    before one fetch."""
    sharding = batch_sharding(exp.mesh)
    losses = [exp.steps.evaluate(state, global_batch(b, sharding)) for b in local_batches]
    return jax.device_get(losses)


def evaluate(exp: Experiment, state) -> float:
    """Mean validation cross-entropy over ``train.eval_batches`` fixed batches."""
    return float(np.mean(batch_losses(exp, state, exp.eval_batches)))


def restore_run(config: ml_collections.ConfigDict, workdir: str, action: str, *,
                data_position: bool):
    """(experiment, state, step, data iterator) of the latest checkpoint of ``workdir``, read
    without writing (safe beside a live trainer), as the model and on the data the run was
    trained with; ``action`` names the use in the messages ("evaluate", "measure"). With
    ``data_position`` the iterator is positioned after that step (the checkpoint must come
    from as many processes as this run has); without, it is None."""
    workdir = preflight(config, workdir, lambda w: _check_trained_run(w, config))
    ckpt = CheckpointReader(Workdir(workdir).checkpoints)
    try:
        exp = build_experiment(config, lambda data: check_run_data(
            workdir, data.info, config.data.data_dir, action), workdir=workdir)
        batches = train_iterator(exp) if data_position else None
        restored = ckpt.restore_latest(exp.steps.abstract_state, batches)
    finally:
        ckpt.close()  # also when building the experiment fails: waits for orbax's threads
    if restored is None:
        raise _no_checkpoint(workdir)
    state, step = restored
    return exp, state, step, batches
