"""model.attention=auto: the kernel chosen where the run is built, recorded, and kept on resume."""

import json
import subprocess
import sys

import pytest

from configs.default import get_config
from postnorm.kernels.build import KernelBuildError
from postnorm.model import attention_choice
from postnorm.model.attention_choice import choose_attention
from postnorm.runtime.preemption import Preempted, PreemptionWatch
from postnorm.train.loop import train_and_evaluate
from postnorm.train.programs import resolve_attention
from tests.reliability_helpers import REPO, config_flag, subprocess_env, tiny_config, write_corpus

SMALL = {"d_model": 64, "n_heads": 4}


def no_compiler(monkeypatch):
    def refuse(compiler=None):
        raise KernelBuildError("no C++ compiler on the PATH")
    monkeypatch.setattr(attention_choice, "register_attention_kernels", refuse)


@pytest.mark.parametrize("platform,dtype,kernel", [
    ("cpu", "float32", "cpu"), ("cpu", "bfloat16", "blocked"), ("gpu", "bfloat16", "cudnn"),
    ("gpu", "float32", "blocked"), ("tpu", "bfloat16", "blocked")])
def test_the_rule(platform, dtype, kernel):
    assert choose_attention(dtype=dtype, platform=platform, **SMALL)[0] == kernel


def test_a_head_dim_the_cpu_kernel_does_not_take_gets_blocked():
    kernel, why = choose_attention(dtype="float32", platform="cpu", d_model=600, n_heads=2)
    assert kernel == "blocked" and "head dims up to 256" in why


def test_without_a_compiler_the_cpu_gets_blocked_and_says_why(monkeypatch):
    no_compiler(monkeypatch)
    kernel, why = choose_attention(dtype="float32", platform="cpu", **SMALL)
    assert (kernel, why) == ("blocked", "the C++ CPU kernel cannot be built here (no C++ "
                                        "compiler on the PATH)")


def test_a_recorded_kernel_is_kept_where_it_runs(monkeypatch):
    assert choose_attention(dtype="float32", platform="cpu", recorded="einsum", **SMALL) == (
        "einsum", "the kernel the run started with (its config.json)")
    kernel, why = choose_attention(dtype="float32", platform="gpu", recorded="cpu", **SMALL)
    assert kernel == "blocked" and why.startswith("the run started with 'cpu', which cannot run "
                                                  "here (model.attention='cpu' is a CPU kernel")


def test_resolving_copies_the_config_and_leaves_a_named_kernel_alone():
    config = get_config()
    resolved = resolve_attention(config)
    assert (config.model.attention, resolved.model.attention) == ("auto", "cpu")
    config.model.attention = "einsum"
    assert resolve_attention(config) is config


def test_the_resolved_kernel_is_recorded_and_a_resume_keeps_it(tmp_path, monkeypatch):
    """A run started with the blocked kernel resumes on it under auto, which would otherwise
    pick the C++ kernel on this CPU (the same numbers need the same kernel)."""
    corpus = write_corpus(tmp_path / "corpus")
    started = tiny_config(corpus, tmp_path / "tfds", train__steps=4, model__attention="blocked")
    with monkeypatch.context() as patch:
        patch.setattr(PreemptionWatch, "should_stop", lambda self, step: step == 2)
        with pytest.raises(Preempted, match="at step 2"):
            train_and_evaluate(started, str(tmp_path / "run"))
    resumed = tiny_config(corpus, tmp_path / "tfds", train__steps=4)
    assert resumed.model.attention == "auto"
    train_and_evaluate(resumed, str(tmp_path / "run"))
    recorded = json.loads((tmp_path / "run" / "config.json").read_text())
    assert recorded["model"]["attention"] == "blocked"
    assert (tmp_path / "run" / "checkpoints" / "4").is_dir()
    train_and_evaluate(resumed, str(tmp_path / "fresh"))
    fresh = json.loads((tmp_path / "fresh" / "config.json").read_text())
    assert fresh["model"]["attention"] == "cpu"


def test_main_trains_on_a_machine_without_a_compiler(tmp_path):
    """The README's main command with no C++ compiler on the PATH: it trains with blocked."""
    corpus = write_corpus(tmp_path / "corpus")
    (tmp_path / "bin").mkdir()  # a PATH with no compiler on it
    env = {**subprocess_env(None), "PATH": str(tmp_path / "bin")}
    workdir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "main.py", "--config",
         config_flag(corpus, tmp_path / "tfds", train__steps=2), "--workdir", str(workdir)],
        cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "model.attention=auto -> blocked: the C++ CPU kernel cannot be built here" in (
        result.stderr)
    assert json.loads((workdir / "config.json").read_text())["model"]["attention"] == "blocked"
    assert (workdir / "checkpoints" / "2").is_dir() and (workdir / "plots").is_dir()
