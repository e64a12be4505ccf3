"""A damaged latest checkpoint is detected at restore, logged, set aside, and the one before
it is used; if none can be restored, CheckpointError names the directory.

The damage is done to the files on disk: garbled or truncated array data, a deleted state
metadata file. (orbax alone restores garbled array data without an error; the checksums
saved with each step catch it.)
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training.train_state import TrainState
from jax.sharding import SingleDeviceSharding

from postnorm.checkpoint import Checkpointer, CheckpointError

TX = optax.adam(1e-2)


def _state(seed: int) -> TrainState:
    """Big enough that orbax writes the array data to its own file, not inline."""
    params = {"w": jax.random.normal(jax.random.key(seed), (256, 256)), "b": jnp.zeros((4,))}
    return TrainState.create(apply_fn=None, params=params, tx=TX)


def _abstract():
    device = SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                        jax.eval_shape(lambda: _state(0)))


def _data_iter() -> grain.DatasetIterator:
    return iter(grain.MapDataset.range(100).batch(4).to_iter_dataset())


def _host(state: TrainState) -> list[bytes]:
    return [np.asarray(x).tobytes() for x in jax.tree.leaves((state.params, state.opt_state))]


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, dict[int, TrainState]]:
    """Checkpoints of steps 1 and 2 (different states; the iterator advanced in between)."""
    directory = tmp_path / "checkpoints"
    ckpt = Checkpointer(str(directory), save_every=1, keep=5)
    it = _data_iter()
    states = {1: _state(1), 2: _state(2)}
    for step, state in states.items():
        next(it)
        ckpt.save(step, state, it)
    ckpt.close()
    return directory, states


def _largest_file(root: Path) -> Path:
    return max((p for p in root.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def _garble(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(b ^ 0xFF for b in data[middle:middle + 64])
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def _delete_state_metadata(step_dir: Path) -> None:
    (step_dir / "state" / "_METADATA").unlink()


@pytest.mark.parametrize("damage", [
    lambda step_dir: _garble(_largest_file(step_dir / "state")),
    lambda step_dir: _truncate(_largest_file(step_dir / "state")),
    _delete_state_metadata,
], ids=["garbled-array-data", "truncated-array-data", "deleted-state-metadata"])
def test_damaged_latest_falls_back_to_the_previous_step(saved, damage, caplog):
    directory, states = saved
    damage(directory / "2")
    ckpt = Checkpointer(str(directory), save_every=1, keep=5)
    it = _data_iter()
    with caplog.at_level(logging.ERROR):
        restored = ckpt.restore_latest(_abstract(), it)
    assert restored is not None
    state, step = restored
    assert step == 1 and _host(state) == _host(states[1])
    expected_it = _data_iter()
    next(expected_it)
    np.testing.assert_array_equal(next(it), next(expected_it))  # step 1's data position
    assert f"checkpoint step 2 in {directory} is unusable" in caplog.text

    # Step 2 is set aside: no longer latest, and the step can be saved again.
    assert (directory / "2.corrupt").is_dir() and not (directory / "2").exists()
    assert ckpt.latest_step() == 1
    assert ckpt.save(2, states[2], it)
    ckpt.close()
    restored = Checkpointer(str(directory), save_every=1, keep=5).restore_latest(
        _abstract(), _data_iter())
    assert restored[1] == 2 and _host(restored[0]) == _host(states[2])


def test_missing_checkpoint_metadata_file_is_tolerated(saved):
    directory, states = saved
    (directory / "2" / "_CHECKPOINT_METADATA").unlink()
    state, step = Checkpointer(str(directory), save_every=1, keep=5).restore_latest(
        _abstract(), _data_iter())
    assert step == 2 and _host(state) == _host(states[2])


@pytest.mark.parametrize("damage", [_garble, _truncate], ids=["garbled", "truncated"])
def test_no_restorable_step_raises_naming_the_directory(saved, damage, caplog):
    """One line per step in the error (orbax's own errors can run to pages: they are logged)."""
    directory, _ = saved
    for step in ("1", "2"):
        damage(_largest_file(directory / step / "state"))
    ckpt = Checkpointer(str(directory), save_every=1, keep=5)
    with caplog.at_level(logging.ERROR), pytest.raises(CheckpointError) as err:
        ckpt.restore_latest(_abstract(), _data_iter())
    message = str(err.value)
    assert re.match(f"No checkpoint in {directory} can be restored \\(step 2: \\w+: .*; "
                    "step 1: \\w+: .*; the log above has each step's full error\\)", message)
    assert "\n" not in message and len(message) < 1200
    assert "checkpoint step 2 in" in caplog.text and "checkpoint step 1 in" in caplog.text
    assert sorted(p.name for p in directory.iterdir()) == ["1", "2"]  # nothing moved aside
