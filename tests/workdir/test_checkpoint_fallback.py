"""A damaged latest checkpoint is detected at restore, logged, set aside, and the one before
it is used; if none can be restored, CheckpointError names the directory. The read-only
``CheckpointReader`` (eval, analysis) falls back the same way but changes nothing on disk.

The damage is done to the files on disk: garbled or truncated array data, a deleted state
metadata file. (orbax alone restores garbled array data without an error; the checksums
saved with each step catch it.)
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training.train_state import TrainState
from jax.sharding import SingleDeviceSharding

from postnorm.workdir.checkpoint import Checkpointer, CheckpointError, CheckpointReader

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


@pytest.mark.parametrize("item", ["integrity/*", "data/*", "state/_METADATA"])
def test_a_damaged_json_file_is_named_and_the_previous_step_restores(saved, item, caplog):
    """The checksums, the data-iterator state and the state's tree metadata are JSON files;
    orbax's error for a garbled one names no file, the log line does."""
    directory, states = saved
    (damaged,) = [p for p in (directory / "2").glob(item) if p.name != "commit_success.txt"]
    damaged.write_text('{"state": [garbled')
    with caplog.at_level(logging.ERROR):
        state, step = Checkpointer(str(directory), save_every=1, keep=5).restore_latest(
            _abstract(), _data_iter())
    assert step == 1 and _host(state) == _host(states[1])
    assert f"{damaged} is not valid JSON" in caplog.text


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


def _snapshot(root: Path) -> list[tuple[str, int, int]]:
    """Every path under ``root`` with its size and modification time."""
    return sorted((str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns)
                  for p in root.rglob("*"))


def test_reader_falls_back_and_leaves_the_directory_as_it_was(saved, caplog):
    """No rename of the damaged step, and a live trainer's in-flight save is left alone."""
    directory, states = saved
    _garble(_largest_file(directory / "2" / "state"))
    shutil.copytree(directory / "1", directory / "3.orbax-checkpoint-tmp-1")
    before = _snapshot(directory)
    reader = CheckpointReader(str(directory))
    with caplog.at_level(logging.ERROR):
        state, step = reader.restore_latest(_abstract(), _data_iter())
    reader.close()
    assert step == 1 and _host(state) == _host(states[1])
    assert f"checkpoint step 2 in {directory} is unusable" in caplog.text
    assert _snapshot(directory) == before


def test_reader_rereads_the_listing_when_a_trainer_deletes_the_step_it_reads(saved, monkeypatch,
                                                                              caplog):
    """A trainer keeping one checkpoint saves step 3, deleting 1 and 2, while the reader is
    reading step 2: the reader restores step 3 and reports no unusable step."""
    directory, _ = saved
    state_3, read = _state(3), CheckpointReader._restore_step

    def trainer_saves_during_the_read(self, step, *args):
        if step == 2:
            trainer = Checkpointer(str(directory), save_every=1, keep=1)
            trainer.save(3, state_3, _data_iter())
            trainer.close()
            assert not (directory / "2").exists()
        return read(self, step, *args)

    monkeypatch.setattr(CheckpointReader, "_restore_step", trainer_saves_during_the_read)
    reader = CheckpointReader(str(directory))
    with caplog.at_level(logging.INFO):
        state, step = reader.restore_latest(_abstract(), _data_iter())
    reader.close()
    assert step == 3 and _host(state) == _host(state_3)
    assert "checkpoint step 2 in" in caplog.text and "deleted while being read" in caplog.text
    assert "unusable" not in caplog.text


def test_reader_of_a_missing_directory_names_it_and_creates_nothing(tmp_path):
    directory = tmp_path / "run" / "checkpoints"
    with pytest.raises(CheckpointError, match=f"no checkpoint directory {directory}: train first"):
        CheckpointReader(str(directory))
    assert not (tmp_path / "run").exists()


def test_a_reader_whose_steps_all_vanish_says_so(saved, monkeypatch):
    """Every step is deleted as it is read (a trainer saving far faster than the reader): the
    error says the steps were deleted, not that the files are damaged."""
    directory, _ = saved
    read = CheckpointReader._restore_step

    def deleted_on_read(self, step, *args):
        shutil.rmtree(directory / str(step))
        return read(self, step, *args)

    monkeypatch.setattr(CheckpointReader, "_restore_step", deleted_on_read)
    reader = CheckpointReader(str(directory))
    with pytest.raises(CheckpointError, match=f"The checkpoints in {directory} were deleted "
                       "while being read: .* let the trainer keep more"):
        reader.restore_latest(_abstract(), _data_iter())
    reader.close()
