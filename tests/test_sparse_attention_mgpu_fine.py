"""Mosaic GPU (Hopper) block-sparse attention over KV blocks of 16 and 32 rows: the forward and dQ with one TMA
copy per block into 64- or 128-row stages (mgpu_common.FineWalk), and sparse_attention_mgpu_fine's dK/dV
(one block per consumer, transposed products), in jax's GPU interpreter against the plain-JAX reference; the
compiled (wgmma) forms lowered for CUDA; dispatch on a Hopper-shaped device.

The interpreter runs the real barriers, TMA copies and rings with plain dots for the products; it is slow
(tens of seconds per forward + backward), hence few, small cases that each cover several paths.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import sparse_attention as sa
from pallas_kernels import sparse_attention_mgpu as mgpu
from pallas_kernels.mgpu_common import FineWalk, Ops, import_plgpu
from pallas_kernels.sparse_attention import sparse_attention_reference
from pallas_kernels.sparse_attention_mgpu import sparse_attention_mgpu, sparse_attention_mgpu_backward
from tests.test_sparse_attention_mgpu import outputs_and_grads
from tests.test_sparse_attention_mgpu import selection as mgpu_selection


def selection(key, b, h, tiles, blocks, counts):
    """Ascending distinct ids, the given counts per tile, garbage (out of range too) past the count."""
    return mgpu_selection(key, b, h, tiles, blocks, max(counts), counts)


def assert_close(got, want, names=("o", "lse", "dq", "dk", "dv")):
    for name, a, w in zip(names, got, want, strict=True):
        a, w = np.asarray(a, np.float64), np.asarray(w, np.float64)
        finite = np.isfinite(w)
        assert (np.isfinite(a) == finite).all(), f"{name}: non-finite entries differ from the reference"
        a, w = np.where(finite, a, 0.0), np.where(finite, w, 0.0)
        err = np.linalg.norm(a - w) / np.linalg.norm(w)
        assert err < (1e-5 if name == "lse" else 1.5e-2), f"{name}: relative error {err:.2e}"


def check_against_reference(q_tile, kv_block, d, s, counts, kv_valid, seed, tuning, b=1, h=1):
    ks = jax.random.split(jax.random.key(seed), 6)
    q, k, v = (jax.random.normal(k_, (b, s, h, d), jnp.bfloat16) for k_ in ks[:3])
    index, count = selection(ks[3], b, h, s // q_tile, s // kv_block, counts)
    wo, wl = jax.random.normal(ks[4], (b, s, h, d)), jax.random.normal(ks[5], (b, h, s))
    kw = dict(q_tile=q_tile, kv_block=kv_block, kv_valid=kv_valid, return_lse=True)
    kernel = lambda q, k, v: sparse_attention_mgpu(q, k, v, index, count, tuning=tuning, interpret=True, **kw)
    got = outputs_and_grads(kernel, q, k, v, wo, wl)
    want = outputs_and_grads(
        lambda q, k, v: sparse_attention_reference(q, k, v, index, count, **kw),
        *(x.astype(jnp.float32) for x in (q, k, v)),
        wo,
        wl,
    )
    assert_close(got, want)
    return got


def test_16_row_blocks_two_lists_masked_keys_and_empty_tile_in_gpu_interpreter():
    """kv_block 16 with 64-row query tiles: the forward's and dQ's two consumers walk their own lists in 64-row
    stages of four 16-row copies; lists of 0 (no keys: o = 0, lse = -inf, zero grads), 3, 5 and 7 blocks end
    in partial stages (the last entry repeated, masked); kv_valid masks keys per block (some blocks partly,
    some wholly); dK/dV walks one 16-key block per consumer; one ring stage in the forward."""
    kv_valid = jnp.array([[16, 5, 0, 16, 9, 16, 16, 1, 16, 16, 0, 12, 16, 16, 16, 3]], jnp.int32)
    o, lse, dq, dk, dv = check_against_reference(64, 16, 64, 256, [0, 3, 5, 7], kv_valid, 0, {"fwd_stages": 1})
    assert np.all(np.asarray(o[:, :64]) == 0) and np.all(np.isneginf(np.asarray(lse[:, :, :64])))
    assert np.all(np.asarray(dq[:, :64]) == 0)
    for blk in np.flatnonzero(np.asarray(kv_valid[0]) < 16):  # masked keys get no gradient
        masked = slice(blk * 16 + int(kv_valid[0, blk]), (blk + 1) * 16)
        assert np.all(np.asarray(dk[:, masked]) == 0) and np.all(np.asarray(dv[:, masked]) == 0)


def test_32_row_blocks_shared_list_persistent_backward_in_gpu_interpreter():
    """kv_block 32 with 128-row query tiles at D = 128: both consumers share one list in 128-row steps of four
    32-row copies (odd counts: a partial last step); dQ and the fine dK/dV persistent (dK/dV: three CTAs over
    two heads x four block pairs, rings carried from item to item), dK/dV two 64-row steps per query tile."""
    tuning = {"fwd_stages": 2, "dq_programs": 3, "dkdv_programs": 3}
    check_against_reference(128, 32, 128, 256, [1, 5], None, 1, tuning, h=2)


def test_backward_under_merged_statistics_with_16_row_blocks_in_gpu_interpreter():
    """sparse_attention_mgpu_backward (what the context-parallel ring calls) at kv_block 16: a selection split
    into disjoint halves A and B; under the whole selection's (o, lse) the two calls sum to the whole's
    gradients, with masked keys, a tile that A leaves empty and a tile with kv_count 0 (lse = -inf, nonzero
    lse cotangent); the fine dK/dV persistent on two CTAs (the interpreter runs CTAs one after another)."""
    b, h, s, d, q_tile, kv_block = 1, 1, 256, 64, 64, 16
    ks = jax.random.split(jax.random.key(5), 6)
    q, k, v = (jax.random.normal(k_, (b, s, h, d), jnp.bfloat16) for k_ in ks[:3])
    index, count = selection(ks[3], b, h, 4, 16, [0, 3, 6, 5])
    kv_valid = jnp.full((b, 16), 16, jnp.int32).at[0, 2].set(7).at[0, 5].set(0)
    cot_o, cot_lse = jax.random.normal(ks[4], (b, s, h, d)), jax.random.normal(ks[5], (b, h, s))
    kw = dict(q_tile=q_tile, kv_block=kv_block, kv_valid=kv_valid)
    whole = lambda q, k, v: sparse_attention_reference(q, k, v, index, count, return_lse=True, **kw)
    (o, lse), pullback = jax.vjp(whole, *(x.astype(jnp.float32) for x in (q, k, v)))
    want = pullback((cot_o, cot_lse))
    live = jnp.arange(index.shape[-1]) < count[..., None]
    in_a = live & (jnp.arange(index.shape[-1]) % 2 == 0)
    in_a = in_a.at[:, :, 1].set(False)  # tile 1: all of its keys in B
    parts = []
    for part in (in_a, live & ~in_a):
        order = jnp.argsort(~part, axis=-1, stable=True)  # the part's entries first, in ascending id order
        idx = jnp.take_along_axis(index, order, axis=-1)
        parts.append(
            sparse_attention_mgpu_backward(
                q, k, v, idx, part.sum(-1), o, lse, cot_o, cot_lse, interpret=True, tuning={"dkdv_programs": 2}, **kw
            )
        )
    for name, a, bb, w in zip(["dq", "dk", "dv"], *parts, want, strict=True):
        got, w = np.asarray(a, np.float64) + np.asarray(bb, np.float64), np.asarray(w, np.float64)
        assert np.all(np.isfinite(got)), f"{name} holds NaN or inf"
        err = np.linalg.norm(got - w) / np.linalg.norm(w)
        assert err < 1.5e-2, f"{name}: relative error {err:.2e}"
    assert np.all(np.asarray(parts[0][0][:, :128]) == 0)  # A: tile 0 has no key, tile 1 none of A's


@dataclasses.dataclass(frozen=True)
class PlainOps(Ops):
    """Ops of the interpreter (plain arrays), for testing a walk's masks outside a kernel."""

    interpret: bool = True


