"""The training loop: data, sharded state, jitted steps, eval, checkpoints and metrics.

Step t's metrics are fetched only after step t+1 is dispatched, and only on logging steps,
so the host never waits on the device in between. A run resumes from the latest checkpoint in
``<workdir>/checkpoints`` (state and data-iterator position) and rewrites the metrics of any
steps it repeats.

A non-finite step (``postnorm.nonfinite``) is handled per ``train.nonfinite``: ``skip`` needs
nothing from the host; with ``abort`` and ``rollback`` the device freezes the state, and the
host reads the freeze flag with the metrics it fetches anyway and before every eval and
checkpoint, so a frozen state is never evaluated or saved. On SIGTERM (``postnorm.preemption``)
the loop saves a checkpoint after the current step and raises ``Preempted``.
"""

import contextlib
import dataclasses
import os
import time
from collections.abc import Callable, Iterator

import jax
import ml_collections
import numpy as np
from absl import logging
from clu import parameter_overview
from jax.experimental import multihost_utils

from postnorm.checkpoint import (
    Checkpointer,
    CheckpointError,
    CheckpointReader,
    all_processes_agree,
)
from postnorm.compilation_cache import use_compilation_cache
from postnorm.data import DataError, LMData, load_data
from postnorm.data.files import write_json_atomic
from postnorm.data.lfreq import frequency_floor
from postnorm.diag_step import flatten_diagnostics
from postnorm.forensics import set_aside_dumps, write_nonfinite_dump
from postnorm.metrics import (
    JSONL_NAME,
    MetricsFileError,
    MetricsWriteError,
    MetricWriter,
    Progress,
    read_jsonl,
    truncate_jsonl,
)
from postnorm.model import ModelSpec, param_count_formula
from postnorm.nonfinite import GuardedState, NonFiniteError
from postnorm.optim import make_optimizer
from postnorm.plots import render_run_plots
from postnorm.preemption import Preempted, PreemptionWatch
from postnorm.run_config import (
    WorkdirError,
    check_eval_config,
    check_run_config,
    latest_checkpoint_step,
    write_run_config,
)
from postnorm.run_data import check_run_data, data_info_path
from postnorm.sharding import batch_sharding, make_mesh
from postnorm.step_builder import CompiledSteps, compile_steps
from postnorm.validation import ConfigError, check_config, check_vocab_layout
from postnorm.workdir_lock import WorkdirLock
from postnorm.xla_options import compiler_options


@dataclasses.dataclass
class Experiment:
    """Everything built from a config before the first step."""

    config: ml_collections.ConfigDict
    data: LMData
    spec: ModelSpec
    steps: CompiledSteps
    mesh: jax.sharding.Mesh
    eval_batches: list[dict[str, np.ndarray]]  # this process's share of the validation batches
    eval_floor: float  # frequency floor of all processes' validation batches


def global_frequency_floor(local_targets: np.ndarray, counts_V: np.ndarray) -> float:
    """The frequency floor (``postnorm.data.lfreq``) of the global batch whose share on this
    process is ``local_targets``; every process holds an equal share."""
    local = frequency_floor(local_targets, counts_V)
    return float(np.mean(multihost_utils.process_allgather(np.float64(local))))


def _load_data_once(config: ml_collections.ConfigDict) -> LMData:
    """Process 0 prepares the dataset, tokenizer and L_freq caches; the others then read them.
    An error on any process stops every process."""
    loaded: list[LMData] = []

    def load() -> None:
        loaded.append(load_data(config.data, seed=config.seed))

    first = jax.process_index() == 0
    _stop_together(load if first else lambda: None, _data_failed_elsewhere)
    _stop_together(lambda: None if first else load(), _data_failed_elsewhere)
    return loaded[0]


