"""Held-out loss: the flow-matching loss at fixed timesteps (EVAL_T) with fixed noise, per bucket and
overall. The one implementation behind the trainer's periodic evaluation and `dsv-jax eval`."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from dsv_jax.config import Config
from dsv_jax.train.step import EVAL_T, make_eval_step


def to_device(batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    return {k: jnp.asarray(v) for k, v in batch.items()}


def held_out_loss(
    cfg: Config,
    graphdef,
    params,
    attention_for: Callable,
    feed,
    batches: int,
    *,
    put: Callable = to_device,
    cache: dict | None = None,
    name: str = "eval_loss",
) -> dict[str, float]:
    """{name: mean over buckets and EVAL_T, name/TxHxW: per bucket, name/t_T: per timestep}.

    feed: anything with `.shapes` and `.batch_at(i, shape)` (the eval split of a data feed, or
    `data.real_clips.RealClips`); batch i of every bucket uses noise key i. attention_for(shape) ->
    (plans, runtime inputs or None) of inference; put moves a host batch to the devices; cache keeps
    the compiled steps (by plans) across calls."""
    cache = {} if cache is None else cache
    out: dict[str, Any] = {}
    if batches <= 0:  # train.eval_batches=0: no held-out loss
        return out
    all_losses = []
    for shape in feed.shapes:
        plans, inputs = attention_for(shape)
        if plans not in cache:
            cache[plans] = jax.jit(make_eval_step(cfg, graphdef, plans))
        losses = [
            np.asarray(cache[plans](params, put(feed.batch_at(i, shape)), jax.random.key(i), inputs))
            for i in range(batches)
        ]
        mean = np.mean(losses, axis=0)
        out[f"{name}/{'x'.join(map(str, shape))}"] = float(mean.mean())
        all_losses.append(mean)
    if not all_losses:  # a held-out split whose samples fall only in buckets not trained on
        return out
    per_t = np.mean(all_losses, axis=0)
    out.update({f"{name}/t_{t}": float(v) for t, v in zip(EVAL_T, per_t)})
    out[name] = float(per_t.mean())
    return out
