"""Checkpointing of the train state together with the data-iterator position."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from jax.experimental import multihost_utils

from postnorm.errors import UserError
from postnorm.files import make_writable_dir
from postnorm.runtime.multihost import all_processes_agree
from postnorm.workdir.checksum import tree_checksums
from postnorm.workdir.layout import finalized_steps

PyTree = Any


class CheckpointError(UserError, RuntimeError):
    """The checkpoint directory cannot be used; the message names the path and the fix."""


class ProcessCountError(CheckpointError):
    """A checkpoint's data positions were saved by another number of processes."""


def _check_writable(directory: epath.Path) -> None:
    """Creates `directory` (idempotently, on every process) and proves it writable."""
    try:
        make_writable_dir(str(directory))
    except OSError as e:
        raise CheckpointError(
            f"Checkpoint directory {directory} cannot be created or written ({e}). "
            "Use a workdir whose checkpoints/ subdirectory can be created and written "
            "(no parent path may be a regular file; check permissions and free space)."
        ) from e


def _brief(reason: Exception | str, limit: int = 300) -> str:
    """The first line of an error, at most ``limit`` characters (orbax's errors can run to
    pages of TensorStore specs)."""
    text = f"{type(reason).__name__}: {reason}" if isinstance(reason, Exception) else reason
    line = next((part.strip() for part in text.splitlines() if part.strip()), text)
    return line if len(line) <= limit else line[:limit] + " ..."


# The JSON files of a step directory: orbax's metadata, the checksums, the data-iterator state
# and the state's tree and sharding metadata (its array chunks are binary).
_JSON_FILES = ("_CHECKPOINT_METADATA", "integrity/*", "data/*", "state/_METADATA",
               "state/_sharding", "state/array_metadatas/*")


def _damaged_json(step_dir: epath.Path) -> str:
    """The JSON file of ``step_dir`` that does not parse, or the step directory when each
    one does."""
    for pattern in _JSON_FILES:
        for path in sorted(step_dir.glob(pattern)):
            if path.name == "commit_success.txt" or not path.is_file():
                continue
            try:
                json.loads(path.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError):
                return str(path)
    return f"a JSON file of {step_dir}"


# How often a reader lists the steps again after one vanished under it or newer ones appeared
# (a live trainer saving and deleting its oldest kept steps) before it stops chasing them.
_MAX_RESCANS = 5
# The newest steps a reader considers (a trainer keeps `train.keep_ckpts` of them).
_MAX_LISTED = 256


def _without_none_fields(abstract_state: PyTree) -> dict | None:
    """A dataclass state's pytree fields but those whose value is None, as a dict; None when
    ``abstract_state`` is not a dataclass or has no such field."""
    if not dataclasses.is_dataclass(abstract_state):
        return None
    fields = {f.name: getattr(abstract_state, f.name) for f in dataclasses.fields(abstract_state)
              if f.metadata.get("pytree_node", True)}
    if all(value is not None for value in fields.values()):
        return None
    return {name: value for name, value in fields.items() if value is not None}


