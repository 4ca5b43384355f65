"""The DSV predictor: per block, per head low-rank projections whose logits q_lr k_lr^T approximate q k^T.

    q_lr = RoPE(x W_Q^lr),  k_lr = RoPE(x W_K^lr)     x: the block's normalised input (what QKV sees), detached
    loss = 0.9 * mean_rows(1 - cos(z_hat, z)) + 0.1 * mean_rows(MSE(z_hat / |z_hat|, z / |z|))
           (with dsv.center_logits, our addition, on rows minus their mean: see `predictor_loss`)

z are the true scaled logits q k^T * D**-0.5 of sampled queries (every `query_stride`-th) against all
valid keys, detached; z_hat the predicted ones. The predictor's inputs and targets are stop-gradient,
so its loss never reaches the model, and the model's loss never reaches it (it only feeds the integer
top-k selection). It trains with its own optimizer (see `dsv_jax.train.optimizer`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv_jax.attention.rope import apply_rope
from dsv_jax.config import ModelConfig


class LowRankPredictor(nnx.Module):
    def __init__(self, cfg: ModelConfig, rank: int, rngs: nnx.Rngs, *, rope: bool = True):
        self.heads, self.rank, self.rope, self.rope_theta = cfg.heads, rank, rope, cfg.rope_theta
        init = nnx.initializers.lecun_normal()
        self.wq = nnx.Linear(
            cfg.hidden,
            cfg.heads * rank,
            use_bias=False,
            kernel_init=init,
            param_dtype=jnp.float32,
            dtype=jnp.float32,
            rngs=rngs,
        )
        self.wk = nnx.Linear(
            cfg.hidden,
            cfg.heads * rank,
            use_bias=False,
            kernel_init=init,
            param_dtype=jnp.float32,
            dtype=jnp.float32,
            rngs=rngs,
        )

    def __call__(self, x, rope=None):
        """x [B, S, hidden] (already detached by the caller) -> q_lr, k_lr [B, S, H, rank] in fp32.

        rope: (cos, sin) [S, rank / 2] of the tokens' 3D rotary angles (`attention.rope.rotary`; the model
        computes them, as for q and k), applied when the predictor was built with rope=True."""
        b, s, _ = x.shape
        x = x.astype(jnp.float32)
        q = self.wq(x).reshape(b, s, self.heads, self.rank)
        k = self.wk(x).reshape(b, s, self.heads, self.rank)
        if self.rope:
            if rope is None:
                raise ValueError("this predictor applies 3D RoPE: pass the tokens' rotary tables (rope.rotary)")
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        return q, k


@functools.lru_cache(maxsize=256)
def sample_positions(n_real: int, stride: int, max_queries: int) -> np.ndarray:
    """Static query samples: one per `stride` tokens (more stride when that exceeds `max_queries`), as
    indices 0..n_real-1 into the real tokens (a padded layout maps them through its valid positions).

    The offset inside each stride cycles (i * 37 mod stride) so the samples do not all sit at the same
    corner of a 3D tile, which a plain every-Nth sample of tile-major tokens would do."""
    stride = max(stride, -(-n_real // max_queries))
    starts = np.arange(0, n_real, stride)
    pos = starts + (np.arange(len(starts)) * 37) % stride
    return np.minimum(pos, n_real - 1).astype(np.int32)


def true_logits(q, k, positions, key_valid, sm_scale):
    """Scaled logits [B, H, Q, S] of the sampled queries (fp32, detached); keys where key_valid [S]
    (bool) is False are -inf."""
    qs = jax.lax.stop_gradient(q[:, positions]).astype(jnp.float32)
    z = jnp.einsum("bqhd,bkhd->bhqk", qs, jax.lax.stop_gradient(k).astype(jnp.float32)) * sm_scale
    return jnp.where(jnp.asarray(key_valid), z, -jnp.inf)


def predictor_loss(q_lr, k_lr, z, positions, key_valid, *, center: bool = True):
    """The paper's loss between predicted and true logit rows over the valid keys (key_valid [S],
    bool); z from `true_logits`. -> scalar.

    center (our default; False = the paper's form): compare the rows after subtracting each row's mean
    over the valid keys. Softmax ignores a row's offset (q . mean key), which can dominate the cosine of
    raw rows while saying nothing about which keys win; centred rows train the predictor on the ranking
    that the selection uses."""
    valid = jnp.asarray(key_valid)
    n_valid = int(np.sum(key_valid))
    zh = jnp.einsum("bqhr,bkhr->bhqk", q_lr[:, positions], k_lr) * (q_lr.shape[-1] ** -0.5)
    zh = jnp.where(valid, zh, 0.0)
    zt = jnp.where(valid, z, 0.0)
    if center:
        zh = jnp.where(valid, zh - jnp.sum(zh, -1, keepdims=True) / n_valid, 0.0)
        zt = jnp.where(valid, zt - jnp.sum(zt, -1, keepdims=True) / n_valid, 0.0)
    eps = 1e-6
    nh = jnp.sqrt(jnp.sum(zh * zh, -1, keepdims=True) + eps)
    nt = jnp.sqrt(jnp.sum(zt * zt, -1, keepdims=True) + eps)
    cosine = jnp.sum(zh * zt, -1) / (nh[..., 0] * nt[..., 0])
    mse = jnp.sum(jnp.square(zh / nh - zt / nt), -1) / n_valid
    return 0.9 * jnp.mean(1.0 - cosine) + 0.1 * jnp.mean(mse)
