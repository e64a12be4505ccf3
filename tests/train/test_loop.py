"""Training tests: the loss falls, resume is exact, and the sharded step matches one device."""

import functools
import json
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.default import get_config
from postnorm.config.schema import ConfigError
from postnorm.data import DataError, load_data
from postnorm.data.lfreq import frequency_floor
from postnorm.model import ModelSpec
from postnorm.runtime.mesh import batch_sharding, make_mesh
from postnorm.train import experiment, loop
from postnorm.train.loop import evaluate_checkpoint, train_and_evaluate
from postnorm.train.losses import Loss
from postnorm.train.optim import make_optimizer
from postnorm.train.programs import compile_steps
from postnorm.train.reporter import Reporter
from postnorm.train.validate import check_config
from postnorm.workdir.checkpoint import Checkpointer, CheckpointError, CheckpointReader
from postnorm.workdir.config_record import write_run_config
from postnorm.workdir.metrics import MetricWriter
from tests.reliability_helpers import read_losses, read_records, tiny_config, write_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def test_twenty_steps_lower_the_loss_and_write_outputs(corpus, tmp_path):
    """Also: the diagnostic step runs on its schedule's steps (a dense phase to step 6)."""
    workdir = tmp_path / "run"
    config = tiny_config(corpus, tmp_path / "tfds", diag__dense_every=3, diag__dense_until=6)
    train_and_evaluate(config, str(workdir))
    losses = read_losses(workdir)
    assert sorted(losses) == list(range(1, 21))
    diagnosed = [r["step"] for r in read_records(workdir) if "diag/tsim_attn/layer_00" in r]
    assert diagnosed == [1, 3, 6, 10, 20]
    assert np.mean([losses[s] for s in (18, 19, 20)]) < losses[1] - 1.0
    assert (workdir / "config.json").exists()
    assert list((workdir / "tensorboard").glob("events.out.tfevents.*"))
    assert (workdir / "checkpoints" / "20").is_dir()
    record = json.loads((workdir / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["eval/lfreq"] > 0

    # Each logged batch's frequency floor, recomputed from the same data order.
    data = load_data(config.data, seed=config.seed)
    batches = data.train_iterator(batch_size=config.data.batch_size, seed=config.seed)
    floors = {step: frequency_floor(next(batches)["targets"], data.unigram_counts)
              for step in range(1, 21)}
    logged = {r["step"]: r["train/freq_floor"] for r in read_records(workdir)
              if "train/freq_floor" in r}
    assert sorted(logged) == sorted(losses)
    for step, floor in logged.items():
        assert floor == pytest.approx(floors[step], rel=1e-12)
    eval_targets = [b["targets"] for b in data.eval_batches(
        batch_size=config.data.batch_size, num_batches=config.train.eval_batches)]
    assert record["eval/freq_floor"] == pytest.approx(
        frequency_floor(np.stack(eval_targets), data.unigram_counts), rel=1e-12)


@pytest.mark.slow
def test_resume_reproduces_losses_exactly(corpus, tmp_path):
    """Resuming from the step-4 checkpoint repeats steps 5..8 bit for bit, also when the
    resume changes how often it evaluates, diagnoses and saves (``RESUMABLE_FIELDS``)."""
    config = tiny_config(corpus, tmp_path / "tfds", train__steps=8, train__ckpt_every=4)
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    train_and_evaluate(config, str(full))
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(full / "checkpoints" / "4", resumed / "checkpoints" / "4")
    shutil.copy(full / "config.json", resumed / "config.json")
    watched_differently = config.copy_and_resolve_references()
    watched_differently.diag.every = watched_differently.train.eval_every = 3
    watched_differently.train.ckpt_every, watched_differently.train.keep_ckpts = 2, 5
    train_and_evaluate(watched_differently, str(resumed))
    want, got = read_losses(full), read_losses(resumed)
    assert sorted(got) == [5, 6, 7, 8]
    for step in got:
        assert got[step] == want[step], (step, got[step], want[step])


def test_sharded_step_matches_single_device():
    assert jax.device_count() == 8, "tests/conftest.py sets 8 simulated CPU devices"
    config = get_config("layers=2,model.attention=cpu")
    config.model.d_model, config.model.n_heads, config.model.d_ff = 32, 4, 64
    spec = ModelSpec.from_config(config.model, vocab_size=64, max_len=32)
    tx, schedule = make_optimizer(config.opt, 10)
    tokens = np.random.default_rng(0).integers(0, 64, size=(8, 33)).astype(np.int32)
    local = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    losses, diagnostics = {}, {}
    for name, mesh_fields, devices in (("single", (1, 1, 1), jax.devices()[:1]),
                                       ("sharded", (2, 2, 2), None)):
        config.mesh.data, config.mesh.fsdp, config.mesh.tensor = mesh_fields
        mesh = make_mesh(config.mesh, devices)
        steps = compile_steps(spec, tx, schedule, mesh, Loss())
        state = steps.init(0)
        batch = {k: jax.device_put(v, batch_sharding(mesh)) for k, v in local.items()}
        history = []
        for _ in range(3):
            state, metrics = steps.train(state, batch)
            history.append(float(metrics["train/loss"]))
        # The diagnostic step too: with fsdp its per-layer SVDs once deadlocked on CPU.
        state, metrics, diagnostics[name] = steps.diag(state, batch)
        losses[name] = [*history, float(metrics["train/loss"])]
        if name == "sharded":  # layers replicated, embed (32) over fsdp 2, mlp (64) over tensor 2
            w_up = state.params["layers"]["ffn"]["w_up"]
            assert w_up.sharding.shard_shape(w_up.shape) == (2, 16, 32)
    np.testing.assert_allclose(losses["sharded"], losses["single"], rtol=1e-5)
    assert diagnostics["sharded"].keys() == diagnostics["single"].keys()
    for key, value in diagnostics["single"].items():
        np.testing.assert_allclose(diagnostics["sharded"][key], value, rtol=1e-4, atol=1e-6,
                                   err_msg=key)


@pytest.mark.parametrize("field,value,message", [
    ("model.n_heads", 5, "not divisible by model.n_heads"),
    ("model.norm", "rezero", "model.norm='rezero' is invalid"),
    ("model.init", "he", "model.init='he' is invalid"),
    ("mesh.tensor", 3, "mesh.tensor=3 = 3 must divide the 8 devices"),
    ("data.batch_size", 12, "divisible by mesh data x fsdp"),
])
def test_invalid_fields_name_the_problem(field, value, message):
    config = get_config()
    section, name = field.split(".")
    config[section][name] = value
    with pytest.raises(ConfigError, match=message):
        check_config(config, device_count=8)


@pytest.mark.parametrize(("entry", "opened"), [(loop.train_and_evaluate, Checkpointer),
                                               (loop.evaluate_checkpoint, CheckpointReader)])
def test_a_failed_build_still_closes_the_checkpointer(entry, opened, corpus, tmp_path,
                                                     monkeypatch):
    """When building the experiment fails, the checkpoint manager (and orbax's threads) is
    closed."""
    closed, close = [], opened.close

    def recording_close(self):
        closed.append(self.directory.name)
        close(self)

    monkeypatch.setattr(opened, "close", recording_close)
    config = tiny_config(corpus, tmp_path / "data", train__eval_batches=10_000)
    if entry is loop.evaluate_checkpoint:  # it builds only for a run with a checkpoint
        (tmp_path / "run" / "checkpoints" / "1").mkdir(parents=True)
        write_run_config(str(tmp_path / "run"), config)
    with pytest.raises(DataError, match=r"lower the eval batch count or size "
                       r"\(train.eval_batches, data.batch_size\) or data.seq_len"):
        entry(config, str(tmp_path / "run"))
    assert closed == ["checkpoints"]


def test_evaluating_a_workdir_without_checkpoints_is_a_checkpoint_error(corpus, tmp_path):
    """main.py maps CheckpointError to exit 2 with the message; the message says what to do,
    and nothing is created."""
    config = tiny_config(corpus, tmp_path / "tfds")
    with pytest.raises(CheckpointError, match=r"no checkpoint in .*/run/checkpoints: train first"):
        evaluate_checkpoint(config, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_a_failed_start_of_the_loop_closes_the_metric_writer(corpus, tmp_path, monkeypatch):
    """When the preemption watch fails to start, the opened TensorBoard and JSONL writers are
    closed."""
    closed, close = [], MetricWriter.close

    def recording_close(self):
        closed.append(type(self).__name__)
        close(self)

    def failing_watch(start_step):
        raise RuntimeError(f"no watch at step {start_step}")

    monkeypatch.setattr(MetricWriter, "close", recording_close)
    monkeypatch.setattr(loop, "PreemptionWatch", failing_watch)
    with pytest.raises(RuntimeError, match="no watch at step 0"):
        train_and_evaluate(tiny_config(corpus, tmp_path / "tfds"), str(tmp_path / "run"))
    assert closed == ["MetricWriter"]


def test_mesh_axis_sizes_and_shard_shapes():
    """The module docstring's layout: batch over data x fsdp; params: embed over fsdp,
    heads/mlp/vocab over tensor, layers and norms replicated."""
    cfg = get_config("layers=2")
    cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor = 2, 4, 1
    mesh = make_mesh(cfg.mesh)
    assert dict(mesh.shape) == {"data": 2, "fsdp": 4, "tensor": 1}
    assert batch_sharding(mesh).shard_shape((8, 16)) == (1, 16)

    cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor = 1, 2, 4
    mesh = make_mesh(cfg.mesh)
    assert dict(mesh.shape) == {"data": 1, "fsdp": 2, "tensor": 4}
    assert batch_sharding(mesh).shard_shape((8, 16)) == (4, 16)  # replicated over tensor
    cfg.model.d_model, cfg.model.n_heads, cfg.model.d_ff = 32, 4, 64
    cfg.model.attention = "cpu"
    spec = ModelSpec.from_config(cfg.model, vocab_size=64, max_len=16)
    tx, schedule = make_optimizer(cfg.opt, 10)
    params = compile_steps(spec, tx, schedule, mesh, Loss()).abstract_state.params
    layers = params["layers"]
    # layers axis (2) replicated; embed (32) / fsdp 2 = 16; mlp (64) / tensor 4 = 16.
    assert layers["ffn"]["w_up"].sharding.shard_shape((2, 32, 64)) == (2, 16, 16)
    assert layers["ffn"]["w_down"].sharding.shard_shape((2, 64, 32)) == (2, 16, 16)
    # vocab (64) / tensor 4 = 16; embed / fsdp 2 = 16.
    assert params["embedding"].sharding.shard_shape((64, 32)) == (16, 16)


def numpy_cross_entropy(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Per-token -log softmax(logits)[target], float64."""
    logits = logits.astype(np.float64)
    m = logits.max(-1, keepdims=True)
    logz = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[..., 0]
    return logz - np.take_along_axis(logits, targets[..., None], -1)[..., 0]


def test_eval_loss_is_the_token_mean_cross_entropy_of_every_eval_batch(tmp_path):
    config = tiny_config(write_corpus(tmp_path / "corpus"), tmp_path / "tfds",
                         train__eval_batches=3)
    exp = experiment.build_experiment(config)
    assert len(exp.eval_batches) == 3
    state = exp.steps.init(config.seed)
    it = experiment.train_iterator(exp)
    sharding = batch_sharding(exp.mesh)
    for _ in range(5):  # some training, so the batches' losses differ
        state, _ = exp.steps.train(state, experiment.global_batch(next(it), sharding))
    per_token = [
        numpy_cross_entropy(np.asarray(state.apply_fn({"params": state.params}, b["inputs"])),
                             b["targets"])
        for b in exp.eval_batches
    ]
    means = [float(t.mean()) for t in per_token]
    assert max(means) - min(means) > 1e-3, means  # the batches are told apart
    # Equal-size batches: the mean of batch means is the token-weighted mean.
    expected = float(np.concatenate([t.ravel() for t in per_token]).mean())
    assert experiment.evaluate(exp, state) == pytest.approx(expected, rel=2e-6)


def test_time_left_out_of_the_step_rate_starts_when_the_dispatched_steps_finish(tmp_path):
    """A compile, an eval or a save is left out of ``train/tokens_per_s``. Steps dispatched
    before it may still be running (dispatch is asynchronous); their time must stay in the
    rate, not vanish into the left-out block that overlaps them."""
    reporter = Reporter(str(tmp_path), tokens_per_step=1, total_steps=10, lfreq=1.0)
    reporter.restart(0, 0)
    steps = jax.jit(lambda x: functools.reduce(lambda a, _: jnp.tanh(a @ a), range(8), x))
    x = jnp.full((1536, 1536), 1 / 1536, jnp.float32)
    jax.block_until_ready(steps(x))  # compiled
    start = time.perf_counter()
    jax.block_until_ready(steps(x))
    work = time.perf_counter() - start  # the steps' own time
    assert work > 0.1
    start = time.perf_counter()
    pending = steps(x)
    with reporter.excluded(pending):
        time.sleep(work)  # a compile as long as the steps
    counted = time.perf_counter() - start - reporter.progress._excluded_s
    assert counted > 0.5 * work  # overlapping the block, it would have been about 0
    reporter.close()
