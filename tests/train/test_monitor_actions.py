"""The early-warning monitor's actions: the optimizer transforms that carry them against numpy,
each change on a train state, and whole runs in which a scripted similarity makes the real
monitor warn: an action without and with rollback (bounded, recorded), and an exact resume with
a warning pending, or after a rollback, killed with SIGKILL and rerun."""

import json
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from optax import tree_utils

from postnorm.diagnostics import early_warning
from postnorm.sweep.record import run_metrics_summary
from postnorm.train import reporter as reporter_module
from postnorm.train.loop import train_and_evaluate
from postnorm.train.monitor_actions import apply_change
from postnorm.train.optim import clip_when_warned, make_optimizer, scale_by_layer
from postnorm.train.state import GuardedState
from tests.reliability_helpers import (
    REPO,
    finalized_steps,
    read_records,
    subprocess_env,
    tiny_config,
    write_corpus,
)


def test_the_layer_scale_and_the_warned_clip_against_numpy():
    rng = np.random.default_rng(0)
    updates = {"layers": {"w": jnp.asarray(rng.normal(size=(3, 4, 2)), jnp.float32),
                          "b": jnp.asarray(rng.normal(size=(3, 2)), jnp.float32)},
               "embedding": jnp.asarray(rng.normal(size=(5, 2)), jnp.float32)}
    tx = scale_by_layer(3)
    state = tx.init(updates)
    np.testing.assert_array_equal(state.layer_lr_scale, np.ones(3))
    state = state._replace(layer_lr_scale=jnp.asarray([1.0, 0.5, 0.25]))
    out, _ = tx.update(updates, state)
    np.testing.assert_allclose(out["layers"]["w"], np.asarray(updates["layers"]["w"])
                               * np.array([1.0, 0.5, 0.25])[:, None, None], rtol=1e-6)
    np.testing.assert_allclose(out["layers"]["b"], np.asarray(updates["layers"]["b"])
                               * np.array([1.0, 0.5, 0.25])[:, None], rtol=1e-6)
    np.testing.assert_array_equal(out["embedding"], updates["embedding"])
    clip = clip_when_warned()
    clip_state = clip.init(updates)
    same, _ = clip.update(updates, clip_state)  # inf: no clipping before a warn
    for a, b in zip(jax.tree.leaves(same), jax.tree.leaves(updates), strict=True):
        np.testing.assert_array_equal(a, b)
    norm = np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2) for x in jax.tree.leaves(updates)))
    clipped, _ = clip.update(updates, clip_state._replace(warned_clip_norm=jnp.float32(1.0)))
    for a, b in zip(jax.tree.leaves(clipped), jax.tree.leaves(updates), strict=True):
        np.testing.assert_allclose(a, np.asarray(b) / norm, rtol=1e-5)


def small_state(action: str) -> GuardedState:
    opt = ml_collections.ConfigDict(dict(
        optimizer="adamw", momentum=0.9, lr=1e-3, schedule="constant", warmup_steps=0,
        min_lr_ratio=0.1, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.0,
        decay_norms_and_embeddings=False, clip_norm=0.5))
    tx, _ = make_optimizer(opt, 10, monitor_action=action, n_layers=4)
    params = {"layers": {"w": jnp.ones((4, 2))}, "embedding": jnp.ones((3, 2))}
    return GuardedState.create_guarded(apply_fn=None, params=params, tx=tx, monitor_acts=True)


@pytest.mark.parametrize("action", ["lr_scale", "layer_lr", "clip"])
def test_each_change_compounds_on_the_state_at_the_warn(action):
    monitor = ml_collections.ConfigDict(dict(action=action, lr_factor=0.5, layer_lr_factor=0.25,
                                             clip_norm=2.0, clip_factor=0.5))
    tsim_L = np.array([0.5, 0.995, 0.999, 0.2])  # layers 1 and 2 alike
    state = small_state(action)
    once = apply_change(state, state, monitor, tsim_L)
    twice = apply_change(once, once, monitor, tsim_L)
    assert (int(once.monitor_actions), int(twice.monitor_actions)) == (1, 2)
    name, first, second = {
        "lr_scale": ("warned_lr_scale", 0.5, 0.25),
        "layer_lr": ("layer_lr_scale", [1.0, 0.25, 0.25, 1.0], [1.0, 1 / 16, 1 / 16, 1.0]),
        "clip": ("warned_clip_norm", 2.0, 1.0)}[action]
    np.testing.assert_array_equal(tree_utils.tree_get(once.opt_state, name), first)
    np.testing.assert_array_equal(tree_utils.tree_get(twice.opt_state, name), second)
    assert float(twice.lr_scale) == 1.0  # the non-finite policy's scale is left alone
    # a rollback: the change goes onto the restored state, from the values at the warn, and the
    # non-finite policy's scale and count at the warn are kept
    restored = small_state(action)
    at_warn = once.replace(lr_scale=jnp.float32(0.5), rollbacks=jnp.int32(1))
    rolled = apply_change(restored, at_warn, monitor, tsim_L)
    assert int(rolled.monitor_actions) == 2
    assert (float(rolled.lr_scale), int(rolled.rollbacks)) == (0.5, 1)
    np.testing.assert_array_equal(tree_utils.tree_get(rolled.opt_state, name), second)


