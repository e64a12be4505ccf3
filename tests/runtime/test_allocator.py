"""runtime.allocator: finding tcmalloc, re-executing under it, and the errors when it cannot."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from postnorm.runtime.allocator import (
    REEXECUTED,
    TCMALLOC_LIBRARIES,
    AllocatorError,
    find_tcmalloc,
    loaded_allocator,
    preload_command,
    use_allocator,
)
from tests.reliability_helpers import (
    REPO,
    config_flag,
    jax_cache_dir,
    read_losses,
    run_main,
    write_corpus,
)

needs_tcmalloc = pytest.mark.skipif(
    find_tcmalloc() is None,
    reason="no tcmalloc library installed (Debian/Ubuntu: apt install libtcmalloc-minimal4)")


@pytest.fixture(autouse=True)
def no_exec_of_pytest(monkeypatch):
    """An in-process call that would re-execute fails the test instead of replacing pytest."""
    def refuse(*args):
        raise AssertionError(f"os.execve{args[:2]}")
    monkeypatch.setattr(os, "execve", refuse)
    monkeypatch.delenv(REEXECUTED, raising=False)


def _fake_library(directory: Path) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / TCMALLOC_LIBRARIES[0]
    path.write_bytes(b"")
    return str(path)


def test_loaded_allocator_reads_the_process_maps(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    assert loaded_allocator(maps) == "system"
    maps.write_text(maps.read_text()
                    + "7f02-7f03 r-xp 0 08:01 2 /usr/lib/libtcmalloc_minimal.so.4.5.10\n")
    assert loaded_allocator(maps) == "tcmalloc"
    assert loaded_allocator(tmp_path / "absent") == "system"


def test_find_tcmalloc_takes_the_first_directory_that_has_it(tmp_path):
    assert find_tcmalloc([str(tmp_path / "a"), str(tmp_path / "b")]) is None
    second = _fake_library(tmp_path / "b")
    assert find_tcmalloc([str(tmp_path / "a"), str(tmp_path / "b")]) == second
    first = _fake_library(tmp_path / "a")
    assert find_tcmalloc([str(tmp_path / "a"), str(tmp_path / "b")]) == first


@pytest.mark.parametrize("orig_argv", [
    ["python3", "main.py", "--config", "configs/default.py", "--workdir", "w"],
    ["python3", "-m", "benchmarks.bench", "--programs", "train"],
    ["python3", "-u", "-c", "print(1)", "x"],
])
def test_preload_command_repeats_the_command_with_the_users_preloads(orig_argv, monkeypatch):
    monkeypatch.setattr(sys, "orig_argv", orig_argv)
    argv, env = preload_command("/lib/tc.so", {"LD_PRELOAD": "/lib/mine.so", "HOME": "/h"})
    assert argv == [sys.executable, *orig_argv[1:]]
    assert env["LD_PRELOAD"] == "/lib/tc.so /lib/mine.so" and env["HOME"] == "/h"
    assert env[REEXECUTED] == "/lib/tc.so"
    assert int(env["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"]) >= 1 << 40
    _, env = preload_command("/lib/tc.so", {"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": "5"})
    assert env["LD_PRELOAD"] == "/lib/tc.so" and env["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"] == "5"


def test_missing_library_is_an_error_for_tcmalloc_and_not_for_auto(tmp_path, monkeypatch):
    monkeypatch.setattr("postnorm.runtime.allocator.loaded_allocator", lambda: "system")
    empty = [str(tmp_path)]
    assert use_allocator("auto", empty) == "system"
    assert use_allocator("system", empty) == "system"
    with pytest.raises(AllocatorError, match=r"runtime.allocator='tcmalloc'.*apt install "
                                             r"libtcmalloc-minimal4.*runtime.allocator=auto"):
        use_allocator("tcmalloc", empty)
    with pytest.raises(AllocatorError, match=r"runtime.allocator='jemalloc' is invalid"):
        use_allocator("jemalloc", empty)


def test_a_preload_the_loader_ignored_is_not_retried(tmp_path, monkeypatch):
    monkeypatch.setattr("postnorm.runtime.allocator.loaded_allocator", lambda: "system")
    library = _fake_library(tmp_path)
    monkeypatch.setenv(REEXECUTED, library)  # as in the re-executed process
    assert use_allocator("auto", [str(tmp_path)]) == "system"
    with pytest.raises(AllocatorError, match="was preloaded, but the loader did not map it"):
        use_allocator("tcmalloc", [str(tmp_path)])


def test_a_failed_re_execution_is_an_allocator_error(tmp_path, monkeypatch):
    monkeypatch.setattr("postnorm.runtime.allocator.loaded_allocator", lambda: "system")
    library = _fake_library(tmp_path)

    def fail(path, argv, env):
        assert env["LD_PRELOAD"].split()[0] == library and env[REEXECUTED] == library
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(os, "execve", fail)
    with pytest.raises(AllocatorError, match="re-executing .* failed .*Permission denied"):
        use_allocator("auto", [str(tmp_path)])


def test_bench_variants_cannot_change_the_allocator():
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench", "--config",
         "configs/default.py:runtime.allocator=system", "--variant", "runtime.allocator=auto"],
        cwd=REPO, capture_output=True, text=True, timeout=120, env={**os.environ,
                                                                     "JAX_PLATFORMS": "cpu"})
    assert result.returncode == 1
    assert "runtime.* is one per process" in result.stderr


@needs_tcmalloc
@pytest.mark.parametrize("choice", ["auto", "tcmalloc"])
def test_the_command_is_re_executed_under_tcmalloc(choice):
    code = ("import sys; from postnorm.runtime.allocator import loaded_allocator, use_allocator; "
            f"print(use_allocator({choice!r}), loaded_allocator(), sys.argv[1:])")
    result = subprocess.run([sys.executable, "-c", code, "x", "--flag=1"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[-2] == "tcmalloc tcmalloc ['x', '--flag=1']"


def test_system_stays_on_the_starting_allocator():
    code = ("from postnorm.runtime.allocator import loaded_allocator, use_allocator; "
            "print(use_allocator('system'), loaded_allocator())")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                            text=True, timeout=120, env={"PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "system system"


@pytest.mark.slow
@needs_tcmalloc
def test_training_under_tcmalloc_gives_the_same_losses(tmp_path, tmp_path_factory):
    corpus = write_corpus(tmp_path / "corpus")
    cache, losses = jax_cache_dir(tmp_path_factory), {}
    for choice in ("system", "tcmalloc"):
        flag = config_flag(corpus, tmp_path / "tfds", train__steps=6,
                           runtime__allocator=choice)
        result = run_main("--config", flag, "--workdir", str(tmp_path / choice),
                          cache_dir=cache)
        assert result.returncode == 0, result.stderr[-3000:]
        assert f"; allocator: {choice}" in result.stderr
        losses[choice] = read_losses(tmp_path / choice)
    assert sorted(losses["system"]) == list(range(1, 7))
    assert losses["tcmalloc"] == losses["system"]
