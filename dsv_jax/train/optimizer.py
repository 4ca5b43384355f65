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
