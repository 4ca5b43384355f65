"""experiments/harness.py: the selections, budget, vjp wrapper and device timing the benchmarks share."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import harness


@pytest.mark.parametrize("local_share", [0.0, 0.5, 1.0])
def test_random_selection_counts_order_and_locality(local_share):
    keep = np.array([0.1, 0.3, 0.55])
    seq, q_tile, kv_block = 2048, 64, 32
    index, count = harness.random_selection(jax.random.key(3), seq=seq, heads=3, q_tile=q_tile, kv_block=kv_block,
                                            keep=keep, local_share=local_share)
    blocks, tiles = seq // kv_block, seq // q_tile
    want = np.round(keep * blocks).astype(int)
    assert index.shape == (1, 3, tiles, want.max()) and count.shape == (1, 3, tiles)
    assert (np.asarray(count)[0] == want[:, None]).all()
    for h in range(3):
        for t in range(tiles):
            ids = np.asarray(index)[0, h, t, :want[h]]
            assert (np.diff(ids) > 0).all() and ids.min() >= 0 and ids.max() < blocks  # ascending, distinct
            centre = (t * q_tile + q_tile // 2) // kv_block
            near = int(round(want[h] * local_share))
            first = min(max(centre - near // 2, 0), blocks - near)
            assert set(range(first, first + near)) <= set(ids.tolist())  # the blocks around the tile
    if local_share < 1:  # the rest is random: tiles differ beyond their window
        far = [set(np.asarray(index)[0, 2, t, :want[2]].tolist()) for t in range(tiles)]
        assert len({frozenset(f) for f in far}) == tiles


def test_budget_plans_against_what_is_left():
    budget = harness.Budget(100.0, reserve=10.0, start=time.time() - 30.0)
    assert 59 < budget.left() <= 60
    assert budget.allows(50) and budget.skip_reason(50) is None
    reason = budget.skip_reason(80)
    assert reason.startswith("budget: needs ~80 s, ") and reason.endswith(" s left") and not budget.allows(80)
    assert budget.skip_reason(1, fits=False).startswith("budget:")  # another process decided
    budget.expired = True
    assert not budget.allows(0) and budget.left() == 0
    assert harness.Budget(None).left() == float("inf")


def test_fwd_bwd_is_the_vjp_with_the_cotangent_last():
    ks = jax.random.split(jax.random.key(1), 4)
    x, w, y, cot = (jax.random.normal(k, (5, 5)) for k in ks)
    fn = lambda x, w, y: jnp.tanh(x @ w) * y  # noqa: E731
    out, grads = harness.fwd_bwd(fn, 2)(x, w, y, cot)
    np.testing.assert_allclose(out, fn(x, w, y), rtol=1e-6)
    want = jax.grad(lambda x, w: jnp.sum(fn(x, w, y) * cot), argnums=(0, 1))(x, w)
    assert len(grads) == 2
    for g, r in zip(grads, want):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)


def test_time_fn_queues_short_calls_back_to_back():
    x = jax.random.normal(jax.random.key(2), (64, 64))
    f = jax.jit(lambda a: a @ a)
    t = harness.time_fn(f, x, warmup=1, iters=3, min_ms=5.0)
    assert t["runs"] == 3 and t["calls_per_run"] > 1  # a short call: several per repetition
    assert 0 < t["min_ms"] <= t["median_ms"] <= t["max_ms"] and t["blocking_median_ms"] > 0
    slow = harness.time_fn(lambda: time.sleep(0.02), warmup=1, iters=2, min_ms=5.0)
    assert slow["calls_per_run"] == 1 and slow["median_ms"] >= 20 and "blocking_median_ms" not in slow
