"""DSV end to end on the CPU: backends, selection glue, window lists, predictor, optimizer split,
controller, checkpoint restore mid stage 2, and the CLI reaching stage 2."""

import json
import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv_jax.attention import attention
from dsv_jax.config import get_config
from dsv_jax.dsv.controller import DSVController
from dsv_jax.dsv.plan import AttentionPlan
from dsv_jax.dsv.selection import select_kv, window_extent, window_selection
from dsv_jax.model import VideoDiT
from dsv_jax.model.tokens import token_layout
from dsv_jax.train.loss import flow_matching_loss
from dsv_jax.train.optimizer import param_labels
from dsv_jax.train.step import abstract_model, init_state, make_train_step
from tests.conftest import SMALL, small_config


def rand(key, shape):
    return jax.random.normal(jax.random.key(key), shape, jnp.float32)


def masked_dense(q, k, v, allowed):
    """Reference: softmax over the keys allowed[b, h, i, j] only. q, k, v [B, S, H, D]."""
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    p = jax.nn.softmax(jnp.where(allowed, logits, -jnp.inf), -1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


def block_scores(q_lr, k_lr, q_tile, kv_block, reduce):
    b, s, h, r = q_lr.shape
    proxy = q_lr.reshape(b, s // q_tile, q_tile, h, r).mean(2)
    sc = jnp.einsum("bthr,bshr->bhts", proxy, k_lr).reshape(b, h, s // q_tile, s // kv_block, kv_block)
    return np.asarray(sc.mean(-1) if reduce == "mean" else sc.max(-1))


# -- backends ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("kv_block, d", [(1, 24), (8, 16)])
def test_dsv_backend_selecting_every_block_equals_dense(kv_block, d):
    b, s, h, q_tile = 2, 48, 3, 16
    q, k, v = rand(0, (b, s, h, d)), rand(1, (b, s, h, d)), rand(2, (b, s, h, d))
    dense = attention(q, k, v, backend="xla")
    nb = s // kv_block
    idx = jnp.broadcast_to(jnp.arange(nb, dtype=jnp.int32), (b, h, s // q_tile, nb))
    out = attention(q, k, v, backend="dsv", kv_index=idx, kv_count=jnp.full(idx.shape[:3], nb, jnp.int32),
                    q_tile=q_tile, kv_block=kv_block)
    np.testing.assert_allclose(out, dense, atol=2e-5)
    # from the predictor's projections with top_k = every block and keep ratio 1 for every head
    q_lr, k_lr = rand(3, (b, s, h, 6)), rand(4, (b, s, h, 6))
    out = attention(q, k, v, backend="dsv", q_lr=q_lr, k_lr=k_lr, top_k=nb, keep=jnp.ones((h,)),
                    q_tile=q_tile, kv_block=kv_block)
    np.testing.assert_allclose(out, dense, atol=2e-5)
    # a padded layout (kv_lens) falls back to dense attention masked by length
    lens = jnp.array([s, 29], jnp.int32)
    np.testing.assert_allclose(attention(q, k, v, backend="dsv", kv_lens=lens, kv_index=idx, q_tile=q_tile,
                                         kv_block=kv_block), attention(q, k, v, backend="xla", kv_lens=lens), atol=2e-5)


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
                for blk in idx[bi, hi, t, :expect_counts[bi, hi]]:
                    allowed[bi, hi, t * q_tile:(t + 1) * q_tile, blk * kv_block:(blk + 1) * kv_block] = True
    out = attention(q, k, v, backend="dsv", q_lr=q_lr, k_lr=k_lr, top_k=top_k, keep=keep, q_tile=q_tile,
                    kv_block=kv_block, block_reduce=reduce)
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


@pytest.mark.parametrize("reduce", ["mean", "max"])
def test_recall_curve_is_the_mass_of_the_predictors_best_blocks(reduce):
    """Brute force: for each sampled query, rank its tile's KV blocks by the predictor's score, take the
    best ceil(f * blocks), and sum the query's exact attention probabilities inside them."""
    from dsv_jax.dsv.profiler import RECALL_FRACTIONS, profile_rows

    b, s, h, r, q_tile, kv_block = 2, 96, 3, 4, 8, 4
    z = 3 * rand(30, (b, h, 5, s))
    positions = np.array([0, 17, 40, 63, 95])
    q_lr, k_lr = rand(31, (b, s, h, r)), rand(32, (b, s, h, r))
    out = profile_rows(z, positions, s, theta=0.9, percentile=10.0, coords=np.zeros((s, 3), np.int32),
                       q_tile=q_tile, kv_block=kv_block, lowrank=(q_lr, k_lr), block_reduce=reduce)
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
                        mask[blk * kv_block:(blk + 1) * kv_block] = True
                    expect[hi, j] += p[bi, hi, qi, mask].sum() / (b * len(positions))
    np.testing.assert_allclose(out["recall_curve"], expect, atol=1e-5)
    # and each point is the recall of the selection select_kv makes at that keep ratio (same block counts)
    from dsv_jax.dsv.profiler import selection_recall

    for j in (0, 5, 9, 14):
        sel = select_kv(q_lr, k_lr, nb, jnp.full((h,), RECALL_FRACTIONS[j]), q_tile=q_tile, kv_block=kv_block,
                        block_reduce=reduce)
        np.testing.assert_allclose(selection_recall(jnp.asarray(p), positions, sel, q_tile, kv_block),
                                   out["recall_curve"][:, j], atol=1e-5)
    assert np.all(np.diff(np.asarray(out["recall_curve"]), axis=-1) >= -1e-6)
    np.testing.assert_allclose(out["recall_curve"][:, -1], 1.0, atol=1e-5)
    # without the predictor's projections there is no curve
    assert np.isnan(profile_rows(z, positions, s, theta=0.9, percentile=10.0,
                                 coords=np.zeros((s, 3), np.int32))["recall_curve"]).all()


def test_oracle_curves_bound_the_selection_rule_and_the_predictor():
    """Analysis statistics: the best token selection holds at least what the best block selection holds,
    which holds at least what any rule (true q, k or the predictor) selects at the same keep ratio."""
    from dsv_jax.dsv.profiler import RECALL_FRACTIONS, profile_rows

    b, s, h, d, r, q_tile, kv_block = 1, 64, 2, 8, 4, 8, 4
    q, k = rand(40, (b, s, h, d)), rand(41, (b, s, h, d))
    positions = np.arange(0, s, 5)
    z = jnp.einsum("bqhd,bkhd->bhqk", q[:, positions], k) * d ** -0.5
    coords = np.stack(np.unravel_index(np.arange(s), (4, 4, 4)), 1)
    out = profile_rows(z, positions, s, theta=0.9, percentile=10.0, coords=coords, q_tile=q_tile,
                       kv_block=kv_block, lowrank=(rand(42, (b, s, h, r)), rand(43, (b, s, h, r))),
                       analysis=True, exact=(q, k))
    tokens, blocks = np.asarray(out["oracle_curve"][:, 0]), np.asarray(out["oracle_curve"][:, 1])
    assert tokens.shape == blocks.shape == (h, len(RECALL_FRACTIONS))
    whole = [j for j, f in enumerate(RECALL_FRACTIONS) if float(f * s / kv_block).is_integer()]  # no rounding
    assert len(whole) >= 3 and np.all(tokens[:, whole] >= blocks[:, whole] - 1e-6)
    for rule in ("exact_proxy_curve", "recall_curve"):
        assert np.all(blocks >= np.asarray(out[rule]) - 1e-6)
    np.testing.assert_allclose(tokens[:, -1], 1.0, atol=1e-5)


def test_centred_predictor_loss_ignores_row_offsets():
    """Softmax is shift-invariant per row: with center=True a constant added to a row of true logits
    changes nothing; the paper's raw-row loss does change."""
    from dsv_jax.dsv.predictor import predictor_loss

    b, s, h, r = 1, 32, 2, 4
    q_lr, k_lr = rand(50, (b, s, h, r)), rand(51, (b, s, h, r))
    positions = np.array([0, 9, 20])
    z = rand(52, (b, h, 3, s))
    shifted = z + 5.0 * rand(53, (b, h, 3, 1))
    every = np.ones(s, bool)
    centred = [float(predictor_loss(q_lr, k_lr, x, positions, every, center=True)) for x in (z, shifted)]
    raw = [float(predictor_loss(q_lr, k_lr, x, positions, every, center=False)) for x in (z, shifted)]
    assert centred[0] == pytest.approx(centred[1], abs=1e-5)
    assert abs(raw[0] - raw[1]) > 1e-2
    # a padded layout (padding inside tiles): only the valid keys count, and the means are over them
    valid = np.random.default_rng(0).random(s) < 0.7
    padded = jnp.where(valid, shifted, -jnp.inf)
    got = float(predictor_loss(q_lr, k_lr, padded, positions, valid, center=True))
    zh = np.einsum("bqhr,bkhr->bhqk", np.asarray(q_lr)[:, positions], np.asarray(k_lr)[:, valid]) * r ** -0.5
    zt = np.asarray(shifted)[..., valid]
    zh, zt = zh - zh.mean(-1, keepdims=True), zt - zt.mean(-1, keepdims=True)
    nh, nt = np.linalg.norm(zh, axis=-1, keepdims=True), np.linalg.norm(zt, axis=-1, keepdims=True)
    expect = 0.9 * np.mean(1 - np.sum(zh * zt, -1) / (nh * nt)[..., 0]) + \
        0.1 * np.mean(np.sum((zh / nh - zt / nt) ** 2, -1) / valid.sum())
    assert got == pytest.approx(expect, rel=1e-4)


# -- model: sparse plans that select everything equal dense; padded layouts fall back ---------------

def dsv_model(arch, seed=0, **model_kw):
    cfg = get_config("tiny", ["model.hidden=32", "model.heads=2", "model.depth=2", "model.text_dim=16",
                              "attention=dsv", f"model.arch={arch}", "dsv.rank=4"])
    import dataclasses
    model = VideoDiT(dataclasses.replace(cfg.model, **model_kw), rngs=nnx.Rngs(seed), predictor_rank=4)
    graphdef, state = nnx.split(model)
    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    leaves = [x + 0.1 * jax.random.normal(kk, x.shape, x.dtype) for x, kk in zip(leaves, keys)]
    return nnx.merge(graphdef, jax.tree.unflatten(tree, leaves))


def model_inputs(shape, b=2):
    x = rand(20, (b, *shape, 3))
    t = jax.random.uniform(jax.random.key(21), (b,))
    text = rand(22, (b, 5, 16))
    mask = jnp.arange(5)[None] < jnp.array([3, 5])[:b, None]
    return x, t, text, mask


@pytest.mark.parametrize("arch", ["dit", "mmdit"])
@pytest.mark.parametrize("latent", [(4, 16, 24), (3, 20, 28)], ids=["unpadded", "padded"])
def test_model_with_sparse_plans_selecting_everything_equals_dense(arch, latent, monkeypatch):
    """Every block kept: the sparse path (DiT: sparse kernel; MMDiT: sparse kernel on video keys with
    log-sum-exp, merged with the dense text part) equals dense attention, forward and gradients. The
    padded latent's token grid (3, 5, 7) does not divide into 2x2x2 tiles: its edge tiles are partly
    padding, masked in the kernels by kv_valid and in dense attention by a key mask."""
    from dsv_jax.dsv import backend

    calls = []
    kernel = backend.sparse_attention
    monkeypatch.setattr(backend, "sparse_attention", lambda *a, **k: calls.append(k) or kernel(*a, **k))
    model = dsv_model(arch, patch=(1, 4, 4), tile=(2, 2, 2))
    x, t, text, mask = model_inputs(latent)
    everything = AttentionPlan(mode="dsv", sparse=True, keep=1.0, profile=True)
    inputs = {"keep": jnp.ones((2, 2))}

    def loss(model, attention, inputs=None):
        out, aux = model(x, t, text, mask, attention=attention, attention_inputs=inputs, return_aux=True)
        return jnp.sum(out * jnp.cos(jnp.arange(out.size).reshape(out.shape))), (out, aux)

    (_, (dense, _)), g_dense = nnx.value_and_grad(loss, has_aux=True)(model, "xla")
    (_, (out, aux)), g_sparse = nnx.value_and_grad(loss, has_aux=True)(model, [everything, everything], inputs)
    np.testing.assert_allclose(out, dense, atol=3e-5)
    for a, b in zip(jax.tree.leaves(g_sparse), jax.tree.leaves(g_dense)):
        np.testing.assert_allclose(a, b, atol=2e-4, rtol=2e-3)
    np.testing.assert_allclose(aux["recall"], 1.0, atol=1e-5)  # every block selected: all mass inside
    assert aux["sparsity"].shape == (2, 2) and np.all((aux["sparsity"] >= 0) & (aux["sparsity"] < 1))
    # the sparse kernel ran for the video keys (MMDiT: with lse), with kv_valid on the padded layout
    assert calls and all((c.get("kv_valid") is not None) == (latent == (3, 20, 28)) for c in calls)
    assert all(c.get("return_lse", False) == (arch == "mmdit") for c in calls)
    # a real selection (half the blocks) changes the output
    half = AttentionPlan(mode="dsv", sparse=True, keep=0.5)
    sparse = model(x, t, text, mask, attention=half, attention_inputs=inputs)
    assert 1e-4 < float(jnp.abs(sparse - dense).max())


# -- predictor: learns, and is isolated from the model in both directions ----------------------------

def test_predictor_learns_and_is_isolated_from_the_model():
    """The main loss gradient never reaches the predictor, the predictor loss gradient never reaches the
    model, and each optimizer moves only its own parameters; on a fixed batch the predictor loss falls."""
    cfg = small_config("attention=dsv", "dsv.rank=4", "model.patch=[1,2,2]", "data.buckets=[[4,16,16]]",
                       "data.bucket_weights=[1]")
    state = init_state(cfg)
    leaves, tree = jax.tree.flatten(state.params)  # non-zero gates, so that every path has a gradient
    keys = jax.random.split(jax.random.key(3), len(leaves))
    state = state.replace(params=jax.tree.unflatten(
        tree, [x + 0.05 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]))
    graphdef, _ = abstract_model(cfg)
    from dsv_jax.data.feed import make_feed

    batch = {k: jnp.asarray(v) for k, v in
             make_feed(cfg, batch_multiple=1, process_index=0, process_count=1).batch_at(0).items()}
    plan = AttentionPlan(mode="dsv", predictor=True, sparse=True, keep=0.5)
    keep = jnp.full((2, 2), 0.3)

    @jax.jit
    def both_grads(params):
        def losses(p, which):
            loss, aux = flow_matching_loss(nnx.merge(graphdef, p), batch, jax.random.key(0), cfg.train, plan,
                                           {"keep": keep}, return_aux=True)
            return loss if which == 0 else jnp.sum(aux["predictor_loss"])

        return jax.grad(losses)(params, 0), jax.grad(losses)(params, 1)

    labels = jax.tree.leaves(param_labels(state.params))
    assert labels.count("predictor") == 2  # W_Q^lr and W_K^lr, stacked over blocks
    g_main, g_pred = map(jax.tree.leaves, both_grads(state.params))
    for lab, gm, gp in zip(labels, g_main, g_pred):
        if lab == "predictor":
            assert float(jnp.abs(gm).max()) == 0.0 and float(jnp.abs(gp).max()) > 0
        else:
            assert float(jnp.abs(gp).max()) == 0.0
    assert np.mean([float(jnp.abs(g).max()) > 0 for lab, g in zip(labels, g_main) if lab == "main"]) > 0.9

    step = jax.jit(make_train_step(cfg, graphdef, plan))
    before = jax.tree.leaves(jax.device_get(state.params))
    s2, _ = step(state, batch, np.float32(1e-2), {"keep": keep, "predictor_lr": np.float32(0.0)})
    after_main_only = jax.tree.leaves(jax.device_get(s2.params))
    curve = []
    for _ in range(60):  # lr 0: only the predictor trains
        state, m = step(state, batch, np.float32(0.0), {"keep": keep, "predictor_lr": np.float32(3e-3)})
        curve.append(float(np.mean(m["dsv/predictor_loss"])))
    assert bool(m["finite"]) and m["dsv/predictor_loss"].shape == (2,)
    for lab, x, y1, y2 in zip(labels, before, jax.tree.leaves(state.params), after_main_only):
        if lab == "predictor":
            assert not np.array_equal(x, y1)
            np.testing.assert_array_equal(x, y2)
        else:
            np.testing.assert_array_equal(x, y1)
            assert not np.array_equal(x, y2) or not np.any(x)
    first, last = np.mean(curve[:5]), np.mean(curve[-5:])
    assert last < 0.7 * first, (first, last)


# -- controller --------------------------------------------------------------------------------------

def controller(*overrides):
    return DSVController(small_config("attention=dsv", "model.depth=3", "model.heads=2", *overrides))


def observe(ctl, step, shape, loss, sparsity):
    return ctl.observe(step, shape, {"dsv/predictor_loss": np.full(3, loss), "dsv/sparsity": np.asarray(sparsity)})


def test_controller_switches_on_the_loss_and_decides_per_block():
    ctl = controller("dsv.stage1_steps=0", "dsv.ema=0.5", "dsv.threshold=0.8", "dsv.ladder=[0.1,0.2,0.5,1.0]")
    shape = (4, 16, 16)
    assert ctl.profile_due(7, shape)  # never profiled: profile now
    sp = [[0.95, 0.93], [0.85, 0.7], [0.5, 0.6]]  # block means 0.94, 0.775, 0.55
    assert observe(ctl, 0, shape, 0.5, sp) == [] and ctl.stage == 1
    assert not ctl.profile_due(7, shape) and ctl.profile_due(50, shape)
    plans = ctl.plans(shape, profile=True)
    assert all(not p.sparse and p.predictor and p.profile for p in plans)
    assert ctl.plans(shape, train=False)[0] == AttentionPlan(mode="dsv", kv_block=0)  # dense, no predictor
    for step in range(50, 500, 50):  # loss EMA 0.25, 0.125, ... falls below 0.01 at the 6th observation
        events = observe(ctl, step, shape, 0.0, sp)
        if ctl.stage == 2:
            break
    assert step == 300 and ctl.switch_step == 301 and "stage 2" in events[0] and ctl.loss_ema < 0.01
    plans = ctl.plans(shape)
    assert [p.sparse for p in plans] == [True, False, False]
    assert plans[0].keep == 0.1  # max head keep 0.07 -> rung 0.1
    np.testing.assert_allclose(ctl.inputs(shape)["keep"], 1 - np.asarray(sp), atol=1e-6)
    assert ctl.inputs(shape)["predictor_lr"] == pytest.approx(1e-5)  # stage 2: predictor_lr * 0.1
    # hysteresis: block 0 at mean 0.78 stays sparse (needs < 0.75 to turn dense); its rung rises with need
    observe(ctl, 150, shape, 0.0, [[0.61, 0.61], [0.85, 0.7], [0.5, 0.6]])  # EMA 0.78
    assert ctl.plans(shape)[0].sparse and ctl.plans(shape)[0].keep == 0.5
    observe(ctl, 200, shape, 0.0, [[0.4, 0.4], [0.85, 0.7], [0.5, 0.6]])  # EMA 0.59 -> dense
    assert not ctl.plans(shape)[0].sparse
    # JSON round trip gives the same decisions
    clone = controller("dsv.stage1_steps=0", "dsv.ema=0.5", "dsv.threshold=0.8", "dsv.ladder=[0.1,0.2,0.5,1.0]")
    clone.load_state_dict(json.loads(json.dumps(ctl.state_dict())))
    assert clone.plans(shape) == ctl.plans(shape) and clone.stage == 2
    np.testing.assert_array_equal(clone.inputs(shape)["keep"], ctl.inputs(shape)["keep"])


def test_controller_switches_after_the_configured_steps():
    ctl = controller("dsv.stage1_steps=30")
    assert ctl.before_step(29) == [] and ctl.stage == 1
    assert "after 30 stage-1 steps" in ctl.before_step(30)[0] and ctl.stage == 2
    # a shape first profiled in stage 2 is decided at once
    observe(ctl, 31, (1, 16, 16), 0.3, [[0.9, 0.9]] * 3)
    assert all(p.sparse for p in ctl.plans((1, 16, 16)))
    with pytest.raises(ValueError, match="3 blocks x 2 heads"):
        controller().load_state_dict({"stage": 1, "switch_step": None, "loss_ema": None,
                                      "shapes": {"1x16x16": {"sparsity": [[0.5]], "rungs": [0.0], "profiles": 1}}})


def test_controller_keeps_what_the_recall_target_needs():
    """With dsv.recall_target, a head keeps the smallest profiled fraction whose (EMA) recall reaches the
    target; the block goes sparse when 1 - mean keep clears the threshold; the curves survive a round trip."""
    from dsv_jax.dsv.profiler import RECALL_FRACTIONS

    overrides = ("dsv.stage1_steps=100", "dsv.recall_target=0.94", "dsv.ema=0.5", "dsv.threshold=0.5",
                 "dsv.ladder=[0.1,0.2,0.5,1.0]")
    ctl = controller(*overrides)
    shape, f = (4, 16, 16), np.asarray(RECALL_FRACTIONS)

    def curve(knee):  # recall 0.9 below the knee fraction, 0.99 from it on
        return np.where(f >= knee - 1e-9, 0.99, 0.9)

    curves = np.stack([np.stack([curve(0.05), curve(0.1)]), np.stack([curve(0.6), curve(0.8)]),
                       np.full((2, len(f)), np.nan)])  # block 2: no predictor measured
    sparsity = np.full((3, 2), 0.97)  # the theta rule alone would keep 3% everywhere
    ctl.observe(0, shape, {"dsv/predictor_loss": np.ones(3), "dsv/sparsity": sparsity, "dsv/recall_curve": curves})
    np.testing.assert_allclose(ctl.keep(shape), [[0.05, 0.1], [0.6, 0.8], [0.03, 0.03]], atol=1e-9)
    # the EMA: block 0 head 0 now measures recall 0.9 up to f = 0.2; averaged, 0.945 from 0.05 on still
    # reaches 0.94 (the new curve alone would need 0.2)
    curves2 = curves.copy()
    curves2[0, 0] = curve(0.2)
    ctl.observe(50, shape, {"dsv/predictor_loss": np.ones(3), "dsv/sparsity": sparsity, "dsv/recall_curve": curves2})
    stored = np.asarray(ctl.shapes["4x16x16"]["recall_curve"][0])[0]
    np.testing.assert_allclose(stored[(f >= 0.05) & (f < 0.2)], 0.945)
    assert ctl.keep(shape)[0, 0] == pytest.approx(0.05)
    assert "stage 2" in ctl.before_step(100)[0]
    plans = ctl.plans(shape)
    assert [p.sparse for p in plans] == [True, False, True]  # block 1 needs 70% of its blocks: dense
    assert plans[0].keep == 0.1 and plans[2].keep == 0.1
    clone = controller(*overrides)
    clone.load_state_dict(json.loads(json.dumps(ctl.state_dict())))
    np.testing.assert_array_equal(clone.keep(shape), ctl.keep(shape))
    assert clone.plans(shape) == plans
    rec = ctl.record(shape)
    assert rec["dsv/head_keep/block1"] == pytest.approx(0.7) and rec["dsv/keep/block1"] == 1.0
    for broken in ([[0.5] * 3] * 2, [[None] * len(f)] * 2):  # wrong shape; JSON nulls
        bad = json.loads(json.dumps(ctl.state_dict()))
        bad["shapes"]["4x16x16"]["recall_curve"][0] = broken
        with pytest.raises(ValueError, match="recall curves"):
            clone.load_state_dict(bad)
    # a state of the previous version (keep scales, no curves) loads, and follows the paper's rule
    old = {"stage": 2, "switch_step": 10, "loss_ema": 0.2, "shapes": {"4x16x16": {
        "sparsity": sparsity.tolist(), "rungs": [0.1, 0.0, 0.1], "scale": [1.25, 1.0, 1.0], "profiles": 3}}}
    clone.load_state_dict(old)
    np.testing.assert_allclose(clone.keep(shape), 0.03)
    # curves measured at other keep ratios are dropped, not misread
    other = json.loads(json.dumps(ctl.state_dict()))
    other["recall_fractions"] = [0.5] * len(f)
    clone.load_state_dict(other)
    assert clone.shapes["4x16x16"]["recall_curve"] == [None] * 3


# -- training: the CLI reaches stage 2; a restore mid stage 2 continues identically -------------------

DSV_RUN = ["attention=dsv", "dsv.rank=4", "dsv.stage1_steps=3", "dsv.profile_every=2", "dsv.threshold=0.2",
           "dsv.ladder=[0.5,1.0]", "data.buckets=[[4,16,20]]", "data.bucket_weights=[1]", "model.patch=[1,2,2]",
           "model.arch=mmdit", "model.adaln=single", "train.ckpt_every=5", "train.steps=7"]


def test_cli_run_reaches_stage_two_and_resume_mid_stage_two_is_identical(tmp_path):
    """`dsv-jax train attention=dsv` (MMDiT: sparse video-video, dense text) switches after the configured
    stage-1 steps and logs it; a run stopped at step 5 (stage 2) and resumed gives the same steps. The
    bucket's token grid (4, 8, 10) does not divide into 2x4x4 tiles: stage 2 runs sparse on padded tiles."""
    from dsv_jax.train.metrics import read_metrics
    from dsv_jax.train.trainer import Trainer, train

    wd = str(tmp_path / "cli")
    r = subprocess.run([sys.executable, "-m", "dsv_jax", "train", "--config", "tiny", "--workdir", wd,
                        "--no-progress", *SMALL, *DSV_RUN], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "DSV stage 2 from step 3 (after 3 stage-1 steps)" in r.stderr
    recs = read_metrics(wd)
    steps = [x for x in recs if "loss" in x]
    assert [x["dsv/stage"] for x in steps] == [1, 1, 1, 2, 2, 2, 2]
    assert all(x["dsv/sparse_blocks"] == 2 for x in steps[3:])  # every block sparse in stage 2
    assert "dsv/predictor_loss/block1" in steps[0] and "dsv/sparsity/block0/head1" in steps[0]
    assert 0 < steps[4]["dsv/recall"] <= 1 and "dsv/recall/block1" in steps[4]
    assert any("stage 2" in x.get("dsv/event", "") for x in recs) and any("eval_loss" in x for x in recs)
    # an export carries the stage-2 decisions: the loaded model runs the trained sparse plans
    from dsv_jax.export import export, load_model

    loaded = load_model(export(wd, str(tmp_path / "model")))
    plans = loaded.attention_for((4, 16, 20))[0]
    assert loaded.dsv_state["stage"] == 2 and len(plans) == 2 and all(p.sparse for p in plans)
    with open(tmp_path / "model" / "export.json") as f:
        assert json.load(f)["attention"] == {"4x16x20": [f"dsv keep<={p.keep:g}" for p in plans]}

    cfg = small_config(*DSV_RUN)
    train(cfg, str(tmp_path / "split"), stop_at=5, progress=False)
    trainer = Trainer(cfg, str(tmp_path / "split"), progress=False)
    assert trainer.policy.stage == 2 and trainer.policy.switch_step == 3 and int(trainer.state.step) == 5
    curves = trainer.policy.state_dict()["shapes"]["4x16x20"]["recall_curve"]  # profiled in training
    assert all(c is not None and np.isfinite(c).all() for c in curves), curves
    trainer.close()
    train(cfg, str(tmp_path / "split"), progress=False)
    keys = ("loss", "grad_norm", "dsv/predictor_loss", "dsv/sparse_blocks", "dsv/stage")
    resumed = [x for x in read_metrics(str(tmp_path / "split")) if "loss" in x]
    assert [x["step"] for x in resumed] == list(range(1, 8))
    np.testing.assert_allclose([[x[k] for k in keys] for x in resumed], [[x[k] for k in keys] for x in steps],
                               rtol=1e-5)
    assert resumed[4]["dsv/recall"] == pytest.approx(steps[4]["dsv/recall"], rel=1e-5)
