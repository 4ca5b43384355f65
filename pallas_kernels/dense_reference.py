"""A dense reference of block-sparse attention: one masked softmax over all keys in float32.

Small shapes only ([B, H, S, S] logits): the independent check of the sparse kernels and their
per-tile reference (`pallas_kernels.sparse_attention.sparse_attention_reference`), which walks the
selection itself and so shares its reading of kv_index / kv_count / kv_valid with the kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def dense_masked_reference(q, k, v, index, count, kv_valid, *, q_tile, kv_block, sm_scale):
    """(o, lse) of block-sparse attention with per-block valid keys, as one dense masked softmax in
    float32 (small shapes only: [B, H, S, S]). Rows with no valid key: o = 0, lse = -inf."""
    b, s, h, d = q.shape
    blocks = s // kv_block
    live = jnp.arange(index.shape[-1]) < count[..., None]
    picked = jax.nn.one_hot(jnp.where(live, index, blocks), blocks + 1, dtype=jnp.bool_)[..., :blocks]
    mask = jnp.repeat(jnp.repeat(jnp.any(picked, axis=-2), q_tile, axis=2), kv_block, axis=3)  # [B, H, S, S]
    if kv_valid is not None:
        key_ok = (jnp.arange(s) % kv_block)[None] < jnp.repeat(kv_valid, kv_block, axis=1)  # [B, S]
        mask = mask & key_ok[:, None, None, :]
    f32 = lambda x: x.astype(jnp.float32)
    logits = jnp.where(mask, jnp.einsum("bqhd,bkhd->bhqk", f32(q), f32(k)) * sm_scale, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.exp(logits - m)
    l = jnp.sum(e, axis=-1, keepdims=True)
    empty = l == 0.0
    o = jnp.einsum("bhqk,bkhd->bqhd", e / jnp.where(empty, 1.0, l), f32(v))
    lse = jnp.where(empty, -jnp.inf, m + jnp.log(jnp.where(empty, 1.0, l)))[..., 0]
    return o, lse
