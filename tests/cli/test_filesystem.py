"""Filesystem failures end in a clear error, and no checkpoint that claims to be complete.

The full-disk test mounts a 128 KiB tmpfs on ``<workdir>/checkpoints`` (root only; skipped
otherwise) and, so that it also runs without root, repeats the failure with a file-size limit
(``RLIMIT_FSIZE``: writes past it fail with EFBIG) on the main.py process. The limit, 16 KiB,
is below the size of the tiny model's embedding table (257 x 32 float32, about 28 KiB after
zstd). OCDBT stores each array chunk whole in one data file, so the first checkpoint must fail;
a higher limit (96 KiB was tried) lets it pass whenever OCDBT spreads the arrays over enough
small files. A missing dataset or tokenizer is covered by tests/data/test_config.py and
tests/cli/test_main.py; a failed replacement of a file by tests/test_files.py.
"""

import subprocess
import sys
from pathlib import Path

import pytest

from postnorm.data import load_data
from postnorm.workdir.checkpoint import Checkpointer
from tests.reliability_helpers import (
    REPO,
    config_flag,
    finalized_steps,
    jax_cache_dir,
    read_records,
    subprocess_env,
    tiny_config,
    write_corpus,
)


def _mount_tmpfs(path: Path, options: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                            capture_output=True, text=True)
    if result.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({result.stderr.strip()}); needs root")


@pytest.fixture
def mounts():
    """Mounts tmpfs file systems (``mount(path, options)``) and unmounts them afterwards."""
    mounted = []

    def mount(path: Path, options: str) -> None:
        _mount_tmpfs(path, options)
        mounted.append(path)

    yield mount
    for path in reversed(mounted):
        subprocess.run(["umount", str(path)], check=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A prepared dataset (so the main.py runs below only read it) and the --config flag."""
    root = tmp_path_factory.mktemp("filesystem")
    corpus = write_corpus(root / "corpus")
    load_data(tiny_config(corpus, root / "tfds").data)
    flag = config_flag(corpus, root / "tfds", train__steps=30, train__ckpt_every=4)
    return flag, jax_cache_dir(tmp_path_factory)


def _main(setup, workdir: Path, file_size_limit_kib: int | None = None, **overrides):
    """main.py on ``workdir`` (config fields as ``section__field=value``); with a limit,
    bash's ``ulimit -f`` sets RLIMIT_FSIZE first.

    A limited run gets its own compilation cache: the limit would truncate the entries it
    writes, and the session's other runs would then read them.
    """
    flag, cache = setup
    flag += "".join(f",{k.replace('__', '.')}={v}" for k, v in overrides.items())
    command = [sys.executable, "main.py", "--config", flag, "--workdir", str(workdir)]
    if file_size_limit_kib:
        command = ["bash", "-c", f'ulimit -f {file_size_limit_kib} && exec "$@"', "bash",
                   *command]
        cache = workdir.parent / "limited-jax-cache"
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=subprocess_env(cache))


@pytest.mark.parametrize("where", ["under-a-regular-file", "read-only-filesystem",
                                   "checkpoints-a-regular-file"])
def test_unwritable_workdir_is_a_clear_error(setup, tmp_path, where, mounts):
    if where == "under-a-regular-file":
        (tmp_path / "file").write_text("")
        workdir = tmp_path / "file" / "run"
    elif where == "read-only-filesystem":
        mounts(tmp_path / "ro", "ro,size=64k")
        workdir = tmp_path / "ro" / "run"
    else:
        workdir = tmp_path / "run"
        workdir.mkdir()
        (workdir / "checkpoints").write_text("")
    result = _main(setup, workdir)
    assert result.returncode == 2, result.stderr[-3000:]
    unwritable = (f"Checkpoint directory {workdir}/checkpoints" if where.startswith("checkpoints")
                  else f"Workdir {workdir}")
    assert f"postnorm: error: {unwritable} cannot be created or written" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("failure", ["tmpfs-full", "file-size-limit"])
def test_full_disk_during_a_checkpoint_is_a_clear_error_and_leaves_no_checkpoint(
        setup, tmp_path, failure, mounts):
    workdir = tmp_path / "run"
    if failure == "tmpfs-full":
        mounts(workdir / "checkpoints", "size=128k")
        result, reason = _main(setup, workdir), "No space left on device"
    else:
        result, reason = _main(setup, workdir, file_size_limit_kib=16), "File too large"
    assert result.returncode == 2, result.stderr[-3000:]
    # Our message is one line; orbax's asyncio may log the sibling writes' failures after it.
    error = result.stderr[result.stderr.index("postnorm: error: "):].splitlines()[0]
    assert error.startswith(f"postnorm: error: Writing a checkpoint under {workdir}/checkpoints "
                            "failed (")
    assert reason in error and "Traceback" not in error
    # Only the unfinalized tmp directory is left: nothing a restart would take as a checkpoint.
    assert finalized_steps(workdir) == []
    assert [p.name for p in (workdir / "checkpoints").iterdir()] == ["4.orbax-checkpoint-tmp"]
    ckpt = Checkpointer(str(workdir / "checkpoints"), save_every=4, keep=3)
    assert ckpt.latest_step() is None
    ckpt.close()


@pytest.mark.slow
@pytest.mark.parametrize("failure", ["tensorboard-tmpfs-full", "jsonl-tmpfs-full",
                                     "file-size-limit"])
def test_full_disk_while_logging_is_a_clear_error_and_a_rerun_resumes(
        setup, tmp_path, failure, mounts):
    """No checkpoint before step 1000 and diagnostics at every step, so the metrics files
    outgrow 16 KiB first (the event file before metrics.jsonl under a file-size limit): the
    run stops with one line naming what failed, every record written is whole, and the same
    command without the limit trains the run to its end."""
    workdir = tmp_path / "run"
    fields = dict(train__ckpt_every=1000, diag__every=1)
    if failure == "file-size-limit":
        result = _main(setup, workdir, file_size_limit_kib=16, **fields)
        reason = "File too large"
    else:
        if failure == "tensorboard-tmpfs-full":
            mounts(workdir / "tensorboard", "size=16k")
        else:  # the event files get room of their own
            mounts(workdir, "size=32k")  # 16 KiB for the files written before the loop
            mounts(workdir / "tensorboard", "size=1m")
        result, reason = _main(setup, workdir, **fields), "No space left on device"
    [event_file] = (workdir / "tensorboard").iterdir()
    failed = workdir / "metrics.jsonl" if failure == "jsonl-tmpfs-full" else event_file
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    error = result.stderr[result.stderr.index("postnorm: error: "):].splitlines()[0]
    assert error == (f"postnorm: error: Writing {failed} failed ({reason}). Free space on its "
                     "file system (or raise the quota or file-size limit that stopped it), "
                     "then rerun: the run resumes from its latest finalized checkpoint")
    logged = [r["step"] for r in read_records(workdir) if "train/loss" in r]  # whole lines
    assert logged == list(range(1, len(logged) + 1)) and 1 <= len(logged) < 30
    assert finalized_steps(workdir) == []
    if failure == "file-size-limit":
        result = _main(setup, workdir, **fields)
        assert result.returncode == 0, result.stderr[-3000:]
        assert [r["step"] for r in read_records(workdir) if "train/loss" in r] \
            == list(range(1, 31))
