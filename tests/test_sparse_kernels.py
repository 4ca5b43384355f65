"""Pallas DSV kernels (interpret mode on CPU) against their plain-JAX references and brute force."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_kernels import lowrank_topk_triton
from pallas_kernels import sparse_attention_triton as triton_attn
from pallas_kernels.lowrank_topk import lowrank_topk, lowrank_topk_reference
from pallas_kernels.lowrank_topk_triton import lowrank_topk_pallas
from pallas_kernels.sparse_attention import sparse_attention, sparse_attention_reference
from pallas_kernels.sparse_index import dkdv_worklist, sanitize_index
from pallas_kernels.tuning import SparseAttentionTuning, TopkTuning
from tests.conftest import triton_lowering_on_cpu


def dkdv_worklist_numpy(kv_index, kv_count, *, kv_block: int, rows: int, seq_len: int):
    """The dK/dV work lists built by loops, to check `dkdv_worklist`:
    {(b, h, row block): [(tile, selected rows mask), ...]}."""
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


def random_selection(key, b, h, tiles, num_blocks, n_sel):
    """Ascending distinct ids per tile, random counts in 1..n_sel, garbage (out of range too) past the count."""
    k1, k2, k3 = jax.random.split(key, 3)
    ids = jnp.sort(jax.lax.top_k(jax.random.uniform(k1, (b, h, tiles, num_blocks)), n_sel)[1], axis=-1)
    count = jax.random.randint(k2, (b, h, tiles), 1, n_sel + 1, dtype=jnp.int32)
    garbage = jax.random.randint(k3, ids.shape, -3 * num_blocks, 3 * num_blocks, dtype=jnp.int32)
    return jnp.where(jnp.arange(n_sel) < count[..., None], ids, garbage).astype(jnp.int32), count


def qkv(key, b, s, h, d, dtype=jnp.float32):
    ks = jax.random.split(key, 3)
    return tuple(jax.random.normal(k_, (b, s, h, d), dtype) for k_ in ks)


def loss_fn(impl, index, count, **kw):
    # A nonlinear readout so every output element gets its own cotangent; the output rides along as aux.
    def loss(q, k, v):
        o = sparse_attention(q, k, v, index, count, impl=impl, **kw)
        return jnp.sum(jnp.sin(o.astype(jnp.float32))), o

    return loss


def value_and_grads(impl, index, count, q, k, v, **kw):
    grad_fn = jax.value_and_grad(loss_fn(impl, index, count, **kw), argnums=(0, 1, 2), has_aux=True)
    (_, out), grads = jax.jit(grad_fn)(q, k, v)
    return out, grads


def assert_close(a, b, tol, what):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    err = np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-6)
    assert err < tol, f"{what}: relative max error {err:.2e} >= {tol:.0e}"


# (kv_block, D, K, q_tile, S): token level (gathered rows, masked dK/dV), small blocks (gathered, masked),
# tile-sized blocks (contiguous steps, block-level transposed index); odd K; D = 96 is padded to 128;
# S = 48 is no multiple of the 64-row dK/dV blocks (they shrink to 16 rows).
CASES = [(1, 96, 37, 32, 128), (16, 64, 5, 16, 192), (64, 96, 3, 32, 256), (1, 64, 7, 16, 48)]


@pytest.mark.parametrize("kv_block,d,n_sel,q_tile,s", CASES)
def test_pallas_forward_and_gradients_match_reference(kv_block, d, n_sel, q_tile, s):
    b, h = 2, 2
    q, k, v = qkv(jax.random.key(kv_block), b, s, h, d)
    index, count = random_selection(jax.random.key(7 + kv_block), b, h, s // q_tile, s // kv_block, n_sel)
    kw = dict(q_tile=q_tile, kv_block=kv_block)
    out, grads = value_and_grads("pallas", index, count, q, k, v, **kw)
    ref, ref_grads = value_and_grads("xla", index, count, q, k, v, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close(out, ref, 1e-5, "forward")
    for name, g, rg in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert float(jnp.max(jnp.abs(rg))) > 0.0
        assert_close(g, rg, 1e-5, name)


def test_every_block_selected_is_dense_attention():
    b, s, h, d, q_tile, kv_block = 2, 128, 2, 64, 32, 16
    q, k, v = qkv(jax.random.key(3), b, s, h, d)
    nb = s // kv_block
    index = jnp.broadcast_to(jnp.arange(nb, dtype=jnp.int32), (b, h, s // q_tile, nb))
    count = jnp.full((b, h, s // q_tile), nb, jnp.int32)

    def dense(q, k, v):
        return jnp.sum(jnp.sin(jax.nn.dot_product_attention(q, k, v, implementation="xla")))

    out, grads = value_and_grads("pallas", index, count, q, k, v, q_tile=q_tile, kv_block=kv_block)
    assert_close(out, jax.nn.dot_product_attention(q, k, v), 1e-5, "forward")
    for name, g, rg in zip(("dq", "dk", "dv"), grads, jax.grad(dense, argnums=(0, 1, 2))(q, k, v)):
        assert_close(g, rg, 1e-5, name)


@pytest.mark.parametrize("kv_block,rows_per_step", [(64, 128), (32, 16)])
def test_other_step_shapes(kv_block, rows_per_step):
    """Gathering two whole blocks per step, and a block spanning two contiguous steps; sm_scale given."""
    b, s, h, d, q_tile = 1, 256, 2, 64, 16
    q, k, v = qkv(jax.random.key(11), b, s, h, d)
    index, count = random_selection(jax.random.key(12), b, h, s // q_tile, s // kv_block, 3)
    tuning = SparseAttentionTuning(rows_per_step=rows_per_step)

    def pallas_loss(q, k, v):
        o = triton_attn.sparse_attention_pallas(
            q, k, v, index, count, q_tile=q_tile, kv_block=kv_block, sm_scale=0.3, tuning=tuning, interpret=True
        )
        return jnp.sum(jnp.sin(o)), o

    (_, out), grads = jax.jit(jax.value_and_grad(pallas_loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)

    def ref(q, k, v):
        return sparse_attention_reference(q, k, v, index, count, q_tile=q_tile, kv_block=kv_block, sm_scale=0.3)

    assert_close(out, ref(q, k, v), 1e-5, "forward")
    ref_grads = jax.grad(lambda *a: jnp.sum(jnp.sin(ref(*a))), argnums=(0, 1, 2))(q, k, v)
    for name, g, rg in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close(g, rg, 1e-5, name)


def test_bf16_inputs():
    b, s, h, d, q_tile, kv_block = 1, 128, 2, 64, 32, 1
    q, k, v = qkv(jax.random.key(5), b, s, h, d, jnp.bfloat16)
    index, count = random_selection(jax.random.key(6), b, h, s // q_tile, s, 21)
    out = sparse_attention(q, k, v, index, count, q_tile=q_tile, kv_block=kv_block, impl="pallas")
    assert out.dtype == jnp.bfloat16
    ref = sparse_attention_reference(
        q.astype(jnp.float32),
        k.astype(jnp.float32),
        v.astype(jnp.float32),
        index,
        count,
        q_tile=q_tile,
        kv_block=kv_block,
    )
    assert_close(out, ref, 2e-2, "bf16 forward")


def test_auto_is_the_reference_on_cpu():
    b, s, h, d = 1, 128, 2, 32
    q, k, v = qkv(jax.random.key(8), b, s, h, d)
    index, count = random_selection(jax.random.key(9), b, h, 4, 2, 1)
    auto = sparse_attention(q, k, v, index, count, q_tile=32, kv_block=64)
    np.testing.assert_array_equal(auto, sparse_attention_reference(q, k, v, index, count, q_tile=32, kv_block=64))


def test_longest_first_orders_row_blocks_by_their_pairs():
    """Descending pair counts, ties in ascending row-block order, per (batch, head)."""
    from pallas_kernels.sparse_index import longest_first

    starts = jnp.array([[[0, 2, 7, 7, 10, 12], [0, 0, 1, 2, 3, 4]]], jnp.int32)  # pairs [2,5,0,3,2], [0,1,1,1,1]
    assert longest_first(starts).tolist() == [[[1, 3, 0, 4, 2], [1, 2, 3, 4, 0]]]


@pytest.mark.parametrize(
    "kv_block,rows,counting",
    [(1, 64, False), (4, 32, False), (64, 64, True), (128, 64, True), (64, 64, False), (128, 64, False)],
)
def test_dkdv_worklist_is_the_transposed_index(kv_block, rows, counting, monkeypatch):
    """Both ways of ordering the pairs: by counting (whole blocks, small table) and by a sort."""
    import pallas_kernels.sparse_index as sparse_index

    if not counting:
        monkeypatch.setattr(sparse_index, "COUNTING_LIMIT", 0)
    b, h, s, q_tile = 2, 2, 512, 32
    n_sel = min(5, s // kv_block)
    index, count = random_selection(jax.random.key(kv_block), b, h, s // q_tile, s // kv_block, n_sel)
    index, count = sanitize_index(index, count, s // kv_block)
    order, starts, masks, per_tile = dkdv_worklist(index, count, kv_block=kv_block, rows=rows, seq_len=s)
    order, starts = np.asarray(order), np.asarray(starts)
    expected = dkdv_worklist_numpy(index, count, kv_block=kv_block, rows=rows, seq_len=s)
    full = (1 << rows) - 1
    for bi in range(b):
        for hi in range(h):
            for blk in range(s // rows):
                pairs = order[bi, hi, starts[bi, hi, blk] : starts[bi, hi, blk + 1]]
                got = []
                for p in pairs:
                    if masks is None:
                        bits = full
                    else:
                        bits = sum(int(np.uint32(w)) << (32 * i) for i, w in enumerate(np.asarray(masks[bi, hi, p])))
                    got.append((int(p) // per_tile, bits))
                assert got == expected.get((bi, hi, blk), []), (bi, hi, blk)


# ---------------------------------------------------------------------------------------------------
# lowrank_topk


def brute_force_scores(q_lr, k_lr, q_tile, kv_block, block_reduce):
    q, k = np.asarray(q_lr, np.float64), np.asarray(k_lr, np.float64)
    b, s, h, r = q.shape
    proxy = q.reshape(b, s // q_tile, q_tile, h, r).mean(2)
    scores = np.einsum("bthr,bshr->bhts", proxy, k).reshape(b, h, s // q_tile, s // kv_block, kv_block)
    return scores.mean(-1) if block_reduce == "mean" else scores.max(-1)


@pytest.mark.parametrize(
    "kv_block,block_reduce,top_k,q_tile,s",
    [(1, "mean", 37, 32, 256), (16, "max", 5, 64, 512), (32, "mean", 13, 64, 448), (4, "max", 9, 16, 160)],
)
def test_lowrank_topk_matches_brute_force_and_reference(kv_block, block_reduce, top_k, q_tile, s):
    b, h, r = 2, 3, 12
    ks = jax.random.split(jax.random.key(top_k), 2)
    q_lr = jax.random.normal(ks[0], (b, s, h, r), jnp.float32)
    k_lr = jax.random.normal(ks[1], (b, s, h, r), jnp.float32)
    kw = dict(q_tile=q_tile, kv_block=kv_block, block_reduce=block_reduce)
    got = np.asarray(lowrank_topk(q_lr, k_lr, top_k, impl="pallas", **kw))
    assert got.shape == (b, h, s // q_tile, top_k) and got.dtype == np.int32
    assert np.all(np.diff(got, axis=-1) > 0), "ids must be strictly ascending"
    scores = brute_force_scores(q_lr, k_lr, q_tile, kv_block, block_reduce)
    picked = np.take_along_axis(scores, got, axis=-1)
    kth = -np.sort(-scores, axis=-1)[..., top_k - 1]
    # The picked scores are exactly the top_k largest (up to fp32 rounding of near-equal scores).
    np.testing.assert_allclose(np.sort(picked, -1), np.sort(-np.sort(-scores, -1)[..., :top_k], -1), atol=1e-5)
    assert np.all(picked.min(-1) >= kth - 1e-5)
    ref = np.asarray(lowrank_topk_reference(q_lr, k_lr, top_k, **kw))
    assert np.mean(got == ref) > 0.99


@pytest.mark.parametrize("block_reduce", ["mean", "max"])
def test_lowrank_topk_ties_break_like_lax_top_k(block_reduce):
    """Small integer inputs: scores are exact and heavily tied; the lower id must win, as in the reference."""
    ks = jax.random.split(jax.random.key(4), 2)
    q_lr = jax.random.randint(ks[0], (1, 256, 2, 16), -1, 2).astype(jnp.float32)
    k_lr = jax.random.randint(ks[1], (1, 256, 2, 16), -1, 2).astype(jnp.float32)
    for kv_block, top_k in [(1, 50), (4, 9)]:
        kw = dict(q_tile=32, kv_block=kv_block, block_reduce=block_reduce)
        np.testing.assert_array_equal(
            lowrank_topk(q_lr, k_lr, top_k, impl="pallas", **kw), lowrank_topk_reference(q_lr, k_lr, top_k, **kw)
        )


def test_lowrank_topk_selects_everything_and_small_steps():
    ks = jax.random.split(jax.random.key(2), 2)
    q_lr = jax.random.normal(ks[0], (1, 128, 2, 16), jnp.bfloat16)
    k_lr = jax.random.normal(ks[1], (1, 128, 2, 16), jnp.bfloat16)
    everything = lowrank_topk(q_lr, k_lr, 8, q_tile=16, kv_block=16, impl="pallas")
    np.testing.assert_array_equal(everything, np.broadcast_to(np.arange(8), (1, 2, 8, 8)))
    tuned = lowrank_topk_pallas(
        q_lr,
        k_lr,
        30,
        q_tile=16,
        kv_block=1,
        block_reduce="mean",
        interpret=True,
        tuning=TopkTuning(tiles_per_program=16, keys_per_step=16, radix_bits=2),
    )
    np.testing.assert_array_equal(tuned, lowrank_topk_reference(q_lr, k_lr, 30, q_tile=16, kv_block=1))


def topk_is_exact(got, q_lr, k_lr, top_k, q_tile):
    """The ids are strictly ascending and their scores are the top_k largest (fp32 rounding aside)."""
    scores = brute_force_scores(q_lr, k_lr, q_tile, 1, "mean")
    assert np.all(np.diff(got, axis=-1) > 0)
    picked = np.sort(np.take_along_axis(scores, got, axis=-1), -1)
    np.testing.assert_allclose(picked, np.sort(-np.sort(-scores, -1)[..., :top_k], -1), atol=1e-5)


@pytest.mark.parametrize("top_k", [7, 120, 500])
def test_lowrank_topk_seeded_first_pass(top_k):
    """Token level with a sampled first pass (TopkTuning.sample): exact, also where the strided sample sees
    only outliers (every 32nd key scaled 50x: the seeds then miss and the even splits must recover)."""
    ks = jax.random.split(jax.random.key(top_k), 2)
    q_lr = jax.random.normal(ks[0], (1, 512, 2, 16), jnp.float32)
    k_lr = jax.random.normal(ks[1], (1, 512, 2, 16), jnp.float32)
    outliers = k_lr.at[:, ::32].multiply(50.0)
    tuning = TopkTuning(tiles_per_program=16, keys_per_step=32, sample=16)
    for keys in (k_lr, outliers):
        got = np.asarray(
            lowrank_topk_pallas(
                q_lr, keys, top_k, q_tile=32, kv_block=1, block_reduce="mean", interpret=True, tuning=tuning
            )
        )
        topk_is_exact(got, q_lr, keys, top_k, 32)


def exact_scores(values, r=16):
    """q_lr, k_lr [1, S, H, r] whose token-level scores are exactly values [H, S] (q rows e_0, keys v e_0)."""
    h, s = values.shape
    q_lr = np.zeros((1, s, h, r), np.float32)
    q_lr[..., 0] = 1.0
    k_lr = np.zeros((1, s, h, r), np.float32)
    k_lr[0, :, :, 0] = values.T
    return jnp.asarray(q_lr), jnp.asarray(k_lr)


@pytest.mark.parametrize(
    "bits,tau,sample", [(4, -1.7014147e38, 0), (8, -1.7014634e38, 0), (2, -1.7014122e38, 0), (4, 4.0977204e15, 16)]
)
def test_lowrank_topk_slowest_brackets_finish(bits, tau, sample):
    """Brackets that take the most counting passes: ten keys above tau, 100 tied at tau (no threshold ever has
    exactly top_k keys above it, so the bracket narrows to hi = lo + 1: 32 // radix_bits passes, 8 at 4 bits, 4 at
    8, 16 at 2), the rest -inf; or, seeded, the sampled value below tau at every 32nd key, so that the first pass
    misses and 9 passes are needed (experiments.bench_topk.bracket_passes replays them): a pass cap of
    32 // radix_bits would stop that one before its bracket closes and pick wrong ids."""
    s, q_tile, top_k = 512, 32, 60
    rng = np.random.default_rng(5)
    values = np.full((2, s), -np.inf, np.float32)
    free = np.setdiff1d(np.arange(s), np.arange(0, s, 32)) if sample else np.arange(s)
    for h in range(2):
        ids = rng.permutation(free)
        values[h, ids[:10]] = np.inf if sample else 5.0 + h
        values[h, ids[10:110]] = np.float32(tau)
        if sample:
            values[h, ::32] = np.float32(4.0945716e15)
    q_lr, k_lr = exact_scores(values)
    tuning = TopkTuning(tiles_per_program=16, keys_per_step=32, radix_bits=bits, sample=sample)
    got = lowrank_topk_pallas(
        q_lr, k_lr, top_k, q_tile=q_tile, kv_block=1, block_reduce="mean", interpret=True, tuning=tuning
    )
    np.testing.assert_array_equal(got, lowrank_topk_reference(q_lr, k_lr, top_k, q_tile=q_tile, kv_block=1))


