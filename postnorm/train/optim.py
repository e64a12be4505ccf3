"""AdamW (or SGD with momentum, a control for methods that act on gradients) with linear warmup
then cosine or constant learning rate, optional clipping.

Weight decay applies to the weight matrices only; norm gains, token and position embeddings
are excluded unless ``opt.decay_norms_and_embeddings`` is set.
"""

import jax
import ml_collections
import optax

NO_DECAY_NAMES = ("scale", "embedding", "pos_embedding")
OPTIMIZERS = ("adamw", "sgd")


def learning_rate_schedule(opt_cfg: ml_collections.ConfigDict, total_steps: int) -> optax.Schedule:
    """Linear warmup from 0 to ``lr``, then cosine decay to ``lr * min_lr_ratio`` or constant."""
    warmup = optax.linear_schedule(0.0, opt_cfg.lr, max(opt_cfg.warmup_steps, 1))
    if opt_cfg.schedule == "constant":
        after = optax.constant_schedule(opt_cfg.lr)
    else:
        after = optax.cosine_decay_schedule(
            opt_cfg.lr, max(total_steps - opt_cfg.warmup_steps, 1), alpha=opt_cfg.min_lr_ratio)
    return optax.join_schedules([warmup, after], [opt_cfg.warmup_steps])


def weight_decay_mask(params, decay_all: bool):
    """True for leaves that get weight decay."""

    def decays(path, _) -> bool:
        name = getattr(path[-1], "key", str(path[-1]))
        return decay_all or name not in NO_DECAY_NAMES

    return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(opt_cfg: ml_collections.ConfigDict,
                   total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """The optimizer and its schedule (the schedule is also logged as ``train/lr``)."""
    schedule = learning_rate_schedule(opt_cfg, total_steps)

    def mask(params):
        return weight_decay_mask(params, opt_cfg.decay_norms_and_embeddings)

    if opt_cfg.optimizer == "sgd":  # weight decay as PyTorch's SGD: wd * w joins the gradient
        tx = optax.chain(optax.add_decayed_weights(opt_cfg.weight_decay, mask),
                         optax.sgd(schedule, momentum=opt_cfg.momentum))
    else:
        tx = optax.adamw(schedule, b1=opt_cfg.b1, b2=opt_cfg.b2, eps=opt_cfg.eps,
                         weight_decay=opt_cfg.weight_decay, mask=mask)
    if opt_cfg.clip_norm > 0:
        return optax.chain(optax.clip_by_global_norm(opt_cfg.clip_norm), tx), schedule
    return tx, schedule
