import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv_jax.attention.rope import apply_rope, rope_angles, rotary
from dsv_jax.config import get_config
from dsv_jax.model import VideoDiT
from dsv_jax.model.tokens import patchify, token_layout, unpatchify


def perturbed_model(model_cfg, seed=0):
    """A model whose zero-initialised parameters (gates, final layer) are made non-zero, so that
    every path contributes to the output."""
    graphdef, state = nnx.split(VideoDiT(model_cfg, rngs=nnx.Rngs(seed)))
    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    leaves = [x + 0.05 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    return nnx.merge(graphdef, jax.tree.unflatten(tree, leaves))


def inputs(b=2, shape=(6, 24, 40), c=3, text_dim=16, lens=(3, 5)):
    x = jax.random.normal(jax.random.key(10), (b, *shape, c))
    t = jax.random.uniform(jax.random.key(11), (b,))
    text = jax.random.normal(jax.random.key(12), (b, 5, text_dim))
    mask = jnp.arange(5)[None] < jnp.asarray(lens)[:, None]
    return x, t, text, mask


def small_model_cfg(**kw):
    cfg = get_config("tiny", ["model.hidden=32", "model.heads=2", "model.depth=2", "model.text_dim=16"]).model
    return dataclasses.replace(cfg, **kw)


def test_notebook_api_shape():
    from dsv_jax.config import get_config as gc
    from dsv_jax.model import VideoDiT as V

    model = V(gc("tiny").model, rngs=nnx.Rngs(0))
    latents = jax.random.normal(jax.random.key(0), (2, 4, 32, 32, 3))
    text = jax.random.normal(jax.random.key(1), (2, 16, gc("tiny").model.text_dim))
    velocity = model(latents, jnp.array([0.2, 0.9]), text, jnp.ones((2, 16), bool))
    assert velocity.shape == latents.shape and velocity.dtype == latents.dtype


@pytest.mark.parametrize(
    "grid, tile, multiple",
    [
        ((3, 6, 10), (2, 4, 4), 1),
        ((1, 8, 8), (2, 4, 4), 1),
        ((4, 4, 4), (4, 4, 4), 1),
        ((5, 7, 9), (2, 4, 4), 8),
        ((1, 45, 80), (4, 4, 4), 1),
    ],
)
def test_token_layout_is_tile_major_valid_first_and_reversible(grid, tile, multiple):
    layout = token_layout(grid, tile, multiple)
    ts = layout.tile_size
    assert layout.tile == tuple(min(t, g) for t, g in zip(tile, grid))
    assert layout.seq_len % ts == 0 and (layout.seq_len // ts) % multiple == 0
    # every real raster index appears exactly once; padding points at n_real
    assert sorted(layout.order[layout.valid].tolist()) == list(range(np.prod(grid)))
    assert np.all(layout.order[~layout.valid] == layout.n_real) and layout.n_real == np.prod(grid)
    # each tile is a contiguous range covering one 3D box of the padded grid, its real tokens first
    for i in range(layout.seq_len // ts):
        box, valid = layout.coords[i * ts : (i + 1) * ts], layout.valid[i * ts : (i + 1) * ts]
        assert np.all(box.max(0) - box.min(0) + 1 == np.array(layout.tile))
        assert np.all(np.diff(valid.astype(int)) <= 0)  # True... then False...
        assert np.array_equal(valid, np.all(box < np.array(grid), axis=1))
    # kv_valid: per block, the number of valid keys, which are the block's first ones
    for kv_block in (ts, max(1, ts // 2), 1):
        counts = layout.kv_valid(kv_block)
        rows = layout.valid.reshape(-1, kv_block)
        assert np.array_equal(counts, rows.sum(1))
        assert np.array_equal(rows, np.arange(kv_block)[None] < counts[:, None])
    x = jax.random.normal(jax.random.key(0), (2, grid[0] * 1, grid[1] * 2, grid[2] * 2, 3))
    tokens, lay = patchify(x, (1, 2, 2), tile, multiple)
    assert tokens.shape == (2, layout.seq_len, 12)
    assert float(jnp.abs(tokens[:, ~lay.valid]).max(initial=0.0)) == 0.0  # padding tokens are zero
    np.testing.assert_array_equal(unpatchify(tokens, lay, (1, 2, 2), 3), x)


def test_patch_must_divide():
    with pytest.raises(ValueError, match="not divisible by patch"):
        patchify(jnp.zeros((1, 3, 8, 8, 3)), (2, 2, 2), (1, 1, 1))


@pytest.mark.parametrize("arch", ["dit", "mmdit"])
def test_output_independent_of_tile_order_and_padding(arch, monkeypatch):
    """RoPE on true coordinates and length masks make the tile order (and the padding of grids that
    do not divide into tiles) invisible: outputs match the raster order exactly."""
    import dsv_jax.model.dit as dit

    x, t, text, mask = inputs()
    ref = perturbed_model(small_model_cfg(arch=arch, tile=(1, 1, 1), patch=(1, 4, 4)))(x, t, text, mask)
    assert float(jnp.abs(ref).mean()) > 0.1
    # dense attention alone keeps raster order (dsv.plan.tiled): lay the tokens out in the model's tiles as a
    # step with a sparse or profiling block does, so that the tiles and their padding are what is compared
    monkeypatch.setattr(dit, "tiled", lambda attention: True)
    for tile in [(2, 4, 4), (4, 4, 4)]:  # grid (6, 6, 10): the second needs padding
        out = perturbed_model(small_model_cfg(arch=arch, tile=tile, patch=(1, 4, 4)))(x, t, text, mask)
        np.testing.assert_allclose(out, ref, atol=2e-5)


def test_tokens_lie_in_tiles_only_where_a_block_needs_them(monkeypatch):
    """Dense attention runs on the raster order, unpadded; a block that selects, trains a predictor, profiles
    or attends sparsely needs the model's tiles (dsv.plan.tiled)."""
    import dsv_jax.model.dit as dit
    from dsv_jax.dsv.plan import AttentionPlan, tiled

    seen, real = [], dit.patchify
    monkeypatch.setattr(
        dit, "patchify", lambda x, patch, tile, multiple=1: seen.append(tile) or real(x, patch, tile, multiple)
    )
    x, t, text, mask = inputs()
    perturbed_model(small_model_cfg(tile=(4, 4, 4), patch=(1, 4, 4)))(x, t, text, mask)
    assert seen == [(1, 1, 1)]
    dense, window = AttentionPlan(), AttentionPlan(mode="window", sparse=True)
    assert not any(tiled(a) for a in ("auto", "xla", dense, [dense, "xla"], AttentionPlan(mode="dsv", keep=0.5)))
    assert tiled(window) and tiled([dense, window]) and tiled(AttentionPlan(profile=True))
    for flag in ("sparse", "predictor", "profile", "capture"):
        assert tiled(AttentionPlan(mode="dsv", keep=0.5, **{flag: True})), flag


@pytest.mark.parametrize("arch", ["dit", "mmdit"])
def test_text_padding_is_masked(arch):
    model = perturbed_model(small_model_cfg(arch=arch, patch=(1, 4, 4)))
    x, t, text, mask = inputs()
    out = model(x, t, text, mask)
    garbage = jnp.where(mask[..., None], text, 100.0 * jax.random.normal(jax.random.key(3), text.shape))
    np.testing.assert_allclose(model(x, t, garbage, mask), out, atol=2e-5)
    # and the text does matter where it is valid
    assert float(jnp.abs(model(x, t, text * -1.0, mask) - out).max()) > 1e-3


@pytest.mark.parametrize("arch", ["dit", "mmdit"])
def test_scan_and_loop_agree_and_gradients_flow(arch):
    x, t, text, mask = inputs()
    scan = perturbed_model(small_model_cfg(arch=arch, patch=(1, 4, 4), scan_layers=True))
    loop = perturbed_model(small_model_cfg(arch=arch, patch=(1, 4, 4), scan_layers=False, remat=False))
    np.testing.assert_allclose(scan(x, t, text, mask), loop(x, t, text, mask), atol=1e-5)

    graphdef, params = nnx.split(scan)
    grads = jax.grad(lambda p: jnp.mean(nnx.merge(graphdef, p)(x, t, text, mask) ** 2))(params)
    norms = [float(jnp.linalg.norm(g)) for g in jax.tree.leaves(grads)]
    assert all(np.isfinite(norms)) and sum(n > 0 for n in norms) > 0.9 * len(norms)


@pytest.mark.parametrize("arch", ["dit", "mmdit"])
def test_absolute_position_adds_fixed_features_and_no_parameters(arch, monkeypatch):
    """model.absolute_position: a token's sin-cos features of its (t, h, w), added to its embedding. The same
    parameters as without (checkpoints from before the option load with it off, its default); the output
    now tells positions apart (with RoPE alone, a DiT gives every token of a clip of identical tokens the
    same output: attention sees only relative positions and identical values; MMDiT's joint text keys
    already break that); tile order and padding stay invisible."""
    from dsv_jax.model.layers import position_features

    coords = np.array([[0, 0, 0], [1, 0, 0], [0, 2, 0], [0, 0, 3], [5, 7, 9]])
    feats = np.asarray(position_features(coords, 32))  # 32 channels: t 12, h 10, w 10 -> 6, 5, 5 angles
    assert feats.shape == (5, 32)
    np.testing.assert_allclose(feats[0], [0.0] * 16 + [1.0] * 16, atol=1e-6)  # the origin: sin 0, cos 1
    w_freqs = 10000.0 ** (-np.arange(0, 10, 2) / 10)  # the w axis: its own 5 frequencies, angles 11..15
    np.testing.assert_allclose(feats[3, 11:16], np.sin(3 * w_freqs), atol=1e-6)
    np.testing.assert_allclose(feats[3, 27:32], np.cos(3 * w_freqs), atol=1e-6)
    np.testing.assert_allclose(feats[3, :11], 0.0, atol=1e-6)  # t and h at 0
    np.testing.assert_allclose(feats[1, 0], np.sin(1.0), atol=1e-6)  # t = 1, the first t frequency is 1
    assert len({tuple(np.round(f, 5)) for f in feats}) == len(coords)  # every position its own features

    plain = small_model_cfg(arch=arch, patch=(1, 4, 4), tile=(1, 1, 1))
    placed = dataclasses.replace(plain, absolute_position=True)
    shapes = lambda cfg: jax.tree.map(jnp.shape, nnx.state(VideoDiT(cfg, rngs=nnx.Rngs(0))))
    assert shapes(plain) == shapes(placed)

    x, t, text, mask = inputs(shape=(4, 24, 24))
    uniform = jnp.tile(x[:, :1, :4, :4], (1, 4, 6, 6, 1))  # every 4 x 4 patch the same
    spread = {}
    for cfg in (plain, placed):
        out = perturbed_model(cfg)(uniform, t, text, mask).reshape(2, 4, 6, 4, 6, 4, 3)
        spread[cfg.absolute_position] = float(jnp.abs(out - out[:, :1, :1, :, :1]).max())
    if arch == "dit":  # MMDiT's joint text keys already tell positions apart
        assert spread[False] < 1e-4, spread
    assert spread[True] > 1e-2 and spread[True] > 2 * spread[False], spread
    ref = perturbed_model(placed)(x, t, text, mask)
    import dsv_jax.model.dit as dit

    monkeypatch.setattr(dit, "tiled", lambda attention: True)  # the tiles as a sparse step lays them out
    padded = perturbed_model(dataclasses.replace(placed, tile=(4, 4, 4)))(x, t, text, mask)  # grid 4 x 6 x 6
    np.testing.assert_allclose(padded, ref, atol=2e-5)


def test_zero_init_blocks_start_as_identity():
    """AdaLN-Zero: with the gates and the final layer at zero the velocity starts at exactly zero."""
    model = VideoDiT(small_model_cfg(patch=(1, 4, 4)), rngs=nnx.Rngs(0))
    x, t, text, mask = inputs()
    assert float(jnp.abs(model(x, t, text, mask)).max()) == 0.0


def test_rope_rotates_pairs_and_is_relative():
    d = 24
    coords = np.array([[0, 0, 0], [1, 2, 3], [3, 5, 7], [4, 7, 10]])
    ang = rotary(coords, d)
    # the host-side tables are the cos and sin of the angles
    np.testing.assert_allclose(ang[0], np.cos(rope_angles(coords, d)), rtol=1e-6)
    np.testing.assert_allclose(ang[1], np.sin(rope_angles(coords, d)), atol=1e-7)
    q = jax.random.normal(jax.random.key(0), (1, 4, 1, d))
    k = jax.random.normal(jax.random.key(1), (1, 4, 1, d))
    rq, rk = apply_rope(q, ang), apply_rope(k, ang)
    np.testing.assert_allclose(jnp.linalg.norm(rq, axis=-1), jnp.linalg.norm(q, axis=-1), rtol=1e-5)
    np.testing.assert_allclose(jnp.linalg.norm(rk, axis=-1), jnp.linalg.norm(k, axis=-1), rtol=1e-5)
    # q.k depends only on the coordinate difference: (1,2,3)->(4,7,10) equals (0,0,0)->(3,5,7)
    q0 = jnp.broadcast_to(q[:, :1], q.shape)
    k0 = jnp.broadcast_to(k[:, :1], k.shape)
    rq0, rk0 = apply_rope(q0, ang), apply_rope(k0, ang)
    a = jnp.sum(rq0[0, 1, 0] * rk0[0, 3, 0])
    b = jnp.sum(rq0[0, 0, 0] * rk0[0, 2, 0])
    np.testing.assert_allclose(a, b, rtol=1e-4)


@pytest.mark.parametrize("d", [4, 24, 128])
def test_rope_custom_vjp_is_the_rotation_by_the_opposite_angle(d):
    """apply_rope's hand-written backward (rotate the cotangent back) against numerical derivatives, and the
    forward against the per-pair formula a' = a cos - b sin, b' = a sin + b cos (pairs: the two halves of
    each axis part), at head dims 4 (parts 4 + 0 + 0), 24 (8 + 8 + 8) and 128 (44 + 42 + 42: odd halves)."""
    from jax.test_util import check_grads

    from dsv_jax.attention.rope import axis_dims

    coords = np.random.RandomState(d).randint(0, 30, (6, 3))
    cos, sin = rotary(coords, d)
    x = jax.random.normal(jax.random.key(d), (2, 6, 3, d), jnp.float32)
    check_grads(lambda x: apply_rope(x, (cos, sin)), (x,), order=1, modes=["rev"], atol=1e-3, rtol=1e-3)
    out, start, col = np.asarray(apply_rope(x, (cos, sin))), 0, 0
    for dim in axis_dims(d):
        h = dim // 2
        a, b = np.asarray(x[..., start : start + h]), np.asarray(x[..., start + h : start + dim])
        c, s = cos[None, :, None, col : col + h], sin[None, :, None, col : col + h]
        np.testing.assert_allclose(out[..., start : start + h], a * c - b * s, atol=1e-5)
        np.testing.assert_allclose(out[..., start + h : start + dim], a * s + b * c, atol=1e-5)
        start, col = start + dim, col + h


def test_the_rotary_tables_are_host_constants_not_recomputed_in_every_block():
    """RoPE's cos / sin come from the host (attention.rope.rotary) once per shape: the model's program has
    no cos or sin at all (each block and pass evaluated them per element of q and k before: ~5% of a 2.7B
    step on an H200), with remat and scanned blocks."""
    model = VideoDiT(small_model_cfg(patch=(1, 4, 4), remat=True, scan_layers=True), rngs=nnx.Rngs(0))
    x, t, text, mask = inputs()
    graphdef, state = nnx.split(model)
    loss = lambda st: jnp.sum(nnx.merge(graphdef, st)(x, t, text, mask) ** 2)
    program = str(jax.make_jaxpr(jax.grad(loss))(state))
    trig = re.findall(r"\w+:f32\[([\d,]*)\] = (?:cos|sin) ", program)
    sizes = [int(np.prod([int(n) for n in shape.split(",") if n])) for shape in trig]
    assert sizes and max(sizes) <= 2 * 256  # the timestep embedding's [B, 128] only, nothing per token


def test_bad_inputs_are_named():
    model = VideoDiT(small_model_cfg(patch=(1, 4, 4)), rngs=nnx.Rngs(0))
    x, t, text, mask = inputs()
    with pytest.raises(ValueError, match=r"latents must be \[B, T, H, W, 3\]"):
        model(x[..., :2], t, text, mask)
    with pytest.raises(ValueError, match="text must be"):
        model(x, t, text[..., :3], mask)
