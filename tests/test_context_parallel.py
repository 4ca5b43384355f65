"""Context parallelism on 8 fake CPU devices: every strategy and factorisation equals single-device
attention (outputs and gradients, dense and sparse with heterogeneous per-head sparsity); head
rebalancing; the planner's known optima; byte formulas against the traced collectives; overflow."""

import itertools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv_jax.attention import attention
from dsv_jax.config import ParallelConfig
from dsv_jax.parallel import ContextPlan, context_attention, make_mesh, select_kv_blocks, selective_capacity
from dsv_jax.parallel.comm import _subjaxprs, collective_bytes, context_bytes
from dsv_jax.parallel.hcp import balance_heads, balance_heads_host
from dsv_jax.parallel.planner import Hardware, KernelModel, Workload, candidate_cost, plan_attention
from pallas_kernels.lowrank_topk import lowrank_topk_reference
from pallas_kernels.sparse_attention import sparse_attention_reference
from tests.conftest import SMALL

B, S, H, D = 2, 256, 8, 16
QT = KB = 16  # query tile and KV block: 16 tiles/blocks over the sequence
NB = S // KB
PER_HEAD_K = (1, 2, 3, 5, 7, 9, 12, 15)  # heterogeneous per-head sparsity: 0.94 .. 0.06
ATOL = 3e-5


def device_loads(loads, perm, degree: int) -> np.ndarray:
    """Load of each device under an assignment from `balance_heads` ."""
    loads, perm = np.asarray(loads, np.float64), np.asarray(perm)
    return np.concatenate([loads, [0.0]])[perm].reshape(degree, -1).sum(axis=1)


@pytest.fixture(scope="module")
def mesh():
    return make_mesh(ParallelConfig(data=1, fsdp=1, context=8))


@pytest.fixture(scope="module")
def inputs():
    ks = jax.random.split(jax.random.key(7), 4)
    q, k, v = (jax.random.normal(kk, (B, S, H, D), jnp.float32) for kk in ks[:3])
    cot = jax.random.normal(ks[3], (B, S, H, D), jnp.float32)
    return q, k, v, cot


@pytest.fixture(scope="module")
def selection():
    """kv_index / kv_count with head h keeping PER_HEAD_K[h] of the 16 blocks (random, per tile; count
    varies by tile too), entries past the count filled with junk that must be ignored."""
    rng = np.random.default_rng(3)
    t = S // QT
    k_max = max(PER_HEAD_K)
    idx = np.full((B, H, t, k_max), 999, np.int32)
    cnt = np.zeros((B, H, t), np.int32)
    for b, h, i in itertools.product(range(B), range(H), range(t)):
        c = max(1, PER_HEAD_K[h] - (i % 2))
        idx[b, h, i, :c] = np.sort(rng.choice(NB, c, replace=False))
        cnt[b, h, i] = c
    return jnp.asarray(idx), jnp.asarray(cnt)


def fwd_and_grads(f, q, k, v, cot):
    out, vjp = jax.vjp(f, q, k, v)
    return (out, *vjp(cot))


def assert_close(got, want):
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=ATOL, rtol=1e-4)


KV_LENS = jnp.array([S, 203], jnp.int32)


@pytest.fixture(scope="module")
def dense_ref(inputs):
    q, k, v, cot = inputs
    f = lambda q, k, v: attention(q, k, v, backend="xla", kv_lens=KV_LENS)
    return jax.jit(lambda q, k, v, c: fwd_and_grads(f, q, k, v, c))(q, k, v, cot)


@pytest.fixture(scope="module")
def sparse_ref(inputs, selection):
    q, k, v, cot = inputs
    idx, cnt = selection
    f = lambda q, k, v: sparse_attention_reference(q, k, v, idx, cnt, q_tile=QT, kv_block=KB)
    return jax.jit(lambda q, k, v, c: fwd_and_grads(f, q, k, v, c))(q, k, v, cot)


# (strategy, (HCP, SCP) degrees, SCP strategy): each factorisation 1x8, 2x4, 4x2, 8x1 appears.
DENSE_CASES = [
    ("ulysses", None, None),
    ("ring", None, None),
    ("allgather", None, None),
    ("hybrid", (2, 4), "ring"),
    ("hybrid", (4, 2), "allgather"),
    ("hybrid", (8, 1), None),
]
# (pure "selective" 1x8 runs in test_selective_capacity_overflow_is_counted_and_exact)
SPARSE_CASES = [
    ("ulysses", None, None),
    ("ring", None, None),
    ("allgather", None, None),
    ("hybrid", (2, 4), "selective"),
    ("hybrid", (4, 2), "selective"),
    ("hybrid", (4, 2), "ring"),
    ("hybrid-uneven", (4, 2), "allgather"),
]


def _shard_map_meshes(jaxpr):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "shard_map":
            yield eqn.params["mesh"]
        for _, sub in _subjaxprs(eqn):
            yield from _shard_map_meshes(sub)


