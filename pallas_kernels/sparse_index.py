"""Index transforms of block-sparse attention, in plain JAX (they run on device, outside the kernels).

The forward and dQ kernels walk each query tile's own list (kv_index). dK/dV needs the transpose: for
each block of key rows, the query tiles that use it. `dkdv_worklist` builds it without atomics:

  1. every (query tile, selected block) entry becomes one or more (tile, key row block) pairs;
     at token level (kv_block < 32) the consecutive entries of a tile that fall into the same row
     block are folded into one pair carrying a bit mask of the selected rows (ids are ascending, so
     these entries are adjacent: a cumulative sum numbers the pairs, no sort needed);
  2. one stable sort per (batch, head) orders the pairs by row block (tiles stay ascending inside a
     row block), and a binary search gives each row block's [start, end) range in the sorted list.

Memory is O(pairs) = O(S / q_tile * K), the size of kv_index itself (times the rows a block spans).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

MASK_BITS = 32  # one int32 mask word covers 32 key rows


def sanitize_index(kv_index, kv_count, num_blocks):
    """kv_index with every entry at position >= kv_count replaced by 0 (safe to load), counts in 0..K."""
    n_sel = kv_index.shape[-1]
    count = jnp.clip(kv_count.astype(jnp.int32), 0, n_sel)
    live = jnp.arange(n_sel, dtype=jnp.int32) < count[..., None]
    index = jnp.where(live, jnp.clip(kv_index.astype(jnp.int32), 0, num_blocks - 1), 0)
    return index, count


def dkdv_worklist(kv_index, kv_count, *, kv_block: int, rows: int, seq_len: int):
    """Work list of the dK/dV kernel, whose programs each own `rows` consecutive key rows.

    kv_index, kv_count: sanitized [B, H, T, K], [B, H, T].
    Returns (order, starts, masks, pairs_per_tile):
      order  int32 [B, H, N]: pair numbers (tile * pairs_per_tile + slot) sorted by row block;
      starts int32 [B, H, seq_len // rows + 1]: row block j's pairs are order[starts[j]:starts[j+1]];
      masks  int32 [B, H, N, rows // 32] bit masks of selected rows per pair, or None when every pair
             covers whole row blocks (kv_block >= rows).
    """
    b, h, tiles, n_sel = kv_index.shape
    row_blocks = seq_len // rows
    live = jnp.arange(n_sel, dtype=jnp.int32) < kv_count[..., None]
    if kv_block >= rows:
        # Each selected block spans `span` whole row blocks: one pair each, no mask.
        span = kv_block // rows
        first = kv_index * span
        row_block = (first[..., None] + jnp.arange(span, dtype=jnp.int32)).reshape(b, h, tiles, n_sel * span)
        live = jnp.repeat(live, span, axis=-1)
        pair_block = jnp.where(live, row_block, row_blocks)  # dead pairs sort last
        pairs_per_tile = n_sel * span
        masks = None
    else:
        first_row = kv_index * kv_block
        row_block = jnp.where(live, first_row // rows, row_blocks)
        prev = jnp.concatenate([jnp.full_like(row_block[..., :1], -1), row_block[..., :-1]], axis=-1)
        opens = live & (row_block != prev)  # first entry of a new (tile, row block) pair
        slot = jnp.cumsum(opens.astype(jnp.int32), axis=-1) - 1
        pairs_per_tile = min(n_sel, row_blocks)
        # Scatter with one target per pair (row block ids) and disjoint bits per target (mask words).
        tile_base = (jnp.arange(b * h * tiles, dtype=jnp.int32) * pairs_per_tile).reshape(b, h, tiles, 1)
        flat_pair = jnp.where(live, tile_base + slot, -1)
        n_pairs_total = b * h * tiles * pairs_per_tile
        pair_block = jnp.full((n_pairs_total,), row_blocks, jnp.int32)
        pair_block = pair_block.at[jnp.where(opens, flat_pair, n_pairs_total).ravel()].set(
            row_block.ravel(), mode="drop").reshape(b, h, tiles, pairs_per_tile)
        offset = first_row % rows
        words = rows // MASK_BITS
        run = (1 << kv_block) - 1  # kv_block < 32 here, so a block's bits sit inside one word
        bits = jax.lax.shift_left(jnp.int32(run), offset % MASK_BITS)
        target = jnp.where(live, flat_pair * words + offset // MASK_BITS, n_pairs_total * words)
        masks = jnp.zeros((n_pairs_total * words,), jnp.int32).at[target.ravel()].add(bits.ravel(), mode="drop")
        masks = masks.reshape(b, h, tiles * pairs_per_tile, words)
    n = tiles * pairs_per_tile
    keys = pair_block.reshape(b, h, n)
    numbers = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), keys.shape)
    sorted_keys, order = jax.lax.sort((keys, numbers), dimension=-1, num_keys=1, is_stable=True)
    bounds = jnp.arange(row_blocks + 1, dtype=jnp.int32)
    search = jax.vmap(jax.vmap(lambda sk: jnp.searchsorted(sk, bounds, side="left").astype(jnp.int32)))
    starts = search(sorted_keys)
    return order, starts, masks, pairs_per_tile


def dkdv_worklist_numpy(kv_index, kv_count, *, kv_block: int, rows: int, seq_len: int):
    """The same lists built by loops (for tests): {(b, h, row block): [(tile, selected rows mask), ...]}."""
    kv_index, kv_count = np.asarray(kv_index), np.asarray(kv_count)
    out = {}
    b, h, tiles, _ = kv_index.shape
    for bi in range(b):
        for hi in range(h):
            for t in range(tiles):
                for blk in kv_index[bi, hi, t, : kv_count[bi, hi, t]]:
                    for row in range(blk * kv_block, (blk + 1) * kv_block):
                        key = (bi, hi, row // rows)
                        lst = out.setdefault(key, {})
                        lst[t] = lst.get(t, 0) | (1 << (row % rows))
    return {k: sorted(v.items()) for k, v in out.items()}