def build_experiment(config: ml_collections.ConfigDict,
                     check_data: Callable[[LMData], None] | None = None) -> Experiment:
    """Load data and build the model, mesh and compiled steps of a validated config.

    ``check_data`` vets the loaded data before anything is compiled (every process stops if
    it raises on one). The validation batches are read here, so a split too small for them
    fails before training. An XLA option XLA does not know fails before the data is loaded.
    """
    xla_options = compiler_options(config.runtime.xla_options)
    data = _load_data_once(config)
    if check_data is not None:
        _stop_together(lambda: check_data(data))
    check_vocab_layout(config, vocab_size=data.tokenizer.vocab_size,
                       device_count=jax.device_count())
    eval_batches: list[dict[str, np.ndarray]] = []
    _stop_together(lambda: eval_batches.extend(data.eval_batches(
        batch_size=config.data.batch_size // jax.process_count(),
        num_batches=config.train.eval_batches, process_index=jax.process_index(),
        process_count=jax.process_count())), _data_failed_elsewhere)
    spec = ModelSpec.from_config(config.model, vocab_size=data.tokenizer.vocab_size,
                                 max_len=config.data.seq_len)
    counts = param_count_formula(spec)
    logging.info("parameters: %s", ", ".join(f"{k}={v:,}" for k, v in counts.items()))
    mesh = make_mesh(config.mesh)
    logging.info("mesh: %s", ", ".join(f"{axis}={size}" for axis, size in mesh.shape.items()))
    tx, schedule = make_optimizer(config.opt, config.train.steps)
    steps = compile_steps(spec, tx, schedule, mesh,
                          halt_on_nonfinite=config.train.nonfinite != "skip",
                          compiler_options=xla_options)
    eval_floor = global_frequency_floor(np.stack([b["targets"] for b in eval_batches]),
                                        data.unigram_counts)
    return Experiment(config, data, spec, steps, mesh, eval_batches, eval_floor)


def global_batch(local: dict[str, np.ndarray], sharding) -> dict[str, jax.Array]:
    """This process's share of a batch as global arrays with ``sharding``."""
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in local.items()}


def train_iterator(exp: Experiment):
    """A fresh iterator over this process's shard of the training batches (position 0)."""
    return exp.data.train_iterator(
        batch_size=exp.config.data.batch_size // jax.process_count(), seed=exp.config.seed,
        process_index=jax.process_index(), process_count=jax.process_count())


def batch_losses(exp: Experiment, state, local_batches: list[dict[str, np.ndarray]]) -> list:
    """Mean cross-entropy of ``state`` on each batch (this process's shares), all dispatched
    before one fetch."""
    sharding = batch_sharding(exp.mesh)
    losses = [exp.steps.evaluate(state, global_batch(b, sharding)) for b in local_batches]
    return jax.device_get(losses)


def evaluate(exp: Experiment, state) -> float:
    """Mean validation cross-entropy over ``train.eval_batches`` fixed batches."""
    return float(np.mean(batch_losses(exp, state, exp.eval_batches)))


def _restore_or_init(exp: Experiment, ckpt: Checkpointer):
    """(state, step, data iterator) of the latest usable checkpoint, or of step 0."""
    data_iter = train_iterator(exp)
    restored = ckpt.restore_latest(exp.steps.abstract_state, data_iter)
    if restored is None:
        logging.info("no checkpoint in %s: starting from step 0", ckpt.directory)
        return exp.steps.init(exp.config.seed), 0, data_iter
    state, step = restored
    logging.info("resumed from the checkpoint at step %d", step)
    return state, step, data_iter


def _stop_together(check: Callable[[], None],
                   elsewhere: Callable[[], Exception] = lambda: WorkdirError(
                       "another process found the workdir unusable when this run started: its "
                       "log says why")) -> None:
    """Run ``check`` on every process. If it raised on any process, every process raises: that
    one its own error, the others ``elsewhere()``, so that none is left waiting for the others
    in a collective."""
    try:
        check()
    except Exception:
        all_processes_agree(False)
        raise
    if not all_processes_agree(True):
        raise elsewhere()


def _check_config_everywhere(config: ml_collections.ConfigDict) -> None:
    """``check_config`` on every process, agreed on: part of it depends on the host (the
    backend, and the C++ kernel that ``model.attention=cpu`` builds there)."""
    _stop_together(
        lambda: check_config(config, device_count=jax.device_count(),
                             process_count=jax.process_count()),
        lambda: ConfigError("another process found the config unusable on its host when this "
                            "run started: its log says why"))


def _data_failed_elsewhere() -> DataError:
    return DataError("another process could not load the data when this run started: its log "
                     "says why")


def _open_metrics(workdir: str, last_step: int) -> MetricWriter:
    """A metric writer, after dropping the records of steps after ``last_step``."""
    path, writer = os.path.join(workdir, JSONL_NAME), jax.process_index() == 0
    _stop_together(lambda: truncate_jsonl(path, last_step) if writer else None)
    return MetricWriter(workdir, enabled=writer, after_step=last_step)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, float]:
    """Train ``config`` in ``workdir`` (resuming if possible); returns the final metrics.

    Raises ``Preempted`` after checkpointing on SIGTERM, and ``NonFiniteError`` when a
    non-finite step stops the run (policy ``abort``, or ``rollback`` out of rollbacks).
    """
    _check_config_everywhere(config)
    use_compilation_cache(config.runtime.compilation_cache_dir)
    compiler_options(config.runtime.xla_options)  # an option XLA does not know: before the workdir
    workdir = os.path.abspath(os.path.expanduser(workdir))
    _stop_together(lambda: check_run_config(workdir, config))  # a refusal writes nothing
    lock = WorkdirLock(workdir)
    _stop_together(lock.acquire if jax.process_index() == 0 else lambda: None)
    try:
        return _train_holding_the_lock(config, workdir)
    finally:
        lock.release()


