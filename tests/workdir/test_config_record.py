"""A workdir holds the run of one config: a resume may change only how the run is watched."""

import json
import subprocess
import sys

import pytest

from configs.default import get_config
from postnorm.train.experiment import restore_run
from postnorm.train.loop import evaluate_checkpoint, train_and_evaluate
from postnorm.workdir import config_record as run_config
from postnorm.workdir.config_record import WorkdirConfigError
from tests.reliability_helpers import REPO, subprocess_env


def recorded_run(tmp_path):
    """A workdir with a step-4 checkpoint directory whose config.json records ``layers=2``."""
    config = get_config("layers=2")
    workdir = tmp_path / "run"
    (workdir / "checkpoints" / "4").mkdir(parents=True)
    run_config.write_run_config(str(workdir), config)
    return workdir, config


def listing(workdir) -> dict[str, bytes]:
    return {str(p.relative_to(workdir)): p.read_bytes() if p.is_file() else b""
            for p in sorted(workdir.rglob("*"))}


def test_changed_fields_are_dotted_paths_and_ignore_the_process_section():
    old = {"model": {"n_layers": 2, "d_model": 64}, "runtime": {"allocator": "auto"}}
    new = {"model": {"n_layers": 4, "d_model": 64}, "runtime": {"allocator": "system"},
           "opt": {"lr": 1e-3}}
    assert run_config.changed_fields(old, new) == ["model.n_layers", "opt.lr"]
    assert run_config.changed_fields(new, new) == []


def test_a_changed_field_is_refused_with_its_values(tmp_path):
    workdir, config = recorded_run(tmp_path)
    run_config.check_run_config(str(workdir), config)  # the same config resumes
    changed = config.copy_and_resolve_references()
    changed.opt.lr, changed.train.steps = 0.5, 7
    with pytest.raises(WorkdirConfigError) as err:
        run_config.check_run_config(str(workdir), changed)
    message = str(err.value)
    assert f"{workdir} holds a run of a different config" in message
    assert "opt.lr: 0.001 -> 0.5" in message
    assert f"train.steps: {config.train.steps} -> 7" in message
    assert "use a new --workdir" in message


def test_watching_implementation_and_process_fields_may_change_on_resume(tmp_path):
    workdir, config = recorded_run(tmp_path)
    watched = config.copy_and_resolve_references()
    for path in ("train.log_every", "train.eval_every", "train.ckpt_every", "train.keep_ckpts",
                 "diag.every", "model.scan_unroll", "model.attention_block", "mesh.fsdp"):
        section, name = path.split(".")
        watched[section][name] += 1
    watched.data.data_dir, watched.model.remat, watched.model.attention = "/x", "dots", "xla"
    watched.train.nonfinite, watched.train.rollback_lr_factor = "rollback", 0.1
    watched.train.max_rollbacks += 1
    watched.runtime.allocator = "system"
    run_config.check_run_config(str(workdir), watched)


def test_a_run_recorded_before_an_implementation_field_existed_resumes(tmp_path):
    workdir, config = recorded_run(tmp_path)
    data = json.loads((workdir / "config.json").read_text())
    del data["model"]["scan_unroll"], data["mesh"]
    (workdir / "config.json").write_text(json.dumps(data))
    run_config.check_run_config(str(workdir), config)


def test_a_workdir_without_a_checkpoint_starts_afresh_with_any_config(tmp_path):
    """Nothing was trained (e.g. the first start failed): the new config is not refused."""
    workdir, config = recorded_run(tmp_path)
    (workdir / "checkpoints" / "4").rmdir()
    (workdir / "checkpoints" / "8.orbax-checkpoint-tmp").mkdir()  # never finalized
    changed = config.copy_and_resolve_references()
    changed.seed = 7
    run_config.check_run_config(str(workdir), changed)


def test_a_checkpoint_without_its_config_is_refused(tmp_path):
    workdir, config = recorded_run(tmp_path)
    (workdir / "config.json").unlink()
    with pytest.raises(WorkdirConfigError,
                       match=r"holds a checkpoint \(step 4\) but no config.json"):
        run_config.check_run_config(str(workdir), config)
    with pytest.raises(WorkdirConfigError,  # nothing says which model the checkpoint is
                       match=r"holds a checkpoint \(step 4\) but no config.json"):
        run_config.check_eval_config(str(workdir), config)


