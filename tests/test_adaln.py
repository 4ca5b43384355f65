"""Fused AdaLN kernels (interpret mode on the CPU) against the plain-JAX reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_kernels.adaln import (
    BlockSizes,
    adaln_modulate,
    adaln_modulate_pallas,
    adaln_modulate_reference,
    gated_residual_adaln,
    gated_residual_adaln_pallas,
    gated_residual_adaln_reference,
)
from tests.conftest import triton_lowering_on_cpu

# Relative (norm) error allowed against the reference. bf16: the reference rounds intermediate
# cotangents to bf16 where the kernel keeps fp32, so the two differ by a few bf16 ulps.
TOL = {jnp.float32: 2e-6, jnp.bfloat16: 1e-2}


def rel_error(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def make_inputs(seed, b, n, c, dtype):
    """Fresh random inputs; rows with a large common offset (where a one-pass variance would fail)."""
    ks = jax.random.split(jax.random.key(seed), 9)
    x = (3.0 * jax.random.normal(ks[0], (b, n, c)) + 4.0 * jax.random.normal(ks[1], (b, n, 1))).astype(dtype)
    vec = lambda k: 0.7 * jax.random.normal(k, (b, c), jnp.float32)
    big = lambda k: jax.random.normal(k, (b, n, c), dtype)
    return dict(
        x=x, scale=vec(ks[2]), shift=vec(ks[3]), gate=vec(ks[4]), branch=big(ks[5]), dy=big(ks[6]), dh=big(ks[7])
    )


def adaln_vjp(fn, v):
    y, pullback = jax.vjp(fn, v["x"], v["scale"], v["shift"])
    return y, pullback(v["dy"])


def gated_vjp(fn, v):
    out, pullback = jax.vjp(fn, v["x"], v["branch"], v["gate"], v["scale"], v["shift"])
    return out, pullback((v["dh"], v["dy"]))


def check_close(outs, refs, dtype, names):
    for name, o, r in zip(names, outs, refs):
        assert o.shape == r.shape and o.dtype == r.dtype, (name, o.shape, o.dtype, r.shape, r.dtype)
        err = rel_error(o, r)
        assert err < TOL[dtype], f"{name}: relative error {err:.2e} >= {TOL[dtype]:.0e}"


# (batch, N, C, dtype): odd N; widths split into chunks (48 = 3 x 16, 96 = 3 x 32; 160 = 5 x 32 in the
# walk test below), padded to a power of two (100 -> 128), and a model width (1152 = 9 x 128).
CASES = [
    (2, 37, 48, jnp.float32),
    (2, 19, 100, jnp.float32),
    (2, 37, 96, jnp.bfloat16),
    (1, 7, 1152, jnp.bfloat16),
]


@pytest.mark.parametrize("b, n, c, dtype", CASES)
def test_adaln_modulate_forward_and_gradients(b, n, c, dtype):
    v = make_inputs(n * c, b, n, c, dtype)
    fused = jax.jit(lambda v: adaln_vjp(lambda *a: adaln_modulate(*a, impl="pallas"), v))
    y, grads = fused(v)
    y_ref, grads_ref = adaln_vjp(adaln_modulate_reference, v)
    check_close([y, *grads], [y_ref, *grads_ref], dtype, ["y", "dx", "dscale", "dshift"])
    assert float(jnp.std(y.astype(jnp.float32))) > 0.5  # not a degenerate output


@pytest.mark.parametrize("b, n, c, dtype", CASES)
def test_gated_residual_adaln_forward_and_gradients(b, n, c, dtype):
    v = make_inputs(n + c, b, n, c, dtype)
    fused = jax.jit(lambda v: gated_vjp(lambda *a: gated_residual_adaln(*a, impl="pallas"), v))
    (h, y), grads = fused(v)
    (h_ref, y_ref), grads_ref = gated_vjp(gated_residual_adaln_reference, v)
    check_close(
        [h, y, *grads],
        [h_ref, y_ref, *grads_ref],
        dtype,
        ["h", "y", "dresidual", "dbranch", "dgate", "dscale", "dshift"],
    )


def test_walk_over_several_tiles_and_ragged_chunks():
    """Small tiles so that every backward program walks several row tiles and the last chunk and
    the last tile are ragged; the result must not depend on the block sizes."""
    b, n, c = 2, 37, 160
    v = make_inputs(7, b, n, c, jnp.float32)
    small = BlockSizes(rows=4, warps=1, bwd_rows=2, bwd_warps=1, bwd_programs=6)  # chunks of 14, 14, 9 rows
    y, grads = jax.jit(lambda v: adaln_vjp(lambda *a: adaln_modulate_pallas(*a, block_sizes=small), v))(v)
    y_ref, grads_ref = adaln_vjp(adaln_modulate_reference, v)
    check_close([y, *grads], [y_ref, *grads_ref], jnp.float32, ["y", "dx", "dscale", "dshift"])
    out, grads = jax.jit(lambda v: gated_vjp(lambda *a: gated_residual_adaln_pallas(*a, block_sizes=small), v))(v)
    out_ref, grads_ref = gated_vjp(gated_residual_adaln_reference, v)
    check_close(
        [*out, *grads],
        [*out_ref, *grads_ref],
        jnp.float32,
        ["h", "y", "dresidual", "dbranch", "dgate", "dscale", "dshift"],
    )


def test_mixed_dtypes_keep_each_input_dtype():
    """bf16 activations with fp32 modulation vectors (the model's case) and an fp32 branch."""
    v = make_inputs(3, 2, 11, 48, jnp.bfloat16)
    v["branch"] = v["branch"].astype(jnp.float32)
    out, grads = jax.jit(lambda v: gated_vjp(lambda *a: gated_residual_adaln(*a, impl="pallas"), v))(v)
    out_ref, grads_ref = gated_vjp(gated_residual_adaln_reference, v)
    assert [g.dtype for g in grads] == [jnp.bfloat16, jnp.float32, jnp.float32, jnp.float32, jnp.float32]
    check_close(
        [*out, *grads],
        [*out_ref, *grads_ref],
        jnp.bfloat16,
        ["h", "y", "dresidual", "dbranch", "dgate", "dscale", "dshift"],
    )


def test_sharded_over_batch_and_sequence():
    """On a (data, fsdp, context) mesh of 8 devices with x split over B and N, each device runs the
    kernels on its own rows (no all-gather) and d_scale / d_shift / d_gate are summed across N shards."""
    mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(2, 2, 2), ("data", "fsdp", "context"))
    rows, vecs = NamedSharding(mesh, P(("data", "fsdp"), "context")), NamedSharding(mesh, P(("data", "fsdp")))
    v = make_inputs(11, 4, 26, 48, jnp.float32)  # 13 rows of each sample per device
    v = {k: jax.device_put(a, rows if a.ndim == 3 else vecs) for k, a in v.items()}
    for run, ref, names in [
        (
            lambda v: adaln_vjp(lambda *a: adaln_modulate(*a, impl="pallas"), v),
            lambda v: adaln_vjp(adaln_modulate_reference, v),
            ["y", "dx", "dscale", "dshift"],
        ),
        (
            lambda v: gated_vjp(lambda *a: gated_residual_adaln(*a, impl="pallas"), v),
            lambda v: gated_vjp(gated_residual_adaln_reference, v),
            ["h", "y", "dresidual", "dbranch", "dgate", "dscale", "dshift"],
        ),
    ]:
        compiled = jax.jit(run).lower(v).compile()
        assert "all-gather" not in compiled.as_text()
        outs = jax.tree.leaves(compiled(v))
        check_close(outs, jax.tree.leaves(ref(v)), jnp.float32, names)
        assert all(o.sharding.is_equivalent_to(rows if o.ndim == 3 else vecs, o.ndim) for o in outs)