def _record_run(workdir: str, config: ml_collections.ConfigDict, data_info: dict,
                start: int) -> None:
    """Record the run's config and data (process 0); a run starting afresh sets an earlier
    attempt's non-finite dumps aside, as they are not its own."""
    write_run_config(workdir, config)
    write_json_atomic(data_info_path(workdir), data_info)
    if start == 0:
        for path in set_aside_dumps(workdir):
            logging.info("starting afresh: an earlier attempt's dump moved to %s", path)


def _check_resumed_data(workdir: str, config: ml_collections.ConfigDict, data: LMData) -> None:
    """A run with a checkpoint resumes only on the data it was trained on."""
    if latest_checkpoint_step(workdir) is not None:
        check_run_data(workdir, data.info, config.data.data_dir, "resume")


def _train_holding_the_lock(config: ml_collections.ConfigDict, workdir: str) -> dict[str, float]:
    """``train_and_evaluate`` once ``workdir`` is this run's alone."""
    # Again under the lock: a run that held it may have recorded a config since the check.
    _stop_together(lambda: check_run_config(workdir, config))
    metrics_path = os.path.join(workdir, JSONL_NAME)  # damaged: refused before any compile
    _stop_together(lambda: read_jsonl(metrics_path)
                   if jax.process_index() == 0 and os.path.exists(metrics_path) else None)
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), save_every=config.train.ckpt_every,
                        keep=config.train.keep_ckpts)
    try:
        exp = build_experiment(config, lambda data: _check_resumed_data(workdir, config, data))
        state, start, data_iter = _restore_or_init(exp, ckpt)
        _stop_together(lambda: _record_run(workdir, config, exp.data.info, start)
                       if jax.process_index() == 0 else None)
        if jax.process_index() == 0:
            parameter_overview.log_parameter_overview(state.params)
        reporter = _Reporter(workdir, config.data.batch_size * config.data.seq_len,
                             config.train.steps, exp.data.lfreq)
        try:
            reporter.restart(start, int(state.skipped_steps))
            watch = PreemptionWatch(start)
            try:
                _train_loop(exp, ckpt, watch, reporter, state, start, data_iter, workdir)
            finally:
                watch.close()
        finally:
            reporter.close()  # also when the watch or the metric writers fail to start
    finally:
        ckpt.close()  # also when building the experiment fails: waits for orbax's threads
    if jax.process_index() == 0:
        try:
            render_run_plots(workdir)
        except (OSError, MetricsFileError) as err:  # the run is complete and checkpointed
            logging.error("the run finished, but its plots could not be written (%s); fix that, "
                          "then run main.py --mode=plots --workdir %s", err, workdir)
    return reporter.final


def _train_loop(exp: Experiment, ckpt: Checkpointer, watch: PreemptionWatch,
                reporter: "_Reporter", state: GuardedState, start: int, data_iter,
                workdir: str) -> None:
    """Steps ``start + 1 .. train.steps``, with evals, checkpoints, rollbacks and preemption."""
    config = exp.config
    total = config.train.steps
    halting = config.train.nonfinite != "skip"
    positions = {}  # step -> data-iterator state before its batch, since the last clean check
    sharding = batch_sharding(exp.mesh)
    called = set()  # the programs called so far: their first call compiles them
    step = start
    while step < total:
        step += 1
        if halting:
            positions[step] = data_iter.get_state()
        local_batch = next(data_iter)
        batch = global_batch(local_batch, sharding)
        is_diag = step % config.diag.every == 0 or step == 1
        program = "diag" if is_diag else "train"
        compiling = program not in called
        called.add(program)
        with reporter.excluded(state) if compiling else contextlib.nullcontext():
            if is_diag:
                state, device_metrics, device_diag = exp.steps.diag(state, batch)
            else:
                (state, device_metrics), device_diag = exp.steps.train(state, batch), None
        reporter.flush()  # step - 1's metrics: the device is already busy with this step
        is_log = step % config.train.log_every == 0 or step in (start + 1, total)
        if is_log or is_diag:
            floor = (global_frequency_floor(local_batch["targets"], exp.data.unigram_counts)
                     if is_log else None)
            reporter.hold(step, device_metrics if is_log else None, device_diag, floor)
        is_eval = step % config.train.eval_every == 0 or step == total
        stop = watch.should_stop(step)
        if halting and (reporter.saw_skip or is_eval or stop
                        or step % config.train.ckpt_every == 0 or step == total):
            if int(state.halted_at):  # a host sync, but evals and saves sync anyway
                reporter.flush()
                halted, skipped = int(state.halted_at), int(state.skipped_steps)
                try:
                    state, start, data_iter = _nonfinite(exp, ckpt, state, positions, workdir)
                except NonFiniteError:  # the steps after the halted one froze the state
                    reporter.restart(halted, skipped)  # their records are dropped
                    raise
                reporter.restart(start, int(state.skipped_steps))
                step, positions = start, {}
                continue
            positions.clear()
        if is_eval:
            reporter.flush()
            with reporter.excluded(state):
                reporter.write_eval(step, evaluate(exp, state), exp.eval_floor)
        if ckpt.should_save(step, force=step == total or stop):
            with reporter.excluded(state):
                ckpt.save(step, state, data_iter, force=step == total or stop)
        if stop and step < total:  # a stop asked for during the last step: the run is done
            reporter.flush()
            ckpt.wait_until_finished()
            raise Preempted(step, str(ckpt.directory), interrupted=watch.interrupted)
    reporter.flush()