def test_fine_walk_masks_each_block_and_the_partial_last_step():
    """A 128-row step of 16-row blocks: column c is kept iff c mod 16 < the valid keys of block c // 16;
    past the list's end (7 entries: the 8th block of the step) nothing is kept."""
    walk = FineWalk(16, 128)
    assert (walk.sub, walk.per_block) == (8, 1)
    per_entry = jnp.array([16, 3, 0, 16, 7, 16, 1, 9], jnp.int32)
    valid = walk.valid_keys(jnp.int32(0), jnp.int32(7), lambda e: per_entry[e])
    keep = np.asarray(walk.keep(PlainOps(import_plgpu()), (64, 128), valid))
    want = np.concatenate([np.arange(16) < (int(n) if i < 7 else 0) for i, n in enumerate(per_entry)])
    assert (keep == want[None, :]).all()
    unmasked = walk.valid_keys(jnp.int32(1), jnp.int32(11), None)  # step 1 of 11 entries: 3 of 8 blocks
    assert [int(x) for x in unmasked] == [16, 16, 16, 0, 0, 0, 0, 0]


SPLIT = {"fused_backward": False}  # 128-row tiles at 16-row blocks default to the fused backward
FINE_LOWERINGS = [  # (q_tile, kv_block, D, masked, tuning)
    (128, 16, 128, False, SPLIT),
    (128, 16, 128, True, SPLIT),
    (64, 16, 128, True, {"fwd_programs": 0}),
    (128, 32, 128, False, {"dkdv_programs": 132, "dq_programs": 132}),
    (64, 32, 64, False, None),
]


