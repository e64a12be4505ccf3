"""Checkpointing of the train state together with the data-iterator position.

Thin wrapper around an orbax ``CheckpointManager``. On-disk layout::

    <workdir>/checkpoints/               # a local filesystem path
      <step>/                            # one finalized checkpoint per saved step
        state/                           # TrainState pytree (orbax StandardSave, OCDBT)
        data/process_<i>-of-<n>.json     # grain iterator state, one file per JAX process
        _CHECKPOINT_METADATA, commit_success.txt
      <step>.orbax-checkpoint-tmp/       # in-flight (or interrupted) save, never restored

A save is written into ``<step>.orbax-checkpoint-tmp`` and renamed to ``<step>`` only once
every item has been written, so a crash mid-save never yields a partial "latest" checkpoint.
Stale tmp directories are deleted (in the background) when a ``Checkpointer`` is created.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import grain
import orbax.checkpoint as ocp
from etils import epath

PyTree = Any


class CheckpointError(RuntimeError):
    """The checkpoint directory cannot be used; the message names the path and the fix."""


def _check_writable(directory: epath.Path) -> None:
    """Creates `directory` (idempotently, on every process) and proves it writable."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".write-probe-"):
            pass
    except OSError as e:
        raise CheckpointError(
            f"Checkpoint directory {directory} cannot be created or written ({e}). "
            "Use a workdir whose checkpoints/ subdirectory can be created and written "
            "(no parent path may be a regular file; check permissions and free space)."
        ) from e


class Checkpointer:
    """Saves and restores ``{state, data_iterator}`` under one step directory."""

    def __init__(self, directory: str, *, save_every: int, keep: int) -> None:
        if save_every < 1 or keep < 1:
            raise ValueError(f"save_every and keep must be >= 1, got {save_every}, {keep}")
        self.directory = epath.Path(os.path.abspath(directory))
        _check_writable(self.directory)
        self._save_every = save_every
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep,
                cleanup_tmp_directories=True,
                enable_async_checkpointing=True,
            ),
        )

    def latest_step(self) -> int | None:
        """Step of the newest finalized checkpoint, or None if there is none."""
        return self._manager.latest_step()

    def save(
        self, step: int, state: PyTree, data_iterator: grain.DatasetIterator, *, force: bool = False
    ) -> bool:
        """Starts saving if `step` is a multiple of `save_every` (or `force`); returns whether.

        Arrays are copied to host and the iterator state is captured before this returns, so
        the caller may immediately donate `state` and advance `data_iterator`; the disk write
        finishes in the background (see `wait_until_finished`). A step that already has a
        checkpoint is not saved again.
        """
        if not (force or step % self._save_every == 0) or step in self._manager.all_steps():
            return False
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=grain.checkpoint.CheckpointSave(data_iterator),
        )
        return self._manager.save(step, args=args, force=True)

    def restore_latest(
        self, abstract_state: PyTree, data_iterator: grain.DatasetIterator
    ) -> tuple[PyTree, int] | None:
        """Restores the newest checkpoint, or returns None when there is none.

        `abstract_state` is a pytree of `jax.ShapeDtypeStruct` carrying `.sharding`; arrays
        are restored with exactly those shardings. `data_iterator` is rewound in place.
        """
        step = self._manager.latest_step()
        if step is None:
            return None
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state),
                data=grain.checkpoint.CheckpointRestore(data_iterator),
            ),
        )
        return restored.state, step

    def wait_until_finished(self) -> None:
        """Blocks until background saves are finalized; re-raises their errors."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves and releases the manager's resources."""
        self._manager.close()
