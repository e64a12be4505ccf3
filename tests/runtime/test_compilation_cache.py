"""``runtime.compilation_cache_dir``: a second run loads the programs the first one compiled,
computes the same losses, and an unusable directory is a clear error before anything runs."""

import subprocess
import sys
from pathlib import Path

import pytest

from postnorm.runtime import compilation_cache
from postnorm.runtime.compilation_cache import CompilationCacheError, use_compilation_cache
from tests.reliability_helpers import (
    REPO,
    config_flag,
    read_losses,
    subprocess_env,
    write_corpus,
)

HIT = "Persistent compilation cache hit for 'jit_guarded'"  # the train and diagnostic steps


def _main(config: str, workdir: Path) -> subprocess.CompletedProcess:
    """main.py on one CPU device, with no cache from the environment and JAX's compiler logging
    on (and shown: ``runtime.log_level=debug``). Every program is written to the cache (the
    tiny model compiles in less than JAX's default threshold of one second)."""
    env = {**subprocess_env(None), "JAX_DEBUG_LOG_MODULES": "jax._src.compiler"}
    return subprocess.run([sys.executable, "main.py", "--config", config, "--workdir",
                           str(workdir)], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env=env)


@pytest.mark.slow
def test_a_second_run_loads_the_first_runs_programs_and_computes_the_same_losses(tmp_path):
    cache = tmp_path / "cache" / "jax"  # created by the first run
    config = config_flag(write_corpus(tmp_path / "corpus"), tmp_path / "tfds", train__steps=6,
                         runtime__compilation_cache_dir=str(cache),
                         runtime__log_level="debug")
    first = _main(config, tmp_path / "first")
    assert first.returncode == 0, first.stderr[-3000:]
    assert f"compilation cache: {cache} (0 compiled programs)" in first.stderr
    assert HIT not in first.stderr
    written = sorted(p.name for p in cache.iterdir() if p.name.endswith("-cache"))
    assert sum(name.startswith("jit_guarded-") for name in written) == 2, written

    second = _main(config, tmp_path / "second")
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"compilation cache: {cache} ({len(written)} compiled programs)" in second.stderr
    assert second.stderr.count(HIT) == 2, second.stderr[-3000:]
    assert read_losses(tmp_path / "second") == read_losses(tmp_path / "first")
    assert sorted(read_losses(tmp_path / "first")) == list(range(1, 7))


def test_a_cache_directory_that_cannot_be_created_is_a_clear_error(tmp_path):
    (tmp_path / "file").write_text("")
    directory = str(tmp_path / "file" / "cache")
    with pytest.raises(CompilationCacheError) as err:
        use_compilation_cache(directory)
    assert str(err.value).startswith(
        f"runtime.compilation_cache_dir={directory!r}: {directory} cannot be created or written "
        "(Not a directory); point it at a writable directory")


def test_main_stops_on_an_unusable_cache_directory_before_training(tmp_path):
    (tmp_path / "file").write_text("")
    directory = tmp_path / "file" / "cache"
    config = config_flag(write_corpus(tmp_path / "corpus"), tmp_path / "tfds",
                         runtime__compilation_cache_dir=str(directory))
    result = _main(config, tmp_path / "run")
    assert result.returncode == 2, result.stderr[-3000:]
    assert (f"postnorm: error: runtime.compilation_cache_dir='{directory}': {directory} cannot "
            "be created or written") in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()


def test_a_url_or_a_second_directory_in_one_process_is_refused(tmp_path, monkeypatch):
    with pytest.raises(CompilationCacheError, match="only local or mounted directories"):
        use_compilation_cache("gs://bucket/cache")
    # As if an earlier run in this process had set a directory (JAX keeps the first it opens).
    monkeypatch.setattr(compilation_cache, "_directory_in_use", str(tmp_path / "first"))
    with pytest.raises(CompilationCacheError, match=f"already uses the compilation cache at "
                                                    f"{tmp_path / 'first'}, and one serves"):
        use_compilation_cache(str(tmp_path / "second"))
    assert not (tmp_path / "second").exists()
