"""The training loop: data, sharded state, jitted steps, eval, checkpoints and metrics.

Step t's metrics are fetched only after step t+1 is dispatched, and only on logging steps,
so the host never waits on the device in between. A run resumes from the latest checkpoint in
``<workdir>/checkpoints`` (state and data-iterator position) and rewrites the metrics of any
steps it repeats.
"""

import dataclasses
import json
import os

import jax
import ml_collections
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from postnorm.checkpoint import Checkpointer
from postnorm.data import LMData, load_data
from postnorm.diag_step import flatten_diagnostics
from postnorm.metrics import JSONL_NAME, MetricWriter, Progress, truncate_jsonl
from postnorm.model import ModelSpec, param_count_formula
from postnorm.optim import make_optimizer
from postnorm.plots import render_run_plots
from postnorm.sharding import batch_sharding, make_mesh
from postnorm.step_builder import CompiledSteps, compile_steps
from postnorm.validation import check_config


@dataclasses.dataclass
class Experiment:
    """Everything built from a config before the first step."""

    config: ml_collections.ConfigDict
    data: LMData
    spec: ModelSpec
    steps: CompiledSteps
    mesh: jax.sharding.Mesh


def _load_data_once(config: ml_collections.ConfigDict) -> LMData:
    """Process 0 prepares the dataset, tokenizer and L_freq caches; the others then read them."""
    if jax.process_index() == 0:
        data = load_data(config.data, seed=config.seed)
    multihost_utils.sync_global_devices("postnorm: data prepared")
    if jax.process_index() != 0:
        data = load_data(config.data, seed=config.seed)
    return data


def build_experiment(config: ml_collections.ConfigDict) -> Experiment:
    """Load data and build the model, mesh and compiled steps of a validated config."""
    data = _load_data_once(config)
    spec = ModelSpec.from_config(config.model, vocab_size=data.tokenizer.vocab_size,
                                 max_len=config.data.seq_len)
    counts = param_count_formula(spec)
    logging.info("parameters: %s", ", ".join(f"{k}={v:,}" for k, v in counts.items()))
    mesh = make_mesh(config.mesh)
    tx, schedule = make_optimizer(config.opt, config.train.steps)
    return Experiment(config, data, spec, compile_steps(spec, tx, schedule, mesh), mesh)


def _global_batch(local: dict[str, np.ndarray], sharding) -> dict[str, jax.Array]:
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in local.items()}


def evaluate(exp: Experiment, state) -> float:
    """Mean validation cross-entropy over ``train.eval_batches`` fixed batches."""
    cfg = exp.config
    local = exp.data.eval_batches(
        batch_size=cfg.data.batch_size // jax.process_count(),
        num_batches=cfg.train.eval_batches, process_index=jax.process_index(),
        process_count=jax.process_count())
    sharding = batch_sharding(exp.mesh)
    losses = [exp.steps.evaluate(state, _global_batch(b, sharding)) for b in local]
    return float(np.mean(jax.device_get(losses)))


def _write_config(config: ml_collections.ConfigDict, workdir: str) -> None:
    if jax.process_index() == 0:
        with open(os.path.join(workdir, "config.json"), "w") as f:
            f.write(config.to_json_best_effort(indent=2))


