"""Mosaic GPU (Hopper) block-sparse attention: forward and all gradients in jax's GPU interpreter against a
dense masked reference, and the compiled (wgmma) form lowered for CUDA.

The interpreter runs the real barriers, TMA copies, rings and control flow of the three warpgroups, with
plain dots for the products (it has no transposed or register wgmma operands); the lowering tests cover
the wgmma form. The interpreter is slow (seconds per kernel launch), hence one CTA per kernel and a one-stage forward
ring, so that two steps already refill a stage (the producer waits for its release).
"""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import sparse_attention_mgpu as mgpu
from pallas_kernels.sparse_attention import sparse_attention_reference
from pallas_kernels.sparse_attention_mgpu import sparse_attention_mgpu, sparse_attention_mgpu_backward
from pallas_kernels.sparse_attention_reference import dense_masked_reference
from tests.test_sparse_attention_padded import split_selection


def selection(key, b, h, tiles, blocks, n_sel, counts):
    """Ascending distinct ids, the given counts per tile, garbage (out of range too) past the count."""
    k1, k2 = jax.random.split(key)
    ids = jnp.sort(jax.lax.top_k(jax.random.uniform(k1, (b, h, tiles, blocks)), n_sel)[1], axis=-1)
    count = jnp.broadcast_to(jnp.asarray(counts, jnp.int32), (b, h, tiles))
    garbage = jax.random.randint(k2, ids.shape, -3 * blocks, 3 * blocks, dtype=jnp.int32)
    return jnp.where(jnp.arange(n_sel) < count[..., None], ids, garbage).astype(jnp.int32), count


