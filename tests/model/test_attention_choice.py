"""model.attention=auto: the kernel chosen where the run is built (the faster one, timed on this
CPU), recorded, and kept on resume; the blocked kernel where no compiler builds the C++ one."""

import dataclasses
import json
import subprocess
import sys

import pytest

from configs.default import get_config
from postnorm.kernels.build import KernelBuildError
from postnorm.model import ModelSpec, attention_choice
from postnorm.model.attention_choice import choose_attention, layer_step_seconds
from postnorm.model.placements import PLACEMENTS
from postnorm.runtime.preemption import Preempted, PreemptionWatch
from postnorm.train.loop import train_and_evaluate
from postnorm.train.programs import resolve_attention
from tests.reliability_helpers import REPO, config_flag, subprocess_env, tiny_config, write_corpus

SPEC = ModelSpec(vocab_size=2, max_len=32, n_layers=1, d_model=32, n_heads=4, d_ff=64,
                 attention="blocked")


def no_compiler(monkeypatch):
    def refuse(compiler=None):
        raise KernelBuildError("no C++ compiler on the PATH")
    monkeypatch.setattr(attention_choice, "register_attention_kernels", refuse)


def timed_as(monkeypatch, tmp_path, seconds: dict[str, float]) -> list:
    """The probe's measurement replaced by ``seconds``, its cache in ``tmp_path``; returns the
    list of measurements made."""
    made = []

    def measure(spec, batch, kernels, rounds=7, xla_options=None):
        made.append((spec.max_len, batch, kernels))
        return dict(seconds)

    monkeypatch.setattr(attention_choice, "layer_step_seconds", measure)
    monkeypatch.setattr(attention_choice, "PROBE_CACHE", tmp_path / "choice.json")
    return made


@pytest.mark.parametrize("platform,dtype,kernel", [
    ("gpu", "bfloat16", "cudnn"), ("gpu", "float32", "blocked"), ("tpu", "bfloat16", "blocked"),
    ("cpu", "bfloat16", "blocked")])
def test_the_rule_off_the_probe(platform, dtype, kernel):
    spec = dataclasses.replace(SPEC, dtype=dtype)
    assert choose_attention(spec, batch=4, platform=platform)[0] == kernel


@pytest.mark.parametrize("seconds,fastest", [({"cpu": 1e-3, "blocked": 2e-3}, "cpu"),
                                              ({"cpu": 3e-3, "blocked": 2e-3}, "blocked")])
def test_the_cpu_gets_the_faster_kernel_measured_once_per_shape(monkeypatch, tmp_path, seconds,
                                                                 fastest):
    made = timed_as(monkeypatch, tmp_path, seconds)
    kernel, why = choose_attention(SPEC, batch=4, platform="cpu")
    assert kernel == fastest and f"cpu {seconds['cpu'] * 1e3:.2f} ms" in why
    assert choose_attention(SPEC, batch=4, platform="cpu")[0] == fastest
    assert len(made) == 1  # cached: the second choice measured nothing
    choose_attention(SPEC, batch=8, platform="cpu")  # another shape is measured
    assert [m[1] for m in made] == [4, 8]


def test_the_measurement_times_both_kernels():
    seconds = layer_step_seconds(SPEC, batch=2, kernels=("cpu", "blocked"), rounds=2)
    assert set(seconds) == {"cpu", "blocked"} and all(0 < s < 10 for s in seconds.values())



@pytest.mark.parametrize("norm", sorted(PLACEMENTS))
def test_the_measurement_runs_the_layer_of_every_arrangement(norm):
    """Arrangements with a lambda profile (mixln, adaptive) take their first layer's."""
    spec = dataclasses.replace(SPEC, norm=norm, n_layers=4)
    seconds = layer_step_seconds(spec, batch=1, kernels=("blocked",), rounds=1)
    assert 0 < seconds["blocked"] < 10

