"""A training run's console (``main.py``, ``postnorm.runtime.console``): other libraries' INFO
lines only at ``runtime.log_level=info``; the closing summary last, its numbers those of
``metrics.jsonl`` computed here; ``report.html`` written with the plots."""

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.reliability_helpers import (
    ABSL_LINE,
    PROJECT_FILES,
    REPO,
    config_flag,
    jax_cache_dir,
    subprocess_env,
    third_party_info,
    write_corpus,
)

ORBAX_FILES = ("checkpoint_manager.py", "async_checkpointer.py", "atomicity.py")
EARLY_LAYERS, SMOOTHING = 4, 3  # the collapse rule's defaults (postnorm.analysis.collapse)


def run_console(flag: str, workdir: Path, cache_dir: Path, timeout: float = 300) -> list[str]:
    """``main.py``'s stdout and stderr as one stream, in the order written."""
    done = subprocess.run([sys.executable, "main.py", "--config", flag, "--workdir",
                           str(workdir)], cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout,
                          env=subprocess_env(cache_dir))
    assert done.returncode == 0, done.stdout[-3000:]
    return done.stdout.splitlines()


def expected_numbers(workdir: Path) -> dict:
    """The summary's numbers from ``metrics.jsonl``, read here: the mean train cross-entropy
    and frequency floor of the last 3 logged steps, tsim at the last diagnostic step, and
    ||dL/dX|| of the first 4 layers (at most) at the first diagnostic step over the last."""
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    train = sorted((r for r in records if "train/loss" in r), key=lambda r: r["step"])
    tail = train[-SMOOTHING:]
    loss = np.mean([r.get("train/ce", r["train/loss"]) for r in tail])
    floor = np.mean([r["train/freq_floor"] for r in tail])
    lfreq = train[-1]["train/lfreq"]
    diags = [r for r in records if "diag/tsim_attn/layer_00" in r]
    tsim_L = np.array([v for k, v in sorted(diags[-1].items())
                       if k.startswith("diag/tsim_attn/")])
    grad = [diags[0][f"diag/dldx_norm_attn/layer_{i:02d}"]
            / diags[-1][f"diag/dldx_norm_attn/layer_{i:02d}"]
            for i in range(min(EARLY_LAYERS, len(tsim_L)))]
    evals = [r["eval/loss"] for r in records if "eval/loss" in r]
    return {"step": train[-1]["step"], "loss": loss, "lfreq": lfreq, "over_lfreq": loss / lfreq,
            "over_floor": loss / floor, "eval": evals[-1], "eval_over_lfreq": evals[-1] / lfreq,
            "alike": int(np.sum(tsim_L >= 0.99)), "layers": len(tsim_L),
            "diag_steps": (diags[0]["step"], diags[-1]["step"]), "grad": grad,
            "meets_rule": np.mean(tsim_L >= 0.99) >= 0.5 and abs(loss - floor) <= 0.05 * floor}


def check_summary(lines: list[str], workdir: Path) -> None:
    """The summary's lines end the console, and say what ``expected_numbers`` computes."""
    (start,) = [i for i, line in enumerate(lines) if line.startswith("== done: ")]
    summary = lines[start:]
    assert len(summary) == 7 and not any(ABSL_LINE.match(line) for line in summary), summary
    want = expected_numbers(workdir)
    head, verdict, alike, loss, grad, plots, report = summary
    assert head == f"== done: step {want['step']} in {workdir}"
    assert verdict.startswith("collapse: yes" if want["meets_rule"] else "collapse: no ")
    assert alike == (f"layers alike at step {want['diag_steps'][1]}: {want['alike']} of "
                     f"{want['layers']} (tsim >= 0.99)")
    numbers = [float(x) for x in re.findall(r"\d+\.\d+", loss)]
    assert numbers == pytest.approx([want[k] for k in ("loss", "over_lfreq", "lfreq",
                                                       "over_floor", "eval", "eval_over_lfreq")],
                                    abs=6e-5), loss
    last_early = len(want["grad"]) - 1
    match = re.fullmatch(rf"early-layer gradient: \|\|dL/dX\|\| of layers 0-{last_early} "
                         r"(fell|grew) (\S+)x to (\S+)x from step (\d+) to (\d+)", grad)
    assert match, grad
    low, high = min(want["grad"]), max(want["grad"])
    shown = (low, high) if match[1] == "fell" else (1 / high, 1 / low)
    assert (match[1] == "fell") == (low >= 1)
    assert [float(match[2]), float(match[3])] == pytest.approx(shown, rel=6e-3)
    assert (int(match[4]), int(match[5])) == want["diag_steps"]
    names = re.fullmatch(rf"plots: {workdir}/plots/ \((.*)\)", plots)[1].split(", ")
    assert sorted(names) == sorted(p.stem for p in (workdir / "plots").glob("*.png"))
    assert "loss_vs_lfreq" in names and "heatmap_tsim" in names
    assert report == f"report: {workdir}/report.html"
    text = (workdir / "report.html").read_text()
    captions = re.findall(r'<img alt="([^"]+)"[^>]*><figcaption>([^<]+)</figcaption>', text)
    assert len(captions) >= 8
    assert all(len(words.split()) >= 6  # words, not the file's name
               and not re.search(rf"(?<!\w){re.escape(alt)}(?![\w(])", words)
               for alt, words in captions), captions


