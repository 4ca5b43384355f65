"""Which KV blocks each query tile attends to, in the layout of `pallas_kernels.sparse_attention`:
kv_index int32 [B, H, T, K] (block ids, ascending within the first kv_count entries), kv_count [B, H, T].

DSV (`select_kv`): every query tile shares one KV list, chosen from the low-rank projections by
`lowrank_topk` (proxy = the tile's mean q_lr; DSV's paper uses the middle token). K = top_k is static
(a rung of the keep ladder); each head keeps its own runtime count <= K. Because `lowrank_topk` returns
its K ids in ascending order (not by score) and the kernel reads only the first kv_count entries, a head
with count < K re-ranks the K candidates by score and moves its best `count` to the front, ascending.

Padded layouts (kv_valid, int32 [B, S // kv_block] valid keys per block, as in `sparse_attention`): the
scores ignore padded keys and padded query rows (`pallas_kernels.lowrank_topk`), a block without a valid
key is never selected, and counts are taken from and capped by the number of valid blocks: a keep ratio
is a fraction of the valid blocks, and where fewer blocks are valid than top_k, kv_count drops (the
valid ids come first; the rest of the row is never read).

Window baseline (`window_selection`): a static 3D neighbourhood of tiles around each query tile.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.lowrank_topk import block_mean_keys, lowrank_topk, reduce_block, row_flags, tile_proxies


def head_counts(keep, n_blocks, top_k: int) -> jax.Array:
    """Per-head KV block counts from keep ratios [..., H] (runtime): ceil(keep * n_blocks), in 1..top_k.
    n_blocks: an int, or per-batch counts [B] (then keep is [B, H] or [H])."""
    n_blocks = jnp.asarray(n_blocks)
    if n_blocks.ndim:
        n_blocks = n_blocks[:, None]
    counts = jnp.ceil(jnp.asarray(keep, jnp.float32) * n_blocks - 1e-4).astype(jnp.int32)
    return jnp.clip(counts, 1, top_k)


def candidate_scores(q_lr, k_lr, kv_index, *, q_tile: int, kv_block: int, block_reduce: str = "mean", kv_valid=None):
    """Scores [B, H, T, K] of the selected blocks, as `lowrank_topk` scores them (-inf: no valid key)."""
    b, s, h, r = q_lr.shape
    nb = s // kv_block
    valid_rows = None if kv_valid is None else row_flags(kv_valid, kv_block)
    proxy = tile_proxies(q_lr, q_tile, valid_rows).transpose(0, 2, 1, 3)  # [B, H, T, r]
    n_valid = None
    if kv_valid is not None:
        per_block = jnp.broadcast_to(kv_valid.astype(jnp.int32)[:, None, None], (*kv_index.shape[:3], nb))
        n_valid = jnp.take_along_axis(per_block, kv_index, axis=-1)  # [B, H, T, K]
    if block_reduce == "mean":  # mean of dot products = dot product with the block's mean key
        kbar = block_mean_keys(k_lr, kv_block, kv_valid).transpose(0, 2, 1, 3)  # [B, H, nb, r]
        picked = jnp.take_along_axis(kbar[:, :, None], kv_index[..., None], axis=3)  # [B, H, T, K, r]
        scores = jnp.einsum("bhtr,bhtkr->bhtk", proxy, picked)
        return scores if n_valid is None else jnp.where(n_valid > 0, scores, -jnp.inf)
    keys = k_lr.astype(jnp.float32).reshape(b, nb, kv_block, h, r).transpose(0, 3, 1, 2, 4)  # [B, H, nb, kvb, r]

    def one_tile(args):  # the max over a block is not linear: gather one query tile at a time
        p, idx, n = args  # [B, H, r], [B, H, K], [B, H, K] or None
        blocks = jnp.take_along_axis(keys, idx[..., None, None], axis=2)  # [B, H, K, kv_block, r]
        return reduce_block(jnp.einsum("bhr,bhkjr->bhkj", p, blocks), "max", n)

    per_tile = (
        proxy.transpose(2, 0, 1, 3),
        kv_index.transpose(2, 0, 1, 3),
        None if n_valid is None else n_valid.transpose(2, 0, 1, 3),
    )
    return jax.lax.map(one_tile, per_tile).transpose(1, 2, 0, 3)


def _to_front(kv_index, front):
    """Per row, the ids where `front` holds first, then the others, each group ascending."""
    big = jnp.iinfo(jnp.int32).max // 2
    key = jnp.sort(jnp.where(front, kv_index, big + kv_index), axis=-1)
    return jnp.where(key >= big, key - big, key).astype(jnp.int32)


def keep_best(kv_index, scores, counts):
    """Per row, move the `counts` best-scoring ids to the front in ascending order (the rest follow)."""
    rank = jnp.argsort(jnp.argsort(-scores, axis=-1), axis=-1)  # 0 = best
    return _to_front(kv_index, rank < counts[..., None])


def select_kv(
    q_lr, k_lr, top_k: int, keep=None, *, q_tile: int, kv_block: int, block_reduce: str = "mean", kv_valid=None
):
    """(kv_index [B, H, T, top_k], kv_count [B, H, T]) from the predictor's projections [B, S, H, r].

    keep: optional per-head keep ratios [H] or [B, H] (runtime); None keeps all top_k blocks per head.
    kv_valid: optional int32 [B, S // kv_block], valid keys per block (padded layouts; see the module)."""
    q_lr, k_lr = jax.lax.stop_gradient(q_lr), jax.lax.stop_gradient(k_lr)
    kv_index = lowrank_topk(
        q_lr, k_lr, top_k, q_tile=q_tile, kv_block=kv_block, block_reduce=block_reduce, kv_valid=kv_valid, impl="auto"
    )
    scores = lambda: candidate_scores(
        q_lr, k_lr, kv_index, q_tile=q_tile, kv_block=kv_block, block_reduce=block_reduce, kv_valid=kv_valid
    )
    return apply_counts(kv_index, top_k, keep, k_lr.shape[1] // kv_block, kv_valid, scores)


def apply_counts(kv_index, top_k: int, keep, n_blocks: int, kv_valid, scores):
    """The per-head counts of top_k candidate ids (ascending, [B, H, T, top_k]) and the ids reordered so
    that each row's first count ids are the ones to attend: what `select_kv` returns. Shared with the
    context-parallel selection, which finds its candidates another way. scores() -> [B, H, T, top_k]
    candidate scores (called only when the keep ratios need a ranking)."""
    b, h, tiles, _ = kv_index.shape
    n_ok = None if kv_valid is None else jnp.sum(kv_valid > 0, axis=-1).astype(jnp.int32)  # [B] usable blocks
    if keep is None:
        if n_ok is None:
            return kv_index, jnp.full((b, h, tiles), top_k, jnp.int32)
        usable = jnp.take_along_axis(
            jnp.broadcast_to((kv_valid > 0)[:, None, None], (b, h, tiles, n_blocks)), kv_index, -1
        )
        # Only when some batch entry has fewer usable blocks than top_k can an empty block be among the ids.
        kv_index = jax.lax.cond(jnp.min(n_ok) < top_k, lambda: _to_front(kv_index, usable), lambda: kv_index)
        return kv_index, jnp.broadcast_to(jnp.minimum(n_ok, top_k)[:, None, None], (b, h, tiles))
    per_head = head_counts(keep, n_blocks if n_ok is None else n_ok, top_k)
    per_head = jnp.broadcast_to(per_head if per_head.ndim == 2 else per_head[None], (b, h))
    if n_ok is not None:
        per_head = jnp.minimum(per_head, n_ok[:, None])
    counts = jnp.broadcast_to(per_head[..., None], (b, h, tiles))
    if top_k == 1:
        return kv_index, counts
    return keep_best(kv_index, scores(), counts), counts


def window_extent(n: int, fraction: float) -> int:
    """Tiles per window along a dimension of n tiles: fraction of it, at least one."""
    return max(1, min(n, math.floor(fraction * n + 0.5)))


@functools.lru_cache(maxsize=128)
def window_selection(tile_grid: tuple[int, int, int], fraction: float) -> np.ndarray:
    """Static kv_index [T, K] of the window baseline over a grid of tiles (raster order = tile-major).

    Each query tile attends to the m_t x m_h x m_w tiles (m_d = fraction of the tiles along d, at least
    one) of a box centred on it and shifted inside the grid, so every tile has the same count K."""
    ms = [window_extent(n, fraction) for n in tile_grid]
    starts = [np.clip(np.arange(n) - (m - 1) // 2, 0, n - m) for n, m in zip(tile_grid, ms)]
    nt, nh, nw = tile_grid
    rows = []
    for a in range(nt):
        for c in range(nh):
            for e in range(nw):
                t = starts[0][a] + np.arange(ms[0])
                y = starts[1][c] + np.arange(ms[1])
                x = starts[2][e] + np.arange(ms[2])
                ids = (t[:, None, None] * nh + y[None, :, None]) * nw + x[None, None, :]
                rows.append(ids.reshape(-1))
    return np.asarray(rows, np.int32)  # ascending: raster order of (t, y, x) within the box