@pytest.mark.parametrize("q_tile,kv_block,d,masked,tuning", FINE_LOWERINGS)
def test_fine_block_kernels_lower_for_cuda(q_tile, kv_block, d, masked, tuning):
    """The compiled forms (wgmma with N = 16 or 32 and transposed SMEM A and B operands, 16- or 32-row TMA
    copies into 128-byte swizzled stages and rings, P^T and dS^T stored from the transposed register layout,
    [g, 64] tiles of dK, dV) lower to Mosaic GPU on the CPU: forward, dQ and the fine dK/dV, named for profiles."""
    s, h = 768, 2
    x = jax.ShapeDtypeStruct((1, s, h, d), jnp.bfloat16)
    idx = jax.ShapeDtypeStruct((1, h, s // q_tile, 5), jnp.int32)
    cnt = jax.ShapeDtypeStruct((1, h, s // q_tile), jnp.int32)
    valid = jax.ShapeDtypeStruct((1, s // kv_block), jnp.int32)

    def loss(q, k, v, i, c, kv):
        kw = dict(q_tile=q_tile, kv_block=kv_block, kv_valid=kv if masked else None, return_lse=True, tuning=tuning)
        o, lse = sparse_attention_mgpu(q, k, v, i, c, **kw)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    text = (
        jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        .trace(x, x, x, idx, cnt, valid)
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 3
    assert all(name in text for name in ("dsv_sparse_fwd", "dsv_sparse_dq", "dsv_sparse_dkdv_fine"))


def test_fine_dkdv_keeps_every_streamed_operand_at_a_128_byte_swizzle(monkeypatch):
    """The fine dK/dV's speed rests on its SMEM swizzles: a Q / dO ring swizzled at 2g bytes (as P stored [64, g]
    would force) makes its TMA copies fetch 32-byte rows, and at g = 16 the L2 ran request-bound at twice the
    time (docs/kernels/mgpu_notes.md, "The 16-row dK/dV profiled and fixed"). Every bf16 SMEM ref it declares
    must be swizzled at 128 bytes, with P^T and dS^T as [g, 64]."""
    from pallas_kernels import sparse_attention_mgpu_fine as fine

    declared = []

    def recording(plgpu, shape, dtype, swizzle):
        declared.append((tuple(shape), swizzle))
        return original(plgpu, shape, dtype, swizzle)

    original = fine.swizzled_at
    monkeypatch.setattr(fine, "swizzled_at", recording)
    s, h, d, g = 768, 2, 128, 16
    x = jax.ShapeDtypeStruct((1, s, h, d), jnp.bfloat16)
    idx = jax.ShapeDtypeStruct((1, h, s // 128, 5), jnp.int32)
    cnt = jax.ShapeDtypeStruct((1, h, s // 128), jnp.int32)

    def loss(q, k, v, i, c):
        o = sparse_attention_mgpu(q, k, v, i, c, q_tile=128, kv_block=g, tuning=SPLIT)
        return jnp.sum(o.astype(jnp.float32))

    jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(x, x, x, idx, cnt).lower(lowering_platforms=("cuda",))
    assert declared, "the fine dK/dV declared no swizzled SMEM"
    assert {swizzle for _, swizzle in declared} == {128}
    assert (2, g, 64) in [shape for shape, _ in declared]  # P^T, dS^T: a [g, 64] tile per consumer


@dataclasses.dataclass
class FakeDevice:
    device_kind: str
    compute_capability: str
    platform: str = "gpu"


def test_hopper_dispatch_takes_the_mosaic_gpu_kernels_for_16_and_32_row_blocks():
    h200 = FakeDevice("NVIDIA H200", "9.0")
    x = jax.ShapeDtypeStruct((1, 1024, 2, 128), jnp.bfloat16)
    for kv_block in (16, 32):
        for q_tile in (64, 128):
            assert sa.kernel_path(x, x, x, q_tile=q_tile, kv_block=kv_block, device=h200) == ("mgpu", [])
    path, why = sa.kernel_path(x, x, x, q_tile=64, kv_block=8, device=h200)
    assert path == "triton" and "kv_block=8" in why[0]
    assert sa.kernel_path(x, x, x, q_tile=128, kv_block=16)[0] == "xla"  # the tests' CPU: the reference
    q = jnp.zeros((1, 256, 1, 64), jnp.bfloat16)
    assert mgpu.supported(q, q, q, q_tile=64, kv_block=16) is None
    assert "16, 32 or a multiple of 64" in mgpu.supported(q, q, q, q_tile=64, kv_block=48)


def test_fine_dkdv_smem_fits_two_stages_not_three_at_d128():
    """The fine dK/dV's SMEM (two 64-row Q / dO rings, per consumer a block's K, V, P, dS and out tiles) fits
    two ring stages at D = 128 and refuses three with the kernel named."""
    cfg = mgpu.default_config(128, 16, 128, 0.1, tuning=SPLIT)
    assert cfg.smem_bytes("dkdv") == 2 * (2 * 16 * 128 * 2 + 2 * 64 * 16 * 2 + 2 * 128 * 16 * 2) + 2 * 2 * (
        2 * 64 * 128 * 2 + 2 * 64 * 4
    )
    mgpu.check_smem(cfg)
    with pytest.raises(ValueError, match="dK/dV kernel would need"):
        mgpu.check_smem(mgpu.default_config(128, 16, 128, 0.1, tuning={**SPLIT, "dkdv_stages": 3}))


# ----------------------------------------------------------------------------------------------------
# The fused backward (sparse_attention_mgpu_fused): dQ, dK and dV by query tile, dK/dV added by TMA reductions

FUSED = {"fused_backward": True}


@pytest.fixture
def fused_calls(monkeypatch):
    """Counts the fused backward's launches, so that a test fails if the call fell back to dQ and dK/dV."""
    from pallas_kernels import sparse_attention_mgpu_fused as fused

    calls = []
    original = fused.backward

    def counting(*args, **kwargs):
        calls.append(args[-1])
        return original(*args, **kwargs)

    monkeypatch.setattr(fused, "backward", counting)
    return calls


def test_fused_backward_16_row_blocks_masked_keys_and_empty_tile_in_gpu_interpreter(fused_calls):
    """kv_block 16, 128-row query tiles, D = 64: lists of 0 blocks (zero dQ) and 7 (a partial last step whose
    repeated, masked block adds zeros); kv_valid masks keys per block (those keys get no dK, dV); the reduced
    dK and dV match the reference."""
    kv_valid = jnp.array([[16, 5, 0, 16, 9, 16, 16, 1, 16, 16, 0, 12, 16, 16, 16, 3]], jnp.int32)
    tuning = {**FUSED, "fwd_stages": 1}
    o, lse, dq, dk, dv = check_against_reference(128, 16, 64, 256, [0, 7], kv_valid, 0, tuning)
    assert len(fused_calls) == 1 and fused_calls[0].masked
    assert np.all(np.asarray(dq[:, :128]) == 0)
    for blk in np.flatnonzero(np.asarray(kv_valid[0]) < 16):
        masked = slice(blk * 16 + int(kv_valid[0, blk]), (blk + 1) * 16)
        assert np.all(np.asarray(dk[:, masked]) == 0) and np.all(np.asarray(dv[:, masked]) == 0)


def test_fused_backward_32_row_blocks_persistent_two_heads_in_gpu_interpreter(fused_calls):
    """kv_block 32 at D = 128 (two blocks a step), persistent on three CTAs over two heads x two query tiles,
    the ring and the shared P / dS barriers carried from item to item; odd counts end in a partial step."""
    check_against_reference(128, 32, 128, 256, [1, 5], None, 1, {**FUSED, "fwd_stages": 2, "dq_programs": 3}, h=2)
    assert len(fused_calls) == 1 and fused_calls[0].dq_programs == 3


def test_fused_backward_under_merged_statistics_in_gpu_interpreter(fused_calls):
    """sparse_attention_mgpu_backward (the context-parallel ring's call) on the fused kernel: two disjoint halves
    of a selection, under the whole's (o, lse) and a nonzero lse cotangent, sum to the whole's gradients (a tile
    that one half leaves empty, a tile with no key)."""
    b, h, s, d, q_tile, kv_block = 1, 1, 512, 64, 128, 16
    ks = jax.random.split(jax.random.key(9), 6)
    q, k, v = (jax.random.normal(k_, (b, s, h, d), jnp.bfloat16) for k_ in ks[:3])
    index, count = selection(ks[3], b, h, 4, 32, [0, 3, 6, 9])
    cot_o, cot_lse = jax.random.normal(ks[4], (b, s, h, d)), jax.random.normal(ks[5], (b, h, s))
    kw = dict(q_tile=q_tile, kv_block=kv_block)
    whole = lambda q, k, v: sparse_attention_reference(q, k, v, index, count, return_lse=True, **kw)
    (o, lse), pullback = jax.vjp(whole, *(x.astype(jnp.float32) for x in (q, k, v)))
    want = pullback((cot_o, cot_lse))
    live = jnp.arange(index.shape[-1]) < count[..., None]
    in_a = (live & (jnp.arange(index.shape[-1]) % 2 == 0)).at[:, :, 1].set(False)
    total = [0.0, 0.0, 0.0]
    for part in (in_a, live & ~in_a):
        order = jnp.argsort(~part, axis=-1, stable=True)
        idx = jnp.take_along_axis(index, order, axis=-1)
        grads = sparse_attention_mgpu_backward(
            q, k, v, idx, part.sum(-1), o, lse, cot_o, cot_lse, interpret=True, tuning=FUSED, **kw
        )
        total = [t + np.asarray(g_, np.float64) for t, g_ in zip(total, grads, strict=True)]
    assert len(fused_calls) == 2
    for name, got, w in zip(["dq", "dk", "dv"], total, want, strict=True):
        w = np.asarray(w, np.float64)
        err = np.linalg.norm(got - w) / np.linalg.norm(w)
        assert err < 1.5e-2, f"{name}: relative error {err:.2e}"


@pytest.mark.parametrize("kv_block,masked", [(16, False), (32, True)])
def test_fused_backward_lowers_for_cuda_as_one_kernel(kv_block, masked):
    """The compiled form (TMA reductions of fp32 tiles from a 128-byte swizzled stage, transposed SMEM A
    operands, dV / dK in one in-place Ref) lowers to Mosaic GPU on the CPU: the forward and one backward kernel
    whose operands include the fp32 accumulator."""
    s, h, d = 1024, 2, 128
    x = jax.ShapeDtypeStruct((1, s, h, d), jnp.bfloat16)
    idx = jax.ShapeDtypeStruct((1, h, s // 128, 6), jnp.int32)
    cnt = jax.ShapeDtypeStruct((1, h, s // 128), jnp.int32)
    valid = jax.ShapeDtypeStruct((1, s // kv_block), jnp.int32)

    def loss(q, k, v, i, c, kv):
        kw = dict(q_tile=128, kv_block=kv_block, kv_valid=kv if masked else None, tuning=FUSED)
        return jnp.sum(sparse_attention_mgpu(q, k, v, i, c, **kw).astype(jnp.float32))

    lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(x, x, x, idx, cnt, valid)
    text = lowered.lower(lowering_platforms=("cuda",)).as_text()
    calls = [line for line in text.splitlines() if "stablehlo.custom_call @mosaic_gpu" in line]
    assert len(calls) == 2 and "dsv_sparse_dq" not in text and "dsv_sparse_dkdv" not in text
    operands = calls[1].split("(", 1)[1].split(")", 1)[0].count("%")
    assert operands == 8 + masked + 1  # q, k, v, do, lse2, delta, index, count, [valid], the dV / dK Ref


def test_fused_backward_smem_and_geometry():
    """The fused backward fits two 64-row K / V stages at D = 128 (225 KiB) and refuses three with the kernel
    named; it runs only at 16- and 32-row blocks with 128-row query tiles (elsewhere the split kernels do)."""
    cfg = mgpu.default_config(128, 16, 128, 0.1, tuning=FUSED)
    assert cfg.fuses_backward and cfg.smem_bytes("fused") == 225 * 1024
    mgpu.check_smem(cfg)
    with pytest.raises(ValueError, match="fused backward kernel would need"):
        mgpu.check_smem(mgpu.default_config(128, 16, 128, 0.1, tuning={**FUSED, "dq_stages": 3}))
    assert not mgpu.default_config(64, 16, 128, 0.1, tuning=FUSED).fuses_backward
    assert not mgpu.default_config(128, 64, 128, 0.1, tuning=FUSED).fuses_backward
    with pytest.raises(ValueError, match="dQ kernel would need"):  # not fused: the split kernels are checked
        mgpu.check_smem(mgpu.default_config(64, 16, 128, 0.1, tuning={**FUSED, "dq_stages": 3}))


def test_fused_backward_is_the_default_only_where_it_measured_faster():
    """Fused by default at 16-row blocks with 128-row tiles (fwd + bwd 1.46x at 90%, S = 64k on an H100), split at
    32-row blocks (0.93x there); a tuning overrides either way."""
    assert mgpu.default_config(128, 16, 128, 0.1).fuses_backward
    assert not mgpu.default_config(128, 32, 128, 0.1).fuses_backward
    assert not mgpu.default_config(64, 16, 128, 0.1).fuses_backward
    assert not mgpu.default_config(128, 16, 128, 0.1, tuning=SPLIT).fuses_backward
    assert mgpu.default_config(128, 32, 128, 0.1, tuning=FUSED).fuses_backward


def _run_state_constants(jaxpr, found):
    """Constant operands of every run_state (a wgmma's accumulator scope) in jaxpr and the jaxprs inside it."""
    from jax._src import core as jax_core

    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "run_state":
            found += [v for v in eqn.invars if isinstance(v, jax_core.Literal)]
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else [param]:
                if isinstance(sub, jax_core.ClosedJaxpr):
                    _run_state_constants(sub.jaxpr, found)
                elif isinstance(sub, jax_core.Jaxpr):
                    _run_state_constants(sub, found)
    return found


def test_no_wgmma_scope_takes_a_constant_as_state():
    """A ref index that mixes a constant with the consumer index (rows.at[1, wg]) enters a wgmma's run_state as a
    constant state operand, which jax 0.11's Mosaic GPU lowering rejects ("Shaped arrays must be represented by
    ir.Values, got: TypedInt(1)"; the fused backward's first GPU runs) while jax 0.10 lowers it. Checked on the
    compiled (non-interpreted) forward, dQ, fine dK/dV and fused kernels' traced bodies."""
    from pallas_kernels import sparse_attention_mgpu_bwd as bwd
    from pallas_kernels import sparse_attention_mgpu_fine as fine
    from pallas_kernels import sparse_attention_mgpu_fused as fused
    from pallas_kernels import sparse_attention_mgpu_fwd as fwd

    s, h, d = 1024, 2, 128
    x = jax.ShapeDtypeStruct((1, s, h, d), jnp.bfloat16)
    rows = jax.ShapeDtypeStruct((1, h, s), jnp.float32)
    idx = jax.ShapeDtypeStruct((1, h, s // 128, 6), jnp.int32)
    cnt = jax.ShapeDtypeStruct((1, h, s // 128), jnp.int32)
    ints = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    cfg = mgpu.default_config(128, 16, d, d**-0.5, tuning=FUSED)
    kernels = {
        "forward": (lambda q, k, v, i, c: fwd.forward(q, k, v, i, c, None, cfg), (x, x, x, idx, cnt)),
        "dq": (lambda *a: bwd.dq(*a, None, cfg), (x, x, x, x, rows, rows, idx, cnt)),
        "fine dkdv": (
            lambda *a: fine.dkdv(*a, None, cfg),
            (x, x, x, x, rows, rows, ints(1, h, 400), ints(1, h, s // 16 + 1), ints(1, h, s // 16)),
        ),
        "fused": (lambda *a: fused.backward(*a, None, cfg), (x, x, x, x, rows, rows, idx, cnt)),
    }
    for name, (fn, args) in kernels.items():
        found = _run_state_constants(jax.make_jaxpr(fn)(*args).jaxpr, [])
        assert not found, f"{name}: constants {found} enter a wgmma's run_state"