def test_lowrank_topk_bucket_counters_flush_before_they_overflow():
    """Every key in one bucket, pass after pass (all tied but ten): each 8-bit counter of a key lane then counts
    one key per step, and 256 steps (4096 keys, 16 a step) would carry it into its neighbour's field if the
    counters were not summed out every FLUSH_STEPS = 255 steps; the last step is the remainder's flush."""
    s, q_tile, top_k = 4096, 256, 60
    values = np.ones((1, s), np.float32)
    values[0, np.random.default_rng(6).permutation(s)[:10]] = 2.0
    q_lr, k_lr = exact_scores(values)
    tuning = TopkTuning(tiles_per_program=16, keys_per_step=16, sample=0)
    got = lowrank_topk_pallas(
        q_lr, k_lr, top_k, q_tile=q_tile, kv_block=1, block_reduce="mean", interpret=True, tuning=tuning
    )
    np.testing.assert_array_equal(got, lowrank_topk_reference(q_lr, k_lr, top_k, q_tile=q_tile, kv_block=1))


@pytest.mark.parametrize("bits", [1, 4])
def test_lowrank_topk_counts_every_flush_window(bits):
    """Two full windows of FLUSH_STEPS steps and a remainder of three (8208 keys, 16 a step), random scores: a
    window that started at the wrong step would count some keys twice and miss others."""
    s, q_tile = 16 * (2 * 255 + 3), 432
    values = np.random.default_rng(bits).standard_normal((1, s)).astype(np.float32)
    q_lr, k_lr = exact_scores(values)
    tuning = TopkTuning(tiles_per_program=16, keys_per_step=16, radix_bits=bits, sample=0)
    for top_k in (5, 2000):
        got = lowrank_topk_pallas(
            q_lr, k_lr, top_k, q_tile=q_tile, kv_block=1, block_reduce="mean", interpret=True, tuning=tuning
        )
        np.testing.assert_array_equal(got, lowrank_topk_reference(q_lr, k_lr, top_k, q_tile=q_tile, kv_block=1))