class CheckpointReader:
    """Restores ``{state, data_iterator}`` from a checkpoint directory without writing to it."""

    def __init__(self, directory: str) -> None:
        self.directory = epath.Path(os.path.abspath(directory))
        self._prepare_directory()
        self._manager = ocp.CheckpointManager(self.directory, options=self._manager_options())

    def _prepare_directory(self) -> None:
        if not self.directory.is_dir():
            raise CheckpointError(f"no checkpoint directory {self.directory}: train first "
                                  "(--mode=train) or point --workdir at a trained run")

    def _manager_options(self) -> ocp.CheckpointManagerOptions:
        return ocp.CheckpointManagerOptions(
            read_only=True, create=False, cleanup_tmp_directories=False,
            save_interval_steps=0, max_to_keep=None, enable_async_checkpointing=False,
            lightweight_initialize=True,
        )

    def _steps(self) -> list[int]:
        """The finalized steps, newest first, listed afresh: a live trainer may have saved or
        deleted some since the last call. Process 0 lists them for all (a collective: every
        process calls it), so that every process tries the same steps."""
        steps, error = [], None
        if jax.process_index() == 0:
            try:
                steps = finalized_steps(str(self.directory))[:_MAX_LISTED]
            except OSError as e:
                error = e
        if jax.process_count() > 1:
            listed = np.full(_MAX_LISTED + 1, -1, np.int32)
            listed[0] = error is None
            listed[1:len(steps) + 1] = steps
            listed = multihost_utils.broadcast_one_to_all(listed)
            steps = [int(s) for s in listed[1:] if s >= 0]
            error = error or (None if listed[0] else "process 0 could not list it")
        if error is not None:
            raise CheckpointError(f"{self.directory} cannot be listed ({error}): make it readable")
        return steps

    def restore_latest(
        self, abstract_state: PyTree, data_iterator: grain.DatasetIterator | None,
        before: int | None = None,
    ) -> tuple[PyTree, int] | None:
        """Restores the newest usable checkpoint (of a step < ``before``, when given), or returns
        None when there is none.

        `abstract_state` is a pytree of `jax.ShapeDtypeStruct` carrying `.sharding`; arrays
        are restored with exactly those shardings. `data_iterator` is rewound in place (None:
        the data position is not read, as an evaluation needs none). A step that fails to
        restore is logged and skipped; if every step fails, CheckpointError. After a failure
        the steps are listed again: a step that is gone was deleted by a live trainer, not
        damaged, and newer steps saved meanwhile are tried first. A step written by another
        number of processes is not damaged: ``ProcessCountError`` says so at once.
        """
        failures: dict[int, Exception | str] = {}
        rescans = 0
        steps = [s for s in self._steps() if before is None or s < before]
        while steps:
            step = steps.pop(0)
            if data_iterator is not None:
                self._check_process_count(step)
            try:
                state, error = self._restore_step(step, abstract_state, data_iterator), None
            except Exception as e:  # any failure makes the step unusable: try an older one
                state, error = None, e
            if all_processes_agree(error is None):
                self._set_aside(sorted(failures))
                return state, step
            listed = self._steps()
            if step in listed:
                reason = error or "another process could not restore it"
                logging.error("checkpoint step %d in %s is unusable: %s", step, self.directory,
                              reason)
                failures[step] = reason
            else:
                logging.info("checkpoint step %d in %s was deleted while being read (a "
                             "trainer's keep policy)", step, self.directory)
            if (step not in listed or listed[0] > step) and rescans < _MAX_RESCANS:
                rescans += 1
                steps = [s for s in listed if s not in failures and (before is None
                                                                      or s < before)]
        listed = self._steps()
        damaged = {step: reason for step, reason in failures.items() if step in listed}
        if not damaged and (failures or rescans):  # every step tried vanished
            raise CheckpointError(
                f"The checkpoints in {self.directory} were deleted while being read: a trainer "
                "of this workdir saves and deletes them faster than they can be read. Rerun, "
                "or let the trainer keep more (train.keep_ckpts).")
        if damaged:
            details = "; ".join(f"step {step}: {_brief(reason)}"
                                for step, reason in damaged.items())
            raise CheckpointError(
                f"No checkpoint in {self.directory} can be restored ({details}; the log above "
                "has each step's full error). If the config changed since they were written, "
                "restore the old config or use a new --workdir; otherwise the files are damaged: "
                "move the directory aside to start over."
            )
        return None

    def _check_process_count(self, step: int) -> None:
        """``ProcessCountError`` when `step`'s data positions come from another number of
        processes (each process's iterator is saved as ``process_<i>-of-<n>.json``)."""
        names = [path.name for path in (self.directory / str(step) / "data").glob("process_*")]
        counts = {int(m.group(1)) for name in names
                  if (m := re.fullmatch(r"process_\d+-of-(\d+)\.json", name))}
        if counts and counts != {jax.process_count()}:
            written = ", ".join(map(str, sorted(counts)))
            raise ProcessCountError(
                f"checkpoint step {step} in {self.directory} was written by {written} "
                f"processes and this run has {jax.process_count()}: each process resumes its "
                f"own share of the data, so resume it with {written} processes "
                "(--num_processes); --mode=eval reads no data position and runs with any number")

    def _restore_step(
        self, step: int, abstract_state: PyTree, data_iterator: grain.DatasetIterator | None
    ) -> PyTree:
        """The state of `step`, verified against the checksums saved with it.

        A dataclass state's field whose value is None holds no array; a checkpoint written
        before that field existed has no entry for it, and is restored without it.
        """
        try:
            restored = self._restore_items(step, abstract_state, data_iterator)
            state = restored.state
        except ValueError as err:
            target = _without_none_fields(abstract_state)
            if target is None or "tree structures do not match" not in str(err):
                raise
            restored = self._restore_items(step, target, data_iterator)
            state = abstract_state.replace(**restored.state)
        saved, actual = restored.integrity["state"], tree_checksums(state)
        bad = sorted(k for k in saved.keys() | actual.keys() if saved.get(k) != actual.get(k))
        if bad:
            raise CheckpointError(
                f"the arrays {bad} read from {self.directory / str(step) / 'state'} do not match "
                "the checksums saved with them: the files are corrupt"
            )
        return state

    def _restore_items(self, step: int, state_target: PyTree,
                       data_iterator: grain.DatasetIterator | None) -> Any:
        items = {"state": ocp.args.StandardRestore(state_target),
                 "integrity": ocp.args.JsonRestore()}
        if data_iterator is not None:
            items["data"] = grain.checkpoint.CheckpointRestore(data_iterator)
        try:
            return self._manager.restore(step, args=ocp.args.Composite(**items))
        except json.JSONDecodeError as err:  # orbax's message names no file
            raise CheckpointError(
                f"{_damaged_json(self.directory / str(step))} is not valid JSON ({err}): the "
                "file is damaged") from err

    def _set_aside(self, steps: list[int]) -> None:
        """What to do with unusable `steps` once an older one restored: a reader leaves them."""

    def close(self) -> None:
        """Releases the manager's resources."""
        self._manager.close()