def scripted_similarity(monkeypatch, from_step: int = 3) -> None:
    """From ``from_step`` on, the monitor reads every layer at tsim 1 and the loss at its floor:
    the real rule watches there and warns two diagnostic steps later (persistence 3)."""
    real = early_warning.assess

    def assess(step, tsim_L, loss, floor, state, rule=early_warning.DEFAULT_MONITOR):
        if step >= from_step:
            return real(step, np.ones_like(np.asarray(tsim_L)), floor, floor, state, rule)
        return real(step, tsim_L, loss, floor, state, rule)

    monkeypatch.setattr(early_warning, "assess", assess)  # the replay on a (re)start
    monkeypatch.setattr(reporter_module, "assess", assess)  # the live reading


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def config_for(corpus, tmp_path, **monitor):
    return tiny_config(corpus, tmp_path / "tfds", train__steps=12, diag__every=3,
                       train__ckpt_every=4, train__eval_every=12,
                       **{f"monitor__{k}": v for k, v in monitor.items()})


def actions_of(workdir) -> list[dict]:
    return json.loads((workdir / "monitor_actions.json").read_text())["actions"]


@pytest.mark.slow
def test_an_action_without_rollback_changes_the_run_from_the_warn_on(corpus, tmp_path,
                                                                       monkeypatch):
    scripted_similarity(monkeypatch)
    workdir = tmp_path / "run"
    train_and_evaluate(config_for(corpus, tmp_path, action="lr_scale", lr_factor=0.5),
                       str(workdir))
    records = read_records(workdir)
    levels = {r["step"]: r["monitor/level"] for r in records if "monitor/level" in r}
    assert levels == {1: 0, 3: 1, 6: 1, 9: 2, 12: 2}
    (entry,) = actions_of(workdir)  # one warn: level stays at warn
    assert (entry["step"], entry["actions"], entry["rolled_back_to"],
            entry["warned_lr_scale"]) == (9, 1, None, 0.5)
    lrs = {r["step"]: r["train/lr"] for r in records if "train/lr" in r}
    plain = tmp_path / "plain"
    train_and_evaluate(config_for(corpus, tmp_path), str(plain))
    plain_lrs = {r["step"]: r["train/lr"] for r in read_records(plain) if "train/lr" in r}
    # the warn at step 9 is read while step 10 runs: the lr is halved from step 11 on
    for step, lr in lrs.items():
        assert lr == pytest.approx(plain_lrs[step] * (0.5 if step >= 11 else 1.0), rel=1e-6)


@pytest.mark.slow
def test_a_rollback_returns_before_the_warn_and_is_bounded_and_recorded(corpus, tmp_path,
                                                                         monkeypatch):
    scripted_similarity(monkeypatch)
    workdir = tmp_path / "run"
    train_and_evaluate(config_for(corpus, tmp_path, action="lr_scale", rollback=True,
                                  max_actions=2), str(workdir))
    entries = actions_of(workdir)
    assert [(e["step"], e["actions"], e["rolled_back_to"], e["warned_lr_scale"])
            for e in entries] == [(9, 1, 8, 0.5), (9, 2, 8, 0.25)]
    # the run's result record (and so a sweep's archive) lists them
    assert run_metrics_summary(str(workdir))["monitor_actions"] == [
        {**{k: v for k, v in e.items() if k != "layers"}, "layers_alike": len(e["layers"])}
        for e in entries]
    records = read_records(workdir)
    steps = [r["step"] for r in records if "train/loss" in r]
    assert steps == list(range(1, 13))  # no step twice: the rolled-back records were dropped
    lrs = {r["step"]: r["train/lr"] for r in records if "train/lr" in r}
    plain = tmp_path / "plain"
    train_and_evaluate(config_for(corpus, tmp_path), str(plain))
    plain_lrs = {r["step"]: r["train/lr"] for r in read_records(plain) if "train/lr" in r}
    for step, lr in lrs.items():  # steps 9 on ran twice rolled back, at lr x 0.25
        assert lr == pytest.approx(plain_lrs[step] * (0.25 if step >= 9 else 1.0), rel=1e-6)


