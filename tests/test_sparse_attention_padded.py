"""Padded token layouts (kv_valid) and log-sum-exp output of the DSV kernels: sparse attention (reference and
Pallas in interpret mode) against dense attention over the valid tokens and a brute-force masked softmax;
the backward of one key set's share under given (merged) softmax statistics; selection that ignores padding."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv_jax.attention import merge_attention
from dsv_jax.dsv.selection import candidate_scores, select_kv
from pallas_kernels.lowrank_topk import lowrank_topk
from pallas_kernels.sparse_attention import sparse_attention, sparse_attention_backward, sparse_attention_reference
from tests.test_sparse_kernels import assert_close, qkv, random_selection


def tile_major_validity(grid, tile):
    """bool [S] of a token grid padded to whole tiles, in tile-major order (tiles in raster order), each
    tile's real tokens first (raster order inside the tile), then its padding."""
    tile = tuple(min(t, g) for t, g in zip(tile, grid))
    n_tiles = [-(-g // t) for g, t in zip(grid, tile)]
    inside = np.indices(tile).reshape(3, -1).T  # offsets inside a tile, raster order
    flags = []
    for corner in itertools.product(*(range(n) for n in n_tiles)):
        real = np.all(inside + np.multiply(corner, tile) < np.asarray(grid), axis=1)
        flags += [True] * int(real.sum()) + [False] * int((~real).sum())
    valid = np.asarray(flags)
    assert valid.sum() == np.prod(grid)
    return valid


def kv_valid_of(valid, kv_block, batch):
    """kv_valid [B, S // kv_block] of a validity mask whose blocks hold their valid tokens first."""
    blocks = valid.reshape(-1, kv_block)
    counts = blocks.sum(-1)
    assert np.array_equal(blocks, np.arange(kv_block) < counts[:, None]), "valid tokens must come first in a block"
    return jnp.broadcast_to(jnp.asarray(counts, jnp.int32), (batch, len(counts)))


def masked_attention(q, k, v, allowed):
    """Brute force: (o, lse) of softmax over the keys allowed[b, h, i, j]; rows with none give 0 and -inf."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") * q.shape[-1] ** -0.5
    s = jnp.where(allowed, s, -jnp.inf)
    m = jax.lax.stop_gradient(jnp.max(s, -1, keepdims=True))
    m = jnp.where(m == -jnp.inf, 0.0, m)
    e = jnp.exp(s - m)
    l = jnp.sum(e, -1, keepdims=True)
    l_safe = jnp.where(l > 0, l, 1.0)
    o = jnp.einsum("bhqk,bkhd->bqhd", e / l_safe, v, precision="highest")
    return o, jnp.where(l > 0, m + jnp.log(l_safe), -jnp.inf)[..., 0]


def allowed_keys(index, count, kv_valid, q_tile, kv_block, s):
    """bool [B, H, S, S]: key j is allowed for query i iff its block is among the live ids of i's tile and
    j is one of the block's valid keys."""
    index, count, kv_valid = np.asarray(index), np.asarray(count), np.asarray(kv_valid)
    b, h, tiles, _ = index.shape
    allowed = np.zeros((b, h, s, s), bool)
    key_ok = (np.arange(kv_block) < kv_valid[..., None]).reshape(b, s)
    for bi, hi, t in itertools.product(range(b), range(h), range(tiles)):
        for blk in index[bi, hi, t, : count[bi, hi, t]]:
            rows = slice(t * q_tile, (t + 1) * q_tile)
            allowed[bi, hi, rows, blk * kv_block : (blk + 1) * kv_block] = key_ok[
                bi, blk * kv_block : (blk + 1) * kv_block
            ]
    return jnp.asarray(allowed)


def vjp_with_lse(fn, q, k, v, cot_o, cot_lse):
    """(o, lse) = fn(q, k, v) and the gradients for random cotangents of both outputs."""
    (o, lse), pullback = jax.vjp(fn, q, k, v)
    return o, lse, pullback((cot_o, cot_lse))


def sparse_fn(impl, index, count, kv_valid, q_tile, kv_block):
    return jax.jit(
        lambda q, k, v: sparse_attention(
            q, k, v, index, count, q_tile=q_tile, kv_block=kv_block, kv_valid=kv_valid, return_lse=True, impl=impl
        )
    )


def cotangents(key, b, s, h, d):
    k1, k2 = jax.random.split(key)
    return jax.random.normal(k1, (b, s, h, d)), jax.random.normal(k2, (b, h, s))


def check_against(impl_out, ref_out, tol, rows=None):
    """Compare (o, lse, (dq, dk, dv)) of an implementation with a reference, on query rows `rows`."""
    o, lse, grads = impl_out
    ro, rl, rgrads = ref_out
    sel = slice(None) if rows is None else rows
    assert_close(o[:, sel], ro[:, sel], tol, "o")
    np.testing.assert_array_equal(np.isinf(np.asarray(lse[:, :, sel])), np.isinf(np.asarray(rl[:, :, sel])))
    finite = np.isfinite(np.asarray(rl[:, :, sel]))
    assert_close(np.asarray(lse[:, :, sel])[finite], np.asarray(rl[:, :, sel])[finite], tol, "lse")
    for name, g, rg in zip(("dq", "dk", "dv"), grads, rgrads):
        assert np.all(np.isfinite(np.asarray(g))), f"{name} holds NaN or inf"
        assert_close(g[:, sel], rg[:, sel], tol, name)


def test_every_block_kept_on_a_padded_layout_is_dense_attention_over_valid_tokens():
    """3x5x6 tokens in 2x2x4 tiles (192 positions, 90 real), blocks of half a tile (gathered rows)."""
    grid, tile, kv_block, d, b, h = (3, 5, 6), (2, 2, 4), 8, 48, 2, 2
    valid = tile_major_validity(grid, tile)
    s, q_tile = len(valid), int(np.prod(tile))
    kv_valid = kv_valid_of(valid, kv_block, b)
    q, k, v = qkv(jax.random.key(s + kv_block), b, s, h, d)
    nb = s // kv_block
    index = jnp.broadcast_to(jnp.arange(nb, dtype=jnp.int32), (b, h, s // q_tile, nb))
    count = jnp.full((b, h, s // q_tile), nb, jnp.int32)
    cot_o, cot_lse = cotangents(jax.random.key(1), b, s, h, d)
    # The model drops padded query rows, so they get no cotangent (else they would add to the real keys' dk, dv).
    cot_o, cot_lse = cot_o * valid[None, :, None, None], cot_lse * valid

    real = np.flatnonzero(valid)  # dense attention among the real tokens only

    def dense(q, k, v):
        qs, ks, vs = q[:, real], k[:, real], v[:, real]
        o = jax.nn.dot_product_attention(qs, ks, vs, implementation="xla")
        logits = jnp.einsum("bqhd,bkhd->bhqk", qs, ks, precision="highest") * d**-0.5
        return o, jax.nn.logsumexp(logits, axis=-1)

    ro, rl, rgrads = vjp_with_lse(jax.jit(dense), q, k, v, cot_o[:, real], cot_lse[:, :, real])
    rgrads = tuple(g[:, real] for g in rgrads)
    pad = np.flatnonzero(~valid)
    for impl in ("xla", "pallas"):
        o, lse, (dq, dk, dv) = vjp_with_lse(
            sparse_fn(impl, index, count, kv_valid, q_tile, kv_block), q, k, v, cot_o, cot_lse
        )
        assert np.all(np.isfinite(np.asarray(o))) and np.all(np.isfinite(np.asarray(lse))), impl  # padded rows too
        check_against((o[:, real], lse[:, :, real], (dq[:, real], dk[:, real], dv[:, real])), (ro, rl, rgrads), 1e-5)
        assert float(jnp.max(jnp.abs(dk[:, pad]))) == 0.0 and float(jnp.max(jnp.abs(dv[:, pad]))) == 0.0, impl


def test_layout_helper_on_video_shapes():
    """The tile-major layout of the model's shapes: 21x30x52 tokens in 4x4x4 tiles, 5x7x9 in 2x4x4: each
    block of a tile (and of half a tile) holds its valid tokens first, and the counts add up."""
    for grid, tile in [((21, 30, 52), (4, 4, 4)), ((5, 7, 9), (2, 4, 4)), ((1, 45, 80), (1, 4, 4))]:
        valid = tile_major_validity(grid, tile)
        size = int(np.prod([min(t, g) for t, g in zip(tile, grid)]))
        for kv_block in (size, size // 2, 1):
            kv_valid = kv_valid_of(valid, kv_block, 1)
            assert int(jnp.sum(kv_valid)) == np.prod(grid)
        assert len(valid) == np.prod([-(-g // t) * t for g, t in zip(grid, tile)])


def test_dense_over_valid_tokens_on_a_larger_padded_grid():
    """5x7x9 tokens in 2x4x4 tiles (576 positions, 315 real), tile-sized blocks, every block kept: the
    reference equals dense attention among the real tokens (the Pallas path is compared with the
    reference on the smaller layouts)."""
    valid = tile_major_validity((5, 7, 9), (2, 4, 4))
    s, b, h, d, tile = len(valid), 1, 2, 16, 32
    q, k, v = qkv(jax.random.key(2), b, s, h, d)
    nb = s // tile
    index = jnp.broadcast_to(jnp.arange(nb, dtype=jnp.int32), (b, h, nb, nb))
    o, lse = sparse_attention(
        q,
        k,
        v,
        index,
        jnp.full((b, h, nb), nb, jnp.int32),
        q_tile=tile,
        kv_block=tile,
        kv_valid=kv_valid_of(valid, tile, b),
        return_lse=True,
        impl="xla",
    )
    real = np.flatnonzero(valid)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q[:, real], k[:, real], precision="highest") * d**-0.5
    assert_close(o[:, real], jax.nn.dot_product_attention(q[:, real], k[:, real], v[:, real]), 1e-5, "o")
    assert_close(lse[:, :, real], jax.nn.logsumexp(logits, -1), 1e-6, "lse")


# (kv_block, q_tile, S, K, D, layout): 64-row blocks read contiguously with random valid counts (some blocks
# empty); token level on one image of 9x10 tokens in 4x4 tiles (144 positions, 90 real).
RANDOM = [(64, 32, 256, 3, 96, None), (1, 16, 144, 21, 64, ((1, 9, 10), (1, 4, 4)))]


@pytest.mark.parametrize("kv_block,q_tile,s,n_sel,d,layout", RANDOM)
def test_random_selection_with_padded_keys_is_a_masked_softmax(kv_block, q_tile, s, n_sel, d, layout):
    """Against a brute-force softmax over the allowed keys; includes a tile that selected only empty blocks
    and a tile with kv_count = 0: o = 0, lse = -inf, zero gradients, no NaN, also under a nonzero lse
    cotangent."""
    b, h = 2, 2
    nb, tiles = s // kv_block, s // q_tile
    q, k, v = qkv(jax.random.key(40 + kv_block), b, s, h, d)
    index, count = random_selection(jax.random.key(41), b, h, tiles, nb, n_sel)
    if layout is None:
        kv_valid = jax.random.randint(jax.random.key(42), (b, nb), 0, kv_block + 1, dtype=jnp.int32)
        kv_valid = kv_valid.at[:, 1].set(kv_block)  # at least one full block
    else:
        kv_valid = kv_valid_of(tile_major_validity(*layout), kv_block, b)
    # batch 0, head 0, tile 0 selects only blocks emptied here; batch 1, head 1, tile 1 selects nothing
    dead = index[0, 0, 0, : count[0, 0, 0]]
    kv_valid = kv_valid.at[0, dead].set(0)
    count = count.at[1, 1, 1].set(0)
    cot_o, cot_lse = cotangents(jax.random.key(43), b, s, h, d)
    allowed = allowed_keys(index, count, kv_valid, q_tile, kv_block, s)
    ref = vjp_with_lse(jax.jit(lambda q, k, v: masked_attention(q, k, v, allowed)), q, k, v, cot_o, cot_lse)
    key_ok = (np.arange(kv_block) < np.asarray(kv_valid)[..., None]).reshape(b, s)
    for impl in ("xla", "pallas"):
        o, lse, grads = got = vjp_with_lse(
            sparse_fn(impl, index, count, kv_valid, q_tile, kv_block), q, k, v, cot_o, cot_lse
        )
        check_against(got, ref, 1e-5)
        for bi, hi, t in [(0, 0, 0), (1, 1, 1)]:
            rows = slice(t * q_tile, (t + 1) * q_tile)
            assert float(jnp.max(jnp.abs(o[bi, rows, hi]))) == 0.0, impl
            assert bool(jnp.all(lse[bi, hi, rows] == -jnp.inf)), impl
            assert float(jnp.max(jnp.abs(grads[0][bi, rows, hi]))) == 0.0, impl  # dq of the empty rows
        for g in grads[1:]:  # dk, dv of padded keys
            assert float(jnp.max(jnp.abs(jnp.where(key_ok[:, :, None, None], 0.0, g)))) == 0.0, impl


def test_without_new_arguments_nothing_changes():
    """kv_valid of full blocks and return_lse leave the Pallas o exactly as the old call computes it."""
    b, s, h, d, q_tile, kv_block = 1, 128, 2, 32, 32, 32
    q, k, v = qkv(jax.random.key(50), b, s, h, d)
    index, count = random_selection(jax.random.key(51), b, h, s // q_tile, s // kv_block, 2)
    old = sparse_attention(q, k, v, index, count, q_tile=q_tile, kv_block=kv_block, impl="pallas")
    new, _ = sparse_attention(
        q,
        k,
        v,
        index,
        count,
        q_tile=q_tile,
        kv_block=kv_block,
        impl="pallas",
        return_lse=True,
        kv_valid=jnp.full((b, s // kv_block), kv_block, jnp.int32),
    )
    np.testing.assert_array_equal(old, new)


def test_kv_valid_errors():
    q, k, v = qkv(jax.random.key(0), 1, 128, 2, 32)
    index, count = random_selection(jax.random.key(1), 1, 2, 4, 2, 1)
    with pytest.raises(ValueError, match=r"kv_valid must be \[B, S // kv_block\] = \[1, 2\]"):
        sparse_attention(q, k, v, index, count, q_tile=32, kv_block=64, kv_valid=jnp.ones((1, 4), jnp.int32))
    with pytest.raises(ValueError, match="kv_valid must be integers"):
        sparse_attention(q, k, v, index, count, q_tile=32, kv_block=64, kv_valid=jnp.ones((1, 2), jnp.float32))


# ---------------------------------------------------------------------------------------------------
# sparse_attention_backward: one key set's share under given softmax statistics

BWD = dict(q_tile=32, kv_block=16)  # 4 query tiles, 8 KV blocks of 128 tokens


def backward_case(seed, padded):
    """q, k, v [2, 128, 2, 64], a selection of up to 5 blocks with a tile of kv_count 0 (batch 1, head 1,
    tile 1), cotangents for (o, lse), and (padded) kv_valid with partly and fully padded blocks, all of
    the blocks of batch 0, head 0, tile 0 among the empty ones."""
    b, s, h, d = 2, 128, 2, 64
    q, k, v = qkv(jax.random.key(seed), b, s, h, d)
    nb = s // BWD["kv_block"]
    index, count = random_selection(jax.random.key(seed + 1), b, h, s // BWD["q_tile"], nb, 5)
    count = count.at[1, 1, 1].set(0)
    kv_valid = None
    if padded:
        kv_valid = jax.random.randint(jax.random.key(seed + 2), (b, nb), 0, BWD["kv_block"] + 1, dtype=jnp.int32)
        kv_valid = kv_valid.at[0, index[0, 0, 0, : count[0, 0, 0]]].set(0)
    return (q, k, v), (index, count), kv_valid, cotangents(jax.random.key(seed + 3), b, s, h, d)


def reference_vjp(q, k, v, index, count, kv_valid, cot):
    fn = lambda q, k, v: sparse_attention_reference(q, k, v, index, count, kv_valid=kv_valid, return_lse=True, **BWD)
    return vjp_with_lse(fn, q, k, v, *cot)


def check_grads(got, want):
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert np.all(np.isfinite(np.asarray(g))), f"{name} holds NaN or inf"
        assert_close(g, w, 1e-5, name)


@pytest.mark.parametrize("padded", [False, True], ids=["full", "padded"])
@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_backward_under_own_statistics_is_the_vjp(impl, padded):
    """Given this call's own (o, lse), sparse_attention_backward is the VJP of sparse_attention(return_lse=True)
    for cotangents of both outputs, rows without a key included (lse = -inf, nonzero lse cotangent)."""
    (q, k, v), (index, count), kv_valid, cot = backward_case(70, padded)
    o, lse, want = reference_vjp(q, k, v, index, count, kv_valid, cot)
    assert np.any(np.isneginf(np.asarray(lse)))
    backward = jax.jit(lambda *a: sparse_attention_backward(*a, kv_valid=kv_valid, impl=impl, **BWD))
    check_grads(backward(q, k, v, index, count, o, lse, *cot), want)


def split_selection(index, count, a_empty):
    """Two disjoint selections whose union is (index, count): A the first half of each tile's live ids
    (none at the (batch, head, tile) a_empty), B the others, moved to the front."""
    first = ((count + 1) // 2).at[a_empty].set(0)
    n_sel = index.shape[-1]
    rest = jnp.take_along_axis(index, jnp.minimum(jnp.arange(n_sel) + first[..., None], n_sel - 1), axis=-1)
    return (index, first), (rest, count - first)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_backward_under_merged_statistics_sums_to_the_whole_gradient(impl):
    """Keys split into disjoint selections A and B: (o, lse) merged from their forwards equal the whole
    selection's, and the two backward calls under the merged (o, lse) sum to its gradients. Rows where A
    sees no key, and rows where no part does (lse = -inf), included; padded blocks too."""
    (q, k, v), (index, count), kv_valid, cot = backward_case(80, padded=True)
    o, lse, want = reference_vjp(q, k, v, index, count, kv_valid, cot)
    parts = split_selection(index, count, (0, 1, 1))
    forward = lambda idx, cnt: sparse_attention_reference(q, k, v, idx, cnt, kv_valid=kv_valid, return_lse=True, **BWD)
    o_m, lse_m = merge_attention(*forward(*parts[0]), *forward(*parts[1]))
    check_against((o_m, lse_m, ()), (o, lse, ()), 1e-5)
    backward = jax.jit(
        lambda idx, cnt: sparse_attention_backward(
            q, k, v, idx, cnt, o_m, lse_m, *cot, kv_valid=kv_valid, impl=impl, **BWD
        )
    )
    grads_a, grads_b = backward(*parts[0]), backward(*parts[1])
    check_grads([a + b for a, b in zip(grads_a, grads_b)], want)
    assert float(jnp.max(jnp.abs(grads_a[0][0, 32:64, 1]))) == 0.0  # A's empty tile: no dq from A


# ---------------------------------------------------------------------------------------------------
# selection on padded layouts


def brute_force_padded_scores(q_lr, k_lr, kv_valid, q_tile, kv_block, reduce):
    """Scores [B, H, T, nb] by loops: proxy = mean of a tile's valid rows, reduce over a block's valid keys."""
    q, k, kv_valid = np.asarray(q_lr, np.float64), np.asarray(k_lr, np.float64), np.asarray(kv_valid)
    b, s, h, _ = q.shape
    row_ok = (np.arange(kv_block) < kv_valid[..., None]).reshape(b, s)
    tiles, nb = s // q_tile, s // kv_block
    out = np.full((b, h, tiles, nb), -np.inf)
    for bi, hi, t in itertools.product(range(b), range(h), range(tiles)):
        rows = np.arange(t * q_tile, (t + 1) * q_tile)
        rows = rows[row_ok[bi, rows]]
        proxy = q[bi, rows, hi].mean(0) if len(rows) else np.zeros(q.shape[-1])
        for blk in range(nb):
            n = kv_valid[bi, blk]
            if n:
                sc = k[bi, blk * kv_block : blk * kv_block + n, hi] @ proxy
                out[bi, hi, t, blk] = sc.mean() if reduce == "mean" else sc.max()
    return out


@pytest.mark.parametrize(
    "kv_block,reduce,top_k,impl", [(8, "max", 5, "pallas"), (8, "mean", 5, "xla"), (1, "mean", 30, "pallas")]
)
def test_lowrank_topk_ignores_padding(kv_block, reduce, top_k, impl):
    valid = tile_major_validity((3, 5, 6), (2, 2, 4))  # 192 positions, 90 real, 16-token tiles
    s, q_tile, b, h, r = len(valid), 16, 2, 2, 8
    kv_valid = kv_valid_of(valid, kv_block, b)
    ks = jax.random.split(jax.random.key(kv_block + top_k), 2)
    q_lr = jax.random.normal(ks[0], (b, s, h, r)) + 0.5
    k_lr = jax.random.normal(ks[1], (b, s, h, r))
    k_lr = jnp.where(jnp.asarray(valid)[None, :, None, None], k_lr, 50.0)  # padded keys would win every block
    q_lr = jnp.where(jnp.asarray(valid)[None, :, None, None], q_lr, -50.0)  # padded queries would flip the proxy
    got = np.asarray(
        lowrank_topk(
            q_lr, k_lr, top_k, q_tile=q_tile, kv_block=kv_block, block_reduce=reduce, kv_valid=kv_valid, impl=impl
        )
    )
    scores = brute_force_padded_scores(q_lr, k_lr, kv_valid, q_tile, kv_block, reduce)
    assert np.all(np.isfinite(np.take_along_axis(scores, got, -1))), "a block without a valid key was selected"
    picked = np.sort(np.take_along_axis(scores, got, -1), -1)
    best = np.sort(-np.sort(-scores, -1)[..., :top_k], -1)
    np.testing.assert_allclose(picked, best, rtol=1e-5, atol=1e-4)
    assert np.all(np.diff(got, axis=-1) > 0)


def test_select_kv_counts_only_valid_blocks():
    """Fewer valid blocks than top_k: kv_count drops to the valid count, the valid ids come first (ascending),
    padding is never selected; with keep ratios the counts are fractions of the valid blocks; candidate
    scores are means over valid keys."""
    b, s, h, r, q_tile, kv_block, top_k = 2, 128, 2, 8, 16, 16, 6
    ks = jax.random.split(jax.random.key(60), 2)
    q_lr, k_lr = jax.random.normal(ks[0], (b, s, h, r)), jax.random.normal(ks[1], (b, s, h, r))
    kv_valid = jnp.asarray([[16, 0, 5, 0, 16, 0, 0, 3], [16, 16, 16, 16, 16, 9, 0, 0]], jnp.int32)
    n_ok = np.asarray([4, 6])
    select = jax.jit(
        lambda keep: select_kv(q_lr, k_lr, top_k, keep, q_tile=q_tile, kv_block=kv_block, kv_valid=kv_valid)
    )
    idx, cnt = select(None)
    np.testing.assert_array_equal(cnt, np.broadcast_to(n_ok[:, None, None], cnt.shape))
    for bi in range(b):
        live = np.asarray(idx[bi, ..., : n_ok[bi]])
        assert set(live.ravel()) == set(np.flatnonzero(np.asarray(kv_valid[bi]))), "all valid blocks, nothing else"
        assert np.all(np.diff(live, axis=-1) > 0)

    keep = jnp.asarray([0.5, 1.0])
    idx, cnt = select(keep)
    np.testing.assert_array_equal(cnt[:, :, 0], [[2, 4], [3, 6]])  # ceil(keep * valid blocks)
    scores = brute_force_padded_scores(q_lr, k_lr, kv_valid, q_tile, kv_block, "mean")
    for bi, hi in itertools.product(range(b), range(h)):
        c = int(cnt[bi, hi, 0])
        chosen = np.take_along_axis(scores[bi, hi], np.asarray(idx[bi, hi, :, :c]), -1)
        np.testing.assert_allclose(np.sort(chosen, -1), np.sort(-np.sort(-scores[bi, hi], -1)[:, :c], -1), rtol=1e-5)
    cand = jax.jit(lambda i: candidate_scores(q_lr, k_lr, i, q_tile=q_tile, kv_block=kv_block, kv_valid=kv_valid))(idx)
    np.testing.assert_allclose(cand, np.take_along_axis(scores, np.asarray(idx), -1), rtol=1e-5, atol=1e-6)
