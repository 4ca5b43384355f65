"""Selection of each query tile's KV blocks from low-rank projections, the definition: input checks, the
plain-JAX reference and the helpers that its Pallas implementation and dsv_jax share.

A query tile's proxy is the mean of its q_lr rows. A KV block's score is the proxy's dot product with
each k_lr row of the block, reduced over the block by `block_reduce` ("mean" or "max"). The result
holds, per (batch, head, query tile), the ids of the top_k highest-scoring blocks, ascending.

Padded layouts (kv_valid, int32 [B, S // kv_block], as in `sparse_attention`): a block's score reduces
over its valid keys only (the first kv_valid rows), and a block without a valid key scores -inf, so it
is picked only when fewer than top_k blocks are valid (callers count those out: `dsv_jax.dsv.select_kv`).
Queries and keys are the same tokens, so kv_valid also marks the padded query rows: a tile's proxy is
the mean of its valid rows (row r is valid iff r % kv_block < kv_valid[r // kv_block], whatever q_tile
is), and the zero vector for a tile without valid rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.defaults import KV_BLOCK, Q_TILE


def check_topk_inputs(q_lr, k_lr, top_k, q_tile, kv_block, block_reduce, kv_valid=None):
    if q_lr.ndim != 4 or k_lr.shape != q_lr.shape:
        raise ValueError(f"q_lr and k_lr must share one shape [B, S, H, r]; got {q_lr.shape}, {k_lr.shape}")
    b, s = q_lr.shape[:2]
    if s % q_tile or s % kv_block:
        raise ValueError(f"sequence length {s} must be divisible by q_tile={q_tile} and kv_block={kv_block}")
    if not 1 <= top_k <= s // kv_block:
        raise ValueError(f"top_k={top_k} must be in 1..{s // kv_block} (the number of KV blocks)")
    if block_reduce not in ("mean", "max"):
        raise ValueError(f"block_reduce={block_reduce!r} is not 'mean' or 'max'")
    if kv_valid is not None and (
        kv_valid.shape != (b, s // kv_block) or not jnp.issubdtype(kv_valid.dtype, jnp.integer)
    ):
        raise ValueError(
            f"kv_valid must be integers [B, S // kv_block] = [{b}, {s // kv_block}]; "
            f"got {kv_valid.dtype} {kv_valid.shape}"
        )


def row_flags(kv_valid, kv_block: int):
    """bool [B, S]: whether each token is valid (its offset in its KV block < the block's kv_valid)."""
    b, nb = kv_valid.shape
    return (jnp.arange(kv_block) < kv_valid[..., None]).reshape(b, nb * kv_block)


def tile_proxies(q_lr, q_tile: int, valid_rows=None):
    """fp32 [B, T, H, r]: the mean q_lr row of each query tile; with valid_rows (bool [B, S]) the mean of its
    valid rows only (zero for a tile without one)."""
    b, s, h, r = q_lr.shape
    q = q_lr.astype(jnp.float32).reshape(b, s // q_tile, q_tile, h, r)
    if valid_rows is None:
        return jnp.mean(q, axis=2)
    w = valid_rows.reshape(b, s // q_tile, q_tile, 1, 1).astype(jnp.float32)
    return jnp.sum(q * w, axis=2) / jnp.maximum(jnp.sum(w, axis=2), 1.0)


def block_mean_keys(k_lr, kv_block: int, kv_valid=None):
    """fp32 [B, nb, H, r]: the mean k_lr row of each KV block (of its valid rows; zero for an empty block).
    A block's "mean" score is the proxy's dot product with it."""
    b, s, h, r = k_lr.shape
    k = k_lr.astype(jnp.float32).reshape(b, s // kv_block, kv_block, h, r)
    if kv_valid is None:
        return jnp.mean(k, axis=2)
    w = row_flags(kv_valid, kv_block).reshape(b, s // kv_block, kv_block, 1, 1).astype(jnp.float32)
    return jnp.sum(k * w, axis=2) / jnp.maximum(jnp.sum(w, axis=2), 1.0)


def reduce_block(scores, block_reduce: str, n_valid=None):
    """Reduce per-row scores [..., nb, kv_block] over each block; with n_valid (broadcastable to [..., nb])
    over the first n_valid rows only, -inf for a block with none."""
    if n_valid is None:
        return jnp.mean(scores, -1) if block_reduce == "mean" else jnp.max(scores, -1)
    valid = jnp.arange(scores.shape[-1]) < n_valid[..., None]
    if block_reduce == "mean":
        red = jnp.sum(jnp.where(valid, scores, 0.0), -1) / jnp.maximum(n_valid, 1).astype(scores.dtype)
    else:
        red = jnp.max(jnp.where(valid, scores, -jnp.inf), -1)
    return jnp.where(n_valid > 0, red, -jnp.inf)


def block_scores(q_lr, k_lr, *, q_tile=Q_TILE, kv_block=KV_BLOCK, block_reduce="mean", tiles=None, kv_valid=None):
    """Scores [B, H, T, S // kv_block] in fp32 (materialised: the reference's way) of every query tile
    (T = S // q_tile), or of the query tiles `tiles` (int array [T]) only."""
    b, s, h, r = q_lr.shape
    valid_rows = None if kv_valid is None else row_flags(kv_valid, kv_block)
    proxy = tile_proxies(q_lr, q_tile, valid_rows)  # [B, T, H, r]
    if tiles is not None:
        proxy = proxy[:, tiles]
    scores = jnp.einsum("bthr,bshr->bhts", proxy, k_lr.astype(jnp.float32))
    scores = scores.reshape(b, h, proxy.shape[1], s // kv_block, kv_block)
    n_valid = None if kv_valid is None else kv_valid.astype(jnp.int32)[:, None, None, :]
    return reduce_block(scores, block_reduce, n_valid)


def lowrank_topk_reference(
    q_lr, k_lr, top_k, *, q_tile=Q_TILE, kv_block=KV_BLOCK, block_reduce="mean", kv_valid=None, impl="auto"
):
    del impl
    check_topk_inputs(q_lr, k_lr, top_k, q_tile, kv_block, block_reduce, kv_valid)
    scores = block_scores(q_lr, k_lr, q_tile=q_tile, kv_block=kv_block, block_reduce=block_reduce, kv_valid=kv_valid)
    _, idx = jax.lax.top_k(scores, top_k)
    return jnp.sort(idx, axis=-1).astype(jnp.int32)