def test_impl_dispatch():
    v = make_inputs(5, 1, 9, 48, jnp.float32)
    args = (v["x"], v["scale"], v["shift"])
    # "auto" on the CPU is the reference itself; "xla" always is.
    for impl in ("auto", "xla"):
        np.testing.assert_array_equal(adaln_modulate(*args, impl=impl), adaln_modulate_reference(*args))
    with pytest.raises(ValueError, match="impl='triton' is not one of"):
        adaln_modulate(*args, impl="triton")


def test_bad_inputs_are_named():
    x = jnp.ones((2, 5, 8))
    vec = jnp.ones((2, 8))
    with pytest.raises(ValueError, match=r"adaln_modulate: x must be \[B, N, C\], got shape \(5, 8\)"):
        adaln_modulate(x[0], vec, vec, impl="pallas")
    with pytest.raises(ValueError, match=r"scale .* must have shape \(2, 8\), got \(2, 7\)"):
        adaln_modulate(x, vec[:, :7], vec, impl="pallas")
    with pytest.raises(ValueError, match=r"shift .* must have shape \(2, 8\), got \(8,\)"):
        adaln_modulate(x, vec, vec[0], impl="xla")
    with pytest.raises(ValueError, match="x must be floating point"):
        adaln_modulate(x.astype(jnp.int32), vec, vec)
    with pytest.raises(ValueError, match=r"branch must have the shape of residual \(2, 5, 8\), got \(2, 4, 8\)"):
        gated_residual_adaln(x, x[:, :4], vec, vec, vec, impl="pallas")
    with pytest.raises(ValueError, match=r"gated_residual_adaln: gate .* must have shape \(2, 8\), got \(1, 8\)"):
        gated_residual_adaln(x, x, vec[:1], vec, vec, impl="pallas")
    with pytest.raises(ValueError, match=r"gated_residual_adaln: scale"):
        gated_residual_adaln(x, x, vec, vec[:, :3], vec)
    with pytest.raises(ValueError, match="BlockSizes.rows=3 must be a power of two"):
        BlockSizes(rows=3, warps=4, bwd_rows=1, bwd_warps=4)


