"""Rectified flow (as Wan 2.1): x_t = (1 - t) x0 + t eps, the model predicts v = eps - x0."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from dsv_jax.config import TrainConfig


def shift_timesteps(t, shift: float):
    """t -> shift * t / (1 + (shift - 1) * t): keeps 0 and 1 and the order, and with shift > 1 moves the
    path towards noise (t = 1), where a model decides layout and motion (SD3's resolution shift). It adds
    log(shift) to logit(t): on the logit-normal training t it is the same as t_logit_mean += log(shift)."""
    return shift * t / (1.0 + (shift - 1.0) * t)


def resolution_shift(cfg: TrainConfig, positions: int) -> float:
    """The factor by which a clip of `positions` latent positions (T x H x W) shifts towards noise relative
    to train.resolution_shift_ref: sqrt(positions / ref), 1 when the option is off (0)."""
    if not cfg.resolution_shift_ref:
        return 1.0
    return math.sqrt(positions / cfg.resolution_shift_ref)


def sample_timesteps(key, batch: int, cfg: TrainConfig, positions: int = 0) -> jax.Array:
    """Logit-normal t: sigmoid(N(mean, std)), which favours the middle of the path (a mean > 0 favours
    noise, see `shift_timesteps`). `positions`: latent positions per clip, for train.resolution_shift_ref."""
    if cfg.resolution_shift_ref and not positions:
        raise ValueError("train.resolution_shift_ref is set: sample_timesteps needs the clips' latent positions")
    mean = cfg.t_logit_mean + (math.log(resolution_shift(cfg, positions)) if positions else 0.0)
    return jax.nn.sigmoid(mean + cfg.t_logit_std * jax.random.normal(key, (batch,)))


def noised(x0, eps, t):
    tb = t.reshape(-1, *([1] * (x0.ndim - 1)))
    return (1.0 - tb) * x0 + tb * eps, eps - x0


def flow_matching_loss(
    model, batch, key, cfg: TrainConfig, attention="auto", attention_inputs=None, return_aux: bool = False
):
    """Rectified-flow MSE; with `return_aux`, (loss, the blocks' DSV outputs) (see VideoDiT)."""
    x0 = batch["latents"].astype(jnp.float32)
    b = x0.shape[0]
    k_t, k_eps, k_drop = jax.random.split(key, 3)
    t = sample_timesteps(k_t, b, cfg, positions=math.prod(x0.shape[1:-1]))
    xt, target = noised(x0, jax.random.normal(k_eps, x0.shape), t)
    drop = jax.random.bernoulli(k_drop, cfg.caption_dropout, (b,)) if cfg.caption_dropout > 0 else None
    text, mask = model.encode_text(batch, drop)
    pred, aux = model(xt, t, text, mask, attention=attention, attention_inputs=attention_inputs, return_aux=True)
    loss = jnp.mean(jnp.square(pred.astype(jnp.float32) - target))
    return (loss, aux) if return_aux else loss


def fixed_t_loss(model, batch, key, t_values, attention="auto", attention_inputs=None):
    """Held-out loss at fixed timesteps with fixed noise: a low-variance quality measure. -> [len(t_values)]"""
    x0 = batch["latents"].astype(jnp.float32)
    text, mask = model.encode_text(batch)

    def at(args):
        i, t = args
        tb = jnp.full((x0.shape[0],), t)
        xt, target = noised(x0, jax.random.normal(jax.random.fold_in(key, i), x0.shape), tb)
        pred = model(xt, tb, text, mask, attention=attention, attention_inputs=attention_inputs)
        return jnp.mean(jnp.square(pred.astype(jnp.float32) - target))

    return jax.lax.map(at, (jnp.arange(len(t_values)), jnp.asarray(t_values, jnp.float32)))
