"""The training loop: steps, evals, checkpoints, rollbacks and preemption, resumable."""

import contextlib
import os
from collections.abc import Callable

import jax
import ml_collections
import numpy as np
from absl import logging
from clu import parameter_overview

from postnorm.data import LMData
from postnorm.diagnostics.early_warning import DEFAULT_RULE, monitor_rule_from
from postnorm.diagnostics.schedule import is_diagnostic_step
from postnorm.errors import NonFiniteError
from postnorm.files import write_json_atomic
from postnorm.runtime.console import set_log_level
from postnorm.runtime.mesh import batch_sharding
from postnorm.runtime.multihost import from_process_0, stop_together
from postnorm.runtime.preemption import Preempted, PreemptionWatch
from postnorm.train.experiment import (
    Experiment,
    build_experiment,
    evaluate,
    global_batch,
    global_frequency_floor,
    initial_state,
    preflight,
    restore_run,
    train_iterator,
    unusable_elsewhere,
)
from postnorm.train.forensics import set_aside_dumps, write_nonfinite_dump
from postnorm.train.monitor_actions import (
    apply_change,
    changed_values,
    keep_actions,
    record_action,
)
from postnorm.train.reporter import Reporter
from postnorm.train.state import GuardedState
from postnorm.workdir.checkpoint import Checkpointer
from postnorm.workdir.config_record import check_run_config, write_run_config
from postnorm.workdir.data_record import check_run_data
from postnorm.workdir.layout import Workdir, latest_checkpoint_step
from postnorm.workdir.lock import WorkdirLock
from postnorm.workdir.metrics import read_jsonl


def _restore_or_init(exp: Experiment, ckpt: Checkpointer, before: int | None = None):
    """(state, step, data iterator) of the latest usable checkpoint (of a step < ``before``),
    or of step 0 (``initial_state``: with Admin's profiling pass, never redone on a resume)."""
    data_iter = train_iterator(exp)
    restored = ckpt.restore_latest(exp.steps.abstract_state, data_iter, before=before)
    if restored is None:
        logging.info("no checkpoint in %s: starting from step 0", ckpt.directory)
        return initial_state(exp, data_iter), 0, data_iter
    state, step = restored
    logging.info("resumed from the checkpoint at step %d", step)
    return state, step, data_iter


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                       on_ready: Callable[[], None] | None = None) -> dict[str, float]:
    """Train ``config`` in ``workdir`` (resuming if possible); returns the final metrics.

    ``on_ready`` (no collective) runs on process 0 once the config, workdir, data and any
    checkpoint have passed their checks, before the first training step (``main.py`` logs the
    step-0 forecast there, so bad input is refused without waiting for it).

    Raises ``Preempted`` after checkpointing on SIGTERM, and ``NonFiniteError`` when a
    non-finite step stops the run (policy ``abort``, or ``rollback`` out of rollbacks).
    """
    workdir = preflight(config, workdir, lambda w: check_run_config(w, config))  # writes nothing
    set_log_level(config.runtime.log_level)  # as main.py does, for sweeps and experiments
    lock = WorkdirLock(workdir)
    stop_together(lock.acquire if jax.process_index() == 0 else lambda: None, unusable_elsewhere)
    try:
        return _train_holding_the_lock(config, workdir, on_ready)
    finally:
        lock.release()


def _record_run(workdir: str, config: ml_collections.ConfigDict, data_info: dict,
                start: int) -> None:
    """Record the run's config and data (process 0); a run starting afresh sets an earlier
    attempt's non-finite dumps aside, as they are not its own."""
    write_run_config(workdir, config)
    write_json_atomic(Workdir(workdir).data_info, data_info)
    if start == 0:
        for path in set_aside_dumps(workdir):
            logging.info("starting afresh: an earlier attempt's dump moved to %s", path)


def _check_resumed_data(workdir: str, config: ml_collections.ConfigDict, data: LMData) -> None:
    """A run with a checkpoint resumes only on the data it was trained on."""
    if latest_checkpoint_step(workdir) is not None:
        check_run_data(workdir, data.info, config.data.data_dir, "resume")


def _check_workdir_again(workdir: str, config: ml_collections.ConfigDict) -> None:
    """Under the lock: a run that held it may have recorded a config since the preflight, and
    a damaged ``metrics.jsonl`` is refused before any compile."""
    check_run_config(workdir, config)
    metrics = Workdir(workdir).metrics
    if jax.process_index() == 0 and os.path.exists(metrics):
        read_jsonl(metrics)


def _train_holding_the_lock(config: ml_collections.ConfigDict, workdir: str,
                            on_ready: Callable[[], None] | None) -> dict[str, float]:
    """``train_and_evaluate`` once ``workdir`` is this run's alone."""
    stop_together(lambda: _check_workdir_again(workdir, config), unusable_elsewhere)
    ckpt = Checkpointer(Workdir(workdir).checkpoints, save_every=config.train.ckpt_every,
                        keep=config.train.keep_ckpts)
    try:
        exp = build_experiment(config, lambda data: _check_resumed_data(workdir, config, data),
                               workdir=workdir)
        state, start, data_iter = _restore_or_init(exp, ckpt)
        if on_ready is not None:
            stop_together(lambda: on_ready() if jax.process_index() == 0 else None,
                          unusable_elsewhere)
        stop_together(lambda: _record_run(workdir, exp.config, exp.data.info, start)
                      if jax.process_index() == 0 else None, unusable_elsewhere)
        _keep_actions_in_effect(workdir, state)
        if jax.process_index() == 0:
            parameter_overview.log_parameter_overview(state.params)
        reporter = Reporter(workdir, config.data.batch_size * config.data.seq_len,
                            config.train.steps, exp.data.lfreq,
                            monitor_rule_from(config.monitor))
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
    return reporter.final


