"""The experiment and benchmark scripts: their outputs agree with each other, and bad input is
one line with exit 2 (config) or 1 (flags), before anything is compiled."""

import csv
import json
import subprocess
import sys

import numpy as np
import pytest

from benchmarks.attention_core import check
from tests.reliability_helpers import REPO, config_flag, subprocess_env, write_corpus

TINY = ("configs/default.py:model.n_layers=2,model.d_model=32,model.d_ff=96,data.seq_len=32,"
        "data.batch_size=4")


def run_module(module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env=subprocess_env(None))


def table_rows(markdown: str, heading: str) -> list[list[str]]:
    """The cells of the first table after ``heading`` (``\\|`` is a literal pipe)."""
    lines = markdown.split(heading, 1)[1].splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("|"))
    end = next((i for i in range(first, len(lines)) if not lines[i].startswith("|")), len(lines))
    rows = lines[first:end]
    return [[c.strip() for c in line.replace("\\|", "¦").strip("|").split("|")] for line in rows]


@pytest.mark.slow
def test_init_similarity_outputs_agree(tmp_path):
    result = run_module("experiments.init_similarity", "--out_dir", str(tmp_path),
                        "--n_layers", "3", "--seq_len", "64", "--seeds", "2", "--norms",
                        "post,pre", "--inputs", "gaussian", "--nouniform_check")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    rows = table_rows((tmp_path / "summary.md").read_text(), "## Summary")
    assert len({len(row) for row in rows}) == 1  # header, separator and rows alike
    header, _, *body = rows
    by_row = {row[0]: dict(zip(header, row, strict=True)) for row in body}
    with open(tmp_path / "layers.csv") as f:
        layers = list(csv.DictReader(f))
    for norm in ("post", "pre"):
        last = [r for r in layers if r["norm"] == norm][-1]
        final = summary["figures"][f"{norm}/gaussian"]["tsim_final"]
        assert float(last["t_out"]) == pytest.approx(final, rel=1e-6)
        assert by_row[f"{norm}/gaussian"]["tsim final"].startswith(f"{final:.4f}+-")
    assert by_row["pre/gaussian"]["ablation final"] == "-"


def test_batch_floors_counts_the_first_logged_step(tmp_path):
    flag = config_flag(write_corpus(tmp_path / "corpus"), tmp_path / "tfds", train__steps=20,
                       train__log_every=10)
    result = run_module("experiments.batch_floors", "--config", flag, "--next=4",
                        f"--out_dir={tmp_path / 'out'}")
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout[result.stdout.index("{\n"):]  # after TFDS's preparation lines
    seed = json.loads(output)["seeds"]["0"]
    assert seed["last_logged_steps"] == [1, 10, 20]  # the trainer logs step 1 too
    # --out_dir: the same statistics with every step's floor, and their table
    written = json.loads((tmp_path / "out" / "summary.json").read_text())["seeds"]["0"]
    assert len(written.pop("floors")) == 20 and written == seed
    table = (tmp_path / "out" / "table.md").read_text().splitlines()
    assert table[0] == ("| data order (seed) | mean floor, steps 1–20 | sd per batch | range | "
                        "mean of steps 1/10/20 | mean of the next 4 batches |")
    assert table[2].startswith(f"| 0 | {seed['mean']:.3f} | {seed['sd']:.3f} | ")


@pytest.mark.slow
def test_leaderboard_measures_of_a_run_against_its_metrics_file(tmp_path):
    """``--runs``: min c is the smallest c_min in the run's metrics.jsonl, read here line by line;
    the fresh-batch loss over L_freq is their quotient; the verdict is the collapse rule's."""
    flag = config_flag(write_corpus(tmp_path / "corpus"), tmp_path / "tfds", train__steps=8,
                       diag__every=4, model__residual_budget="scale")
    workdir = tmp_path / "run"
    trained = subprocess.run([sys.executable, "main.py", "--config", flag, "--workdir",
                              str(workdir)], cwd=REPO, capture_output=True, text=True,
                             timeout=300, env=subprocess_env(None))
    assert trained.returncode == 0, trained.stderr[-3000:]
    result = run_module("experiments.leaderboard", f"--runs={workdir}", "--fresh_batches=3")
    assert result.returncode == 0, result.stderr[-3000:]
    measures = json.loads(result.stdout.strip().splitlines()[-1])
    c_min = min(value for line in (workdir / "metrics.jsonl").read_text().splitlines()
                for key, value in json.loads(line).items() if key.startswith("diag/c_min_"))
    assert measures["min_c"] == pytest.approx(c_min, rel=1e-12)
    assert measures["min_c"] >= 0.9 * (1 - 1e-6)  # the budget's threshold
    assert measures["fresh_loss_over_lfreq"] == pytest.approx(
        measures["fresh_loss"] / measures["lfreq"], rel=1e-12)
    assert measures["fresh_batches"] == 3 and measures["checkpoint_step"] == 8
    assert measures["collapsed"] in (True, False) and measures["final_step"] == 8