@pytest.mark.parametrize(
    "strategy, degrees, scp",
    [
        ("ulysses", None, None),
        ("ring", None, None),
        ("allgather", None, None),
        ("hybrid", (8, 1), None),
        ("hybrid", (1, 8), "selective"),
        ("hybrid", (2, 4), "ring"),
        ("hybrid", (4, 2), "allgather"),
        ("hybrid", (2, 4), "selective"),
    ],
)
def test_every_strategy_keeps_the_callers_mesh(mesh, inputs, selection, strategy, degrees, scp):
    """On the GPU, jit rejects a program whose shardings name two meshes once it holds device-bound
    custom calls (cuDNN, Pallas): every strategy, pure or a true hybrid (both degrees > 1), must run
    on the caller's mesh, with its gradients."""
    q, k, v, cot = inputs
    idx, cnt = selection
    f = lambda q, k, v: context_attention(
        q,
        k,
        v,
        mesh=mesh,
        strategy=strategy,
        degrees=degrees,
        scp=scp,
        kv_index=idx,
        kv_count=cnt,
        q_tile=QT,
        kv_block=KB,
    )
    jaxpr = jax.make_jaxpr(lambda q, k, v, c: fwd_and_grads(f, q, k, v, c))(q, k, v, cot).jaxpr
    meshes = list(_shard_map_meshes(jaxpr))
    assert meshes and all(m.shape_tuple == mesh.shape_tuple and m.axis_names == mesh.axis_names for m in meshes)


def test_cross_attention_runs_per_device_and_matches(mesh, inputs):
    """DiT's text cross-attention under context parallelism: queries stay on their device (inside a
    shard_map on the plan's mesh, where cuDNN accepts them) and the result equals plain attention."""
    q, _, _, cot = inputs
    kt, vt = (jax.random.normal(jax.random.key(i), (B, 8, H, D), jnp.float32) for i in (11, 12))
    lens = jnp.array([8, 5], jnp.int32)
    plan = ContextPlan(mesh, "hybrid", backend="xla")
    f = lambda q, k, v: plan.cross_attention(q, k, v, kv_lens=lens)
    want = fwd_and_grads(lambda q, k, v: attention(q, k, v, backend="xla", kv_lens=lens), q, kt, vt, cot)
    assert_close(jax.jit(lambda *a: fwd_and_grads(f, *a))(q, kt, vt, cot), want)
    meshes = list(_shard_map_meshes(jax.make_jaxpr(f)(q, kt, vt).jaxpr))
    assert len(meshes) == 1 and meshes[0].axis_names == mesh.axis_names


@pytest.mark.parametrize("strategy, degrees, scp", DENSE_CASES)
def test_dense_equals_single_device(mesh, inputs, dense_ref, strategy, degrees, scp):
    q, k, v, cot = inputs
    f = lambda q, k, v: context_attention(
        q, k, v, mesh=mesh, strategy=strategy, degrees=degrees, scp=scp, kv_lens=KV_LENS, q_chunk=16
    )
    assert_close(jax.jit(lambda q, k, v, c: fwd_and_grads(f, q, k, v, c))(q, k, v, cot), dense_ref)


