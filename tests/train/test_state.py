"""Non-finite steps: the in-step guard, and the abort / skip / rollback policies end to end.

The guard is tested on the jitted train step with poisoned parameters (a NaN embedding row).
The policies are tested through main.py with a learning rate of 1e30 and 2 warmup steps:
step 1 has lr 0, step 2's update (lr 5e29) leaves huge but finite parameters, and step 3's
loss is NaN.
"""

import json
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from configs.default import get_config
from postnorm.data import load_data
from postnorm.model import ModelSpec
from postnorm.runtime.mesh import batch_sharding, make_mesh
from postnorm.train.losses import Loss
from postnorm.train.optim import make_optimizer
from postnorm.train.programs import compile_steps
from postnorm.train.state import GuardedState, guard
from tests.reliability_helpers import (
    config_flag,
    finalized_steps,
    jax_cache_dir,
    read_records,
    run_main,
    tiny_config,
    write_corpus,
)

# --- the guard inside the jitted step --------------------------------------------------------


@pytest.fixture(scope="module")
def halting():
    """Steps compiled with ``halt_on_nonfinite=True``, a batch, and its first token."""
    return _steps_and_batch(halt=True)


def _steps_and_batch(halt: bool):
    config = get_config("layers=2,model.attention=cpu")
    config.model.d_model, config.model.n_heads, config.model.d_ff = 32, 4, 64
    config.mesh.data = 1
    spec = ModelSpec.from_config(config.model, vocab_size=64, max_len=16)
    tx, schedule = make_optimizer(config.opt, 10)
    mesh = make_mesh(config.mesh, jax.devices()[:1])
    steps = compile_steps(spec, tx, schedule, mesh, Loss(), halt_on_nonfinite=halt)
    tokens = np.random.default_rng(0).integers(0, 64, size=(8, 17)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    batch = {k: jax.device_put(v, batch_sharding(mesh)) for k, v in batch.items()}
    return steps, batch, int(tokens[0, 0])


def _poison(state, token: int):
    """The state with a NaN in the embedding row of ``token`` (so the loss is NaN)."""
    params = dict(state.params)
    params["embedding"] = state.params["embedding"].at[token, 0].set(jnp.nan)
    return state.replace(params=params)


def _host(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _bitwise_equal(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return all(x.tobytes() == y.tobytes() for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("halt", [False, True])
def test_a_finite_loss_with_a_nonfinite_gradient_norm_is_not_applied(halt):
    state = GuardedState.create_guarded(apply_fn=None, params={"w": jnp.ones(3)},
                                        tx=optax.sgd(0.1))

    def step(grad_norm: float):
        def step_fn(s, _batch):
            metrics = {"train/loss": jnp.float32(1.0), "train/grad_norm": jnp.float32(grad_norm),
                       "train/lr": jnp.float32(0.1)}
            return s.apply_gradients(grads={"w": jnp.ones(3)}), metrics
        return guard(step_fn, halt=halt)(state, None)

    kept, _ = step(np.inf)
    np.testing.assert_array_equal(kept.params["w"], np.ones(3))
    assert int(kept.skipped_steps) == 1 and int(kept.step) == 0
    applied, _ = step(1.0)  # control: the same step with a finite gradient norm is applied
    np.testing.assert_allclose(applied.params["w"], 0.9 * np.ones(3), rtol=1e-6)


def test_skip_guard_keeps_the_state_and_counts_the_step():
    steps, batch, token = _steps_and_batch(halt=False)
    poisoned = _poison(steps.init(0), token)
    before = _host(poisoned.replace(skipped_steps=poisoned.skipped_steps + 1))
    state, metrics = steps.train(poisoned, batch)
    assert np.isnan(metrics["train/loss"]) and int(metrics["train/skipped_steps"]) == 1
    assert _bitwise_equal(_host(state), before)  # params, optimizer state and step unchanged
    assert int(state.halted_at) == 0

    clean = steps.init(0).replace(skipped_steps=state.skipped_steps)
    state, metrics = steps.train(clean, batch)
    assert np.isfinite(metrics["train/loss"]) and int(state.step) == 1
    assert int(state.skipped_steps) == 1  # a finite step is applied and not counted


def test_a_skipped_diagnostic_step_reports_a_zero_update():
    """The update norms of a diagnostic step are those of the update the guard applied: zero
    when it threw the step's non-finite update away, ||new - old|| per layer when it applied
    it (numpy, from the states on the host)."""
    steps, batch, token = _steps_and_batch(halt=False)
    _, metrics, diagnostics = steps.diag(_poison(steps.init(0), token), batch)
    assert np.isnan(metrics["train/loss"]) and int(metrics["train/skipped_steps"]) == 1
    for group in ("attn", "ffn", "norm"):
        np.testing.assert_array_equal(diagnostics[f"update_norm_{group}"], 0.0)

    state, _ = steps.train(steps.init(0), batch)  # the warm-up's learning rate is 0 at step 0
    before = jax.device_get(state.params["layers"])
    state, metrics, diagnostics = steps.diag(state, batch)  # control: applied
    assert int(metrics["train/skipped_steps"]) == 0 and metrics["train/lr"] > 0
    after = jax.device_get(state.params["layers"])
    for group, names in {"attn": ["attn"], "ffn": ["ffn"],
                         "norm": ["norm_attn", "norm_ffn"]}.items():
        want = [np.sqrt(sum(np.sum((np.float64(new[layer]) - old[layer]) ** 2)
                            for name in names for new, old in zip(
                                jax.tree.leaves(after[name]), jax.tree.leaves(before[name]),
                                strict=True)))
                for layer in range(2)]
        assert min(want) > 0
        np.testing.assert_allclose(diagnostics[f"update_norm_{group}"], want, rtol=1e-5)


def test_halt_guard_freezes_the_state_at_the_first_nonfinite_step(halting):
    steps, batch, token = halting
    state, _ = steps.train(steps.init(0), batch)  # step 1: finite, applied
    good_params = jax.tree.map(np.asarray, state.params)
    state, metrics = steps.train(_poison(state, token), batch)  # step 2: NaN
    assert int(state.halted_at) == 2 and int(metrics["train/skipped_steps"]) == 1
    # Even a finite step after it is not applied: the state stays at step 1's.
    state = state.replace(params=jax.tree.map(jnp.asarray, good_params))
    frozen = _host(state.replace(skipped_steps=state.skipped_steps + 1))
    state, metrics = steps.train(state, batch)
    assert np.isfinite(metrics["train/loss"])
    assert int(state.step) == 1 and int(state.halted_at) == 2 and int(state.skipped_steps) == 2
    assert _bitwise_equal(_host(state), frozen)


def test_lr_scale_scales_the_update(halting):
    steps, batch, _ = halting
    start = _host(steps.init(0).params)
    deltas = {}
    for scale in (1.0, 0.25):
        state = steps.init(0)
        state = state.replace(lr_scale=jax.device_put(jnp.float32(scale),
                                                      state.lr_scale.sharding))
        for _ in range(2):  # step 1 has lr 0 (warmup)
            state, metrics = steps.train(state, batch)
        assert float(metrics["train/lr"]) == pytest.approx(scale * 1e-3 / 20)
        deltas[scale] = [p - s for p, s in zip(_host(state.params), start, strict=True)]
    for full, quarter in zip(deltas[1.0], deltas[0.25], strict=True):
        # Parameter differences of ~1e-5 carry float32 rounding of the parameters (~1e-7).
        np.testing.assert_allclose(quarter, 0.25 * full, rtol=0, atol=2.5e-7)
        assert np.abs(full).max() > 1e-6


# --- the policies, end to end through main.py -----------------------------------------------

STEPS = 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("nonfinite")
    corpus = write_corpus(root / "corpus")
    return corpus, root / "tfds", jax_cache_dir(tmp_path_factory)


def _run(setup, workdir, **overrides):
    corpus, data_dir, cache = setup
    flag = config_flag(corpus, data_dir, **{"train__steps": STEPS, "opt__lr": 1e30, **overrides})
    return run_main("--config", flag, "--workdir", str(workdir), cache_dir=cache)


def _dump(workdir, step: int) -> dict:
    return json.loads((workdir / f"nonfinite_step_{step}.json").read_text())


@pytest.mark.slow
def test_abort_dumps_the_step_and_exits_nonzero_before_any_checkpoint_of_it(setup, tmp_path):
    workdir = tmp_path / "run"
    result = _run(setup, workdir, train__ckpt_every=1)
    assert result.returncode == 3, result.stderr[-3000:]
    assert (f"postnorm: error: step 3 has a non-finite loss or gradient; no state from it was "
            f"saved. Forensic dump: {workdir}/nonfinite_step_3.json. To go on, set "
            "train.nonfinite to 'skip' or 'rollback' and rerun") in result.stderr
    assert finalized_steps(workdir) == [1, 2]  # steps 1 and 2 saved; nothing from step 3 on
    assert read_records(workdir)[-1]["train/loss"] == "nan"

    dump = _dump(workdir, 3)
    assert dump["step"] == 3 and dump["loss"] == "nan"
    first = dump["first_nonfinite_forward"]
    assert first["layer"] == 0 and first["sublayer"] == "attn" and first["nonfinite_stats"]
    # The statistics come from the parameters before step 3, which are finite, not from NaN
    # ones: their norms are numbers or, where the squares overflow float32, inf, never NaN.
    # (Their forward overflows, so the activation statistics themselves are NaN.)
    param_norms = {k: v for k, v in dump["diagnostics"].items() if k.startswith("param_norm_")}
    assert param_norms and all(x != "nan" for v in param_norms.values() for x in v), param_norms
    assert "grad_norm_attn" in dump["diagnostics"]
    assert not [k for k in dump["diagnostics"] if k.startswith("update_norm_")]  # never applied
    # The recorded iterator position is the one before the third batch.
    corpus, data_dir, _ = setup
    data = load_data(tiny_config(corpus, data_dir).data)
    iterator = data.train_iterator(batch_size=8, seed=0)
    next(iterator), next(iterator)
    assert dump["data_iterator_state_before_batch"] == {"process_0-of-1": iterator.get_state()}

    # The advice can be followed: the rerun with another policy resumes from step 2.
    result = _run(setup, workdir, train__ckpt_every=1, train__nonfinite="skip")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from the checkpoint at step 2" in result.stderr
    skipped = {r["step"]: r["train/skipped_steps"] for r in read_records(workdir)
               if "train/loss" in r}
    assert skipped == {1: 0, 2: 0, **{s: s - 2 for s in range(3, STEPS + 1)}}


@pytest.mark.slow
def test_abort_drops_the_records_of_the_steps_after_the_halted_one(setup, tmp_path):
    """Step 3 is not logged (log_every 2), so the host learns of the halt from step 4's
    metrics, after step 4's record (of the frozen state) was written: it is dropped."""
    workdir = tmp_path / "run"
    result = _run(setup, workdir, train__log_every=2, train__ckpt_every=8)
    assert result.returncode == 3, result.stderr[-3000:]
    assert "step 3 has a non-finite loss" in result.stderr
    assert [r["step"] for r in read_records(workdir)] == [1, 2]

    # Nothing was checkpointed, so a corrected config starts afresh; the dump is kept aside.
    result = _run(setup, workdir, train__log_every=2, train__ckpt_every=8, opt__lr=1e-3)
    assert result.returncode == 0, result.stderr[-3000:]
    assert not list(workdir.glob("nonfinite_step_*.json"))
    assert _dump(workdir / "earlier_attempts", 3)["step"] == 3


@pytest.mark.slow
def test_skip_drops_nonfinite_updates_counts_them_and_finishes(setup, tmp_path):
    workdir = tmp_path / "run"
    result = _run(setup, workdir, train__nonfinite="skip", train__ckpt_every=4)
    assert result.returncode == 0, result.stderr[-3000:]
    records = {r["step"]: r for r in read_records(workdir) if "train/loss" in r}
    assert [records[s]["train/skipped_steps"] for s in range(1, STEPS + 1)] == \
        [0, 0, 1, 2, 3, 4, 5, 6]
    # Skipped updates leave the optimizer's step count, hence the lr schedule, where it was.
    assert {records[s]["train/lr"] for s in range(3, STEPS + 1)} == {records[3]["train/lr"]}
    assert finalized_steps(workdir) == [4, 8]
    assert not list(workdir.glob("nonfinite_step_*.json"))


@pytest.mark.slow
def test_rollback_lowers_the_lr_recovers_and_a_resume_keeps_the_lower_lr(setup, tmp_path):
    workdir = tmp_path / "run"
    result = _run(setup, workdir, train__nonfinite="rollback", train__ckpt_every=4,
                  train__rollback_lr_factor=1e-33)
    assert result.returncode == 0, result.stderr[-3000:]
    assert ("step 3 is non-finite: rolled back to step 0 with the learning rate scaled by 1e-33"
            in result.stderr)
    records = {r["step"]: r for r in read_records(workdir) if "train/loss" in r}
    assert sorted(records) == list(range(1, STEPS + 1))  # the abandoned records are gone
    assert all(np.isfinite(records[s]["train/loss"]) for s in records)
    assert records[3]["train/lr"] == pytest.approx(1e-3, rel=1e-5)  # 1e30 * 1e-33
    assert {records[s]["train/rollbacks"] for s in records} == {1}

    # The lr scale is checkpointed: resuming from step 4 repeats steps 5..8 exactly.
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(workdir / "checkpoints" / "4", resumed / "checkpoints" / "4")
    shutil.copy(workdir / "config.json", resumed / "config.json")  # a checkpoint needs its config
    result = _run(setup, resumed, train__nonfinite="rollback", train__ckpt_every=4,
                  train__rollback_lr_factor=1e-33)
    assert result.returncode == 0, result.stderr[-3000:]
    again = {r["step"]: r["train/loss"] for r in read_records(resumed) if "train/loss" in r}
    assert again == {s: records[s]["train/loss"] for s in range(5, STEPS + 1)}


@pytest.mark.slow
def test_rollback_gives_up_after_max_rollbacks(setup, tmp_path):
    workdir = tmp_path / "run"
    # Step 2's checkpoint already holds the diverged parameters, so rolling back to it cannot
    # help: two rollbacks, then the run stops as abort does.
    result = _run(setup, workdir, train__nonfinite="rollback", train__ckpt_every=1,
                  train__max_rollbacks=2)
    assert result.returncode == 3, result.stderr[-3000:]
    rollbacks = re.findall(r"step 3 is non-finite: rolled back to step 2 with the learning rate "
                           r"scaled by ([0-9.e-]+) \(rollback (\d) of", result.stderr)
    assert rollbacks == [("0.5", "1"), ("0.25", "2")]
    assert "step 3 has a non-finite loss or gradient after 2 rollbacks (train.max_rollbacks=2)" \
        in result.stderr
    assert (workdir / "nonfinite_step_3.json").exists()
    assert finalized_steps(workdir) == [1, 2]
