"""Tests for postnorm.workdir.checkpoint against real orbax, grain, flax and optax objects."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training.train_state import TrainState
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding
from orbax.checkpoint._src.path import async_path  # orbax's tmp-directory cleanup calls this

from postnorm.workdir.checkpoint import Checkpointer, CheckpointError

TMP_SUFFIX = ".orbax-checkpoint-tmp"  # orbax 0.12.8 AtomicRenameTemporaryPath naming
TX = optax.adamw(1e-2)  # one instance, so tree structures (static tx) compare equal


def _apply(params: dict, x: jax.Array) -> jax.Array:
    return x @ params["w"] + params["b"]


def _create_state(rows: int = 16) -> TrainState:
    params = {
        "w": jnp.arange(rows * 4, dtype=jnp.float32).reshape(rows, 4) / 10.0,
        "b": jnp.zeros((4,), jnp.float32),
    }
    return TrainState.create(apply_fn=_apply, params=params, tx=TX)


@jax.jit
def _train_step(state: TrainState, batch: jax.Array) -> TrainState:
    x = jnp.broadcast_to(
        batch[:, None].astype(jnp.float32), (batch.shape[0], state.params["w"].shape[0])
    )
    grads = jax.grad(lambda p: jnp.mean(state.apply_fn(p, x) ** 2))(state.params)
    return state.apply_gradients(grads=grads)


def _data_iter() -> grain.DatasetIterator:
    ds = grain.MapDataset.range(1000).shuffle(seed=1).repeat().batch(4).to_iter_dataset()
    return iter(ds)


def _train(state: TrainState, it: Iterator, n: int) -> TrainState:
    for _ in range(n):
        state = _train_step(state, jnp.asarray(next(it)))
    return state


def _abstract(state_fn, sharding_fn=lambda x: SingleDeviceSharding(jax.devices()[0])):
    shapes = jax.eval_shape(state_fn)
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding_fn(x)), shapes
    )


def _host(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _assert_bitwise_equal(a, b) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(_host(a), _host(b), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()


def _step_dirs(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.is_dir())


def test_round_trip_is_bitwise_and_data_continues(tmp_path: Path) -> None:
    directory = tmp_path / "checkpoints"
    it = _data_iter()
    state = _train(_create_state(), it, 3)
    saved = _host(state)
    ckpt = Checkpointer(str(directory), save_every=1, keep=3)
    assert ckpt.restore_latest(_abstract(_create_state), _data_iter()) is None
    assert ckpt.save(3, state, it)
    # save() has copied everything it needs: the caller may free/donate state and advance data.
    jax.tree.map(lambda x: x.delete(), state)
    expected_batches = [next(it) for _ in range(5)]
    ckpt.close()

    fresh_it = _data_iter()
    restored = Checkpointer(str(directory), save_every=1, keep=3).restore_latest(
        _abstract(_create_state), fresh_it
    )
    assert restored is not None
    new_state, step = restored
    assert step == 3 and int(new_state.step) == 3
    assert isinstance(new_state, TrainState) and new_state.apply_fn is _apply
    assert jax.tree.structure(new_state) == jax.tree.structure(_create_state())
    for x, y in zip(saved, _host(new_state), strict=True):
        assert x.dtype == y.dtype and x.tobytes() == y.tobytes()
    adam = new_state.opt_state[0]
    assert int(adam.count) == 3 and np.any(np.asarray(adam.mu["w"]) != 0)
    for want in expected_batches:
        np.testing.assert_array_equal(next(fresh_it), want)
    _train(new_state, fresh_it, 1)  # restored state feeds the jitted step directly



class _StateWithOptionalField(TrainState):
    """A TrainState that gained a field after checkpoints were written: None unless used."""

    extra: jax.Array | None = None


def test_a_checkpoint_from_before_a_none_field_existed_restores(tmp_path: Path) -> None:
    """A state field added later whose value is None (no arrays) does not make older
    checkpoints unusable; one that holds arrays does."""
    directory = tmp_path / "checkpoints"
    it = _data_iter()
    state = _train(_create_state(), it, 2)
    ckpt = Checkpointer(str(directory), save_every=1, keep=3)
    ckpt.save(2, state, it)
    ckpt.close()

    def newer(extra=None):
        old = _create_state()
        return _StateWithOptionalField.create(apply_fn=_apply, params=old.params, tx=TX,
                                              extra=extra)

    restored = Checkpointer(str(directory), save_every=1, keep=3).restore_latest(
        _abstract(newer), _data_iter())
    assert restored is not None
    new_state, step = restored
    assert step == 2 and isinstance(new_state, _StateWithOptionalField)
    assert new_state.extra is None and new_state.apply_fn is _apply
    for x, y in zip(_host(state), _host(new_state), strict=True):
        assert x.dtype == y.dtype and x.tobytes() == y.tobytes()
    with pytest.raises(CheckpointError, match="can be restored"):
        Checkpointer(str(directory), save_every=1, keep=3).restore_latest(
            _abstract(lambda: newer(jnp.ones(3))), _data_iter())


def test_restore_onto_sharded_abstract_state(tmp_path: Path) -> None:
    n = jax.device_count()
    if n < 2:
        pytest.skip("needs >= 2 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    create = lambda: _create_state(rows=2 * n)
    it = _data_iter()
    state = _train(create(), it, 2)
    ckpt = Checkpointer(str(tmp_path / "checkpoints"), save_every=1, keep=1)
    ckpt.save(2, state, it)
    ckpt.wait_until_finished()

    mesh = Mesh(np.array(jax.devices()), ("data",))
    row_sharded = NamedSharding(mesh, PartitionSpec("data", None))
    replicated = NamedSharding(mesh, PartitionSpec())
    abstract = _abstract(create, lambda x: row_sharded if x.shape == (2 * n, 4) else replicated)
    restored = ckpt.restore_latest(abstract, _data_iter())
    ckpt.close()
    assert restored is not None
    new_state, _ = restored
    for got, want in zip(jax.tree.leaves(new_state), jax.tree.leaves(abstract), strict=True):
        assert got.sharding == want.sharding
    assert new_state.params["w"].sharding == row_sharded
    assert len(new_state.params["w"].addressable_shards) == n
    _assert_bitwise_equal(new_state, state)


def test_unfinalized_checkpoint_is_never_latest(tmp_path: Path) -> None:
    directory = tmp_path / "checkpoints"
    it = _data_iter()
    ckpt = Checkpointer(str(directory), save_every=1, keep=5)
    state = _create_state()
    states = {}
    for step in (1, 2, 3):
        state = _train(state, it, 1)
        states[step] = state
        ckpt.save(step, state, it)
    ckpt.close()
    # Simulate a crash after step 3's files were written but before orbax's finalizing rename.
    os.rename(directory / "3", directory / f"3{TMP_SUFFIX}")

    ckpt = Checkpointer(str(directory), save_every=1, keep=5)
    assert ckpt.latest_step() == 2
    restored = ckpt.restore_latest(_abstract(_create_state), _data_iter())
    assert restored is not None and restored[1] == 2
    _assert_bitwise_equal(restored[0], states[2])
    # Re-saving the interrupted step works and then becomes the latest.
    assert ckpt.save(3, states[3], it)
    ckpt.wait_until_finished()
    assert ckpt.latest_step() == 3
    ckpt.close()
    assert _step_dirs(directory) == ["1", "2", "3"]


def test_close_waits_for_the_stale_tmp_cleanup(tmp_path: Path, monkeypatch) -> None:
    directory = tmp_path / "checkpoints"
    (directory / f"7{TMP_SUFFIX}" / "state").mkdir(parents=True)
    rmtree = async_path.rmtree

    async def slow_rmtree(path, **kwargs):  # a deletion that outlasts an unwaited close()
        await asyncio.sleep(0.5)
        await rmtree(path, **kwargs)

    monkeypatch.setattr(async_path, "rmtree", slow_rmtree)
    ckpt = Checkpointer(str(directory), save_every=1, keep=2)
    ckpt.close()
    assert _step_dirs(directory) == []


def test_keeps_only_last_checkpoints(tmp_path: Path) -> None:
    directory = tmp_path / "checkpoints"
    it = _data_iter()
    state = _create_state()
    ckpt = Checkpointer(str(directory), save_every=1, keep=2)
    for step in range(1, 6):
        ckpt.save(step, state, it)
    ckpt.close()
    assert _step_dirs(directory) == ["4", "5"]


def test_unwritable_directory_raises_naming_path(tmp_path: Path) -> None:
    blocker = tmp_path / "workdir"
    blocker.write_text("a regular file, not a directory")
    directory = blocker / "checkpoints"
    with pytest.raises(CheckpointError, match=str(directory)):
        Checkpointer(str(directory), save_every=1, keep=1)


def test_save_schedule_and_resume_picks_highest_step(tmp_path: Path) -> None:
    directory = tmp_path / "checkpoints"
    it = _data_iter()
    state = _create_state()
    ckpt = Checkpointer(str(directory), save_every=2, keep=10)
    saved = {}
    for step in range(1, 8):
        state = _train(state, it, 1)
        saved[step] = ckpt.save(step, state, it)
    assert [s for s, ok in saved.items() if ok] == [2, 4, 6]
    assert ckpt.save(7, state, it, force=True)
    assert not ckpt.save(7, state, it, force=True)  # already saved: no-op, no error
    ckpt.close()

    restored = Checkpointer(str(directory), save_every=2, keep=10).restore_latest(
        _abstract(_create_state), _data_iter()
    )
    assert restored is not None
    new_state, step = restored
    assert step == 7 and int(new_state.step) == 7
    _assert_bitwise_equal(new_state, state)