def test_without_a_compiler_the_cpu_gets_blocked_and_says_why(monkeypatch, tmp_path):
    made = timed_as(monkeypatch, tmp_path, {"cpu": 1e-3, "blocked": 2e-3})
    no_compiler(monkeypatch)
    kernel, why = choose_attention(SPEC, batch=4, platform="cpu")
    assert (kernel, why) == ("blocked", "the C++ CPU kernel cannot be built here (no C++ "
                                        "compiler on the PATH)")
    assert made == []
    wide = dataclasses.replace(SPEC, d_model=600, n_heads=2)
    assert "head dims up to 256" in choose_attention(wide, batch=4, platform="cpu")[1]


def test_a_recorded_kernel_is_kept_where_it_runs():
    assert choose_attention(SPEC, batch=4, platform="cpu", recorded="einsum") == (
        "einsum", "the kernel the run started with (its config.json)")
    kernel, why = choose_attention(SPEC, batch=4, platform="gpu", recorded="cpu")
    assert kernel == "blocked" and why.startswith("the run started with 'cpu', which cannot run "
                                                  "here (model.attention='cpu' is a CPU kernel")


def test_resolving_copies_the_config_and_leaves_a_named_kernel_alone(monkeypatch, tmp_path):
    timed_as(monkeypatch, tmp_path, {"cpu": 1e-3, "blocked": 2e-3})
    config = get_config()
    resolved = resolve_attention(config)
    assert (config.model.attention, resolved.model.attention) == ("auto", "cpu")
    config.model.attention = "einsum"
    assert resolve_attention(config) is config
    with pytest.raises(ValueError, match="names no kernel"):
        ModelSpec.from_config(get_config().model, vocab_size=2, max_len=8)


@pytest.mark.slow
def test_the_resolved_kernel_is_recorded_and_a_resume_keeps_it(tmp_path, monkeypatch):
    """A run started with the blocked kernel resumes on it under auto, which chooses the C++
    kernel for a fresh run here (the same numbers need the same kernel)."""
    timed_as(monkeypatch, tmp_path, {"cpu": 1e-3, "blocked": 2e-3})
    corpus = write_corpus(tmp_path / "corpus")
    started = tiny_config(corpus, tmp_path / "tfds", train__steps=4, model__attention="blocked")
    with monkeypatch.context() as patch:
        patch.setattr(PreemptionWatch, "should_stop", lambda self, step: step == 2)
        with pytest.raises(Preempted, match="at step 2"):
            train_and_evaluate(started, str(tmp_path / "run"))
    resumed = tiny_config(corpus, tmp_path / "tfds", train__steps=4, model__attention="auto")
    train_and_evaluate(resumed, str(tmp_path / "run"))
    recorded = json.loads((tmp_path / "run" / "config.json").read_text())
    assert recorded["model"]["attention"] == "blocked"
    assert (tmp_path / "run" / "checkpoints" / "4").is_dir()
    train_and_evaluate(resumed, str(tmp_path / "fresh"))
    fresh = json.loads((tmp_path / "fresh" / "config.json").read_text())
    assert fresh["model"]["attention"] == "cpu"


@pytest.mark.slow
def test_main_trains_on_a_machine_without_a_compiler(tmp_path):
    """The README's main command with no C++ compiler on the PATH: it trains with blocked."""
    corpus = write_corpus(tmp_path / "corpus")
    (tmp_path / "bin").mkdir()  # a PATH with no compiler on it
    env = {**subprocess_env(None), "PATH": str(tmp_path / "bin")}
    workdir = tmp_path / "run"
    flag = config_flag(corpus, tmp_path / "tfds", train__steps=2, model__attention="auto")
    result = subprocess.run([sys.executable, "main.py", "--config", flag, "--workdir",
                             str(workdir)], cwd=REPO, capture_output=True, text=True,
                            timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "model.attention=auto -> blocked: the C++ CPU kernel cannot be built here" in (
        result.stderr)
    assert json.loads((workdir / "config.json").read_text())["model"]["attention"] == "blocked"
    assert (workdir / "checkpoints" / "2").is_dir() and (workdir / "plots").is_dir()
