"""Every file and directory a run's workdir holds, by name, and its checkpoint steps."""

import dataclasses
import os

from postnorm.errors import UserError

DUMP_PATTERN = "nonfinite_step_*.json"


class WorkdirError(UserError, ValueError):
    """The workdir cannot be used as it is (the message says why and what to do)."""


@dataclasses.dataclass(frozen=True)
class Workdir:
    """The paths of one run's workdir ``root``."""

    root: str

    def _path(self, *names: str) -> str:
        return os.path.join(self.root, *names)

    @property
    def config(self) -> str:
        """The resolved config the run trains (``workdir.config_record``)."""
        return self._path("config.json")

    @property
    def data_info(self) -> str:
        """The data the run trains on (``workdir.data_record``)."""
        return self._path("data_info.json")

    @property
    def metrics(self) -> str:
        """One JSON record per logged step (``workdir.metrics``)."""
        return self._path("metrics.jsonl")

    @property
    def monitor_actions(self) -> str:
        """Every action the early-warning monitor took (``train.monitor_actions``)."""
        return self._path("monitor_actions.json")

    @property
    def tensorboard(self) -> str:
        return self._path("tensorboard")

    @property
    def checkpoints(self) -> str:
        """``<step>/`` per checkpoint (``workdir.checkpoint``)."""
        return self._path("checkpoints")

    @property
    def lock(self) -> str:
        """Held while a run trains (``workdir.lock``)."""
        return self._path(".train.lock")

    @property
    def plots(self) -> str:
        return self._path("plots")

    @property
    def report_plots(self) -> str:
        """The report's own figures, beside the run's."""
        return self._path("plots", "report")

    @property
    def report(self) -> str:
        return self._path("report.html")

    @property
    def result(self) -> str:
        """A finished run's result (``sweep.record``)."""
        return self._path("result.json")

    @property
    def wall_time(self) -> str:
        """The time the run has trained over its invocations (``sweep.record``)."""
        return self._path("wall_time.json")

    @property
    def thm38(self) -> str:
        """Theorem 3.8 on the final checkpoint (``experiments.collapse``)."""
        return self._path("thm38.json")

    def nonfinite_dump(self, step: int) -> str:
        """The forensic dump of the non-finite step ``step`` (``train.forensics``)."""
        return self._path(f"nonfinite_step_{step}.json")

    @property
    def nonfinite_dumps(self) -> str:
        """A glob pattern of every such dump."""
        return self._path(DUMP_PATTERN)

    @property
    def earlier_attempts(self) -> str:
        """Where a run starting afresh keeps the dumps an earlier attempt left."""
        return self._path("earlier_attempts")


def finalized_steps(directory: str) -> list[int]:
    """The finalized checkpoint steps under `directory` (``<step>/`` directories), newest
    first. Listed from the directory itself, so a step deleted during the listing is left
    out. Raises OSError when `directory` exists but cannot be listed."""
    if not os.path.isdir(directory):
        return []
    steps = [int(name) for name in os.listdir(directory)
             if name.isdigit() and os.path.isdir(os.path.join(directory, name))]
    return sorted(steps, reverse=True)


def latest_checkpoint_step(workdir: str) -> int | None:
    """The newest finalized checkpoint step (``checkpoints/<step>/``), or None."""
    directory = Workdir(workdir).checkpoints
    try:
        steps = finalized_steps(directory)
    except OSError as err:
        raise WorkdirError(f"{directory} cannot be listed ({err}): make it readable") from err
    return next(iter(steps), None)
