"""Shared pieces of the reliability tests: a tiny corpus, tiny configs, and main.py runs."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from tensorboardX.proto import event_pb2

from configs.default import get_config

REPO = Path(__file__).resolve().parents[1]
ABSL_LINE = re.compile(r"^([IWEF])\d{4} [\d:.]+\s+\d+ ([^:\]]+):\d+\] ")
PROJECT_FILES = {p.name for top in ("postnorm", "experiments", "configs")
                 for p in (REPO / top).rglob("*.py")} | {"main.py"}
WORDS = ("the", "model", "layer", "norm", "token", "attention", "residual", "gradient",
         "loss", "collapse", "post", "pre", "value", "key", "query", "scale", "rank")


def write_corpus(root: Path, num_docs: int = 40) -> Path:
    """``num_docs`` text files of random sentences, one document each, in ``root`` (created)."""
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(num_docs):
        text = "\n".join(" ".join(rng.choice(WORDS, size=12)) + "." for _ in range(20))
        (root / f"doc{i:03d}.txt").write_text(text)
    return root


def tiny_overrides(corpus: Path, data_dir: Path, **overrides) -> dict[str, object]:
    """Dotted config fields of a 2-layer, d=32 model on the byte-tokenized ``corpus``."""
    fields = {
        "model.n_layers": 2, "model.d_model": 32, "model.n_heads": 4, "model.d_ff": 64,
        "data.source": "text_files", "data.text_files": str(corpus / "*.txt"),
        "data.data_dir": str(data_dir), "data.tokenizer": "byte", "data.seq_len": 32,
        "data.batch_size": 8, "opt.lr": 3e-3, "opt.warmup_steps": 2, "train.steps": 20,
        "train.log_every": 1, "train.eval_every": 10, "train.eval_batches": 1,
        "runtime.allocator": "system",  # no re-execution; tests/runtime/test_allocator.py covers it
        # a fixed kernel, so runs compared across processes and device counts compute alike
        # (auto times the kernels for each shape: tests/model/test_attention_choice.py)
        "model.attention": "cpu",
    }
    fields.update({key.replace("__", "."): value for key, value in overrides.items()})
    return fields


def tiny_config(corpus: Path, data_dir: Path, **overrides):
    """The ``tiny_overrides`` config as a ConfigDict (``section__field=value`` overrides)."""
    config = get_config()
    for key, value in tiny_overrides(corpus, data_dir, **overrides).items():
        section, field = key.split(".")
        config[section][field] = value
    return config


def config_flag(corpus: Path, data_dir: Path, **overrides) -> str:
    """The ``--config`` value of the ``tiny_overrides`` config."""
    fields = tiny_overrides(corpus, data_dir, **overrides)
    return "configs/default.py:" + ",".join(f"{k}={v}" for k, v in fields.items())


def jax_cache_dir(tmp_path_factory) -> Path:
    """A persistent-compilation-cache directory shared by this pytest session's main.py
    subprocesses: runs of the same config then compile once (a test-time speed-up only)."""
    path = tmp_path_factory.getbasetemp() / "jax-compilation-cache"
    path.mkdir(exist_ok=True)
    return path


def subprocess_env(cache_dir: Path | None, device_count: int = 1) -> dict[str, str]:
    """The environment of a main.py subprocess: CPU with ``device_count`` devices, and JAX's
    compilation cache at ``cache_dir`` for every program (None: no cache from the
    environment)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(
        ("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE", "JAX_ENABLE_COMPILATION_CACHE"))}
    env.update({"JAX_PLATFORMS": "cpu", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                "XLA_FLAGS": f"--xla_force_host_platform_device_count={device_count}"})
    if cache_dir is not None:
        env["JAX_COMPILATION_CACHE_DIR"] = str(cache_dir)
    return env


def start_main(*args: str, log: Path, cache_dir: Path) -> subprocess.Popen:
    """``python main.py ARGS`` in the background, stdout and stderr to ``log``."""
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "main.py", *args], cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT, env=subprocess_env(cache_dir))


def run_main(*args: str, cache_dir: Path | None,
             timeout: float = 300) -> subprocess.CompletedProcess:
    """``python main.py ARGS`` to completion."""
    return subprocess.run([sys.executable, "main.py", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env=subprocess_env(cache_dir))


def read_records(workdir: Path) -> list[dict]:
    """The complete records of ``metrics.jsonl`` (a line still being written is skipped)."""
    path = workdir / "metrics.jsonl"
    if not path.exists():
        return []
    lines = path.read_text().split("\n")[:-1]  # the last piece has no newline yet
    return [json.loads(line) for line in lines if line.strip()]


def read_losses(workdir: Path) -> dict[int, float]:
    """``{step: train/loss}`` of ``metrics.jsonl``."""
    return {r["step"]: r["train/loss"] for r in read_records(workdir) if "train/loss" in r}


def finalized_steps(workdir: Path) -> list[int]:
    """Steps with a finalized checkpoint in ``workdir``."""
    root = workdir / "checkpoints"
    return sorted(int(p.name) for p in root.glob("*") if p.name.isdigit()) if root.exists() else []


def wait_for_step(process: subprocess.Popen, workdir: Path, step: int, log: Path,
                  *, checkpointed: bool = False, timeout: float = 240) -> int:
    """Polls until ``metrics.jsonl`` has a train loss at ``step`` or later (and, with
    ``checkpointed``, a checkpoint is finalized); returns the latest logged step."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"main.py exited ({process.returncode}) before step {step}:\n"
                                 + log.read_text()[-3000:])
        done = max(read_losses(workdir), default=0)
        if done >= step and (not checkpointed or finalized_steps(workdir)):
            return done
        time.sleep(0.02)
    process.kill()
    raise AssertionError(f"main.py did not reach step {step} in {timeout} s")


def _tfrecords(path: Path):
    """The records of a TFRecord file (length, its CRC, data, its CRC); the CRCs unchecked."""
    data, at = path.read_bytes(), 0
    while at + 12 <= len(data):
        length = int.from_bytes(data[at:at + 8], "little")
        yield data[at + 12:at + 12 + length]
        at += 12 + length + 4


def tensorboard_scalars(workdir: Path, tag: str) -> dict[int, list[float]]:
    """``{step: values}`` of ``tag`` as TensorBoard shows them: the event files in order, and a
    session START at step S hides the earlier events at steps >= S (a writer's purge_step)."""
    shown: dict[int, list[float]] = {}
    for path in sorted((workdir / "tensorboard").glob("events.out.tfevents.*")):
        for record in _tfrecords(path):
            event = event_pb2.Event.FromString(record)
            if event.HasField("session_log") and event.session_log.status == 1:  # START
                shown = {step: v for step, v in shown.items() if step < event.step}
            for value in event.summary.value:
                if value.tag == tag:
                    shown.setdefault(event.step, []).append(value.simple_value)
    return shown


def third_party_info(lines: list[str]) -> list[str]:
    """absl-format INFO lines logged from a file outside the project."""
    return [line for line in lines if (m := ABSL_LINE.match(line)) and m[1] == "I"
            and m[2] not in PROJECT_FILES]
