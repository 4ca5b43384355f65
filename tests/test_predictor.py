"""The DSV predictor (dsv_jax/dsv/predictor.py): its loss, learning, and isolation from the model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv_jax.dsv.plan import AttentionPlan
from dsv_jax.train.loss import flow_matching_loss
from dsv_jax.train.optimizer import param_labels
from dsv_jax.train.step import abstract_model, init_state, make_train_step
from tests.conftest import small_config
from tests.dsv_helpers import rand


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
    zh = np.einsum("bqhr,bkhr->bhqk", np.asarray(q_lr)[:, positions], np.asarray(k_lr)[:, valid]) * r**-0.5
    zt = np.asarray(shifted)[..., valid]
    zh, zt = zh - zh.mean(-1, keepdims=True), zt - zt.mean(-1, keepdims=True)
    nh, nt = np.linalg.norm(zh, axis=-1, keepdims=True), np.linalg.norm(zt, axis=-1, keepdims=True)
    expect = 0.9 * np.mean(1 - np.sum(zh * zt, -1) / (nh * nt)[..., 0]) + 0.1 * np.mean(
        np.sum((zh / nh - zt / nt) ** 2, -1) / valid.sum()
    )
    assert got == pytest.approx(expect, rel=1e-4)


def test_predictor_learns_and_is_isolated_from_the_model():
    """The main loss gradient never reaches the predictor, the predictor loss gradient never reaches the
    model, and each optimizer moves only its own parameters; on a fixed batch the predictor loss falls."""
    cfg = small_config(
        "attention=dsv", "dsv.rank=4", "model.patch=[1,2,2]", "data.buckets=[[4,16,16]]", "data.bucket_weights=[1]"
    )
    state = init_state(cfg)
    leaves, tree = jax.tree.flatten(state.params)  # non-zero gates, so that every path has a gradient
    keys = jax.random.split(jax.random.key(3), len(leaves))
    state = state.replace(
        params=jax.tree.unflatten(tree, [x + 0.05 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])
    )
    graphdef, _ = abstract_model(cfg)
    from dsv_jax.data.feed import make_feed

    batch = {
        k: jnp.asarray(v)
        for k, v in make_feed(cfg, batch_multiple=1, process_index=0, process_count=1).batch_at(0).items()
    }
    plan = AttentionPlan(mode="dsv", predictor=True, sparse=True, keep=0.5)
    keep = jnp.full((2, 2), 0.3)

    @jax.jit
    def both_grads(params):
        def losses(p, which):
            loss, aux = flow_matching_loss(
                nnx.merge(graphdef, p), batch, jax.random.key(0), cfg.train, plan, {"keep": keep}, return_aux=True
            )
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


def test_a_step_without_the_predictor_loss_leaves_the_predictor_untouched():
    """Stage 2 between predictor steps (dsv.stage2_predictor_every): the plans skip the predictor loss, the
    model trains, and the predictor's weights and AdamW moments stay exactly as they were (a zero-gradient
    AdamW step would move them by momentum); the next predictor step then moves them again."""
    cfg = small_config(
        "attention=dsv", "dsv.rank=4", "model.patch=[1,2,2]", "data.buckets=[[4,16,16]]", "data.bucket_weights=[1]"
    )
    graphdef, _ = abstract_model(cfg)
    from dsv_jax.data.feed import make_feed

    batch = {
        k: jnp.asarray(v)
        for k, v in make_feed(cfg, batch_multiple=1, process_index=0, process_count=1).batch_at(0).items()
    }
    train = AttentionPlan(mode="dsv", predictor=True, sparse=True, keep=0.5)
    skip = AttentionPlan(mode="dsv", predictor=False, sparse=True, keep=0.5)
    inputs = {"keep": jnp.full((2, 2), 0.3), "predictor_lr": np.float32(1e-2)}
    lr = np.float32(1e-2)
    state, _ = jax.jit(make_train_step(cfg, graphdef, train))(init_state(cfg), batch, lr, inputs)  # moments != 0
    labels = jax.tree.leaves(param_labels(state.params))
    after, m = jax.jit(make_train_step(cfg, graphdef, skip))(state, batch, lr, inputs)
    assert bool(m["finite"]) and "dsv/predictor_loss" not in m
    for lab, x, y in zip(labels, jax.tree.leaves(state.params), jax.tree.leaves(after.params)):
        if lab == "predictor":
            np.testing.assert_array_equal(x, y)
    moved = [
        not np.array_equal(x, y)
        for lab, x, y in zip(labels, jax.tree.leaves(state.params), jax.tree.leaves(after.params))
        if lab == "main"
    ]
    assert np.mean(moved) > 0.5  # the model trains
    old, new = state.opt_state.inner_states["predictor"], after.opt_state.inner_states["predictor"]
    for x, y in zip(jax.tree.leaves(old), jax.tree.leaves(new)):
        np.testing.assert_array_equal(x, y)
    again, _ = jax.jit(make_train_step(cfg, graphdef, train))(after, batch, lr, inputs)
    assert any(
        not np.array_equal(x, y)
        for lab, x, y in zip(labels, jax.tree.leaves(after.params), jax.tree.leaves(again.params))
        if lab == "predictor"
    )
