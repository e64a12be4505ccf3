"""Theorem 3.8 measured on a trained network (docs/MATH.md §5).

* (i) per sequence: X_H = the final hidden states (the LM head's input: the last layer's output
  in Post-Norm, the final norm's output in Pre-Norm), epsilon = ||X_H - Pi_1 X_H||_F, the
  bound L_freq(p_hat) - (2/sqrt(n)) ||W_lm||_2 epsilon with p_hat the sequence's own target
  frequencies, against the measured loss; also the loss (1/n) sum_i CE_i(W_lm x_bar) of the
  fully collapsed prediction that the proof passes through.
* KL(p_freq || q_bar): p_freq the corpus unigram distribution of the training targets (whose
  entropy is L_freq), q_bar the model's output distribution averaged over all eval positions.
* (ii) the constructed p_freq point: every input token identical (so every layer's input is
  collapsed) and W_lm = log(p_hat) x_bar^T / ||x_bar||^2, so softmax(W_lm x_bar) = p_hat, the
  target frequencies of the batch; the loss is then L_freq(p_hat) and every gradient vanishes.
  Reported as per-layer gradient norms there and, with the same W_lm, on the real inputs. The
  point verifies the theorem's algebra, not a state training reaches. A tied head is untied for
  it (the constructed W_lm replaces the head; the embedding keeps its trained value); with
  learned positions identical tokens are not collapsed inputs, so (ii) is skipped with the
  reason recorded.
* Optionally, the final loss on the next training batches: the final parameters' mean loss on
  the ``train_batches`` batches the run would have trained on next, with their frequency
  floor. The last few logged losses each see one batch, whose floor scatters around L_freq by
  more than the 5% that separates a collapsed loss from a learning one; enough batches (which
  span many documents) average it out.

X_H is read without changing the model: a flax method interceptor records the argument of
``Decoder.logits``.
"""


import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from postnorm import theory
from postnorm.diagnostics.stats import layer_norms
from postnorm.model import Decoder, ModelSpec
from postnorm.theory import unigram_entropy
from postnorm.train.experiment import (
    Experiment,
    batch_losses,
    global_frequency_floor,
    restore_run,
)

ABSENT_PROB = 1e-30  # p_hat of tokens absent from the batch at the constructed point


def hidden_and_logits(spec: ModelSpec):
    """A jitted ``f(params, tokens_BxL) -> (hidden_BxLxD, logits_BxLxV)`` of the Decoder."""
    model = Decoder(spec)

    def run(params: dict, tokens_BxL: jax.Array) -> tuple[jax.Array, jax.Array]:
        captured = {}

        def interceptor(next_fun, args, kwargs, context):
            if isinstance(context.module, Decoder) and context.method_name == "logits":
                captured["hidden"] = args[0]
            return next_fun(*args, **kwargs)

        with nn.intercept_methods(interceptor):
            logits_BxLxV = model.apply({"params": params}, tokens_BxL)
        return captured["hidden"].astype(jnp.float32), logits_BxLxV

    return jax.jit(run)


def lm_head_matrix(params: dict, spec: ModelSpec) -> np.ndarray:
    """W_lm as docs/MATH.md §5 writes it, [V, D] with logits = W_lm x (tied heads: E / sqrt(d))."""
    if spec.tie_embeddings:
        return np.asarray(params["embedding"], np.float64) / np.sqrt(spec.d_model)
    return np.asarray(params["lm_head"], np.float64).T


def _log_softmax(logits_NxV: np.ndarray) -> np.ndarray:
    shifted = logits_NxV - logits_NxV.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def _token_cross_entropy(logits_BxLxV: jax.Array, targets_BxL: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits_BxLxV, targets_BxL)