class Checkpointer(CheckpointReader):
    """Saves and restores ``{state, data_iterator}`` under one step directory (the trainer's:
    one writer per workdir)."""

    def __init__(self, directory: str, *, save_every: int, keep: int) -> None:
        if save_every < 1 or keep < 1:
            raise ValueError(f"save_every and keep must be >= 1, got {save_every}, {keep}")
        self._save_every, self._keep = save_every, keep
        super().__init__(directory)

    def _prepare_directory(self) -> None:
        _check_writable(self.directory)

    def _manager_options(self) -> ocp.CheckpointManagerOptions:
        return ocp.CheckpointManagerOptions(
            max_to_keep=self._keep, cleanup_tmp_directories=True, enable_async_checkpointing=True,
        )

    def latest_step(self) -> int | None:
        """Step of the newest finalized checkpoint, or None if there is none."""
        return self._manager.latest_step()

    def _steps(self) -> list[int]:
        """The steps the manager keeps, newest first (this run is their only writer)."""
        return sorted(self._manager.all_steps(), reverse=True)

    def should_save(self, step: int, *, force: bool = False) -> bool:
        """Whether ``save(step, ..., force=force)`` starts a save."""
        return (force or step % self._save_every == 0) and step not in self._manager.all_steps()

    def save(
        self, step: int, state: PyTree, data_iterator: grain.DatasetIterator, *, force: bool = False
    ) -> bool:
        """Starts saving if `step` is a multiple of `save_every` (or `force`); returns whether.

        Arrays are copied to host and the iterator state is captured before this returns, so
        the caller may immediately donate `state` and advance `data_iterator`; the disk write
        finishes in the background (see `wait_until_finished`). A step that already has a
        checkpoint is not saved again.
        """
        if not self.should_save(step, force=force):
            return False
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=grain.checkpoint.CheckpointSave(data_iterator),
            integrity=ocp.args.JsonSave({"state": tree_checksums(state)}),
        )
        try:
            return self._manager.save(step, args=args, force=True)
        except (OSError, ValueError) as e:
            raise self._write_error(e) from e

    def _set_aside(self, steps: list[int]) -> None:
        """Renames the unusable `steps` to `<step>.corrupt[-k]` (process 0) and rescans."""
        if not steps:
            return
        if jax.process_index() == 0:
            for step in steps:
                target, k = self.directory / f"{step}.corrupt", 0
                while target.exists():
                    k += 1
                    target = self.directory / f"{step}.corrupt-{k}"
                (self.directory / str(step)).rename(target)
                logging.warning("moved the unusable checkpoint step %d to %s", step, target)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("postnorm: checkpoints quarantined")
        self._manager.reload()

    def _write_error(self, error: Exception) -> CheckpointError:
        latest = self.latest_step()
        resume = "step 0, as none is finalized" if latest is None else f"step {latest}"
        return CheckpointError(
            f"Writing a checkpoint under {self.directory} failed ({error}). Free space on that "
            "filesystem or fix its permissions (or use another --workdir), then rerun: the run "
            f"resumes from the latest finalized checkpoint ({resume})."
        )

    def wait_until_finished(self) -> None:
        """Blocks until background saves are finalized; their errors raise CheckpointError."""
        try:
            self._manager.wait_until_finished()
        except (OSError, ValueError) as e:
            raise self._write_error(e) from e

    def close(self) -> None:
        """Waits for pending saves and the stale-tmp cleanup; releases the manager's resources.

        Orbax's ``CheckpointManager.close`` does not wait for the cleanup it started at
        construction (only ``save`` does), so without the wait a directory could still be
        being deleted after ``close`` returns (an unmount then fails with "target is busy").
        """
        try:
            try:
                self._manager._maybe_await_cleanup_tmp_directory()
            finally:
                self._manager.close()
        except (OSError, ValueError) as e:
            raise self._write_error(e) from e
