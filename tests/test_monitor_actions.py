"""The early-warning monitor's actions: the optimizer transforms that carry them against numpy,
each change on a train state, and whole runs in which a scripted similarity makes the real
monitor warn: an action without and with rollback (bounded, recorded), and an exact resume with
a warning pending at the checkpoint."""

import json
import shutil

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from optax import tree_utils

from postnorm.diagnostics import early_warning
from postnorm.train import reporter as reporter_module
from postnorm.train.loop import train_and_evaluate
from postnorm.train.monitor_actions import apply_change
from postnorm.train.optim import clip_when_warned, make_optimizer, scale_by_layer
from postnorm.train.state import GuardedState
from tests.reliability_helpers import read_records, tiny_config, write_corpus


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
    records = read_records(workdir)
    steps = [r["step"] for r in records if "train/loss" in r]
    assert steps == list(range(1, 13))  # no step twice: the rolled-back records were dropped
    lrs = {r["step"]: r["train/lr"] for r in records if "train/lr" in r}
    plain = tmp_path / "plain"
    train_and_evaluate(config_for(corpus, tmp_path), str(plain))
    plain_lrs = {r["step"]: r["train/lr"] for r in read_records(plain) if "train/lr" in r}
    for step, lr in lrs.items():  # steps 9 on ran twice rolled back, at lr x 0.25
        assert lr == pytest.approx(plain_lrs[step] * (0.25 if step >= 9 else 1.0), rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("killed_after", [4, 12])
def test_a_resume_with_a_warning_pending_or_after_a_rollback_is_exact(corpus, tmp_path,
                                                                      monkeypatch, killed_after):
    """Killed after step 4 (its checkpoint holds a watch, two diagnostic steps short of the warn
    at step 9) or after step 12 (the warn rolled the run back to step 8 and halved its lr), a run
    resumed from that checkpoint logs and acts exactly as the uninterrupted one."""
    scripted_similarity(monkeypatch)
    config = config_for(corpus, tmp_path, action="lr_scale", rollback=True, max_actions=1)
    # logged every 2 steps, so that the monitor's loss smoothing spans steps a resume must not
    # add to
    config.train.steps, config.train.keep_ckpts, config.train.log_every = 16, 10, 2
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    train_and_evaluate(config, str(full))
    assert [(e["step"], e["rolled_back_to"]) for e in actions_of(full)] == [(9, 8)]
    (resumed / "checkpoints").mkdir(parents=True)
    step_dir = str(killed_after)
    shutil.copytree(full / "checkpoints" / step_dir, resumed / "checkpoints" / step_dir)
    for name in ("config.json", "metrics.jsonl"):  # as a kill -9 after that step leaves them
        shutil.copy(full / name, resumed / name)
    if killed_after == 12:
        shutil.copy(full / "monitor_actions.json", resumed / "monitor_actions.json")
    train_and_evaluate(config, str(resumed))

    def records(workdir) -> list[dict]:
        return [{k: v for k, v in r.items() if k != "train/tokens_per_s"}
                for r in read_records(workdir)]

    want, got = records(full), records(resumed)
    assert [r["step"] for r in want if "train/loss" in r] == [1, *range(2, 17, 2)]
    assert got == want
    assert actions_of(resumed) == actions_of(full)


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