def sequence_bounds(hidden_BxLxD: np.ndarray, token_loss_BxL: np.ndarray,
                    targets_BxL: np.ndarray, w_lm_VxD: np.ndarray) -> dict[str, np.ndarray]:
    """Thm 3.8(i) per sequence: loss, L_freq(p_hat), epsilon, bound, collapsed-prediction loss."""
    n = targets_BxL.shape[1]
    hidden = np.asarray(hidden_BxLxD, np.float64)
    lfreq_B = np.array([theory.frequency_loss(t) for t in targets_BxL])
    eps_B = np.array([theory.collapse_distance(h) for h in hidden])
    bound_B = np.array([theory.collapse_loss_bound(lf, w_lm_VxD, e, n)
                        for lf, e in zip(lfreq_B, eps_B, strict=True)])
    log_q_BxV = _log_softmax(hidden.mean(1) @ w_lm_VxD.T)
    shared_B = -np.take_along_axis(log_q_BxV, targets_BxL, axis=1).mean(1)
    return {"loss": np.asarray(token_loss_BxL, np.float64).mean(1), "lfreq_seq": lfreq_B,
            "eps": eps_B, "bound": bound_B, "collapsed_prediction_loss": shared_B,
            "tsim": np.asarray(theory.tsim(hidden))}


def kl_divergence(p_V: np.ndarray, q_V: np.ndarray) -> float:
    """KL(p || q) in nats over the support of p."""
    p, q = np.asarray(p_V, np.float64), np.asarray(q_V, np.float64)
    support = p > 0
    return float(np.sum(p[support] * np.log(p[support] / q[support])))


def measure_bound(spec: ModelSpec, params: dict, batches: list[dict[str, np.ndarray]],
                  corpus_counts_V: np.ndarray) -> dict:
    """Thm 3.8(i) over ``batches`` and KL(p_freq || q_bar); per-sequence arrays as lists."""
    forward = hidden_and_logits(spec)
    w_lm_VxD = lm_head_matrix(params, spec)

    @jax.jit
    def stats(hidden_params, tokens_BxL, targets_BxL):
        hidden_BxLxD, logits_BxLxV = forward(hidden_params, tokens_BxL)
        probs_sum_V = jax.nn.softmax(logits_BxLxV, axis=-1).sum((0, 1))
        return hidden_BxLxD, _token_cross_entropy(logits_BxLxV, targets_BxL), probs_sum_V

    per_batch, q_sum_V, eval_counts_V = [], 0.0, np.zeros(spec.vocab_size)
    for batch in batches:
        hidden, token_loss, probs_sum = jax.device_get(
            stats(params, batch["inputs"], batch["targets"]))
        per_batch.append(sequence_bounds(hidden, token_loss, batch["targets"], w_lm_VxD))
        q_sum_V = q_sum_V + np.asarray(probs_sum, np.float64)
        eval_counts_V += np.bincount(batch["targets"].ravel(), minlength=spec.vocab_size)
    seq = {k: np.concatenate([b[k] for b in per_batch]) for k in per_batch[0]}
    q_bar_V = q_sum_V / q_sum_V.sum()
    p_freq_V = corpus_counts_V / corpus_counts_V.sum()
    slack = seq["loss"] - seq["bound"]
    return {
        "n": int(batches[0]["targets"].shape[1]), "sequences": int(len(slack)),
        "w_lm_spectral_norm": float(np.linalg.norm(w_lm_VxD, 2)),
        "mean": {k: float(v.mean()) for k, v in seq.items()},
        "bound_holds_fraction": float(np.mean(slack >= 0)), "min_slack": float(slack.min()),
        "kl_pfreq_qbar": kl_divergence(p_freq_V, q_bar_V),
        "kl_eval_targets_qbar": kl_divergence(eval_counts_V / eval_counts_V.sum(), q_bar_V),
        "entropy_qbar": float(-np.sum(q_bar_V * np.log(q_bar_V))),
        "lfreq_corpus": unigram_entropy(corpus_counts_V),
        "per_sequence": {k: v.tolist() for k, v in seq.items()},
    }


def point_unavailable(spec: ModelSpec) -> str | None:
    """Why the constructed p_freq point cannot be built for ``spec``; None when it can."""
    if spec.positions == "learned":
        return ("learned position embeddings make identical input tokens distinct, so no input "
                "is collapsed")
    return None