def _nonfinite(exp: Experiment, ckpt: Checkpointer, state: GuardedState,
               positions: dict[int, dict], workdir: str):
    """Rolls back (returns the restored state, its step and data iterator) or raises."""
    cfg = exp.config.train
    step, rollbacks = int(state.halted_at), int(state.rollbacks)
    if cfg.nonfinite == "rollback" and rollbacks < cfg.max_rollbacks:
        ckpt.wait_until_finished()
        restored, start, data_iter = _restore_or_init(exp, ckpt)
        shardings = exp.steps.state_shardings
        restored = restored.replace(
            lr_scale=jax.device_put(state.lr_scale * cfg.rollback_lr_factor, shardings.lr_scale),
            rollbacks=jax.device_put(state.rollbacks + 1, shardings.rollbacks))
        logging.warning("step %d is non-finite: rolled back to step %d with the learning rate "
                        "scaled by %.3g (rollback %d of train.max_rollbacks=%d)", step, start,
                        float(restored.lr_scale), rollbacks + 1, cfg.max_rollbacks)
        return restored, start, data_iter
    dump = _dump_nonfinite(exp, state, step, positions[step], workdir)
    if cfg.nonfinite == "abort":
        why, policy = "", "set train.nonfinite to 'skip' or 'rollback'"
    else:
        why = f" after {rollbacks} rollbacks (train.max_rollbacks={cfg.max_rollbacks})"
        policy = "raise train.max_rollbacks or set train.nonfinite to 'skip'"
    raise NonFiniteError(
        f"step {step} has a non-finite loss or gradient{why}; no state from it was saved. "
        f"Forensic dump: {dump}. To go on, {policy} and rerun: the run resumes from its last "
        "checkpoint. A lower opt.lr or an opt.clip_norm changes the run, so once it has a "
        "checkpoint that needs a new --workdir.")


def _dump_nonfinite(exp: Experiment, state: GuardedState, step: int, position: dict,
                    workdir: str) -> str:
    """Reruns ``step``'s batch through the diagnostic step with the parameters from before it
    (``state``, which this donates) and writes the forensic dump; returns its path."""
    data_iter = train_iterator(exp)
    data_iter.set_state(position)
    batch = global_batch(next(data_iter), batch_sharding(exp.mesh))
    _, metrics, diagnostics = exp.steps.diag(state, batch)
    return write_nonfinite_dump(workdir, step, position, jax.device_get(metrics),
                                jax.device_get(diagnostics))