@pytest.mark.slow
def test_orbax_lines_only_at_log_level_info_and_the_summary_last(tmp_path, tmp_path_factory):
    """A tiny run saving a checkpoint: no orbax, tfds or clu INFO line by default, all back with
    runtime.log_level=info; either way the summary closes the console. Slow: two runs of
    main.py."""
    assert not PROJECT_FILES & set(ORBAX_FILES)
    corpus, cache = write_corpus(tmp_path / "corpus"), jax_cache_dir(tmp_path_factory)
    consoles = {}
    for level in ("warning", "info"):
        flag = config_flag(corpus, tmp_path / "tfds", train__steps=8, diag__every=2,
                           train__eval_every=4, runtime__log_level=level)
        consoles[level] = run_console(flag, tmp_path / level, cache)
        check_summary(consoles[level], tmp_path / level)
    quiet, loud = consoles["warning"], consoles["info"]
    assert third_party_info(quiet) == [] and not any("[process=0]" in line for line in quiet)
    assert not any(line.startswith("| layers/") for line in quiet)  # clu's parameter table
    for progress in ("] step 8/8 | loss ", "] eval at step 8: loss "):  # the project's own
        assert any(progress in line for line in quiet), progress
    for console in (quiet, loud):  # the step-0 forecast, once, after the checks, before step 1
        (forecast,) = [i for i, line in enumerate(console) if "] collapse forecast" in line]
        checked = next(i for i, line in enumerate(console) if "starting from step 0" in line)
        first_step = next(i for i, line in enumerate(console) if "] step " in line)
        assert checked < forecast < first_step, console[forecast]
        assert "p_collapse" in console[forecast], console[forecast]
    logged_from = {m[2] for line in third_party_info(loud) if (m := ABSL_LINE.match(line))}
    assert set(ORBAX_FILES) <= logged_from, sorted(logged_from)
    assert any(line.startswith("| layers/") for line in loud)


def test_an_unknown_log_level_is_a_config_error(tmp_path):
    done = subprocess.run([sys.executable, "main.py", "--config",
                           "configs/default.py:runtime.log_level=loud", "--workdir",
                           str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=subprocess_env(None))
    assert done.returncode == 2
    assert ("runtime.log_level='loud' is invalid: must be one of "
            "['debug', 'info', 'warning', 'error']") in done.stderr


@pytest.mark.slow
def test_the_default_config_console_is_short_and_ends_with_the_summary(tmp_path,
                                                                        tmp_path_factory):
    """configs/default.py for 4 steps, on a fresh data directory (the embedded corpus built and
    its tokenizer trained, as on a first run)."""
    flag = (f"configs/default.py:train.steps=4,diag.every=2,train.log_every=2,"
            f"data.data_dir={tmp_path / 'tfds'},runtime.allocator=system")
    lines = run_console(flag, tmp_path / "run", jax_cache_dir(tmp_path_factory), timeout=600)
    assert third_party_info(lines) == [] and not any("[process=0]" in line for line in lines)
    check_summary(lines, tmp_path / "run")
    assert len(lines) <= 30, "\n".join(lines)
