"""DSV selection and the window lists (dsv_jax/dsv/selection.py)."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from dsv_jax.attention import attention
from dsv_jax.dsv.selection import select_kv, window_extent, window_selection
from tests.dsv_helpers import block_scores, masked_dense, rand


@pytest.mark.parametrize("reduce", ["mean", "max"])
def test_selection_keeps_each_heads_best_blocks_first(reduce):
    """lowrank_topk returns K ids ascending; a head with a smaller runtime count must attend to its
    best `count` of them (by score), ascending, in the first `count` entries (the kernel's contract)."""
    b, s, h, r, q_tile, kv_block, top_k = 2, 72, 3, 5, 8, 4, 7
    q_lr, k_lr = rand(5, (b, s, h, r)), rand(6, (b, s, h, r))
    keep = jnp.array([[0.05, 0.2, 1.0], [0.3, 0.12, 0.01]])  # [B, H]: counts ceil(keep * 18) clipped to 1..7
    idx, cnt = select_kv(q_lr, k_lr, top_k, keep, q_tile=q_tile, kv_block=kv_block, block_reduce=reduce)
    nb = s // kv_block
    expect_counts = np.clip(np.ceil(np.asarray(keep) * nb), 1, top_k).astype(int)
    np.testing.assert_array_equal(cnt, np.broadcast_to(expect_counts[..., None], cnt.shape))
    scores = block_scores(q_lr, k_lr, q_tile, kv_block, reduce)
    idx = np.asarray(idx)
    for bi in range(b):
        for hi in range(h):
            c = expect_counts[bi, hi]
            for t in range(s // q_tile):
                best = np.sort(np.argsort(-scores[bi, hi, t])[:c])
                np.testing.assert_array_equal(idx[bi, hi, t, :c], best)
    # and the attention through that selection is the masked dense attention over those blocks
    d = 8
    q, k, v = rand(7, (b, s, h, d)), rand(8, (b, s, h, d)), rand(9, (b, s, h, d))
    allowed = np.zeros((b, h, s, s), bool)
    for bi in range(b):
        for hi in range(h):
            for t in range(s // q_tile):
                for blk in idx[bi, hi, t, : expect_counts[bi, hi]]:
                    allowed[bi, hi, t * q_tile : (t + 1) * q_tile, blk * kv_block : (blk + 1) * kv_block] = True
    out = attention(
        q,
        k,
        v,
        backend="dsv",
        q_lr=q_lr,
        k_lr=k_lr,
        top_k=top_k,
        keep=keep,
        q_tile=q_tile,
        kv_block=kv_block,
        block_reduce=reduce,
    )
    np.testing.assert_allclose(out, masked_dense(q, k, v, allowed), atol=2e-5)


@pytest.mark.parametrize("tile_grid, fraction", [((3, 4, 5), 1 / 3), ((3, 4, 5), 2 / 3), ((1, 6, 2), 1 / 3)])
def test_window_selection_is_the_3d_neighbourhood(tile_grid, fraction):
    idx = window_selection(tile_grid, fraction)
    ms = [window_extent(n, fraction) for n in tile_grid]
    assert idx.shape == (math.prod(tile_grid), math.prod(ms))
    coords = np.stack(np.unravel_index(np.arange(math.prod(tile_grid)), tile_grid), 1)
    for q, row in enumerate(idx):
        assert np.all(np.diff(row) > 0)
        box = coords[row]
        # a box of exactly m_d tiles per dimension that contains the query tile, centred where the grid allows
        for a, (n, m) in enumerate(zip(tile_grid, ms)):
            lo, hi = box[:, a].min(), box[:, a].max()
            assert hi - lo + 1 == m and lo <= coords[q, a] <= hi
            assert lo == max(0, min(coords[q, a] - (m - 1) // 2, n - m))
        members = {tuple(c) for c in box}
        assert len(members) == len(row)