class _Reporter:
    """Fetches held device metrics one step late, then logs and writes them."""

    def __init__(self, workdir: str, tokens_per_step: int, total_steps: int, lfreq: float):
        self.workdir, self.tokens_per_step = workdir, tokens_per_step
        self.total_steps, self.lfreq = total_steps, lfreq
        self.final: dict[str, float] = {}
        self.writer: MetricWriter | None = None
        self.saw_skip = False  # the last fetched metrics counted more skipped steps than before
        self._held = None

    def restart(self, step: int, skipped_steps: int) -> None:
        """(Re)start after ``step``, whose state has skipped ``skipped_steps`` steps: the
        records of later steps are dropped."""
        self.close()
        self.writer = _open_metrics(self.workdir, step)
        self.progress = Progress(self.total_steps, self.tokens_per_step, step)
        self.saw_skip, self._held, self._skipped = False, None, skipped_steps

    @contextlib.contextmanager
    def excluded(self, state: GuardedState) -> Iterator[None]:
        """Leave the time of the block (a compile, an eval, a save) out of the step rate,
        once the steps dispatched before it have produced ``state``: their run time, which
        would otherwise overlap the block, stays in the rate."""
        jax.block_until_ready(state)
        start = time.perf_counter()
        try:
            yield
        finally:
            self.progress.exclude(time.perf_counter() - start)

    def hold(self, step: int, metrics, diagnostics, floor: float | None) -> None:
        """Keep ``step``'s device metrics (with its batch's frequency floor) and diagnostics
        until the next ``flush``."""
        self._held = (step, metrics, diagnostics, floor)

    def flush(self) -> None:
        if self._held is None:
            return
        step, device_metrics, device_diag, floor = self._held
        self._held = None
        scalars = {}
        if device_metrics is not None:
            scalars = {k: float(v) for k, v in jax.device_get(device_metrics).items()}
            line, tokens_per_s = self.progress.report(step, scalars, self.lfreq)
            logging.info(line)
            scalars["train/lfreq"] = self.lfreq
            scalars["train/freq_floor"] = floor
            if tokens_per_s is not None:
                scalars["train/tokens_per_s"] = tokens_per_s
            skipped = scalars["train/skipped_steps"]
            self.saw_skip = skipped > self._skipped
            if self.saw_skip:
                logging.warning("%d steps skipped so far: non-finite loss or gradient", skipped)
            self._skipped = skipped
        if device_diag is not None:
            scalars.update(flatten_diagnostics(jax.device_get(device_diag)))
        self._write(step, scalars)
        self.final.update(scalars)

    def _write(self, step: int, scalars: dict[str, float]) -> None:
        """Write and flush ``scalars`` (process 0 writes); when that fails, every process
        raises, so none is left waiting for it in the next step's collective."""
        def write() -> None:
            self.writer.write_scalars(step, scalars)
            self.writer.flush()
        _stop_together(write, lambda: MetricsWriteError(
            "process 0 could not write the metrics: its log says why"))

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def write_eval(self, step: int, eval_loss: float, eval_floor: float) -> None:
        logging.info("eval at step %d: loss %.4f | L_freq %.4f | frequency floor of the eval "
                     "batches %.4f | loss / floor %.4f", step, eval_loss, self.lfreq, eval_floor,
                     eval_loss / eval_floor)
        scalars = {"eval/loss": eval_loss, "eval/lfreq": self.lfreq,
                   "eval/loss_minus_lfreq": eval_loss - self.lfreq,
                   "eval/freq_floor": eval_floor, "eval/loss_over_floor": eval_loss / eval_floor}
        self._write(step, scalars)
        self.final.update(scalars)


def _no_checkpoint(directory: str) -> CheckpointError:
    return CheckpointError(f"no checkpoint in {directory}: train first (--mode=train) or point "
                           "--workdir at a trained run")


def require_checkpoint(workdir: str) -> None:
    """CheckpointError unless ``workdir`` has a finalized checkpoint; checked on every process
    and agreed on, before anything is created or loaded."""
    def check() -> None:
        if latest_checkpoint_step(workdir) is None:
            raise _no_checkpoint(os.path.join(workdir, "checkpoints"))
    _stop_together(check)


def evaluate_checkpoint(config: ml_collections.ConfigDict, workdir: str) -> float:
    """Restore the latest checkpoint of ``workdir`` and evaluate it on the validation split."""
    _check_config_everywhere(config)
    use_compilation_cache(config.runtime.compilation_cache_dir)
    workdir = os.path.abspath(os.path.expanduser(workdir))
    _stop_together(lambda: check_eval_config(workdir, config))
    directory = os.path.join(workdir, "checkpoints")
    require_checkpoint(workdir)
    ckpt = CheckpointReader(directory)  # writes nothing: safe beside a live trainer
    try:
        exp = build_experiment(config, lambda data: check_run_data(
            workdir, data.info, config.data.data_dir, "evaluate"))
        restored = ckpt.restore_latest(exp.steps.abstract_state, None)  # no data position
    finally:
        ckpt.close()
    if restored is None:
        raise _no_checkpoint(directory)
    state, step = restored
    loss = evaluate(exp, state)
    logging.info("eval of the checkpoint at step %d: loss %.4f | L_freq %.4f", step, loss,
                 exp.data.lfreq)
    return loss
