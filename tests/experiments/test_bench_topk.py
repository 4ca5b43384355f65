"""experiments/bench_topk.py's attention mass captured by a selection against the exact top-k's, and its
projected inputs (a rank-16 predictor of full q, k)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.bench_sparse_attention import exact_topk
from experiments.bench_topk import block_mass, mass_captured, mass_table, projected_inputs
from pallas_kernels.lowrank_topk import lowrank_topk_reference

SEQ, HEADS, Q_TILE = 512, 2, 64
TILES = np.array([0, 3, 7])


@pytest.fixture(scope="module")
def inputs():
    return projected_inputs(jax.random.key(0), SEQ, HEADS, 32, 16)


def test_projected_inputs_predict_the_true_logits_at_their_scale(inputs):
    q, k, q_lr, k_lr = (np.asarray(x, np.float32) for x in inputs)
    assert q.shape == k.shape == (1, SEQ, HEADS, 32) and q_lr.shape == k_lr.shape == (1, SEQ, HEADS, 16)
    for h in range(HEADS):
        true = (q[0, ::8, h] @ k[0, :, h].T).ravel() / np.sqrt(32)
        low = (q_lr[0, ::8, h] @ k_lr[0, :, h].T).ravel() / np.sqrt(16)
        assert np.corrcoef(true, low)[0, 1] > 0.5  # a predictor, not noise
        assert 0.5 < (true @ low) / (true @ true) < 1.5  # q_lr k_lr^T / sqrt(r) estimates q k^T / sqrt(D)


@pytest.mark.parametrize("kv_block", [1, 16])
def test_mass_captured_is_one_for_the_exact_selection_and_less_for_a_perturbed_one(inputs, kv_block):
    q, k, q_lr, k_lr = inputs
    table = mass_table(q, k, q_tile=Q_TILE, tiles=TILES)
    assert table.shape == (1, HEADS, len(TILES), SEQ)
    np.testing.assert_allclose(jnp.sum(table, -1), 1.0, rtol=1e-5)  # each tile's mean softmax row
    masses = block_mass(table, kv_block)
    top_k = SEQ // kv_block // 8
    exact = exact_topk(q_lr, k_lr, top_k, q_tile=Q_TILE, kv_block=kv_block, tiles=TILES)
    # the reference selection (fp32 on the CPU) is the exact one, and captures all of its mass
    ids = lowrank_topk_reference(q_lr, k_lr, top_k, q_tile=Q_TILE, kv_block=kv_block)[:, :, TILES]
    np.testing.assert_array_equal(ids, exact)
    got = mass_captured(ids, exact, masses)
    assert got["mean"] == pytest.approx(1.0) and got["min"] == pytest.approx(1.0) and 0 < got["exact_mass"] < 1
    # swapping each list's best block (by true mass) for the selection's worst unselected one loses mass
    best = jnp.argmax(jnp.take_along_axis(masses, exact, -1), axis=-1, keepdims=True)
    outside = jnp.where(jax.nn.one_hot(exact, masses.shape[-1]).sum(-2) > 0, jnp.inf, masses)
    perturbed = jnp.where(jnp.arange(top_k) == best, jnp.argmin(outside, -1, keepdims=True), exact)
    lost = mass_captured(perturbed, exact, masses)
    assert lost["min"] <= lost["mean"] < 0.99 and lost["exact_mass"] == pytest.approx(got["exact_mass"])