@pytest.mark.slow
def test_bench_variants_take_the_config_files_named_variants():
    result = run_module("benchmarks.bench", f"--config={TINY}", "--programs=forward",
                        "--repeats=1", "--peak_size=64", "--variant=pre",
                        "--variant=post,model.n_layers=3")
    assert result.returncode == 0, result.stderr[-3000:]
    variants = json.loads(result.stdout)["variants"]
    assert variants["pre"]["model"]["norm"] == "pre"
    assert variants["post,model.n_layers=3"]["model"]["norm"] == "post"
    assert variants["post,model.n_layers=3"]["model"]["n_layers"] == 3


@pytest.mark.slow
def test_bench_xla_option_sets_apply_over_the_configs_and_reach_the_compiler():
    region = "xla_cpu_copy_insertion_use_region_analysis"
    result = run_module("benchmarks.bench", f"--config={TINY},runtime.xla_options={region}=true",
                        "--programs=train,forward", "--repeats=1", "--peak_size=64",
                        "--xla_options=", f"--xla_options={region}=false")
    assert result.returncode == 0, result.stderr[-3000:]
    variants = json.loads(result.stdout)["variants"]
    assert list(variants) == [" | xla: config", f" | xla: {region}=false"]
    config, off = variants.values()
    assert config["xla_options"] == {region: True} and off["xla_options"] == {region: False}
    # the option changes XLA's buffer assignment of the scanned layers' backward pass, so it
    # reached that program's compilation
    temp = [v["programs"]["train"]["memory"]["temp_size_in_bytes"] for v in variants.values()]
    assert temp[0] < temp[1]


def test_rmsnorm_vjp_checks_the_fused_gradients_and_times_both():
    """The script stops unless the hand-written backward gives autodiff's gradients."""
    result = run_module("benchmarks.rmsnorm_vjp", "--shapes=2x8x16,1x4x32", "--repeats=1",
                        "--calls=1")
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads(result.stdout)["results"]
    assert list(results) == ["2x8x16", "1x4x32"]
    for timing in results.values():
        assert set(timing["median_ms"]) == {"autodiff", "fused"}


@pytest.mark.parametrize("torch", [False, True])
def test_attention_core_checks_every_kernel_against_einsum_and_times_them(torch):
    if torch:
        pytest.importorskip("torch")
    result = run_module("benchmarks.attention_core", "--shape=2x16x2x8",
                        "--kernels=cpu,blocked:4,blocked:16,einsum,xla", "--repeats=1", "--calls=1",
                        "--torch" if torch else "--notorch")
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    kernels = ["cpu", "blocked:4", "blocked:16", "einsum", "xla"]
    kernels += ["torch_sdpa"] if torch else []
    assert list(report["median_ms"]) == kernels
    for parts in report["median_ms"].values():
        assert set(parts) == {"forward", "forward_backward"} and min(parts.values()) > 0


def test_attention_core_check_fails_on_a_wrong_gradient():
    """The check compares the output and every gradient, so a kernel that got one wrong stops
    the script."""
    out, grads = np.ones((2, 3)), (np.ones(2), np.ones(2), np.ones(2))
    check("same", out, grads, (out, grads))
    with pytest.raises(AssertionError, match="wrong differs from the einsum kernel"):
        check("wrong", out, (grads[0], grads[1], 1.01 * grads[2]), (out, grads))


