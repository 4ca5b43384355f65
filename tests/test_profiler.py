"""Sparsity profiling (dsv_jax/dsv/profiler.py): recall curves and oracle bounds."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv_jax.dsv.selection import select_kv
from tests.dsv_helpers import block_scores, rand


@pytest.mark.parametrize("reduce", ["mean", "max"])
def test_recall_curve_is_the_mass_of_the_predictors_best_blocks(reduce):
    """Brute force: for each sampled query, rank its tile's KV blocks by the predictor's score, take the
    best ceil(f * blocks), and sum the query's exact attention probabilities inside them."""
    from dsv_jax.dsv.profiler import RECALL_FRACTIONS, profile_rows

    b, s, h, r, q_tile, kv_block = 2, 96, 3, 4, 8, 4
    z = 3 * rand(30, (b, h, 5, s))
    positions = np.array([0, 17, 40, 63, 95])
    q_lr, k_lr = rand(31, (b, s, h, r)), rand(32, (b, s, h, r))
    out = profile_rows(
        z,
        positions,
        s,
        theta=0.9,
        percentile=10.0,
        coords=np.zeros((s, 3), np.int32),
        q_tile=q_tile,
        kv_block=kv_block,
        lowrank=(q_lr, k_lr),
        block_reduce=reduce,
    )
    p = np.asarray(jax.nn.softmax(z, -1))
    scores = block_scores(q_lr, k_lr, q_tile, kv_block, reduce)  # [B, H, T, nb]
    nb = s // kv_block
    expect = np.zeros((h, len(RECALL_FRACTIONS)))
    for j, f in enumerate(RECALL_FRACTIONS):
        count = max(1, math.ceil(f * nb - 1e-4))
        for bi in range(b):
            for hi in range(h):
                for qi, pos in enumerate(positions):
                    best = np.argsort(-scores[bi, hi, pos // q_tile])[:count]
                    mask = np.zeros(s, bool)
                    for blk in best:
                        mask[blk * kv_block : (blk + 1) * kv_block] = True
                    expect[hi, j] += p[bi, hi, qi, mask].sum() / (b * len(positions))
    np.testing.assert_allclose(out["recall_curve"], expect, atol=1e-5)
    # and each point is the recall of the selection select_kv makes at that keep ratio (same block counts)
    from dsv_jax.dsv.profiler import selection_recall

    for j in (0, 5, 9, 14):
        sel = select_kv(
            q_lr, k_lr, nb, jnp.full((h,), RECALL_FRACTIONS[j]), q_tile=q_tile, kv_block=kv_block, block_reduce=reduce
        )
        np.testing.assert_allclose(
            selection_recall(jnp.asarray(p), positions, sel, q_tile, kv_block), out["recall_curve"][:, j], atol=1e-5
        )
    assert np.all(np.diff(np.asarray(out["recall_curve"]), axis=-1) >= -1e-6)
    np.testing.assert_allclose(out["recall_curve"][:, -1], 1.0, atol=1e-5)
    # without the predictor's projections there is no curve
    assert np.isnan(
        profile_rows(z, positions, s, theta=0.9, percentile=10.0, coords=np.zeros((s, 3), np.int32))["recall_curve"]
    ).all()


def test_oracle_curves_bound_the_selection_rule_and_the_predictor():
    """Analysis statistics: the best token selection holds at least what the best block selection holds,
    which holds at least what any rule (true q, k or the predictor) selects at the same keep ratio."""
    from dsv_jax.dsv.profiler import RECALL_FRACTIONS, profile_rows

    b, s, h, d, r, q_tile, kv_block = 1, 64, 2, 8, 4, 8, 4
    q, k = rand(40, (b, s, h, d)), rand(41, (b, s, h, d))
    positions = np.arange(0, s, 5)
    z = jnp.einsum("bqhd,bkhd->bhqk", q[:, positions], k) * d**-0.5
    coords = np.stack(np.unravel_index(np.arange(s), (4, 4, 4)), 1)
    out = profile_rows(
        z,
        positions,
        s,
        theta=0.9,
        percentile=10.0,
        coords=coords,
        q_tile=q_tile,
        kv_block=kv_block,
        lowrank=(rand(42, (b, s, h, r)), rand(43, (b, s, h, r))),
        analysis=True,
        exact=(q, k),
    )
    tokens, blocks = np.asarray(out["oracle_curve"][:, 0]), np.asarray(out["oracle_curve"][:, 1])
    assert tokens.shape == blocks.shape == (h, len(RECALL_FRACTIONS))
    whole = [j for j, f in enumerate(RECALL_FRACTIONS) if float(f * s / kv_block).is_integer()]  # no rounding
    assert len(whole) >= 3 and np.all(tokens[:, whole] >= blocks[:, whole] - 1e-6)
    for rule in ("exact_proxy_curve", "recall_curve"):
        assert np.all(blocks >= np.asarray(out[rule]) - 1e-6)
    np.testing.assert_allclose(tokens[:, -1], 1.0, atol=1e-5)