def test_first_bracket_holds_the_kth_score():
    """The first pass's span (low, high) is ordered and, on random scores, brackets the true top_k-th largest key
    for nearly every tile (a wrong rank, e.g. counted from the wrong end, brackets none)."""
    b, s, h, r, q_tile, top_k = 1, 4096, 2, 16, 64, 410
    ks = jax.random.split(jax.random.key(3), 2)
    q_lr = jax.random.normal(ks[0], (b, s, h, r), jnp.float32)
    k_lr = jax.random.normal(ks[1], (b, s, h, r), jnp.float32)
    proxy = q_lr.reshape(b, s // q_tile, q_tile, h, r).mean(2).transpose(0, 2, 1, 3)
    seeds = np.asarray(lowrank_topk_triton.first_bracket(proxy, k_lr.transpose(0, 2, 1, 3), top_k, 256))
    assert seeds.shape == (b, h, s // q_tile, 2) and np.all(np.diff(seeds, axis=-1) >= 0)
    scores = jnp.einsum("bhtr,bhsr->bhts", proxy, k_lr.transpose(0, 2, 1, 3))
    kth = np.asarray(lowrank_topk_triton.sortable_key(-jnp.sort(-scores, axis=-1)[..., top_k - 1]))
    inside = (seeds[..., 0] <= kth) & (kth < seeds[..., -1])
    assert inside.mean() > 0.9, inside.mean()


def test_sharded_over_batch_and_heads():
    """With q, k, v split over B and H on an 8-device mesh, every device runs the kernels on its own
    (batch, head) shard: no all-gather, results sharded the same way, equal to the unsharded reference
    (with padded keys, kv_valid split over B, and lse through the backward); also inside shard_map (what
    context parallelism does)."""
    mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(2, 4), ("data", "heads"))
    b, s, h, d, q_tile, kv_block = 2, 128, 4, 32, 32, 16
    q, k, v = qkv(jax.random.key(31), b, s, h, d)
    index, count = random_selection(jax.random.key(32), b, h, s // q_tile, s // kv_block, 3)
    kv_valid = jax.random.randint(jax.random.key(33), (b, s // kv_block), 0, kv_block + 1, dtype=jnp.int32)
    rows, lists = NamedSharding(mesh, P("data", None, "heads")), NamedSharding(mesh, P("data", "heads"))
    per_batch = NamedSharding(mesh, P("data", None))
    args = [jax.device_put(x, rows) for x in (q, k, v)] + [jax.device_put(x, lists) for x in (index, count)]
    valid_sharded = jax.device_put(kv_valid, per_batch)

    def loss(impl, valid):
        def fn(q, k, v):
            o, lse = sparse_attention(
                q, k, v, *args[3:], q_tile=q_tile, kv_block=kv_block, kv_valid=valid, return_lse=True, impl=impl
            )
            return jnp.sum(jnp.sin(o)) + jnp.sum(jnp.where(jnp.isfinite(lse), jnp.cos(lse), 0.0)), (o, lse)

        return jax.value_and_grad(fn, argnums=(0, 1, 2), has_aux=True)

    compiled = jax.jit(loss("pallas", valid_sharded)).lower(*args[:3]).compile()
    assert "all-gather" not in compiled.as_text()
    (_, (out, lse)), grads = compiled(*args[:3])
    (_, (ref, ref_lse)), ref_grads = jax.jit(loss("xla", kv_valid))(q, k, v)
    assert out.sharding.is_equivalent_to(rows, 4) and grads[1].sharding.is_equivalent_to(rows, 4)
    assert_close(out, ref, 1e-5, "forward")
    finite = np.isfinite(np.asarray(ref_lse))
    assert_close(np.asarray(lse)[finite], np.asarray(ref_lse)[finite], 1e-5, "lse")
    for name, g, rg in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close(g, rg, 1e-5, name)

    local = jax.shard_map(
        lambda *a: sparse_attention(*a, q_tile=q_tile, kv_block=kv_block, impl="pallas"),
        mesh=mesh,
        in_specs=(rows.spec,) * 3 + (lists.spec,) * 2,
        out_specs=rows.spec,
        check_vma=False,
    )
    assert_close(
        jax.jit(local)(*args),
        sparse_attention_reference(q, k, v, index, count, q_tile=q_tile, kv_block=kv_block),
        1e-5,
        "forward in shard_map",
    )

    q_lr, k_lr = (jax.device_put(x[..., :16], rows) for x in (q, k))
    picked = jax.jit(lambda a, c, n: lowrank_topk(a, c, 3, q_tile=q_tile, kv_block=kv_block, kv_valid=n, impl="pallas"))
    assert "all-gather" not in picked.lower(q_lr, k_lr, valid_sharded).compile().as_text()
    np.testing.assert_array_equal(
        picked(q_lr, k_lr, valid_sharded),
        lowrank_topk_reference(q[..., :16], k[..., :16], 3, q_tile=q_tile, kv_block=kv_block, kv_valid=kv_valid),
    )


# ---------------------------------------------------------------------------------------------------
# errors and GPU lowering


def test_clear_errors_on_bad_inputs():
    q, k, v = qkv(jax.random.key(0), 1, 128, 2, 32)
    index, count = random_selection(jax.random.key(1), 1, 2, 4, 2, 1)
    with pytest.raises(ValueError, match="divisible by q_tile=48"):
        sparse_attention(q, k, v, index, count, q_tile=48, kv_block=64, impl="pallas")
    with pytest.raises(ValueError, match=r"kv_index must be \[B, H, S // q_tile, K\]"):
        sparse_attention(q, k, v, index[:, :1], count, q_tile=32, kv_block=64, impl="pallas")
    with pytest.raises(ValueError, match="kv_count must be"):
        sparse_attention(q, k, v, index, count[..., :2], q_tile=32, kv_block=64, impl="pallas")
    with pytest.raises(ValueError, match="share one shape"):
        sparse_attention(q, k[:, :64], v, index, count, q_tile=32, kv_block=64, impl="pallas")
    with pytest.raises(ValueError, match="q_tile=8 must be a power of two in 16..128"):
        sparse_attention(
            q,
            k,
            v,
            jnp.zeros((1, 2, 16, 1), jnp.int32),
            jnp.ones((1, 2, 16), jnp.int32),
            q_tile=8,
            kv_block=64,
            impl="pallas",
        )
    with pytest.raises(ValueError, match="impl='cuda'"):
        sparse_attention(q, k, v, index, count, q_tile=32, kv_block=64, impl="cuda")
    with pytest.raises(ValueError, match="top_k=3 must be in 1..2"):
        lowrank_topk(q[..., :16], k[..., :16], 3, q_tile=32, kv_block=64, impl="pallas")
    with pytest.raises(ValueError, match="block_reduce='sum'"):
        lowrank_topk(q[..., :16], k[..., :16], 1, q_tile=32, kv_block=64, block_reduce="sum", impl="pallas")
    with pytest.raises(ValueError, match="rows_per_step=48 must be a power of two"):
        SparseAttentionTuning(rows_per_step=48)
    with pytest.raises(ValueError, match="keys_per_step=8192 must be at most 4096"):
        TopkTuning(keys_per_step=8192)


@triton_lowering_on_cpu
def test_kernels_lower_to_triton_for_gpu():
    """The Pallas -> Triton lowering (what runs on the GPU) accepts every kernel, checked by lowering for CUDA
    (the per-shard bodies: under custom_partitioning the kernels are lowered when XLA partitions); also the
    variants that mask padded keys (kv_valid) and the backward from a row term that carries an lse cotangent."""
    s, d = 512, 128
    x = jax.ShapeDtypeStruct((1, s, 2, d), jnp.bfloat16)
    stat = jax.ShapeDtypeStruct((1, 2, s), jnp.float32)
    flags = jax.ShapeDtypeStruct((1, s), jnp.int32)

    def triton_calls(traced):
        return traced.lower(lowering_platforms=("cuda",)).as_text().count("__gpu$xla.gpu.triton")

    for kv_block, n_sel in [(1, 65), (16, 7), (64, 3)]:
        launch = triton_attn.LaunchConfig(
            q_tile=64,
            kv_block=kv_block,
            seq_len=s,
            head_dim=d,
            sm_scale=0.1,
            tuning=SparseAttentionTuning(),
            interpret=False,
        )
        idx = jax.ShapeDtypeStruct((1, 2, 8, launch.padded_count(n_sel)), jnp.int32)
        cnt = jax.ShapeDtypeStruct((1, 2, 8), jnp.int32)
        fwd = jax.jit(functools.partial(triton_attn._forward, launch=launch)).trace(x, x, x, idx, cnt)
        bwd = jax.jit(functools.partial(triton_attn._backward, launch=launch)).trace(x, x, x, idx, cnt, x, stat, x)
        assert triton_calls(fwd) == 1 and triton_calls(bwd) == 2  # dQ, dK/dV
        masked_fwd = jax.jit(lambda *a, launch=launch: triton_attn._forward(*a[:5], launch, a[5]))
        masked_bwd = jax.jit(lambda *a, launch=launch: triton_attn._backward_from_delta(*a[:8], launch, a[8]))
        assert triton_calls(masked_fwd.trace(x, x, x, idx, cnt, flags)) == 1
        assert triton_calls(masked_bwd.trace(x, x, x, idx, cnt, stat, x, stat, flags)) == 2
    lr = jax.ShapeDtypeStruct((1, 512, 2, 16), jnp.bfloat16)
    for kv_block, reduce in [(1, "mean"), (16, "max")]:
        static = (16, 64, kv_block, reduce, TopkTuning(), False)
        select = jax.jit(lambda a, b, static=static: lowrank_topk_triton._select(a, b, static))
        assert "__gpu$xla.gpu.triton" in select.trace(lr, lr).lower(lowering_platforms=("cuda",)).as_text()
        valid = jax.ShapeDtypeStruct((1, 512 // kv_block), jnp.int32)
        select = jax.jit(lambda a, b, n, static=static: lowrank_topk_triton._select(a, b, static, n))
        assert "__gpu$xla.gpu.triton" in select.trace(lr, lr, valid).lower(lowering_platforms=("cuda",)).as_text()