@pytest.mark.parametrize("strategy, degrees, scp", SPARSE_CASES)
def test_sparse_equals_single_device(mesh, inputs, selection, sparse_ref, strategy, degrees, scp):
    q, k, v, cot = inputs
    idx, cnt = selection
    slots = 3 if strategy == "hybrid-uneven" else None  # 3 head slots per device instead of 2
    capacity = None
    if scp == "selective":  # exactly the capacity this selection needs: no overflow, nothing to spare
        capacity = int(selective_capacity(idx, cnt, mesh=mesh, degrees=degrees, q_tile=QT, kv_block=KB))
        assert 0 < capacity < B * (H // degrees[0]) * (S // degrees[1] // KB)  # less than everything
    f = lambda q, k, v: context_attention(
        q,
        k,
        v,
        mesh=mesh,
        strategy=strategy.split("-")[0],
        degrees=degrees,
        scp=scp,
        kv_index=idx,
        kv_count=cnt,
        q_tile=QT,
        kv_block=KB,
        hcp_slots=slots,
        capacity=capacity,
        return_stats=True,
    )

    def run(q, k, v, c):
        (out, stats), vjp = jax.vjp(f, q, k, v)
        return (out, *vjp((c, jax.tree.map(jnp.zeros_like, stats)))), stats

    got, stats = jax.jit(run)(q, k, v, cot)
    assert_close(got, sparse_ref)
    assert int(stats["fallback"]) == 0 and int(stats["overflow_blocks"]) == 0


@pytest.mark.parametrize(
    "strategy, degrees, scp, sparse", [("hybrid", (2, 4), "ring", False), ("allgather", None, None, True)]
)
def test_sequence_only_sharding_on_an_explicit_mesh(
    inputs, selection, dense_ref, sparse_ref, strategy, degrees, scp, sparse
):
    """q, k, v sharded over the sequence alone, P(None, 'context', None, None), on a (1, 1, 8) mesh of
    Explicit axes (`jax.make_mesh`'s default, where shard_map rejects a layout other than its own):
    context_attention reshards them and equals single-device attention, gradients included."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((1, 1, 8), ("data", "fsdp", "context"))
    seq_only = NamedSharding(mesh, P(None, "context", None, None))
    q, k, v, cot = (jax.device_put(x, seq_only) for x in inputs)
    idx, cnt = selection if sparse else (None, None)
    f = lambda q, k, v: context_attention(
        q,
        k,
        v,
        mesh=mesh,
        strategy=strategy,
        degrees=degrees,
        scp=scp,
        kv_lens=None if sparse else KV_LENS,
        kv_index=idx,
        kv_count=cnt,
        q_tile=QT,
        kv_block=KB,
        q_chunk=16,
    )
    assert_close(
        jax.jit(lambda q, k, v, c: fwd_and_grads(f, q, k, v, c))(q, k, v, cot), sparse_ref if sparse else dense_ref
    )


def test_selection_from_low_rank_keys_matches_reference(mesh):
    ks = jax.random.split(jax.random.key(11), 2)
    q_lr, k_lr = (jax.random.normal(kk, (B, S, H, 4)) for kk in ks)
    idx, cnt = jax.jit(lambda a, b: select_kv_blocks(a, b, 5, mesh=mesh, q_tile=QT, kv_block=KB))(q_lr, k_lr)
    np.testing.assert_array_equal(idx, lowrank_topk_reference(q_lr, k_lr, 5, q_tile=QT, kv_block=KB))
    assert np.all(np.asarray(cnt) == 5)
    # per-head counts: head h keeps its best PER_HEAD_K[h] of the same ranking
    idx_h, cnt_h = select_kv_blocks(q_lr, k_lr, PER_HEAD_K, mesh=mesh, q_tile=QT, kv_block=KB)
    for h, kh in enumerate(PER_HEAD_K):
        want = lowrank_topk_reference(q_lr, k_lr, kh, q_tile=QT, kv_block=KB)[:, h]
        np.testing.assert_array_equal(np.asarray(idx_h)[:, h, :, :kh], want)
        assert np.all(np.asarray(cnt_h)[:, h] == kh)


# -- HCP rebalancing --------------------------------------------------------------------------


def test_balance_heads_lowers_straggler_and_is_a_valid_assignment():
    rng = np.random.default_rng(0)
    removed = []
    balance = jax.jit(balance_heads, static_argnums=1)  # one compile per (heads, degree)
    for trial in range(12):
        for heads, degree in ((8, 4), (16, 4), (24, 8), (16, 2), (16, 8)):
            keep = rng.uniform(0.02, 0.2, heads)
            keep[: heads // 4] = rng.uniform(0.5, 1.0, heads // 4)  # the dense heads side by side: skewed
            perm = np.asarray(balance(keep, degree))
            assert sorted(perm.tolist()) == list(range(heads))
            balanced, contiguous = device_loads(keep, perm, degree), device_loads(keep, np.arange(heads), degree)
            assert balanced.max() < contiguous.max()
            best = _best_split(keep, degree) if heads <= 8 else None
            if best is not None:
                assert balanced.max() <= best * (1 + 1e-6)  # small case: the optimum itself
            # the host copy (planner) reaches the same straggler as the runtime (jitted) one
            host = [keep[g].sum() for g in balance_heads_host(keep, degree)]
            assert max(host) == pytest.approx(balanced.max(), rel=1e-5)
            mean = keep.sum() / degree
            removed.append(1 - (balanced.max() - mean) / (contiguous.max() - mean))
    assert np.mean(removed) > 0.8  # most of the straggler excess goes
    np.testing.assert_array_equal(balance_heads(keep, degree), perm)  # eager == jitted


def _best_split(keep, degree):
    """Exhaustive optimum of equal-size groups (small head counts only)."""
    heads, per = len(keep), len(keep) // degree
    best = np.inf

    def rec(left, worst):
        nonlocal best
        if worst >= best:
            return
        if not left:
            best = worst
            return
        first = left[0]
        for rest in itertools.combinations(left[1:], per - 1):
            g = (first, *rest)
            rec([x for x in left if x not in g], max(worst, keep[list(g)].sum()))

    rec(list(range(heads)), 0.0)
    return best


def test_extra_head_slots_balance_what_equal_counts_cannot():
    keep = np.array([0.4, 0.3, 0.2, 0.15] + [0.05] * 12)  # four dense heads: equal counts leave one per device
    equal = device_loads(keep, np.asarray(balance_heads(keep, 4)), 4)
    uneven_perm = np.asarray(balance_heads(keep, 4, slots=7))
    uneven = device_loads(keep, uneven_perm, 4)
    assert equal.max() == pytest.approx(0.4 + 3 * 0.05)  # the best equal split
    # the optimum: 0.4 alone, 0.3 + 2 light, 0.2 + 4 light, 0.15 + 6 light (heads come in steps of 0.05)
    assert uneven.max() == pytest.approx(0.45) and uneven.sum() == pytest.approx(keep.sum())
    real = uneven_perm[uneven_perm < 16]
    assert sorted(real.tolist()) == list(range(16)) and uneven_perm.shape == (28,)
    host = [keep[g].sum() for g in balance_heads_host(keep, 4, slots=7)]
    assert max(host) == pytest.approx(uneven.max(), rel=1e-5)


def test_rebalanced_hcp_is_exact_and_lowers_max_device_load(mesh, inputs, selection, sparse_ref):
    q, k, v, _ = inputs
    idx, cnt = selection
    run = jax.jit(
        lambda q, k, v, perm: context_attention(
            q,
            k,
            v,
            mesh=mesh,
            strategy="hybrid",
            degrees=(4, 2),
            scp="allgather",
            kv_index=idx,
            kv_count=cnt,
            q_tile=QT,
            kv_block=KB,
            head_perm=perm,
            return_stats=True,
        )
    )
    out_in_order, st_in_order = run(q, k, v, jnp.arange(H))
    out_auto, st_auto = jax.jit(
        lambda q, k, v: context_attention(
            q,
            k,
            v,
            mesh=mesh,
            strategy="hybrid",
            degrees=(4, 2),
            scp="allgather",
            kv_index=idx,
            kv_count=cnt,
            q_tile=QT,
            kv_block=KB,
            return_stats=True,
        )
    )(q, k, v)
    # a different permutation is another runtime input of the same compiled program
    out_rev, _ = run(q, k, v, jnp.arange(H)[::-1])
    assert run._cache_size() == 1
    for o in (out_in_order, out_auto, out_rev):
        np.testing.assert_allclose(o, sparse_ref[0], atol=ATOL)
    assert float(st_auto["max_head_load"]) < float(st_in_order["max_head_load"])
    assert np.isclose(float(st_auto["mean_head_load"]), float(st_in_order["mean_head_load"]))


# -- selective exchange: capacity and overflow ----------------------------------------------------


def _expected_requests(idx, cnt, n):
    """Per device (SCP of n over the whole sequence), remote blocks needed from each peer."""
    idx, cnt = np.asarray(idx), np.asarray(cnt)
    t_loc, nb_loc = (S // QT) // n, NB // n
    req = np.zeros((n, n), np.int64)
    for me in range(n):
        for b, h in itertools.product(range(B), range(H)):
            blocks = set()
            for t in range(me * t_loc, (me + 1) * t_loc):
                blocks |= set(idx[b, h, t, : cnt[b, h, t]].tolist())
            for g in blocks:
                if g // nb_loc != me:
                    req[me, g // nb_loc] += 1
    return req


@pytest.mark.parametrize("capacity", [None, 9])
def test_selective_capacity_overflow_is_counted_and_exact(mesh, inputs, selection, sparse_ref, capacity):
    q, k, v, cot = inputs
    idx, cnt = selection
    req = _expected_requests(idx, cnt, 8)
    assert int(selective_capacity(idx, cnt, mesh=mesh, q_tile=QT, kv_block=KB)) == req.max()
    assert capacity is None or req.max() > capacity  # the small capacity really overflows

    def f(q, k, v):
        return context_attention(
            q,
            k,
            v,
            mesh=mesh,
            strategy="selective",
            kv_index=idx,
            kv_count=cnt,
            q_tile=QT,
            kv_block=KB,
            capacity=capacity,
            return_stats=True,
        )

    (out, stats), vjp = jax.jit(lambda q, k, v: jax.vjp(f, q, k, v))(q, k, v)
    grads = vjp((cot, jax.tree.map(jnp.zeros_like, stats)))
    assert_close((out, *grads), sparse_ref)
    assert int(stats["requested_blocks"]) == req.sum()
    want_overflow = 0 if capacity is None else int(np.maximum(req - capacity, 0).sum())
    assert int(stats["overflow_blocks"]) == want_overflow
    assert int(stats["fallback"]) == int(want_overflow > 0)


def _empty_shard_map_inputs(jaxpr):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "shard_map":
            yield from (v.aval for v in eqn.invars if 0 in getattr(v.aval, "shape", ()))
        for _, sub in _subjaxprs(eqn):
            yield from _empty_shard_map_inputs(sub)


def test_selective_under_remat_in_a_scan_passes_no_empty_residuals(mesh, inputs, selection, sparse_ref):
    """Selective SCP as the model's blocks run it (remat inside a scan), with a buffer that needs no
    padding (q_tile = kv_block). A 0-row padding piece once became a residual of the gradient's shard_map;
    on jax 0.11.2 XLA then left that shard_map with an unread input and Shardy segfaulted removing it."""
    q, k, v, cot = inputs
    idx, cnt = selection
    att = jax.checkpoint(
        lambda q, k, v: context_attention(
            q, k, v, mesh=mesh, strategy="selective", kv_index=idx, kv_count=cnt, q_tile=QT, kv_block=KB
        )
    )
    f = lambda q, k, v: jax.lax.scan(lambda c, _: (c, att(q, k, v)), 0, None, length=1)[1][0]
    run = lambda q, k, v, c: fwd_and_grads(f, q, k, v, c)
    assert not list(_empty_shard_map_inputs(jax.make_jaxpr(run)(q, k, v, cot).jaxpr))
    assert_close(jax.jit(run)(q, k, v, cot), sparse_ref)


# -- communication accounting ---------------------------------------------------------------------


@pytest.mark.parametrize("sparse", [False, True])
def test_byte_formulas_match_traced_collectives(sparse, selection):
    mesh = make_mesh(ParallelConfig(data=1, fsdp=2, context=4))
    q = jnp.ones((4, S, H, D), jnp.bfloat16)
    idx = jnp.zeros((4, H, S // QT, 6), jnp.int32)
    cnt = jnp.ones((4, H, S // QT), jnp.int32)
    cases = [
        ("ulysses", (4, 1), "allgather"),
        ("ring", (1, 4), "ring"),
        ("allgather", (1, 4), "allgather"),
        ("hybrid", (2, 2), "ring"),
        ("hybrid", (2, 2), "allgather"),
    ]
    if sparse:
        cases += [("selective", (1, 4), "selective"), ("hybrid", (2, 2), "selective"), ("hybrid", (4, 1), "slots-6")]
    for strategy, (ph, ps), scp in cases:
        kw = dict(kv_index=idx, kv_count=cnt, q_tile=QT, kv_block=KB) if sparse else {}
        slots = int(scp.split("-")[1]) if scp.startswith("slots") else None
        scp = "allgather" if slots else scp
        f = lambda q, k, v: context_attention(
            q, k, v, mesh=mesh, strategy=strategy, degrees=(ph, ps), scp=scp, capacity=7, hcp_slots=slots, **kw
        )
        fwd = collective_bytes(f, q, q, q)["total"]
        both = collective_bytes(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32)), (0, 1, 2)), q, q, q)[
            "total"
        ]
        want = context_bytes(
            hcp=ph,
            scp=ps,
            scp_strategy=scp,
            batch=2,
            seq_len=S,
            heads=H,
            head_dim=D,
            itemsize=2,
            sparse=sparse,
            top_k=6,
            q_tile=QT,
            kv_block=KB,
            capacity=7,
            mesh_devices=8,
            hcp_slots=slots,
        )
        assert fwd == pytest.approx(want["forward"]), (strategy, ph, ps, scp)
        assert both == pytest.approx(want["total"]), (strategy, ph, ps, scp)
    # selective moves (capacity / a peer's blocks) of the ring's K/V bytes
    ring = context_bytes(hcp=1, scp=4, scp_strategy="ring", batch=2, seq_len=S, heads=H, head_dim=D, itemsize=2)
    peer_blocks = 2 * H * (S // 4 // KB)
    sel = context_bytes(
        hcp=1,
        scp=4,
        scp_strategy="selective",
        batch=2,
        seq_len=S,
        heads=H,
        head_dim=D,
        itemsize=2,
        sparse=True,
        capacity=peer_blocks // 10,
        kv_block=KB,
    )
    kv_sel = 2 * 3 * (peer_blocks // 10) * KB * D * 2
    assert kv_sel == pytest.approx(ring["scp_forward"] * (peer_blocks // 10) / peer_blocks)
    assert sel["scp_forward"] < 0.11 * ring["scp_forward"]


# -- planner ------------------------------------------------------------------------------------

FAST = KernelModel(dense_tflops=1e12)  # compute ~ free: plans are decided by communication
NVL_ONLY = Hardware(nvlink_gbps=100.0, ib_gbps=1.0, efficiency=1.0, gpus_per_node=8, hop_latency_s=0.0)


def test_planner_communication_bound_optima_and_cost_formula():
    w = Workload(seq_len=4096, heads=8, head_dim=64, itemsize=2, recompute_forward=True)
    plan = plan_attention(w, 8, NVL_ONLY, FAST)
    assert (plan.hcp, plan.scp) == (8, 1) and plan.strategy == "ulysses"  # all-to-all moves the fewest bytes
    x = 4096 // 8 * 8 * 64 * 2
    # forward (twice: remat) and backward all-to-alls of 4 tensors, 7/8 of each leaves the device
    assert plan.cost.bytes_sent == pytest.approx(12 * 7 / 8 * x)
    assert plan.cost.comm_s == pytest.approx(12 * 7 / 8 * x / 100e9, rel=1e-6)
    # two heads: HCP at most 2; all-gather over the remaining 4 beats the ring's extra fp32 dK/dV hops
    plan2 = plan_attention(Workload(seq_len=4096, heads=2, head_dim=256), 8, NVL_ONLY, FAST)
    assert (plan2.hcp, plan2.scp, plan2.scp_strategy) == (2, 4, "allgather")


def test_planner_respects_memory_cap_and_overlap():
    w = Workload(seq_len=4096, heads=2, head_dim=4096)  # wide heads: K/V dominate the ring's logits block
    gather = candidate_cost(w, 2, 4, "allgather", NVL_ONLY, FAST)
    ring = candidate_cost(w, 2, 4, "ring", NVL_ONLY, FAST)
    assert ring.memory_bytes < gather.memory_bytes
    capped = plan_attention(w, 8, NVL_ONLY, FAST, memory_cap=(ring.memory_bytes + gather.memory_bytes) / 2)
    assert capped.scp_strategy == "ring" and capped.cost.memory_bytes <= gather.memory_bytes
    with pytest.raises(ValueError, match="fits the memory cap"):
        plan_attention(w, 8, NVL_ONLY, FAST, memory_cap=1.0)
    # compute-bound (slow kernels): the ring hides its hops behind the blocks, so it wins
    slow = KernelModel(dense_tflops=1.0)
    plan = plan_attention(w, 8, NVL_ONLY, slow)
    assert plan.scp_strategy == "ring" and plan.cost.comm_s == pytest.approx(0.0)


def test_planner_rebalancing_and_selective_on_skewed_sparse_heads():
    skew = (0.2, 0.3, 0.95, 0.95, 0.95, 0.95, 0.95, 0.95)  # two dense-ish heads
    w = Workload(seq_len=8192, heads=8, head_dim=64, head_sparsity=skew, recompute_forward=False)
    km = KernelModel(dense_tflops=100.0, sparse_efficiency=1.0)
    balanced = candidate_cost(w, 8 // 2, 2, "selective", NVL_ONLY, km)
    naive = candidate_cost(w, 8 // 2, 2, "selective", NVL_ONLY, km, rebalance=False)
    # in order, heads 0 and 1 land on one device: load 1.5 against a mean of 0.45 per device
    assert max(naive.device_loads) == pytest.approx(1.5)
    # LPT: 0.8 and 0.7 open two devices, the light heads fill the others, then pair with 0.7 and 0.8
    assert max(balanced.device_loads) == pytest.approx(0.85)  # the optimum under 2 heads per device
    assert balanced.compute_s < naive.compute_s
    # pure SCP: selective fetches only what the tiles need; compute is the same, so it beats all-gather
    sel = candidate_cost(w, 1, 8, "selective", NVL_ONLY, km)
    gat = candidate_cost(w, 1, 8, "allgather", NVL_ONLY, km)
    assert sel.compute_s == pytest.approx(gat.compute_s) and sel.time_s < gat.time_s
    assert sel.bytes_sent < np.mean([1 - s for s in skew]) * gat.bytes_sent * 1.01


# -- errors ---------------------------------------------------------------------------------------


def test_errors_name_the_problem(mesh, inputs, selection):
    q, k, v, _ = inputs
    with pytest.raises(ValueError, match="6 heads over an HCP degree of 8"):
        context_attention(q[:, :, :6], k[:, :, :6], v[:, :, :6], mesh=mesh, strategy="ulysses")
    with pytest.raises(ValueError, match="250 is not divisible by the context axis size 8"):
        context_attention(q[:, :250], k[:, :250], v[:, :250], mesh=mesh, strategy="ring")
    with pytest.raises(ValueError, match="needs kv_index and kv_count"):
        context_attention(q, k, v, mesh=mesh, strategy="selective")
    with pytest.raises(ValueError, match="strategy='nope'"):
        context_attention(q, k, v, mesh=mesh, strategy="nope")
    with pytest.raises(ValueError, match="do not multiply to the context axis size 8"):
        context_attention(q, k, v, mesh=mesh, strategy="hybrid", degrees=(2, 2))


def test_plan_pads_sequences_that_do_not_divide(mesh, inputs):
    q, k, v, _ = inputs
    s = 203  # e.g. MMDiT's joint video + text tokens
    lens = jnp.array([s, 150], jnp.int32)
    plan = ContextPlan(mesh, "hybrid", options=(("degrees", (4, 2)), ("scp", "ring")))
    got = jax.jit(lambda q, k, v: attention(q, k, v, backend=plan, kv_lens=lens))(q[:, :s], k[:, :s], v[:, :s])
    want = attention(q[:, :s], k[:, :s], v[:, :s], backend="xla", kv_lens=lens)
    np.testing.assert_allclose(got, want, atol=ATOL)
    assert hash(plan) == hash(ContextPlan(mesh, "hybrid", options=(("degrees", (4, 2)), ("scp", "ring"))))


# -- training through the CLI ---------------------------------------------------------------------


def test_cli_trains_with_context_parallelism(tmp_path):
    wd = str(tmp_path / "run")
    env = dict(os.environ)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "dsv_jax",
            "train",
            "--config",
            "tiny",
            "--workdir",
            wd,
            "--steps",
            "2",
            "--no-progress",
            *SMALL,
            "data.buckets=[[4,16,16]]",
            "data.bucket_weights=[1.0]",
            "parallel.fsdp=2",
            "parallel.context=4",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    with open(os.path.join(wd, "metrics.jsonl")) as f:
        recs = [json.loads(x) for x in f if x.strip()]
    losses = [m["loss"] for m in recs if "loss" in m]
    assert len(losses) == 2 and all(np.isfinite(losses))
    assert all(m["cp/bytes_per_step"] > 0 for m in recs if "loss" in m)
    # the plan and bytes per layer of the bucket (64 tokens, 2 heads x 16, float32, 1 sample per device)
    info = next(m for m in recs if "compile_seconds" in m)
    plan = info["cp/4x16x16/plan"]
    (ph, ps), strat = map(int, plan.split()[0].split("x")), plan.split()[1]
    want = context_bytes(
        hcp=ph,
        scp=ps,
        scp_strategy="allgather" if strat == "ulysses" else strat,
        batch=1,
        seq_len=64,
        heads=2,
        head_dim=16,
        itemsize=4,
    )
    assert ph * ps == 4 and want["total"] > 0
    assert info["cp/4x16x16/bytes_per_layer"] == pytest.approx(want["total"])


KV_VALID = jnp.asarray(np.random.default_rng(5).integers(0, KB + 1, (B, NB)).astype(np.int32))  # 0..16 per block
PADDED_CASES = [
    ("ulysses", None, None),
    ("ring", None, None),
    ("allgather", None, None),
    ("hybrid", (2, 4), "selective"),
]


@pytest.mark.parametrize("strategy, degrees, scp", PADDED_CASES)
def test_sparse_with_padded_blocks_and_lse_equals_single_device(mesh, inputs, selection, strategy, degrees, scp):
    """Padded KV blocks (kv_valid, some empty) and the log-sum-exp output, forward and gradients with
    cotangents for both o and lse: what MMDiT's merge and padded layouts need under every strategy."""
    q, k, v, cot = inputs
    idx, cnt = selection
    lse_cot = jax.random.normal(jax.random.key(9), (B, H, S))

    def run(f):
        def go(q, k, v):
            (o, lse), vjp = jax.vjp(f, q, k, v)
            return (o, jnp.where(jnp.isfinite(lse), lse, 0.0), *vjp((cot, lse_cot)))

        return jax.jit(go)(q, k, v)

    want = run(
        lambda q, k, v: sparse_attention_reference(
            q, k, v, idx, cnt, q_tile=QT, kv_block=KB, kv_valid=KV_VALID, return_lse=True
        )
    )
    got = run(
        lambda q, k, v: context_attention(
            q,
            k,
            v,
            mesh=mesh,
            strategy=strategy,
            degrees=degrees,
            scp=scp,
            kv_index=idx,
            kv_count=cnt,
            q_tile=QT,
            kv_block=KB,
            kv_valid=KV_VALID,
            return_lse=True,
            q_chunk=16,
        )
    )
    assert_close(got, want)


# -- the sparse ring: the kernel on each visiting chunk ------------------------------------------------

RING_B, RING_H = 1, 2  # small: the Pallas interpreter runs each chunk's kernels on every fake device


@pytest.fixture(scope="module")
def ring_case():
    """q, k, v [1, 256, 2, 16] (two tiles and two KV blocks per device), cotangents for (o, lse), and a
    selection of 1..6 of the 16 blocks per tile whose live ids are shuffled (the ring must not rely on
    their order), with kv_count 0 at head 1, tile 3, and garbage past the counts; kv_valid with partly
    and fully padded blocks."""
    ks = jax.random.split(jax.random.key(21), 5)
    q, k, v, cot = (jax.random.normal(kk, (RING_B, S, RING_H, D), jnp.float32) for kk in ks[:4])
    lse_cot = jax.random.normal(ks[4], (RING_B, RING_H, S))
    rng = np.random.default_rng(22)
    t = S // QT
    idx = rng.integers(-NB, 2 * NB, (RING_B, RING_H, t, 6)).astype(np.int32)
    cnt = rng.integers(1, 7, (RING_B, RING_H, t)).astype(np.int32)
    cnt[0, 1, 3] = 0
    for h, i in itertools.product(range(RING_H), range(t)):
        idx[0, h, i, : cnt[0, h, i]] = rng.choice(NB, cnt[0, h, i], replace=False)  # unsorted
    kv_valid = rng.integers(0, KB + 1, (RING_B, NB)).astype(np.int32)
    return (q, k, v), (cot, lse_cot), (jnp.asarray(idx), jnp.asarray(cnt)), jnp.asarray(kv_valid)


def outputs_and_grads_with_lse(f, q, k, v, cot, lse_cot):
    def go(q, k, v):
        (o, lse), vjp = jax.vjp(f, q, k, v)
        return (o, lse, *vjp((cot, lse_cot)))

    return jax.jit(go)(q, k, v)


def sparse_ring(mesh, idx, cnt, kv_valid, impl):
    return lambda q, k, v: context_attention(
        q,
        k,
        v,
        mesh=mesh,
        strategy="ring",
        kv_index=idx,
        kv_count=cnt,
        q_tile=QT,
        kv_block=KB,
        kv_valid=kv_valid,
        impl=impl,
        return_lse=True,
    )


@pytest.mark.parametrize("impl, padded", [("xla", False), ("xla", True), ("pallas", False), ("pallas", True)])
def test_sparse_ring_runs_the_kernel_per_chunk_and_equals_single_device(mesh, ring_case, impl, padded):
    """The sparse ring (each chunk's share of the selection through sparse_attention, the backward through
    sparse_attention_backward under the merged statistics) equals single-device sparse attention: o, lse
    and the gradients of q, k, v for cotangents of both. Every tile misses most chunks; one tile selects
    nothing (lse = -inf, zero dq); padded: some blocks partly or fully padded."""
    (q, k, v), cots, (idx, cnt), kv_valid = ring_case
    kv_valid = kv_valid if padded else None
    want = outputs_and_grads_with_lse(
        lambda q, k, v: sparse_attention_reference(
            q, k, v, idx, cnt, q_tile=QT, kv_block=KB, kv_valid=kv_valid, return_lse=True
        ),
        q,
        k,
        v,
        *cots,
    )
    got = outputs_and_grads_with_lse(sparse_ring(mesh, idx, cnt, kv_valid, impl), q, k, v, *cots)
    lse, want_lse = np.asarray(got[1]), np.asarray(want[1])
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    assert np.all(np.isneginf(lse[0, 1, 3 * QT : 4 * QT]))  # the tile with kv_count 0
    finite = np.isfinite(want_lse)
    assert_close((got[0], lse[finite], *got[2:]), (want[0], want_lse[finite], *want[2:]))
    assert float(jnp.max(jnp.abs(got[2][0, 3 * QT : 4 * QT, 1]))) == 0.0


def test_chunk_selection_keeps_each_chunks_live_ids_ascending_in_front(ring_case):
    """Per visiting chunk: the tile's live ids inside it, chunk-local, ascending at the front (the Pallas
    dK/dV work list folds runs of ascending ids at token level), their count, the chunk's kv_valid."""
    from dsv_jax.parallel.scp import chunk_selection

    _, _, (idx, cnt), kv_valid = ring_case
    nb_loc = NB // 8
    for src in range(8):
        index, count, valid = jax.jit(chunk_selection, static_argnums=4)(idx, cnt, kv_valid, src, nb_loc)
        np.testing.assert_array_equal(valid, kv_valid[:, src * nb_loc : (src + 1) * nb_loc])
        for h, t in itertools.product(range(RING_H), range(S // QT)):
            live = np.asarray(idx[0, h, t, : cnt[0, h, t]])
            want = np.sort(live[(live >= src * nb_loc) & (live < (src + 1) * nb_loc)]) - src * nb_loc
            assert int(count[0, h, t]) == len(want)
            np.testing.assert_array_equal(index[0, h, t, : len(want)], want)


def _pallas_call_names(jaxpr):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            yield eqn.params["name"]
        for _, sub in _subjaxprs(eqn):
            yield from _pallas_call_names(sub)


def test_sparse_ring_never_runs_the_masked_dense_block(mesh, ring_case, monkeypatch):
    """With a selection, the ring's forward and backward trace the block-sparse kernels, and never the
    plain-JAX dense block (whose logits are [rows, S_chunk] per step)."""
    from dsv_jax.parallel import local

    def dense_block(*args, **kwargs):
        raise AssertionError("the sparse ring ran the masked-dense block")

    monkeypatch.setattr(local, "block_lse", dense_block)
    monkeypatch.setattr(local, "block_grads", dense_block)
    (q, k, v), cots, (idx, cnt), kv_valid = ring_case
    f = sparse_ring(mesh, idx, cnt, kv_valid, "pallas")

    def go(q, k, v):
        out, vjp = jax.vjp(f, q, k, v)
        return out, vjp(cots)

    names = set(_pallas_call_names(jax.make_jaxpr(go)(q, k, v).jaxpr))
    assert names == {"sparse_attention_fwd", "sparse_attention_dq", "sparse_attention_dkdv"}


@pytest.mark.parametrize("strategy, degrees, scp", DENSE_CASES[:4])
def test_dense_with_a_key_mask_and_lse_equals_single_device(mesh, inputs, strategy, degrees, scp):
    """A key mask that is not a prefix (a padded token layout's keys), with lse, forward and gradients."""
    q, k, v, cot = inputs
    mask = jnp.asarray(np.random.default_rng(6).random((B, S)) < 0.8)
    lse_cot = jax.random.normal(jax.random.key(10), (B, H, S))

    def run(f):
        def go(q, k, v):
            (o, lse), vjp = jax.vjp(f, q, k, v)
            return (o, lse, *vjp((cot, lse_cot)))

        return jax.jit(go)(q, k, v)

    want = run(lambda q, k, v: attention(q, k, v, backend="xla", kv_mask=mask, return_lse=True))
    got = run(
        lambda q, k, v: context_attention(
            q, k, v, mesh=mesh, strategy=strategy, degrees=degrees, scp=scp, kv_mask=mask, return_lse=True, q_chunk=16
        )
    )
    assert_close(got, want)


def test_remat_keep_attention_keeps_the_rings_output(mesh, inputs):
    """The ring names its merged output and lse (as the sparse kernels do), so model.remat_keep_attention's
    policy keeps them: a rematerialised ring attention's gradient runs the forward ring loop (a scan) once,
    not twice."""
    from dsv_jax.model.attention import remat_policy
    from tests.dsv_helpers import count_primitive

    q, k, v, _ = inputs
    f = lambda q, k, v: context_attention(q, k, v, mesh=mesh, strategy="ring", q_chunk=16)

    def loops(keep):
        g = jax.checkpoint(lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v))), policy=remat_policy(keep))
        return count_primitive(jax.make_jaxpr(jax.grad(g, argnums=(0, 1, 2)))(q, k, v).jaxpr, "scan")

    forward = count_primitive(jax.make_jaxpr(f)(q, k, v).jaxpr, "scan")
    assert forward >= 1
    assert loops(False) - loops(True) == forward
