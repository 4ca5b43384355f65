"""The train state and the jitted train step (one compiled program per bucket shape)."""

from __future__ import annotations

from typing import Any

import flax
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from dsv_jax.config import Config
from dsv_jax.model.t2v import TextToVideo
from dsv_jax.train.loss import flow_matching_loss, fixed_t_loss
from dsv_jax.train.optimizer import make_optimizer


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 []
    params: Any  # nnx.State of TextToVideo's parameters (fp32 master weights)
    opt_state: Any
    rng: jax.Array  # uint32 key data; step keys are fold_in(rng, step), so resuming replays them
    skipped: jax.Array  # int32 []: updates skipped for a non-finite loss or gradient


def abstract_model(cfg: Config):
    """(graphdef, abstract params) without allocating anything."""
    model = nnx.eval_shape(lambda: TextToVideo(cfg, rngs=nnx.Rngs(0)))
    return nnx.split(model, nnx.Param)


def init_state(cfg: Config) -> TrainState:
    model = TextToVideo(cfg, rngs=nnx.Rngs(cfg.train.seed))
    _, params = nnx.split(model, nnx.Param)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                      opt_state=make_optimizer(cfg.train).init(params),
                      rng=jax.random.key_data(jax.random.key(cfg.train.seed + 1)),
                      skipped=jnp.zeros((), jnp.int32))


def make_train_step(cfg: Config, graphdef, attention="auto"):
    """(state, batch, lr) -> (state, metrics). A step whose loss or gradient is not finite leaves the
    parameters and optimizer state untouched and counts itself in `skipped`."""
    tx = make_optimizer(cfg.train)

    def train_step(state: TrainState, batch, lr):
        key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)

        def loss_fn(params):
            return flow_matching_loss(nnx.merge(graphdef, params), batch, key, cfg.train, attention)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        grad_norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, jax.tree.map(lambda u: -lr * u, updates))
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
        new_state = state.replace(step=state.step + 1, params=keep(params, state.params),
                                  opt_state=keep(opt_state, state.opt_state),
                                  skipped=state.skipped + (~finite).astype(jnp.int32))
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": lr, "finite": finite}
        return new_state, metrics

    return train_step


EVAL_T = (0.1, 0.3, 0.5, 0.7, 0.9)


def make_eval_step(cfg: Config, graphdef, attention="auto"):
    """(params, batch, key) -> loss at each of EVAL_T, with noise fixed by `key`."""

    def eval_step(params, batch, key):
        return fixed_t_loss(nnx.merge(graphdef, params), batch, key, EVAL_T, attention)

    return eval_step