@pytest.mark.parametrize("module,args,code,message", [
    ("benchmarks.bench", [f"--config={TINY},model.norm=rezero"], 2,
     "postnorm: error: model.norm='rezero' is invalid"),
    ("benchmarks.diag_overhead", [f"--config={TINY},model.remat=bogus"], 2,
     "postnorm: error: model.remat='bogus' is invalid"),
    ("benchmarks.profile_step", [f"--config={TINY},data.vocab_size=0"], 2,
     "postnorm: error: data.vocab_size=0: must be an integer in [1, "),
    ("benchmarks.bench", [f"--config={TINY}", "--variant=model.bogus=3"], 1,
     "--variant='model.bogus=3': unknown config key 'model.bogus'"),
    pytest.param("benchmarks.bench", [f"--config={TINY}", "--variant=sandwich"], 1,
                 "--variant='sandwich': unknown config variant 'sandwich'; known: ['post', 'pre']",
                 marks=pytest.mark.slow),
    ("benchmarks.bench", [f"--config={TINY}", "--xla_options=xla_cpu_bogus=1"], 1,
     "--xla_options='xla_cpu_bogus=1': INVALID_ARGUMENT: No such compile option: 'xla_cpu_bogus'"),
    pytest.param("benchmarks.bench", [f"--config={TINY}", "--xla_options=fast"], 1,
                 "--xla_options='fast': 'fast' is not name=value", marks=pytest.mark.slow),
    ("benchmarks.bench", [f"--config={TINY}", "--programs", "train", "diag"], 1,
     "unexpected arguments: ['diag']"),
    ("benchmarks.rmsnorm_vjp", ["--shapes=16x128"], 1,
     "--shapes: '16x128' is not BxLxD with positive integers"),
    ("benchmarks.attention_core", ["--shape=16x128", "--notorch"], 1,
     "--shape='16x128': expected BxLxHxK, e.g. 16x128x4x16"),
    ("benchmarks.attention_core", ["--kernels=blocked:0", "--notorch"], 1,
     "--kernels: 'blocked:0' is not cpu, blocked:N, einsum or xla"),
    ("experiments.init_similarity", ["--out_dir=/dev/null/x", "--inputs=gaussian"], 2,
     "postnorm: error: --out_dir='/dev/null/x' cannot be created or written"),
    ("experiments.sweep", ["--sweep=configs/sweeps/stability.py:smoke", "--out_dir=/dev/null"],
     2, "postnorm: error: --out_dir='/dev/null' cannot be created or written (File exists)"),
    ("experiments.sweep", ["--sweep=configs/sweeps/stability.py:smoke", "--out_dir=/tmp/unused",
                           "--fresh_batches=8"], 1,
     "--fresh_batches measures runs into their --archive records: give --archive too"),
    ("experiments.repair_study", ["--runs_under=/nonexistent", "--out_dir=/tmp/unused"], 2,
     "postnorm: error: no finished Post-Norm run without another remedy"),
    ("experiments.batch_floors", ["--seeds="], 1, "--seeds=: give one or more values, each once"),
    ("experiments.batch_floors", ["--report_only"], 1,
     "--report_only rewrites --out_dir's table.md: give --out_dir"),
    ("experiments.batch_floors", ["--out_dir=/nonexistent", "--report_only"], 1,
     "--report_only reads /nonexistent/summary.json, which does not exist"),
    ("experiments.sweep", ["--out_dir=/nonexistent", "--from_summary"], 1,
     "--from_summary reads /nonexistent/summary.json, which does not exist"),
    ("experiments.init_similarity", ["--out_dir=/tmp/unused", "--norms=post,post"], 1,
     "--norms=post,post: give one or more values, each once"),
    ("experiments.collapse", ["--out_dir=/dev/null/x", "--steps=2"], 2,
     "postnorm: error: --out_dir='/dev/null/x' cannot be created or written"),
    ("experiments.leaderboard", ["--out_dir=/dev/null/lb", "--methods=post"], 2,
     "postnorm: error: --out_dir='/dev/null/lb' cannot be created or written"),
    ("experiments.leaderboard", ["--out_dir=/tmp/unused", "--methods=bogus"], 1,
     "--methods: 'bogus' is not one of post, pre"),
    ("experiments.leaderboard", ["--runs=/nonexistent/run"], 2,
     "postnorm: error: --runs: /nonexistent/run holds no checkpoint"),
    ("experiments.leaderboard", ["--runs=/tmp/a", "--out_dir=/tmp/b"], 1,
     "give --out_dir (a leaderboard sweep) or --runs (run directories)"),
    ("experiments.init_similarity", ["--out_dir=/tmp/unused", "--norms=sandwich",
                                     "--init_tsim_target=0.5"], 2,
     "model.norm='sandwich' undoes with the norm on each branch"),
])
def test_bad_input_is_one_line_before_compiling(module, args, code, message):
    result = run_module(module, *args)
    assert result.returncode == code, result.stderr[-3000:]
    assert message in result.stderr and "Traceback" not in result.stderr


# each kind of list: tests/config/test_list_flags.py
@pytest.mark.parametrize("args,code,message", [
    (["--seeds=0,0"], 1, "--seeds=0,0: give one or more values, each once"),
    ([f"--config={TINY},model.d_ff=0,runtime.allocator=system"], 2,
     "postnorm: error: run post_seed0: model.d_ff=0 is invalid: must be an integer >= 1"),
])
def test_collapse_refuses_bad_flags_before_writing_anything(tmp_path, args, code, message):
    result = run_module("experiments.collapse", f"--out_dir={tmp_path / 'out'}", *args)
    assert result.returncode == code, result.stderr[-3000:]
    assert message in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


def test_a_file_in_the_way_of_the_collapse_figures_is_one_line(tmp_path):
    (tmp_path / "figures").write_text("kept")
    result = run_module("experiments.collapse", f"--out_dir={tmp_path}", "--steps=2",
                        f"--config={TINY},runtime.allocator=system")
    assert result.returncode == 2, result.stderr[-3000:]
    assert (f"postnorm: error: --out_dir's figures='{tmp_path}/figures' cannot be created or "
            "written (File exists)") in result.stderr and "Traceback" not in result.stderr
    assert (tmp_path / "figures").read_text() == "kept"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["figures"]


@pytest.mark.slow
def test_collapse_runs_to_the_end_on_the_tied_paper_config(tmp_path):
    """The paper config ties its embeddings: Thm 3.8(ii)'s point is built on an untied copy of
    the head, so the experiment finishes and reports it."""
    result = run_module("experiments.collapse", "--config=configs/paper.py:runlocal",
                        "--seeds=0", "--norms=post", f"--out_dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [row["status"] for row in summary["runs"]] == ["done"]
    (thm_row,) = summary["thm38"]
    assert abs(thm_row["point_loss_minus_lfreq"]) < 1e-4
    record = json.loads((tmp_path / "post_seed0" / "thm38.json").read_text())
    assert record["stationary_point"]["untied_head"]
