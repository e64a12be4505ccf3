"""A TensorBoard event file written in the caller's thread."""

import os
import socket
import time

from tensorboardX.proto.event_pb2 import Event, SessionLog
from tensorboardX.record_writer import RecordWriter
from tensorboardX.summary import scalar


class EventFile:
    """Scalars in ``<logdir>/events.out.tfevents.<second>.<host><filename_suffix>``."""

    def __init__(self, logdir: str, *, filename_suffix: str, purge_step: int | None = None):
        """``purge_step``: TensorBoard hides the events of earlier files in ``logdir`` at this
        step and later ones (the records a resumed run writes again)."""
        os.makedirs(logdir, exist_ok=True)
        self.path = os.path.join(logdir, f"events.out.tfevents.{str(time.time())[:10]}."
                                         f"{socket.gethostname()}{filename_suffix}")
        self._records = RecordWriter(self.path)
        self._add(Event(file_version="brain.Event:2"))
        if purge_step is not None:  # the two events tensorboardX's SummaryWriter writes
            self._add(Event(step=purge_step, file_version="brain.Event:2"))
            self._add(Event(step=purge_step, session_log=SessionLog(status=SessionLog.START)))

    def _add(self, event: Event) -> None:
        event.wall_time = time.time()
        self._records.write(event.SerializeToString())

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self._add(Event(step=step, summary=scalar(tag, value)))

    def flush(self) -> None:
        """Writes the buffered events and syncs the file to disk."""
        self._records.flush()

    def close(self) -> None:
        """Closes the file, also when writing its last events fails (which then raises)."""
        self._records.close()
