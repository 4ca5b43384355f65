"""Per-device attention pieces that the context-parallel strategies call inside shard_map.

- `dense_local`: the attention entry point (cuDNN on a GPU, XLA elsewhere) on whatever this device holds.
- `sparse_local`: the project's block-sparse kernel (`pallas_kernels.sparse_attention`) where the
  queries are a slice of a longer key buffer: the kernel takes q and k of one length, so the query
  side is padded with dummy tiles that attend one block each (spread over distinct blocks so that no
  KV block collects them all in the kernel's dK/dV pass) and whose rows are dropped.
- `block_lse` / `block_grads`: one (query chunk x key chunk) block in plain JAX returning the
  log-sum-exp, and its backward given the global log-sum-exp: what the dense ring merges with
  `dsv_jax.attention.merge_attention` (the sparse ring runs the kernel on each chunk instead).
  Queries are processed `q_chunk` rows at a time, so memory is O(q_chunk x Sk), never [Sq, Sk].

Layout: q, k, v [B, S, H, D]; lse [B, H, S] in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv_jax.attention import attention
from pallas_kernels.sparse_attention import sparse_attention

NEG = -1e30  # log-sum-exp of a row with no visible key: finite, so merges never form inf - inf


def dense_local(q, k, v, *, kv_lens, sm_scale, backend="auto", kv_mask=None, return_lse=False):
    masks = {} if kv_mask is None else {"kv_mask": kv_mask}
    return attention(q, k, v, backend=backend, kv_lens=kv_lens, sm_scale=sm_scale, return_lse=return_lse, **masks)


def sparse_local(
    q, k, v, kv_index, kv_count, *, q_tile, kv_block, sm_scale, impl="auto", kv_valid=None, return_lse=False
):
    """Block-sparse attention of q (the first q.shape[1] rows) against a key buffer k, v that may be longer.

    kv_index [B, H, Sq // q_tile, K] holds block ids of the buffer; kv_valid [B, Skv // kv_block] the
    valid keys of each buffer block (padded layouts). Returns o (and lse [B, H, Sq] with return_lse)."""
    sq, sk = q.shape[1], k.shape[1]
    if sk % q_tile:
        raise ValueError(f"key buffer length {sk} must be a multiple of q_tile={q_tile}")
    if sq < sk:
        b, _, h, d = q.shape
        n_dummy = (sk - sq) // q_tile
        q = jnp.concatenate([q, jnp.zeros((b, sk - sq, h, d), q.dtype)], axis=1)
        spread = (jnp.arange(n_dummy, dtype=kv_index.dtype) % (sk // kv_block))[:, None]
        dummy_idx = jnp.broadcast_to(spread, (b, h, n_dummy, kv_index.shape[-1]))
        kv_index = jnp.concatenate([kv_index, dummy_idx], axis=2)
        kv_count = jnp.concatenate([kv_count, jnp.ones((b, h, n_dummy), kv_count.dtype)], axis=2)
    out = sparse_attention(
        q,
        k,
        v,
        kv_index,
        kv_count,
        q_tile=q_tile,
        kv_block=kv_block,
        sm_scale=sm_scale,
        impl=impl,
        kv_valid=kv_valid,
        return_lse=return_lse,
    )
    if return_lse:
        return out[0][:, :sq], out[1][:, :, :sq]
    return out[:, :sq]


def _chunks(sq: int, q_chunk: int | None) -> int:
    if q_chunk is None or q_chunk >= sq:
        return sq
    c = q_chunk
    while sq % c:  # largest divisor of sq not above q_chunk
        c -= 1
    return c


def _logits(q, k, mask, sm_scale):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * sm_scale
    return jnp.where(mask, s, NEG) if mask is not None else s


def _split_q(x, c):  # [B, Sq, ...] -> [Sq // c, B, c, ...]
    return jnp.moveaxis(x.reshape(x.shape[0], x.shape[1] // c, c, *x.shape[2:]), 1, 0)


def _merge_q(x):  # inverse of _split_q
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])


def block_lse(q, k, v, mask_fn, *, sm_scale, q_chunk=None):
    """(o [B, Sq, H, D] float32, lse [B, H, Sq] float32) of q against this key chunk.

    mask_fn(row0, rows) -> bool mask broadcastable to [B, H, rows, Sk] (True = visible), or None."""
    c = _chunks(q.shape[1], q_chunk)

    def one(args):
        i, qc = args
        mask = mask_fn(i * c, c)
        s = _logits(qc, k, mask, sm_scale)
        m = jnp.max(s, axis=-1, keepdims=True)
        p = jnp.exp(s - m)
        if mask is not None:
            p = jnp.where(mask, p, 0.0)
        l = jnp.sum(p, axis=-1)
        lse = jnp.where(l > 0, m[..., 0] + jnp.log(jnp.maximum(l, 1e-37)), NEG)
        # probabilities in the input dtype for the matmul (bf16 tensor cores), accumulated in float32
        o = jnp.einsum(
            "bhqk,bkhd->bqhd",
            (p / jnp.maximum(l, 1e-37)[..., None]).astype(v.dtype),
            v,
            preferred_element_type=jnp.float32,
        )
        return o, lse

    o, lse = jax.lax.map(one, (jnp.arange(q.shape[1] // c), _split_q(q, c)))
    return _merge_q(o), jnp.moveaxis(lse, 0, 2).reshape(lse.shape[1], lse.shape[2], -1)


def block_grads(q, k, v, do, lse, delta, mask_fn, *, sm_scale, q_chunk=None):
    """Gradients (dq, dk, dv) in float32 of this block's share of attention, given the global
    lse [B, H, Sq] and delta = sum(do * o, -1) [B, H, Sq] of the merged output."""
    c = _chunks(q.shape[1], q_chunk)
    dt = q.dtype  # matmul inputs in the input dtype, accumulation in float32
    f32 = jnp.float32
    lse_c = jnp.moveaxis(lse.reshape(lse.shape[0], lse.shape[1], -1, c), 2, 0)  # [n, B, H, c]
    delta_c = jnp.moveaxis(delta.reshape(delta.shape[0], delta.shape[1], -1, c), 2, 0)

    def one(carry, args):
        dk, dv = carry
        i, qc, doc, lc, dc = args
        mask = mask_fn(i * c, c)
        p = jnp.exp(_logits(qc, k, mask, sm_scale) - lc[..., None])
        if mask is not None:
            p = jnp.where(mask, p, 0.0)
        doc = doc.astype(dt)
        dv = dv + jnp.einsum("bhqk,bqhd->bkhd", p.astype(dt), doc, preferred_element_type=f32)
        ds = p * (jnp.einsum("bqhd,bkhd->bhqk", doc, v, preferred_element_type=f32) - dc[..., None]) * sm_scale
        dk = dk + jnp.einsum("bhqk,bqhd->bkhd", ds.astype(dt), qc, preferred_element_type=f32)
        dq = jnp.einsum("bhqk,bkhd->bqhd", ds.astype(dt), k, preferred_element_type=f32)
        return (dk, dv), dq

    zeros = jnp.zeros(k.shape, jnp.float32)
    (dk, dv), dq = jax.lax.scan(
        one, (zeros, zeros), (jnp.arange(q.shape[1] // c), _split_q(q, c), _split_q(do, c), lse_c, delta_c)
    )
    return _merge_q(dq), dk, dv
