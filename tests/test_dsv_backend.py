"""The "dsv" and "window" attention backends (dsv_jax/dsv/backend.py) against dense references."""

import jax.numpy as jnp
import numpy as np
import pytest

from dsv_jax.attention import attention
from dsv_jax.dsv.selection import window_extent
from dsv_jax.model.tokens import token_layout
from tests.dsv_helpers import masked_dense, rand


@pytest.mark.parametrize("kv_block, d", [(1, 24), (8, 16)])
def test_dsv_backend_selecting_every_block_equals_dense(kv_block, d):
    b, s, h, q_tile = 2, 48, 3, 16
    q, k, v = rand(0, (b, s, h, d)), rand(1, (b, s, h, d)), rand(2, (b, s, h, d))
    dense = attention(q, k, v, backend="xla")
    nb = s // kv_block
    idx = jnp.broadcast_to(jnp.arange(nb, dtype=jnp.int32), (b, h, s // q_tile, nb))
    out = attention(
        q,
        k,
        v,
        backend="dsv",
        kv_index=idx,
        kv_count=jnp.full(idx.shape[:3], nb, jnp.int32),
        q_tile=q_tile,
        kv_block=kv_block,
    )
    np.testing.assert_allclose(out, dense, atol=2e-5)
    # from the predictor's projections with top_k = every block and keep ratio 1 for every head
    q_lr, k_lr = rand(3, (b, s, h, 6)), rand(4, (b, s, h, 6))
    out = attention(
        q, k, v, backend="dsv", q_lr=q_lr, k_lr=k_lr, top_k=nb, keep=jnp.ones((h,)), q_tile=q_tile, kv_block=kv_block
    )
    np.testing.assert_allclose(out, dense, atol=2e-5)
    # a padded layout (kv_lens) falls back to dense attention masked by length
    lens = jnp.array([s, 29], jnp.int32)
    np.testing.assert_allclose(
        attention(q, k, v, backend="dsv", kv_lens=lens, kv_index=idx, q_tile=q_tile, kv_block=kv_block),
        attention(q, k, v, backend="xla", kv_lens=lens),
        atol=2e-5,
    )


def test_window_backend_equals_masked_attention_on_a_real_layout():
    """Built independently from token coordinates: query token i may see key j iff j's 3D tile lies in
    the window box of i's tile."""
    grid, tile, frac = (4, 8, 12), (2, 4, 4), 1 / 3
    layout = token_layout(grid, tile)
    s, h, d = layout.seq_len, 2, 8
    q, k, v = rand(10, (1, s, h, d)), rand(11, (1, s, h, d)), rand(12, (1, s, h, d))
    tcoord = layout.coords // np.array(tile)  # each token's tile coordinate
    n = np.array(grid) // np.array(tile)
    m = np.array([window_extent(x, frac) for x in n])
    lo = np.clip(tcoord - (m - 1) // 2, 0, n - m)
    inside = np.all((tcoord[None] >= lo[:, None]) & (tcoord[None] < (lo + m)[:, None]), -1)  # [S, S]
    ref = masked_dense(q, k, v, jnp.asarray(inside)[None, None])
    out = attention(q, k, v, backend="window", grid=grid, tile=tile, fraction=frac)
    np.testing.assert_allclose(out, ref, atol=2e-5)
    assert 0.05 < inside.mean() < 0.3  # the window really restricts