def outputs_and_grads(fn, q, k, v, wo, wl):
    """(o, lse, dq, dk, dv) of loss = sum(o * wo) + sum(lse * wl) over rows with finite lse."""

    def loss(q, k, v):
        o, lse = fn(q, k, v)
        return jnp.sum(o.astype(jnp.float32) * wo) + jnp.sum(jnp.where(jnp.isfinite(lse), lse * wl, 0.0)), (o, lse)

    (_, (o, lse)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return (o, lse, *grads)


def check_against_dense(q_tile, kv_block, d, s, counts, kv_valid, seed, tuning, chosen=None, b=1, h=1):
    """chosen: (kv_index, kv_count) instead of a random selection with `counts`."""
    ks = jax.random.split(jax.random.key(seed), 6)
    q, k, v = (jax.random.normal(k_, (b, s, h, d), jnp.bfloat16) for k_ in ks[:3])
    tiles, blocks = s // q_tile, s // kv_block
    index, count = chosen or selection(ks[3], b, h, tiles, blocks, min(blocks, max(counts)), counts)
    wo, wl = jax.random.normal(ks[4], (b, s, h, d)), jax.random.normal(ks[5], (b, h, s))
    got = outputs_and_grads(
        lambda q, k, v: sparse_attention_mgpu(
            q,
            k,
            v,
            index,
            count,
            q_tile=q_tile,
            kv_block=kv_block,
            kv_valid=kv_valid,
            return_lse=True,
            tuning=tuning,
            interpret=True,
        ),
        q,
        k,
        v,
        wo,
        wl,
    )
    want = outputs_and_grads(
        lambda q, k, v: dense_masked_reference(
            q, k, v, index, count, kv_valid, q_tile=q_tile, kv_block=kv_block, sm_scale=d**-0.5
        ),
        *(x.astype(jnp.float32) for x in (q, k, v)),
        wo,
        wl,
    )
    for name, a, w in zip(["o", "lse", "dq", "dk", "dv"], got, want):
        a, w = np.asarray(a, np.float64), np.asarray(w, np.float64)
        finite = np.isfinite(w)
        assert (np.isfinite(a) == finite).all(), f"{name}: non-finite entries differ from the reference"
        a, w = np.where(finite, a, 0.0), np.where(finite, w, 0.0)
        err = np.linalg.norm(a - w) / np.linalg.norm(w)
        assert err < (1e-5 if name == "lse" else 1.5e-2), f"{name}: relative error {err:.2e}"
    return got


def test_two_lists_masked_keys_and_empty_tile_in_gpu_interpreter():
    """q_tile 64: the two consumers walk different lists (one empty: no keys, o = 0, lse = -inf, zero
    grads, the schedule barrier kept in step; the other two blocks); kv_block 64: dK/dV walks one list
    per 64 key rows. kv_valid masks keys, and one block has none valid."""
    kv_valid = jnp.array([[0, 37]], jnp.int32)
    o, lse, dq, dk, dv = check_against_dense(64, 64, 64, 128, [0, 2], kv_valid, seed=3, tuning={"fwd_stages": 1})
    assert np.all(np.asarray(o[:, :64]) == 0) and np.all(np.isneginf(np.asarray(lse[:, :, :64])))
    assert np.all(np.asarray(dq[:, :64]) == 0)
    assert np.all(np.asarray(dk[:, :64]) == 0) and np.all(np.asarray(dv[:, 64 + 37 :]) == 0)
    assert np.any(np.asarray(dq[:, 64:]) != 0) and np.any(np.asarray(dk[:, 64 : 64 + 37]) != 0)


@pytest.mark.parametrize("step_rows", [64, 128])
def test_shared_lists_in_gpu_interpreter(step_rows):
    """q_tile 128 and kv_block 128: both consumers share one list and one ring (a stage is freed by
    both), D = 128; a block takes two 64-row steps or one 128-row step (the default at q_tile 128)."""
    check_against_dense(
        128,
        128,
        128,
        128,
        [1],
        None,
        seed=4,
        tuning={"fwd_stages": 1, "fwd_step_rows": step_rows, "dq_step_rows": step_rows},
    )


def test_two_slices_per_step_in_gpu_interpreter():
    """fwd_step_rows = dq_step_rows = 128: a forward and dQ step covers two 64-row slices of the list. Odd
    slice counts (1 and 3 blocks of 64) end in a half step whose second slice repeats the first and is
    masked; one ring stage, so the producer refills it."""
    check_against_dense(
        64, 64, 64, 256, [1, 3, 4, 2], None, seed=6, tuning={"fwd_stages": 1, "fwd_step_rows": 128, "dq_step_rows": 128}
    )


def test_two_slices_per_step_with_masked_keys_in_gpu_interpreter():
    """Two slices per step with kv_valid and 192-key blocks (three slices per block: a step spans two
    blocks, so the second block's entry and offsets count), a 128-row tile sharing one list: per-slice
    valid counts (partial blocks, a block with no valid key), odd slice counts ending in a half step; the
    forward as one CTA per work item (its default is persistent)."""
    kv_valid = jnp.array([[150, 0, 100, 192]], jnp.int32)
    check_against_dense(
        128,
        192,
        64,
        768,
        [2, 1, 3, 2, 1, 0],
        kv_valid,
        seed=7,
        tuning={"fwd_stages": 1, "fwd_step_rows": 128, "dq_step_rows": 128, "fwd_programs": 0},
    )


@pytest.mark.parametrize("longest_first", [True, False])
def test_dkdv_takes_blocks_longest_first_in_gpu_interpreter(longest_first):
    """dK/dV CTAs take their two 64-row blocks in longest-list-first order: lists of 1, 3, 0 and 2 tiles put
    blocks 1 and 3 in the first CTA and 0 and 2 (an empty list) in the second, so each consumer's key rows,
    output rows and kv_valid entry come from its block, not from the CTA's place; ascending order too."""
    from pallas_kernels.sparse_index import longest_first as order_of

    index = jnp.array([[[[1, 0], [1, 3], [1, 3], [0, 0]]]], jnp.int32)
    count = jnp.array([[[1, 2, 2, 1]]], jnp.int32)
    cfg = mgpu.default_config(64, 64, 64, 0.125)
    _, starts, _ = mgpu.dkdv_schedule(index, count, cfg, 256)
    assert order_of(starts).tolist() == [[[1, 3, 0, 2]]]
    kv_valid = jnp.array([[64, 40, 64, 20]], jnp.int32)
    _, _, _, dk, dv = check_against_dense(
        64,
        64,
        64,
        256,
        None,
        kv_valid,
        seed=8,
        chosen=(index, count),
        tuning={"fwd_stages": 1, "dkdv_longest_first": longest_first},
    )
    assert np.all(np.asarray(dk[:, 128:192]) == 0) and np.all(np.asarray(dv[:, 192 + 20 :]) == 0)
    assert np.all(np.asarray(dk[:, 64 + 40 : 128]) == 0) and np.any(np.asarray(dv[:, 192 : 192 + 20]) != 0)


def persistent(ctas: int) -> dict:
    """Tuning that makes all three kernels persistent with `ctas` CTAs."""
    return {"fwd_programs": ctas, "dq_programs": ctas, "dkdv_programs": ctas}


@pytest.mark.parametrize("heads_fastest", [False, True])
def test_work_items_start_in_one_order_in_both_forms(heads_fastest):
    """The persistent loop decodes item w as the one-CTA-per-item grid starts it: Pallas' Mosaic GPU gives the
    grid's last axis to CUDA's x, so the GPU starts the grid in row-major order. By default the first items
    share one head and batch element (their K/V stays in L2); heads_fastest sweeps the heads first."""
    from pallas_kernels.mgpu_common import WorkItems

    work = WorkItems(heads=3, pairs=4, batch=2, heads_fastest=heads_fastest)
    grid = work.launch()
    started = [dict(zip(grid["grid_names"], ix, strict=True)) for ix in np.ndindex(*grid["grid"])]
    started = [(ix["heads"], ix["pairs"], ix["batch"]) for ix in started]
    decoded = [work.unravel(w) for w in range(work.total)]
    assert decoded == started and len(set(decoded)) == work.total
    traced = jax.jit(jax.vmap(lambda w: jnp.stack(work.unravel(w))))(jnp.arange(work.total, dtype=jnp.int32))
    assert np.asarray(traced).tolist() == [list(t) for t in decoded]
    if heads_fastest:
        assert decoded[:3] == [(0, 0, 0), (1, 0, 0), (2, 0, 0)]
    else:
        assert decoded[:5] == [(0, 0, 0), (0, 1, 0), (0, 2, 0), (0, 3, 0), (0, 0, 1)]


@pytest.mark.parametrize("ctas", [1, 5, 7, 24, 30])
def test_persistent_ctas_take_consecutive_items_serpentine(ctas):
    """Persistent CTAs run every item once; the i-th items of all CTAs are the i-th round of consecutive
    items; odd rounds go backwards, so with items longest first no CTA takes the longest of every round
    (the CTAs' loads stay within one item of each other); the traced count and item agree with the ints."""
    from pallas_kernels.mgpu_common import WorkItems

    work = WorkItems(heads=2, pairs=6, batch=2, programs=ctas)
    ran = {c: [work.item_of(c, i) for i in range(work.count_of(c))] for c in range(work.ctas)}
    assert sorted(w for items in ran.values() for w in items) == list(range(work.total))
    for i in range(max(len(items) for items in ran.values())):
        in_flight = sorted(items[i] for items in ran.values() if len(items) > i)
        assert in_flight == list(range(i * work.ctas, i * work.ctas + len(in_flight)))
    length = lambda w: work.total - w  # longest first
    loads = [sum(length(w) for w in items) for items in ran.values()]
    assert max(loads) - min(loads) <= 2 * (work.ctas - 1)  # in order (c, c + N, ...): up to rounds x (N - 1)
    if ctas > 1 and work.total >= 2 * ctas:
        assert ran[0][:2] == [0, 2 * ctas - 1]
    traced = jax.jit(lambda c: (work.count_of(c), work.item_of(c, jnp.int32(1))))
    for c in range(work.ctas):
        n, second = traced(jnp.int32(c))
        assert int(n) == len(ran[c]) and (len(ran[c]) < 2 or int(second) == ran[c][1])


def test_persistent_kernels_in_gpu_interpreter():
    """4 persistent CTAs per kernel over 2 batch x 2 heads x 3 pairs of 64-row tiles (two lists each): CTA c
    runs items c, c + 4, c + 8, so every ring (two stages each) carries its slot count from item to item, a
    list is empty, keys are masked, and each item's head, pair and batch are decoded from its number."""
    kv_valid = jnp.array([[64, 37, 0, 64, 50, 64], [64, 64, 20, 0, 64, 64]], jnp.int32)
    check_against_dense(
        64, 64, 64, 384, [0, 2, 3, 1, 3, 2], kv_valid, seed=9, b=2, h=2, tuning={"fwd_stages": 2, **persistent(4)}
    )


def test_persistent_kernels_with_shared_dkdv_lists_in_gpu_interpreter():
    """kv_block 128: dK/dV's two consumers share one list per 128 key rows, taken longest first by three
    persistent CTAs over 2 heads x 5 pairs (10 items: the last round, odd, has one item, which serpentine
    rounds give to the last CTA); masked keys, a block with none valid, an empty tile."""
    kv_valid = jnp.array([[128, 70, 0, 128, 90]], jnp.int32)
    check_against_dense(
        128, 128, 64, 640, [1, 2, 0, 3, 2], kv_valid, seed=11, h=2, tuning={"fwd_stages": 2, **persistent(3)}
    )


def test_persistent_shared_lists_with_two_slices_per_step_in_gpu_interpreter():
    """One persistent CTA runs every item: 128-row tiles sharing one list, 128-row forward and dQ steps with
    odd slice counts (half steps), heads fastest."""
    check_against_dense(
        128,
        64,
        64,
        384,
        [1, 3, 2],
        None,
        seed=10,
        h=2,
        tuning={"fwd_stages": 1, **persistent(1), "heads_fastest": True},
    )


def test_backward_under_merged_statistics_in_gpu_interpreter():
    """sparse_attention_mgpu_backward: a selection split into disjoint A and B; under the whole selection's
    (o, lse) (what merging A's and B's gives) the two calls sum to the whole's gradients, with masked
    keys, a tile A leaves empty and a tile with kv_count 0 (lse = -inf, nonzero lse cotangent)."""
    b, h, s, d, q_tile, kv_block = 1, 1, 256, 64, 64, 64
    ks = jax.random.split(jax.random.key(5), 6)
    q, k, v = (jax.random.normal(k_, (b, s, h, d), jnp.bfloat16) for k_ in ks[:3])
    index, count = selection(ks[3], b, h, 4, 4, 3, [0, 2, 3, 3])
    kv_valid = jnp.array([[64, 37, 0, 64]], jnp.int32)
    cot_o, cot_lse = jax.random.normal(ks[4], (b, s, h, d)), jax.random.normal(ks[5], (b, h, s))
    kw = dict(q_tile=q_tile, kv_block=kv_block, kv_valid=kv_valid)
    whole = lambda q, k, v: sparse_attention_reference(q, k, v, index, count, return_lse=True, **kw)
    (o, lse), pullback = jax.vjp(whole, *(x.astype(jnp.float32) for x in (q, k, v)))
    want = pullback((cot_o, cot_lse))
    parts = [
        sparse_attention_mgpu_backward(q, k, v, idx, cnt, o, lse, cot_o, cot_lse, interpret=True, **kw)
        for idx, cnt in split_selection(index, count, (0, 0, 1))
    ]
    for name, a, bb, w in zip(["dq", "dk", "dv"], *parts, want):
        got, w = np.asarray(a, np.float64) + np.asarray(bb, np.float64), np.asarray(w, np.float64)
        assert np.all(np.isfinite(got)), f"{name} holds NaN or inf"
        err = np.linalg.norm(got - w) / np.linalg.norm(w)
        assert err < 1.5e-2, f"{name}: relative error {err:.2e}"
    assert np.all(np.asarray(parts[0][0][:, :128]) == 0)  # A: tile 0 has no key, tile 1 none of A's


@pytest.mark.parametrize(
    "q_tile,kv_block,d,masked,tuning",
    [
        (64, 64, 128, False, None),
        (128, 192, 64, True, None),
        (128, 64, 64, False, None),
        (
            128,
            64,
            128,
            False,
            {"producer_registers": 24, "fwd_stages": 5, "dq_stages": 4, "fwd_step_rows": 64, "dq_step_rows": 64},
        ),
        (128, 64, 128, True, {"fwd_step_rows": 128, "dq_step_rows": 128, "fwd_programs": 0}),
        (128, 64, 128, False, persistent(132)),
        (64, 64, 128, True, persistent(132)),
        (128, 64, 64, False, persistent(7)),
    ],
)
def test_compiled_kernels_lower_for_cuda(q_tile, kv_block, d, masked, tuning):
    s, h = 768, 2
    x = jax.ShapeDtypeStruct((1, s, h, d), jnp.bfloat16)
    idx = jax.ShapeDtypeStruct((1, h, s // q_tile, 3), jnp.int32)
    cnt = jax.ShapeDtypeStruct((1, h, s // q_tile), jnp.int32)
    valid = jax.ShapeDtypeStruct((1, s // kv_block), jnp.int32)

    def loss(q, k, v, i, c, kv):
        o, lse = sparse_attention_mgpu(
            q,
            k,
            v,
            i,
            c,
            q_tile=q_tile,
            kv_block=kv_block,
            kv_valid=kv if masked else None,
            return_lse=True,
            tuning=tuning,
        )
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    text = (
        jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        .trace(x, x, x, idx, cnt, valid)
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 3  # forward, dQ, dK/dV
    assert all(name in text for name in ("dsv_sparse_fwd", "dsv_sparse_dq", "dsv_sparse_dkdv"))  # named in profiles


def test_unsupported_geometry_and_bad_kv_valid_are_named():
    q = jnp.zeros((1, 256, 1, 64), jnp.bfloat16)
    assert mgpu.supported(q, q, q, q_tile=64, kv_block=64) is None
    assert "q_tile=32" in mgpu.supported(q, q, q, q_tile=32, kv_block=64)
    assert "kv_block=8" in mgpu.supported(q, q, q, q_tile=64, kv_block=8)
    assert "head dim 96" in mgpu.supported(*(jnp.zeros((1, 256, 1, 96), jnp.bfloat16),) * 3, q_tile=64, kv_block=64)
    assert "float32" in mgpu.supported(q.astype(jnp.float32), q, q, q_tile=64, kv_block=64)
    assert "sequence length 192" in mgpu.supported(q[:, :192], q[:, :192], q[:, :192], q_tile=64, kv_block=64)
    idx, cnt = jnp.zeros((1, 1, 4, 1), jnp.int32), jnp.ones((1, 1, 4), jnp.int32)
    with pytest.raises(ValueError, match="kv_block=8 "):
        sparse_attention_mgpu(q, q, q, jnp.zeros((1, 1, 4, 1), jnp.int32), cnt, q_tile=64, kv_block=8)
    with pytest.raises(ValueError, match=r"kv_valid must be \[B, S // kv_block\] = \[1, 4\]"):
        sparse_attention_mgpu(q, q, q, idx, cnt, q_tile=64, kv_block=64, kv_valid=jnp.zeros((1, 3), jnp.int32))
    with pytest.raises(ValueError, match="dkdv_stages=1 >= 2"):
        sparse_attention_mgpu(q, q, q, idx, cnt, q_tile=64, kv_block=64, tuning={"dkdv_stages": 1})
    with pytest.raises(ValueError, match="producer_registers=30 must be a multiple of 8 in 24..168"):
        sparse_attention_mgpu(q, q, q, idx, cnt, q_tile=64, kv_block=64, tuning={"producer_registers": 30})
    with pytest.raises(ValueError, match="producer_registers=176"):
        sparse_attention_mgpu(q, q, q, idx, cnt, q_tile=64, kv_block=64, tuning={"producer_registers": 176})
    with pytest.raises(ValueError, match=r"the dK/dV kernel would need 260 KiB .* dkdv_stages=3, .* 227 KiB"):
        sparse_attention_mgpu(
            *(jnp.zeros((1, 256, 1, 128), jnp.bfloat16),) * 3,
            idx,
            cnt,
            q_tile=64,
            kv_block=64,
            tuning={"dkdv_stages": 3},
        )
    with pytest.raises(ValueError, match="unknown tuning keys"):
        sparse_attention_mgpu(q, q, q, idx, cnt, q_tile=64, kv_block=64, tuning={"stages": 2})
    assert "not a GPU" in mgpu.available()  # the tests run on the CPU


def test_imports_without_the_triton_lowering():
    """The Mosaic GPU path must survive jax dropping Pallas' Triton lowering: block that module, import."""
    code = (
        "import sys; sys.modules['jax.experimental.pallas.triton'] = None\n"
        "import pallas_kernels.sparse_attention_mgpu as m, pallas_kernels.sparse_attention_mgpu_fwd, "
        "pallas_kernels.sparse_attention_mgpu_bwd\n"
        "assert 'pallas_kernels.sparse_attention_triton' not in sys.modules\nprint('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]


def test_default_config_makes_the_forward_persistent_one_cta_per_sm():
    """The measured default: a persistent forward of one CTA per SM (the device's core_count; 132 where jax
    reports none), dQ and dK/dV one CTA per item; a tuning key still overrides it."""
    import types

    from pallas_kernels.tuning import H100_SMS, multiprocessors

    assert multiprocessors(types.SimpleNamespace(platform="gpu", core_count=114)) == 114
    assert multiprocessors(types.SimpleNamespace(platform="gpu")) == H100_SMS == 132
    assert multiprocessors(types.SimpleNamespace(platform="cpu", core_count=2)) == 132
    cfg = mgpu.default_config(128, 64, 128, 0.1)
    assert (cfg.fwd_programs, cfg.dq_programs, cfg.dkdv_programs) == (multiprocessors(), 0, 0)
    assert mgpu.default_config(128, 64, 128, 0.1, tuning={"fwd_programs": 0}).fwd_programs == 0


def test_each_kernel_takes_its_own_programs_key(monkeypatch):
    """fwd_programs, dq_programs and dkdv_programs reach the forward, dQ and dK/dV kernels respectively."""
    from pallas_kernels.mgpu_common import AttentionConfig

    seen = []
    work = AttentionConfig.work

    def spy(self, kernel, *args):
        items = work(self, kernel, *args)
        seen.append((kernel, items.programs))
        return items

    q, k, v = (jnp.ones((1, 512, 1, 64), jnp.bfloat16) for _ in range(3))
    index, count = jnp.zeros((1, 1, 4, 2), jnp.int32), jnp.full((1, 1, 4), 2, jnp.int32)
    tuning = {"fwd_programs": 3, "dq_programs": 0, "dkdv_programs": 5}
    loss = lambda q, k, v: (
        sparse_attention_mgpu(q, k, v, index, count, q_tile=128, kv_block=64, tuning=tuning, interpret=True)
        .astype(jnp.float32)
        .sum()
    )
    monkeypatch.setattr(AttentionConfig, "work", spy)
    jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    assert sorted(set(seen)) == [("dkdv", 5), ("dq", 0), ("fwd", 3)]
