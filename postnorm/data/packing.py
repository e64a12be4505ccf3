"""Concat-then-split packing of token sequences into fixed-length windows, checkpointable.

grain's own ConcatThenSplitIterDataset keeps tuples in its state, which do not survive the JSON
round trip of grain's orbax checkpoint handler; this packer's state is plain JSON.
"""

from typing import Any

import grain
import numpy as np

_EMPTY = np.zeros((0,), np.int32)


class _PackIterator(grain.DatasetIterator):
    """Emits consecutive `window_len` slices of the concatenated parent sequences.

    The state is the parent state from before the current sequence was fetched and the
    offset into that sequence; restoring refetches that one sequence. A final partial window
    is dropped, so every window is full and nothing is padded.
    """

    def __init__(self, parent: grain.DatasetIterator, window_len: int):
        super().__init__(parent)
        self._window_len = window_len
        self._seq_state = self._parent.get_state()
        self._seq = _EMPTY
        self._offset = 0

    def __next__(self) -> np.ndarray:
        window = np.empty((self._window_len,), np.int32)
        filled = 0
        while filled < self._window_len:
            if self._offset == len(self._seq):
                self._seq_state = self._parent.get_state()
                self._seq = np.asarray(next(self._parent), np.int32)
                self._offset = 0
            n = min(self._window_len - filled, len(self._seq) - self._offset)
            window[filled : filled + n] = self._seq[self._offset : self._offset + n]
            filled += n
            self._offset += n
        return window

    def get_state(self) -> dict[str, Any]:
        return {"sequence_parent_state": self._seq_state, "offset": self._offset}

    def set_state(self, state: dict[str, Any]) -> None:
        missing = [field for field in ("offset", "sequence_parent_state")
                   if not isinstance(state, dict) or field not in state]
        if missing:
            raise ValueError(f"the saved data position has no {' or '.join(missing)}: its "
                             "file (data/process_<i>-of-<n>.json of the checkpoint step) is "
                             "damaged or was not written by this data pipeline")
        self._parent.set_state(state["sequence_parent_state"])
        self._seq_state = state["sequence_parent_state"]
        try:
            self._seq = np.asarray(next(self._parent), np.int32)
        except StopIteration:
            self._seq = _EMPTY
        self._offset = state["offset"]


class PackIterDataset(grain.IterDataset):
    """Packs 1-D int sequences into int32 windows of `window_len` (concat-then-split)."""

    def __init__(self, parent: grain.IterDataset, *, window_len: int):
        super().__init__(parent)
        self._window_len = window_len

    def __iter__(self) -> grain.DatasetIterator:
        return _PackIterator(self._parent.__iter__(), self._window_len)

    def __str__(self) -> str:
        return f"PackIterDataset(window_len={self._window_len})"