def _restore_or_init(exp: Experiment, ckpt: Checkpointer, data_iter):
    restored = ckpt.restore_latest(exp.steps.abstract_state, data_iter)
    if restored is None:
        logging.info("no checkpoint in %s: starting from step 0", ckpt.directory)
        return exp.steps.init(exp.config.seed), 0
    state, step = restored
    logging.info("resumed from the checkpoint at step %d", step)
    return state, step


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, float]:
    """Train ``config`` in ``workdir`` (resuming if possible); returns the final metrics."""
    check_config(config, device_count=jax.device_count(), process_count=jax.process_count())
    workdir = os.path.abspath(os.path.expanduser(workdir))
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), save_every=config.train.ckpt_every,
                        keep=config.train.keep_ckpts)
    exp = build_experiment(config)
    _write_config(config, workdir)
    if jax.process_index() == 0:
        with open(os.path.join(workdir, "data_info.json"), "w") as f:
            json.dump(exp.data.info, f, indent=2)
    lfreq = exp.data.lfreq
    data_iter = exp.data.train_iterator(
        batch_size=config.data.batch_size // jax.process_count(), seed=config.seed,
        process_index=jax.process_index(), process_count=jax.process_count())
    state, start = _restore_or_init(exp, ckpt, data_iter)

    if jax.process_index() == 0:
        truncate_jsonl(os.path.join(workdir, JSONL_NAME), start)
    writer = MetricWriter(workdir, enabled=jax.process_index() == 0)
    total = config.train.steps
    reporter = _Reporter(writer, Progress(total, config.data.batch_size * config.data.seq_len,
                                          start), lfreq)
    sharding = batch_sharding(exp.mesh)
    try:
        for step in range(start + 1, total + 1):
            batch = _global_batch(next(data_iter), sharding)
            is_diag = step % config.diag.every == 0 or step == 1
            if is_diag:
                state, device_metrics, device_diag = exp.steps.diag(state, batch)
            else:
                (state, device_metrics), device_diag = exp.steps.train(state, batch), None
            reporter.flush()  # step - 1's metrics: the device is already busy with this step
            is_log = step % config.train.log_every == 0 or step in (start + 1, total)
            if is_log or is_diag:
                reporter.hold(step, device_metrics if is_log else None, device_diag)
            if step % config.train.eval_every == 0 or step == total:
                reporter.flush()
                reporter.write_eval(step, evaluate(exp, state))
            ckpt.save(step, state, data_iter, force=step == total)
        reporter.flush()
    finally:
        writer.close()
        ckpt.close()
    if jax.process_index() == 0:
        render_run_plots(workdir)
    return reporter.final


class _Reporter:
    """Fetches held device metrics one step late, then logs and writes them."""

    def __init__(self, writer: MetricWriter, progress: Progress, lfreq: float):
        self.writer, self.progress, self.lfreq = writer, progress, lfreq
        self.final: dict[str, float] = {}
        self._held = None

    def hold(self, step: int, metrics, diagnostics) -> None:
        self._held = (step, metrics, diagnostics)

    def flush(self) -> None:
        if self._held is None:
            return
        step, device_metrics, device_diag = self._held
        self._held = None
        scalars = {}
        if device_metrics is not None:
            scalars = {k: float(v) for k, v in jax.device_get(device_metrics).items()}
            line, tokens_per_s = self.progress.report(step, scalars, self.lfreq)
            logging.info(line)
            scalars["train/lfreq"] = self.lfreq
            if tokens_per_s is not None:
                scalars["train/tokens_per_s"] = tokens_per_s
        if device_diag is not None:
            scalars.update(flatten_diagnostics(jax.device_get(device_diag)))
        self.writer.write_scalars(step, scalars)
        self.final.update(scalars)

    def write_eval(self, step: int, eval_loss: float) -> None:
        logging.info("eval at step %d: loss %.4f | L_freq %.4f | loss - L_freq %+.4f",
                     step, eval_loss, self.lfreq, eval_loss - self.lfreq)
        scalars = {"eval/loss": eval_loss, "eval/lfreq": self.lfreq,
                   "eval/loss_minus_lfreq": eval_loss - self.lfreq}
        self.writer.write_scalars(step, scalars)
        self.final.update(scalars)


def evaluate_checkpoint(config: ml_collections.ConfigDict, workdir: str) -> float:
    """Restore the latest checkpoint of ``workdir`` and evaluate it on the validation split."""
    check_config(config, device_count=jax.device_count(), process_count=jax.process_count())
    workdir = os.path.abspath(os.path.expanduser(workdir))
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), save_every=config.train.ckpt_every,
                        keep=config.train.keep_ckpts)
    exp = build_experiment(config)
    data_iter = exp.data.train_iterator(
        batch_size=config.data.batch_size // jax.process_count(), seed=config.seed,
        process_index=jax.process_index(), process_count=jax.process_count())
    restored = ckpt.restore_latest(exp.steps.abstract_state, data_iter)
    ckpt.close()
    if restored is None:
        raise FileNotFoundError(f"no checkpoint in {ckpt.directory}: train first "
                                f"(--mode=train) or point --workdir at a trained run")
    state, step = restored
    loss = evaluate(exp, state)
    logging.info("eval of the checkpoint at step %d: loss %.4f | L_freq %.4f", step, loss,
                 exp.data.lfreq)
    return loss
