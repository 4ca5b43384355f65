"""AdamW with linear warmup, cosine decay and global-norm clipping; decay only on weight matrices.

The learning rate is an input of the compiled step (computed on the host by `lr_at`), not a constant
baked into it: changing train.steps or train.lr on resume, or sharing programs between runs through
the persistent compilation cache, then needs no recompilation.
"""

from __future__ import annotations

import math

import jax
import optax

from dsv_jax.config import TrainConfig


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warmup to cfg.lr, then cosine decay to cfg.lr * min_lr_ratio at cfg.steps."""
    warmup = min(cfg.warmup_steps, max(cfg.steps - 1, 0))
    if step < warmup:
        return cfg.lr * step / warmup
    progress = min(1.0, (step - warmup) / max(cfg.steps - warmup, 1))
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _decay_mask(params):
    def is_matrix(path, _):
        name = str(getattr(path[-1], "key", getattr(path[-1], "name", path[-1])))
        return name in ("kernel", "embedding")

    return jax.tree_util.tree_map_with_path(is_matrix, params)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """AdamW without its learning-rate scaling: the step multiplies the update by -lr."""
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip),
        optax.scale_by_adam(b1=cfg.b1, b2=cfg.b2),
        optax.add_decayed_weights(cfg.weight_decay, mask=_decay_mask),
    )


# -- DSV: the predictor trains in the same step with its own optimizer ------------------------------
# Parameters under a `predictor` module (the blocks' low-rank DSV predictors) get their own AdamW;
# optax.multi_transform masks each group out of the other's transform, so gradient clipping, moments
# and weight decay of the model never see predictor parameters, and vice versa.


def param_labels(params):
    """ "predictor" for the DSV predictor's parameters, "main" for everything else."""

    def label(path, _):
        return "predictor" if any(getattr(p, "key", getattr(p, "name", None)) == "predictor" for p in path) else "main"

    return jax.tree_util.tree_map_with_path(label, params)


def make_predictor_optimizer(cfg) -> optax.GradientTransformation:
    """The predictor's AdamW (DSV: lr 1e-4), without lr scaling like `make_optimizer`. cfg: Config."""
    return optax.chain(
        optax.clip_by_global_norm(cfg.train.grad_clip),
        optax.scale_by_adam(b1=cfg.train.b1, b2=cfg.train.b2),
        optax.add_decayed_weights(cfg.dsv.predictor_weight_decay),
    )


def make_train_optimizer(cfg) -> optax.GradientTransformation:
    """The optimizer of a run (cfg: Config): `make_optimizer`, split with the predictor's under DSV."""
    if not cfg.predictor_rank:
        return make_optimizer(cfg.train)
    return optax.multi_transform(
        {"main": make_optimizer(cfg.train), "predictor": make_predictor_optimizer(cfg)}, param_labels
    )


def scale_updates(updates, lr, predictor_lr=None):
    """-lr * update for model parameters, -predictor_lr * update for predictor parameters."""
    if predictor_lr is None:
        return jax.tree.map(lambda u: -lr * u, updates)
    return jax.tree.map(
        lambda u, lab: -(predictor_lr if lab == "predictor" else lr) * u, updates, param_labels(updates)
    )


def keep_predictor(params, opt_state, old_params, old_opt_state):
    """(params, opt_state) with the DSV predictor's parameters and AdamW state taken from the old ones: a step
    without the predictor loss leaves the predictor untouched (a zero-gradient AdamW step would still
    move it by its momentum and decay its moments). The state is `make_train_optimizer`'s multi_transform."""
    params = jax.tree.map(
        lambda new, old, lab: old if lab == "predictor" else new, params, old_params, param_labels(params)
    )
    inner = dict(opt_state.inner_states, predictor=old_opt_state.inner_states["predictor"])
    return params, opt_state._replace(inner_states=inner)


def keep_model(params, opt_state, old_params, old_opt_state):
    """`keep_predictor`'s mirror for dsv.freeze_model_stage1: everything but the predictor, and the model's
    AdamW state, taken from the old ones (a zero-gradient step would still move the model by weight decay)."""
    params = jax.tree.map(
        lambda new, old, lab: new if lab == "predictor" else old, params, old_params, param_labels(params)
    )
    inner = dict(opt_state.inner_states, main=old_opt_state.inner_states["main"])
    return params, opt_state._replace(inner_states=inner)