@triton_lowering_on_cpu
@pytest.mark.parametrize("c", [1152, 2048, 3072, 5120, 6144])
def test_triton_lowering_at_model_widths(c):
    """Lowers the forward and backward kernels of both ops for a CUDA target (no GPU needed): catches
    shapes or primitives the Triton lowering rejects before the code reaches a GPU. The per-shard calls are
    lowered, as XLA's partitioner lowers them (under custom_partitioning the kernels lower when XLA partitions)."""
    from pallas_kernels import adaln_triton

    x = jax.ShapeDtypeStruct((1, 1000, c), jnp.bfloat16)
    vec = jax.ShapeDtypeStruct((1, c), jnp.float32)
    row = jax.ShapeDtypeStruct((1, 1000), jnp.float32)
    bs = BlockSizes.default(c)
    calls = [
        (adaln_triton._adaln_fwd_call, (x, vec, vec), (1e-6, bs, False)),
        (adaln_triton._adaln_bwd_call, (x, vec, row, row, x), (bs, False)),
        (adaln_triton._gated_fwd_call, (x, x, vec, vec, vec), (1e-6, bs, False)),
        (adaln_triton._gated_bwd_call, (x, x, vec, vec, row, row, x, x), (bs, False)),
    ]
    for call, args, static in calls:
        traced = jax.jit(lambda *a, call=call, static=static: call(*a, *static)).trace(*args)
        assert traced.lower(lowering_platforms=("cuda",)).as_text().count("__gpu$xla.gpu.triton") == 1
    # a gradient through either op runs one forward and one backward kernel, nothing else
    loss = lambda outs: sum(jnp.sum(o.astype(jnp.float32) ** 2) for o in jax.tree.leaves(outs))
    plain = jax.grad(lambda *a: loss(adaln_modulate_pallas(*a, interpret=False)), argnums=(0, 1, 2))
    gated = jax.grad(lambda *a: loss(gated_residual_adaln_pallas(*a, interpret=False)), argnums=(0, 1, 2, 3, 4))
    for fn, args in [(plain, (x, vec, vec)), (gated, (x, x, vec, vec, vec))]:
        eqns = jax.make_jaxpr(fn)(*args).jaxpr.eqns
        assert [e.primitive.name for e in eqns].count("custom_partitioning") == 2


@pytest.mark.parametrize("arch", ["dit", "mmdit"])
def test_model_gradients_match_xla(arch):
    """A jit-ed gradient through a 2-block model (scan + remat): every AdaLN fused (interpret mode)
    vs XLA. The DiT runs data-parallel on a 2 x 2 x 2 mesh (the kernels then see per-device rows)."""
    from tests.test_model import inputs, perturbed_model, small_model_cfg

    batch = inputs(shape=(3, 8, 12))
    grads = {}
    for impl in ("pallas", "xla"):
        cfg = small_model_cfg(arch=arch, patch=(1, 4, 4), adaln_impl=impl)
        assert cfg.depth == 2 and cfg.scan_layers and cfg.remat
        graphdef, params = nnx.split(perturbed_model(cfg))
        args = batch
        if impl == "pallas" and arch == "dit":
            mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(2, 2, 2), ("data", "fsdp", "context"))
            args = [jax.device_put(a, NamedSharding(mesh, P("data"))) for a in batch]
        loss = lambda p, args: jnp.mean(nnx.merge(graphdef, p)(*args) ** 2)
        grads[impl] = jax.jit(jax.value_and_grad(loss))(params, args)
    (loss_p, g_p), (loss_x, g_x) = grads["pallas"], grads["xla"]
    np.testing.assert_allclose(loss_p, loss_x, rtol=1e-5)
    leaves_p, leaves_x = jax.tree.leaves(g_p), jax.tree.leaves(g_x)
    assert len(leaves_p) == len(leaves_x)
    for gp, gx in zip(leaves_p, leaves_x):
        if float(jnp.linalg.norm(gx)) > 0:
            assert rel_error(gp, gx) < 1e-4
    # the modulation tables (whose gradients are the kernels' d_scale / d_shift / d_gate) do learn
    mod = [g for path, g in jax.tree_util.tree_leaves_with_path(g_p) if "mod" in jax.tree_util.keystr(path)]
    assert mod and all(float(jnp.linalg.norm(g)) > 0 for g in mod)