KILLABLE_RUN = """
import sys, time, types
from pathlib import Path

from postnorm.diagnostics import early_warning
from postnorm.train import reporter
from postnorm.train.loop import train_and_evaluate
from tests.train.test_monitor_actions import killable_config, scripted_similarity

corpus, data_dir, workdir, pause_at = *map(Path, sys.argv[1:4]), int(sys.argv[4])
scripted_similarity(types.SimpleNamespace(setattr=setattr))
scripted = early_warning.assess

def assess(step, *args, **kwargs):
    if step == pause_at:  # hold the run here, mid-step, for the test's kill -9
        (workdir / "paused").write_text(str(step))
        time.sleep(600)
    return scripted(step, *args, **kwargs)

early_warning.assess = reporter.assess = assess
train_and_evaluate(killable_config(corpus, data_dir), str(workdir))
"""


def killable_config(corpus, data_dir):
    """20 steps, diagnosed every 3 and checkpointed every 4, logged every 2 (so that the
    monitor's loss smoothing spans steps a resume must not add to); the scripted similarity
    watches from step 3 and warns at step 9, which rolls back to step 8 and halves the lr."""
    return tiny_config(corpus, data_dir, train__steps=20, diag__every=3, train__ckpt_every=4,
                       train__eval_every=20, train__keep_ckpts=10, train__log_every=2,
                       monitor__action="lr_scale", monitor__rollback=True, monitor__max_actions=1)


def start_killable(corpus, tmp_path, workdir, pause_at: int, log):
    return subprocess.Popen(
        [sys.executable, "-c", KILLABLE_RUN, str(corpus), str(tmp_path / "tfds"), str(workdir),
         str(pause_at)], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
        env={**subprocess_env(None), "PYTHONPATH": str(REPO)})


def records_of(workdir) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "train/tokens_per_s"}
            for r in read_records(workdir)]


@pytest.fixture(scope="module")
def uninterrupted(corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("uninterrupted")
    with open(root / "log.txt", "w") as log:
        process = start_killable(corpus, root, root / "run", 0, log)
        assert process.wait(timeout=600) == 0, (root / "log.txt").read_text()[-3000:]
    assert [(e["step"], e["rolled_back_to"]) for e in actions_of(root / "run")] == [(9, 8)]
    return root / "run"


@pytest.mark.slow
@pytest.mark.parametrize(("pause_at", "resumes_from"), [
    (6, 4),    # checkpoint 4 holds the watch read at step 3, two diagnostic steps from the warn
    (15, 12),  # checkpoint 12 came after the warn at 9 rolled back to 8 and halved the lr
], ids=["warning-pending", "after-rollback"])
def test_a_run_killed_9_with_a_warning_pending_or_after_a_rollback_resumes_exactly(
        corpus, tmp_path, uninterrupted, pause_at, resumes_from):
    """kill -9 in the middle of diagnostic step ``pause_at``, then the same run again: it resumes
    from checkpoint ``resumes_from`` and logs and acts exactly as the uninterrupted run."""
    workdir, log_path = tmp_path / "run", tmp_path / "log.txt"
    with open(log_path, "w") as log:
        process = start_killable(corpus, tmp_path, workdir, pause_at, log)
        try:
            deadline = time.monotonic() + 600
            # paused, and the checkpoint before the pause written (its save is asynchronous)
            while not ((workdir / "paused").exists()
                       and resumes_from in finalized_steps(workdir)):
                assert process.poll() is None, log_path.read_text()[-3000:]
                assert time.monotonic() < deadline, "the run never reached its pause"
                time.sleep(0.05)
        finally:  # the kill the test is about, or cleanup after a failed wait
            process.send_signal(signal.SIGKILL)
        assert process.wait(timeout=60) == -signal.SIGKILL
    assert max(finalized_steps(workdir)) == resumes_from
    assert (workdir / "monitor_actions.json").exists() == (resumes_from > 9)
    with open(log_path, "a") as log:
        assert start_killable(corpus, tmp_path, workdir, 0, log).wait(timeout=600) == 0, \
            log_path.read_text()[-3000:]
    want, got = records_of(uninterrupted), records_of(workdir)
    assert [r["step"] for r in want if "train/loss" in r] == [1, *range(2, 21, 2)]
    assert got == want
    assert actions_of(workdir) == actions_of(uninterrupted)


def test_the_record_lists_the_actions_in_effect(tmp_path):
    """A repeated action replaces its record and those after it; a restart from a state that
    holds fewer actions drops the rest."""
    from postnorm.train.monitor_actions import keep_actions, record_action, recorded_actions

    assert recorded_actions(str(tmp_path)) == []
    for step, count in ((9, 1), (19, 2), (29, 3)):
        record_action(str(tmp_path), {"step": step, "actions": count})
    record_action(str(tmp_path), {"step": 21, "actions": 2})  # after a restart before 19
    assert [(e["step"], e["actions"]) for e in recorded_actions(str(tmp_path))] == [(9, 1),
                                                                                    (21, 2)]
    keep_actions(str(tmp_path), 1)
    assert [e["step"] for e in recorded_actions(str(tmp_path))] == [9]