def _train_loop(exp: Experiment, ckpt: Checkpointer, watch: PreemptionWatch,
                reporter: Reporter, state: GuardedState, start: int, data_iter,
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
        is_diag = is_diagnostic_step(step, config.diag)
        program = "diag" if is_diag else "train"
        compiling = program not in called
        called.add(program)
        with reporter.excluded(state) if compiling else contextlib.nullcontext():
            if is_diag:
                state, device_metrics, device_diag = exp.steps.diag(state, batch)
            else:
                (state, device_metrics), device_diag = exp.steps.train(state, batch), None
        # step - 1's metrics (the device is already busy with this step), and the monitor's
        # action on a warn there
        state, restart = _flush_and_act(exp, ckpt, reporter, state, workdir)
        if restart is not None:
            (start, data_iter), positions = restart, {}
            step = start
            continue
        # on the grid only, so that a resumed run logs (and its monitor and collapse rule
        # smooth over) the steps the uninterrupted run logs
        is_log = step % config.train.log_every == 0 or step in (1, total)
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
                _keep_actions_in_effect(workdir, state)
                step, positions = start, {}
                continue
            positions.clear()
        saving = ckpt.should_save(step, force=step == total or stop)
        if is_eval or saving:  # a checkpoint's step has its records written (and read) first
            state, restart = _flush_and_act(exp, ckpt, reporter, state, workdir)
            if restart is not None:
                (start, data_iter), positions = restart, {}
                step = start
                continue
        if is_eval:
            with reporter.excluded(state):
                reporter.write_eval(step, evaluate(exp, state), exp.eval_floor)
        if saving:
            with reporter.excluded(state):
                ckpt.save(step, state, data_iter, force=step == total or stop)
        if stop and step < total:  # a stop asked for during the last step: the run is done
            reporter.flush()
            ckpt.wait_until_finished()
            raise Preempted(step, str(ckpt.directory), interrupted=watch.interrupted)
    reporter.flush()


def _keep_actions_in_effect(workdir: str, state: GuardedState) -> None:
    """After a (re)start: ``monitor_actions.json`` lists only the actions the state holds."""
    if state.monitor_actions is not None:
        in_effect = int(state.monitor_actions)
        stop_together(lambda: keep_actions(workdir, in_effect)
                      if jax.process_index() == 0 else None, unusable_elsewhere)


def _flush_and_act(exp: Experiment, ckpt: Checkpointer, reporter: Reporter,
                   state: GuardedState, workdir: str):
    """Flush the reporter; when that read a diagnostic step on which the early-warning monitor
    newly warned, take ``monitor.action`` (``postnorm.train.monitor_actions``). Returns the
    state and, after a rollback, (the step restored, its data iterator), else None."""
    monitor = exp.config.monitor
    if not reporter.flush() or monitor.action == "none":
        return state, None
    warn_step = from_process_0(reporter.take_warning())  # process 0 holds the history
    if not warn_step:
        return state, None
    done = int(state.monitor_actions)
    if done >= monitor.max_actions:
        logging.warning("collapse early warning at step %d: monitor.max_actions=%d actions "
                        "taken already, none now", warn_step, monitor.max_actions)
        return state, None
    tsim_L = reporter.last_tsim
    restart = None
    changed_from = state
    if monitor.rollback:
        ckpt.wait_until_finished()
        state, start, data_iter = _restore_or_init(exp, ckpt, before=warn_step)
        restart = (start, data_iter)
    state = apply_change(state, changed_from, monitor, tsim_L)
    entry = {"step": warn_step, "action": monitor.action, "actions": done + 1,
             "rolled_back_to": restart[0] if restart else None,
             "layers": [int(i) for i in np.flatnonzero(tsim_L >= DEFAULT_RULE.tsim_threshold)],
             **changed_values(state)}
    logging.warning("collapse early warning at step %d: monitor.action=%s (action %d of "
                    "monitor.max_actions=%d)%s", warn_step, monitor.action, done + 1,
                    monitor.max_actions,
                    f", rolled back to step {restart[0]}" if restart else "")
    stop_together(lambda: record_action(workdir, entry) if jax.process_index() == 0 else None,
                  unusable_elsewhere)
    if restart is not None:
        reporter.restart(restart[0], int(state.skipped_steps))
    return state, restart


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


def evaluate_checkpoint(config: ml_collections.ConfigDict, workdir: str) -> float:
    """Restore the latest checkpoint of ``workdir`` and evaluate it on the validation split."""
    exp, state, step, _ = restore_run(config, workdir, "evaluate", data_position=False)
    loss = evaluate(exp, state)
    logging.info("eval of the checkpoint at step %d: loss %.4f | L_freq %.4f", step, loss,
                 exp.data.lfreq)
    return loss
