"""main.py's handling of bad input: config files, overrides, data and tokenizer paths, and
its params, plots and report modes."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_main(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "main.py", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def test_cli_invalid_field_fails_before_building_anything(tmp_path):
    workdir = tmp_path / "run"
    result = run_main("--config", "configs/default.py:model.n_heads=5", "--workdir", str(workdir))
    assert result.returncode == 2
    assert "model.d_model=64 is not divisible by model.n_heads=5" in result.stderr
    assert "Traceback" not in result.stderr
    assert not workdir.exists()


def test_cli_override_of_an_unknown_field_is_a_one_line_flag_error(tmp_path):
    result = run_main("--config", "configs/default.py", "--config.train.foo=1", "--workdir",
                      str(tmp_path / "run"))
    assert result.returncode == 1
    assert ("FATAL Flags parsing error: a config override names a field the config does not "
            "have") in result.stderr and "['--config.train.foo']" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "run").exists()


@pytest.mark.parametrize(("arg", "message"), [
    ("sandwich", "unknown config variant 'sandwich'; known: ['post', 'pre']"),
    ("lr=fast", "opt.lr='fast': expected float"),
])
def test_cli_bad_config_argument_is_a_one_line_flag_error(tmp_path, arg, message):
    result = run_main("--config", f"configs/default.py:{arg}", "--workdir", str(tmp_path / "run"))
    assert result.returncode == 1
    assert result.stderr.splitlines()[0] == f"FATAL Flags parsing error: {message}"
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()


def test_cli_missing_config_file_is_a_flag_error(tmp_path):
    result = run_main("--config", "configs/nonexistent.py", "--workdir", str(tmp_path / "run"))
    assert result.returncode == 1
    assert "FATAL Flags parsing error" in result.stderr
    assert "No such file or directory: 'configs/nonexistent.py'" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "run").exists()


def test_cli_missing_c4_says_where_it_looked(tmp_path):
    result = run_main("--config", f"configs/paper.py:data.data_dir={tmp_path}", "--workdir",
                      str(tmp_path / "run"))
    assert result.returncode == 2
    assert f"{tmp_path}/c4/en/3.0.1" in result.stderr
    assert "docs/C4.md" in result.stderr
    assert "collapse forecast" not in result.stderr  # refused before the forecast is computed


def test_cli_unreadable_tokenizer(tmp_path):
    bad = tmp_path / "spm.model"
    bad.write_bytes(b"not a sentencepiece model")
    result = run_main("--config", f"configs/default.py:data.tokenizer_path={bad}", "--workdir",
                      str(tmp_path / "run"))
    assert result.returncode == 2
    assert str(bad) in result.stderr and "not a valid SentencePiece model" in result.stderr


def test_cli_params_mode_prints_the_paper_count():
    result = run_main("--config", "configs/paper.py", "--mode=params")
    assert result.returncode == 0, result.stderr
    assert "180.1M" in result.stdout


def test_cli_a_config_files_own_attribute_error_is_not_called_an_unknown_override(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("def get_config():\n    return object().missing_attribute\n")
    result = run_main("--config", str(broken), "--workdir", str(tmp_path / "run"))
    assert result.returncode == 1
    assert "missing_attribute" in result.stderr
    assert "a config override names a field" not in result.stderr


@pytest.mark.parametrize("text,message", [
    ("x = 1\n", "the file defines no get_config(arg=None) returning an ml_collections.ConfigDict"),
    ("def get_config():\n    return 5\n", "the file's get_config() returned an object of type "
                                            "int, not an ml_collections.ConfigDict"),
])
def test_cli_a_config_file_without_a_config_is_a_one_line_flag_error(tmp_path, text, message):
    path = tmp_path / "config_file.py"
    path.write_text(text)
    result = run_main("--config", str(path), "--workdir", str(tmp_path / "run"))
    assert result.returncode == 1
    assert result.stderr.splitlines()[0] == f"FATAL Flags parsing error: --config: {message} " \
                                            "(see configs/default.py)"
    assert "Traceback" not in result.stderr


def test_cli_a_misspelt_field_in_a_config_file_is_named(tmp_path):
    path = tmp_path / "typo.py"
    path.write_text("from configs import default\n\n\ndef get_config(arg=None):\n"
                    "    c = default.get_config(arg)\n    c.model.n_layer = 2\n    return c\n")
    result = run_main("--config", str(path), "--mode=params")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "postnorm: error: unknown config field model.n_layer (did you mean " \
           "model.n_layers?)" in result.stderr


def test_cli_params_mode_counts_the_byte_vocabulary():
    result = run_main("--config", "configs/default.py:data.tokenizer=byte", "--mode=params")
    assert result.returncode == 0, result.stderr
    assert "vocabulary: 257 (from data.tokenizer='byte')" in result.stdout


@pytest.mark.parametrize("mode", ["plots", "report"])
def test_cli_plots_and_report_expand_a_home_workdir(tmp_path, mode):
    result = subprocess.run(
        [sys.executable, "main.py", "--config", "configs/default.py", f"--mode={mode}",
         "--workdir=~/run"], cwd=REPO, capture_output=True, text=True,
        env={**os.environ, "HOME": str(tmp_path)})
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"{tmp_path}/run/metrics.jsonl does not exist" in result.stderr
