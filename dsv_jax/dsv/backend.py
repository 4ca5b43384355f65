"""Sparse attention backends ("dsv", "window"), registered on import of this module.

Registered backends (`dsv_jax.attention.attention(q, k, v, backend=...)`):

    backend="dsv"     options: either kv_index / kv_count (a selection), or q_lr, k_lr, top_k and
                      optionally keep (per-head ratios [H]); q_tile, kv_block, block_reduce
    backend="window"  options: grid (token grid t, h, w), tile (3D tile), fraction (WA-M 1/3, WA-L 2/3)

Both run `pallas_kernels.sparse_attention.sparse_attention` (impl="auto") and take `kv_valid` (int32
[B, S // kv_block], the valid keys of each block, first in the block: a padded token layout) and
`return_lse`. With `kv_lens` (valid keys a prefix) they run the dense backend instead.

The block glue that runs a plan inside a transformer block lives with the model
(`dsv_jax.model.attention`).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from dsv_jax.attention.registry import attention, register_backend
from dsv_jax.dsv.selection import select_kv, window_selection
from pallas_kernels.defaults import KV_BLOCK, Q_TILE
from pallas_kernels.sparse_attention import sparse_attention

# -- registered backends ----------------------------------------------------------------------------


@register_backend("dsv")
def dsv_attention(
    q,
    k,
    v,
    *,
    kv_lens,
    sm_scale,
    kv_index=None,
    kv_count=None,
    q_lr=None,
    k_lr=None,
    top_k=None,
    keep=None,
    q_tile=Q_TILE,
    kv_block=KV_BLOCK,
    block_reduce="mean",
    kv_valid=None,
    dense_backend="auto",
    return_lse=False,
):
    if kv_lens is not None:
        return attention(q, k, v, backend=dense_backend, kv_lens=kv_lens, sm_scale=sm_scale, return_lse=return_lse)
    if kv_index is None:
        if q_lr is None or k_lr is None or top_k is None:
            raise TypeError("backend 'dsv' needs kv_index and kv_count, or q_lr, k_lr and top_k")
        kv_index, kv_count = select_kv(
            q_lr, k_lr, top_k, keep, q_tile=q_tile, kv_block=kv_block, block_reduce=block_reduce, kv_valid=kv_valid
        )
    elif kv_count is None:
        kv_count = jnp.full(kv_index.shape[:3], kv_index.shape[-1], jnp.int32)
    return sparse_attention(
        q,
        k,
        v,
        kv_index,
        kv_count,
        q_tile=q_tile,
        kv_block=kv_block,
        sm_scale=sm_scale,
        kv_valid=kv_valid,
        return_lse=return_lse,
        impl="auto",
    )


def window_kv(batch: int, heads: int, grid, tile, fraction: float, n_tiles: int | None = None):
    """(kv_index, kv_count) of the window baseline for a token grid in `tile`s (tile-major; a grid that
    does not divide is padded to whole tiles). n_tiles: the layout's tile count where it adds whole
    padding tiles after the grid (their query rows get tile 0's window; their outputs are dropped)."""
    tile = tuple(min(int(t), int(g)) for t, g in zip(tile, grid))
    idx = window_selection(tuple(-(-g // t) for g, t in zip(grid, tile)), float(fraction))
    if n_tiles is not None and n_tiles > idx.shape[0]:
        idx = np.concatenate([idx, np.broadcast_to(idx[:1], (n_tiles - idx.shape[0], idx.shape[1]))])
    kv_index = jnp.broadcast_to(jnp.asarray(idx), (batch, heads, *idx.shape))
    return kv_index, jnp.full(kv_index.shape[:3], idx.shape[1], jnp.int32)


@register_backend("window")
def window_attention(
    q, k, v, *, kv_lens, sm_scale, grid, tile, fraction=1 / 3, kv_valid=None, dense_backend="auto", return_lse=False
):
    if kv_lens is not None:
        return attention(q, k, v, backend=dense_backend, kv_lens=kv_lens, sm_scale=sm_scale, return_lse=return_lse)
    tile = tuple(min(int(t), int(g)) for t, g in zip(tile, grid))
    size = int(np.prod(tile))
    kv_index, kv_count = window_kv(q.shape[0], q.shape[2], grid, tile, fraction, n_tiles=q.shape[1] // size)
    return sparse_attention(
        q,
        k,
        v,
        kv_index,
        kv_count,
        q_tile=size,
        kv_block=size,
        sm_scale=sm_scale,
        kv_valid=kv_valid,
        return_lse=return_lse,
        impl="auto",
    )
