"""Index transforms of block-sparse attention, in plain JAX (they run on device, outside the kernels).

The forward and dQ kernels walk each query tile's own list (kv_index). dK/dV needs the transpose: for
each block of key rows, the query tiles that use it. `dkdv_worklist` builds it without atomics:

  1. every (query tile, selected block) entry becomes one or more (tile, key row block) pairs;
     at token level (kv_block < 32) the consecutive entries of a tile that fall into the same row
     block are folded into one pair carrying a bit mask of the selected rows (ids are ascending, so
     these entries are adjacent: running sums and a binary search do it, no scatter, no atomics);
  2. the pairs are ordered by row block (tiles ascending inside a row block) and each row block gets its
     [start, end) range in that list: where whole blocks are selected and the (row block x tile) table is
     small (<= COUNTING_LIMIT entries), by counting: the pairs are written into that table, and a running
     count over it in row-block-major order gives every pair its place (no sort: a few memory-bound passes);
     otherwise (token level, or very long sequences) by one stable sort per (batch, head) and a binary search.

Memory: O(pairs) = O(S / q_tile * K), the size of kv_index itself (times the rows a block spans), for the
sort; the counting table is B x H x (S / rows) x (S / q_tile) int32, at most COUNTING_LIMIT entries.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MASK_BITS = 32  # one int32 mask word covers 32 key rows
# Entries of the counting table above which dkdv_worklist sorts instead: the table and its temporaries
# (flags, running count, scatter) take ~5 x 4 bytes per entry while it is built, 5 GiB at this limit; 64k
# tokens with 64-token tiles and blocks and 16 heads need 2^24 entries, 128k 2^26 (~1.3 GiB transient).
COUNTING_LIMIT = 1 << 28


def result_type(shape, dtype, like):
    """A pallas_call result type that varies over the same shard_map axes as `like`, so the kernels also
    run inside shard_map with check_vma=True; outside shard_map (or on a jax without the field) it is a
    plain ShapeDtypeStruct."""
    mat = getattr(jax.typeof(like), "manual_axis_type", None)
    if mat is not None and getattr(mat, "varying", None):
        try:
            return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat)
        except TypeError:
            pass
    return jax.ShapeDtypeStruct(shape, dtype)


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
      masks  int32 [B, H, N, ceil(rows / 32)] bit masks of selected rows per pair, or None when every pair
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
        pair_block, masks = _fold_rows(kv_index, live, kv_block=kv_block, rows=rows, row_blocks=row_blocks)
        pairs_per_tile = pair_block.shape[-1]
    n = tiles * pairs_per_tile
    if masks is None and b * h * (row_blocks + 1) * tiles <= COUNTING_LIMIT:
        order, starts = _order_by_counting(pair_block, row_blocks)
        return order, starts, masks, pairs_per_tile
    keys = pair_block.reshape(b, h, n)
    numbers = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), keys.shape)
    sorted_keys, order = jax.lax.sort((keys, numbers), dimension=-1, num_keys=1, is_stable=True)
    bounds = jnp.arange(row_blocks + 1, dtype=jnp.int32)
    search = jax.vmap(jax.vmap(lambda sk: jnp.searchsorted(sk, bounds, side="left").astype(jnp.int32)))
    starts = search(sorted_keys)
    return order, starts, masks, pairs_per_tile


def longest_first(starts):
    """int32 [B, H, R]: the R row blocks of a dK/dV work list (starts [B, H, R + 1], as `dkdv_worklist`
    returns) ordered by their number of pairs, most first (ties: lower row block first).

    A dK/dV program that walks two row blocks' lists in parallel (one per consumer) finishes with the longer
    one; taking its two blocks from adjacent places of this order gives them almost the same length, and
    launching the programs in this order starts the longest first (less of a tail in the last wave)."""
    pairs = starts[..., 1:] - starts[..., :-1]
    return jnp.argsort(-pairs, axis=-1, stable=True).astype(jnp.int32)


def _order_by_counting(pair_block, row_blocks):
    """(order, starts) of pairs [B, H, T, P] (row block of each pair, row_blocks = dead) whose live pairs
    are distinct per tile, without a sort. table[b, h, j, t] holds 1 + the pair number of tile t's pair in
    row block j (0: none); read in row-block-major order its nonzero entries are the work list, and a
    running count of them gives each one its position. order's tail past the last live pair is 0 (never
    read: starts end there)."""
    b, h, tiles, per_tile = pair_block.shape
    n = tiles * per_tile
    numbers = jnp.arange(n, dtype=jnp.int32).reshape(tiles, per_tile)
    bi = jnp.arange(b, dtype=jnp.int32)[:, None, None, None]
    hi = jnp.arange(h, dtype=jnp.int32)[None, :, None, None]
    ti = jnp.arange(tiles, dtype=jnp.int32)[:, None]
    table = jnp.zeros((b, h, row_blocks + 1, tiles), jnp.int32)  # the last row collects dead pairs
    table = table.at[bi, hi, pair_block, ti].set(numbers + 1)[:, :, :row_blocks].reshape(b, h, row_blocks * tiles)
    present = table > 0
    place = jnp.cumsum(present, axis=-1, dtype=jnp.int32) - 1
    place = jnp.where(present, place, n)  # out of range: dropped
    order = (
        jnp.zeros((b, h, n), jnp.int32)
        .at[bi[..., 0], hi[..., 0], place]
        .set(table - 1, mode="drop", unique_indices=True)
    )
    counts = jnp.sum(present.reshape(b, h, row_blocks, tiles), axis=-1, dtype=jnp.int32)
    starts = jnp.concatenate([jnp.zeros((b, h, 1), jnp.int32), jnp.cumsum(counts, axis=-1, dtype=jnp.int32)], -1)
    return order, starts


def _fold_rows(kv_index, live, *, kv_block, rows, row_blocks):
    """Token level: fold each tile's selected blocks into (row block, bit mask) pairs, without a scatter.

    Ids ascend, so a tile's entries in one row block form a run. A run's pair number is the count of runs
    that ended before it; its mask is the sum (= OR, the bits are disjoint) of the run's bits, taken as a
    difference of running sums (int32 wrap-around keeps the difference exact). The s-th run's last entry
    is found by a binary search of the running count of run ends, so all steps are scans and gathers.
    """
    n_sel = kv_index.shape[-1]
    first_row = kv_index * kv_block
    row_block = jnp.where(live, first_row // rows, row_blocks)
    following = jnp.concatenate([row_block[..., 1:], jnp.full_like(row_block[..., :1], row_blocks)], axis=-1)
    ends = live & (row_block != following)  # last entry of a (tile, row block) run
    runs_so_far = jnp.cumsum(ends.astype(jnp.int32), axis=-1)
    pairs_per_tile = min(n_sel, row_blocks)
    wanted = jnp.arange(1, pairs_per_tile + 1, dtype=jnp.int32)
    find = lambda c: jnp.searchsorted(c, wanted, side="left").astype(jnp.int32)
    end_pos = jnp.vectorize(find, signature="(k)->(p)")(runs_so_far)  # [.., P]; n_sel where no such run
    has_pair = end_pos < n_sel
    end_pos = jnp.minimum(end_pos, n_sel - 1)
    pair_block = jnp.where(has_pair, jnp.take_along_axis(row_block, end_pos, axis=-1), row_blocks)
    offset = first_row % rows
    run_bits = jax.lax.shift_left(jnp.int32((1 << kv_block) - 1), offset % MASK_BITS)  # kv_block < 32: one word
    masks = []
    for word in range(-(-rows // MASK_BITS)):
        bits = jnp.where(live & (offset // MASK_BITS == word), run_bits, 0)
        total = jnp.take_along_axis(jnp.cumsum(bits, axis=-1, dtype=jnp.int32), end_pos, axis=-1)
        before = jnp.concatenate([jnp.zeros_like(total[..., :1]), total[..., :-1]], axis=-1)
        masks.append(jnp.where(has_pair, total - before, 0))
    b, h, tiles, _ = kv_index.shape
    return pair_block, jnp.stack(masks, axis=-1).reshape(b, h, tiles * pairs_per_tile, len(masks))