def stationary_point(spec: ModelSpec, params: dict, inputs_BxL: np.ndarray,
                     targets_BxL: np.ndarray, token_id: int) -> dict:
    """Thm 3.8(ii) at the constructed p_freq point (module docstring), and the same W_lm on the
    real ``inputs_BxL`` as the control."""
    reason = point_unavailable(spec)
    if reason is not None:
        raise ValueError(f"no constructed p_freq point: {reason}")
    untied = spec.tie_embeddings
    forward, model = hidden_and_logits(spec), Decoder(dataclasses.replace(spec,
                                                                         tie_embeddings=False))
    tokens_BxL = np.full_like(inputs_BxL, token_id)
    hidden = np.asarray(forward(params, tokens_BxL)[0], np.float64)
    x_bar_D = hidden.reshape(-1, spec.d_model).mean(0)
    counts_V = np.bincount(targets_BxL.ravel(), minlength=spec.vocab_size)
    log_p_V = np.log(np.maximum(counts_V / counts_V.sum(), ABSENT_PROB))
    point = {**params, "lm_head": jnp.asarray(np.outer(x_bar_D, log_p_V) / (x_bar_D @ x_bar_D),
                                              jnp.float32)}

    @jax.jit
    def loss_and_grads(p, tokens):
        def loss(q):
            logits = model.apply({"params": q}, tokens)
            return _token_cross_entropy(logits, targets_BxL).mean()
        return jax.value_and_grad(loss)(p)

    def grad_summary(grads: dict) -> dict:
        per_layer = {f"grad_norm_{group}": np.asarray(v).tolist()
                     for group, v in layer_norms(grads["layers"]).items()}
        return {**per_layer,
                "grad_norm_lm_head": float(optax.tree.norm(grads["lm_head"])),
                "grad_norm_embedding": float(optax.tree.norm(grads["embedding"])),
                "max_abs_grad": max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(grads))}

    loss, grads = loss_and_grads(point, tokens_BxL)
    control_loss, control_grads = loss_and_grads(point, inputs_BxL)
    return {
        "token_id": int(token_id), "untied_head": untied, "loss": float(loss),
        "lfreq_batch": unigram_entropy(counts_V),
        "hidden_tsim_min": float(np.min(theory.tsim(hidden))),
        "hidden_eps_max": float(max(theory.collapse_distance(h) for h in hidden)),
        "at_point": grad_summary(grads),
        "control_loss": float(control_loss), "control": grad_summary(control_grads),
    }


def next_batches_loss(exp: Experiment, state, batches, num_batches: int) -> dict:
    """Mean loss of ``state`` on the next ``num_batches`` of the iterator ``batches``, against
    L_freq and the same batches' mean frequency floor."""
    local_batches = [next(batches) for _ in range(num_batches)]
    losses = [float(x) for x in batch_losses(exp, state, local_batches)]
    floors = [global_frequency_floor(b["targets"], exp.data.unigram_counts)
              for b in local_batches]
    loss, floor = float(np.mean(losses)), float(np.mean(floors))
    return {"batches": num_batches, "loss": loss, "floor": floor, "lfreq": exp.data.lfreq,
            "loss_over_lfreq": loss / exp.data.lfreq, "loss_over_floor": loss / floor,
            "losses": losses, "floors": floors}


def measure_run(config: ml_collections.ConfigDict, workdir: str, train_batches: int = 0) -> dict:
    """Thm 3.8 (i), the KL and (ii) on the latest checkpoint of ``workdir`` and the config's
    validation batches; (ii) uses the first batch and its first input token. p_freq comes from
    the training-target counts that L_freq is computed from. With ``train_batches`` > 0, also
    the loss on the next ``train_batches`` training batches (``next_batches_loss``)."""
    exp, state, step, batches = restore_run(config, workdir, "measure", data_position=True)
    params = jax.device_get(state.params)
    first = exp.eval_batches[0]
    record = {
        "checkpoint_step": int(step), "lfreq_logged": exp.data.lfreq,
        "bound": measure_bound(exp.spec, params, exp.eval_batches, exp.data.unigram_counts),
    }
    reason = point_unavailable(exp.spec)
    record["stationary_point"] = (
        {"skipped": reason} if reason is not None else
        stationary_point(exp.spec, params, first["inputs"], first["targets"],
                         int(first["inputs"][0, 0])))
    if train_batches > 0:
        record["next_train_batches"] = next_batches_loss(exp, state, batches, train_batches)
    return record