def test_evaluation_needs_the_runs_model_and_data(tmp_path):
    workdir, config = recorded_run(tmp_path)
    other = config.copy_and_resolve_references()
    other.opt.lr, other.train.eval_batches = 0.5, 9  # not what an evaluation depends on
    other.data.batch_size, other.data.data_dir = 4, "/elsewhere"
    run_config.check_eval_config(str(workdir), other)
    other.model.remat, other.model.attention = "none", "einsum"  # the same model, computed
    run_config.check_eval_config(str(workdir), other)
    positions = other.copy_and_resolve_references()
    positions.model.positions = "none"
    with pytest.raises(WorkdirConfigError, match=r"model.positions: 'rope' -> 'none'\. An "
                                                 "evaluation needs the run's model and data"):
        run_config.check_eval_config(str(workdir), positions)
    other.data.seq_len = 64
    with pytest.raises(WorkdirConfigError, match=r"data.seq_len: 128 -> 64\. An evaluation"):
        run_config.check_eval_config(str(workdir), other)


def test_a_config_recorded_before_a_field_existed_names_the_field(tmp_path):
    workdir, config = recorded_run(tmp_path)
    data = json.loads((workdir / "config.json").read_text())
    del data["model"]["rope_base"]
    (workdir / "config.json").write_text(json.dumps(data))
    with pytest.raises(WorkdirConfigError, match=r"model.rope_base: absent -> 10000.0\. .*a "
                       "field absent from the record was added after the run started"):
        run_config.check_run_config(str(workdir), config)


def measure_restore(config, workdir):
    """The restore the Theorem 3.8 measurement starts from."""
    return restore_run(config, workdir, "measure", data_position=True)


@pytest.mark.parametrize("text", ['{"model": {"n_lay', "[1, 2]", "{}", "\udcff"])
def test_an_unreadable_config_json_names_the_file(tmp_path, text):
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "config.json").write_text(text, errors="surrogateescape")
    with pytest.raises(WorkdirConfigError, match=f"{workdir}/config.json .*restore it"):
        run_config.read_run_config(str(workdir))


@pytest.mark.parametrize("entry", [train_and_evaluate, evaluate_checkpoint,
                                   measure_restore])
def test_training_and_eval_refuse_another_model_before_writing_anything(tmp_path, entry):
    workdir, config = recorded_run(tmp_path)
    before = listing(workdir)
    changed = config.copy_and_resolve_references()
    changed.model.n_layers = 3
    with pytest.raises(WorkdirConfigError, match="model.n_layers: 2 -> 3"):
        entry(changed, str(workdir))
    assert listing(workdir) == before


def test_main_exits_2_with_the_message_and_keeps_the_recorded_config(tmp_path):
    workdir, _ = recorded_run(tmp_path)
    before = listing(workdir)
    result = subprocess.run(
        [sys.executable, "main.py", "--config", "configs/default.py:layers=2,lr=0.5",
         "--workdir", str(workdir)],
        cwd=REPO, capture_output=True, text=True, timeout=300, env=subprocess_env(None))
    assert result.returncode == 2, result.stderr[-3000:]
    assert (f"postnorm: error: {workdir} holds a run of a different config "
            f"({workdir}/config.json): opt.lr: 0.001 -> 0.5.") in result.stderr
    assert "Traceback" not in result.stderr
    assert listing(workdir) == before


def test_a_workdir_under_a_file_has_no_recorded_config(tmp_path):
    """Creating it fails later with its own message (tests/cli/test_filesystem.py)."""
    (tmp_path / "file").write_text("")
    assert run_config.read_run_config(str(tmp_path / "file" / "run")) is None


def test_a_record_from_before_a_default_keeping_field_rebuilds_with_its_default(tmp_path):
    """``recorded_config``: the fields of ``DEFAULTS_KEEP_EARLIER_RUNS`` a record predates take
    their defaults; any other field it lacks stays absent, for validation to name."""
    from postnorm.config.identity import DEFAULTS_KEEP_EARLIER_RUNS, config_data
    data = config_data(get_config())
    for field in DEFAULTS_KEEP_EARLIER_RUNS:
        section, name = field.split(".")
        del data[section][name]
    data["model"]["qk_norm"] = True  # recorded: kept as recorded
    del data["opt"]["lr"]  # not a default-keeping field
    (tmp_path / "config.json").write_text(json.dumps(data))
    config = run_config.recorded_config(str(tmp_path))
    assert config.model.qk_norm is True
    assert config.model.residual_budget == "none" and config.model.init_tsim_target == 0.0
    assert config.train.placement_controller is True
    assert "lr" not in config.opt
    with pytest.raises(WorkdirConfigError, match="config.json does not exist"):
        run_config.recorded_config(str(tmp_path / "empty"))
