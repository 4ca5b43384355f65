"""The block glue (dsv_jax/model/attention.py): sparse plans in DiT and MMDiT, padded layouts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv_jax.dsv.plan import AttentionPlan
from tests.dsv_helpers import count_primitive, dsv_model, model_inputs


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


@pytest.mark.parametrize("scan", [True, False], ids=["scan", "unrolled"])
def test_a_rematerialised_block_keeps_its_selection_for_the_backward(scan):
    """With remat on, the backward recomputes each block but not its DSV selection: the selection is a
    named residual (model.attention.remat_policy), so the top-k runs once per block, not twice; and the
    gradients equal those of the model without remat."""
    model = dsv_model("dit", patch=(1, 4, 4), tile=(2, 2, 2), remat=True, scan_layers=scan)
    plain = dsv_model("dit", patch=(1, 4, 4), tile=(2, 2, 2), remat=False, scan_layers=scan)
    x, t, text, mask = model_inputs((4, 16, 24))
    half = AttentionPlan(mode="dsv", sparse=True, keep=0.5)
    inputs = {"keep": jnp.full((2, 2), 0.5)}

    def loss(model):
        out = model(x, t, text, mask, attention=half, attention_inputs=inputs)
        return jnp.sum(out * jnp.cos(jnp.arange(out.size).reshape(out.shape)))

    graphdef, state = nnx.split(model)
    grad_fn = jax.grad(lambda st: loss(nnx.merge(graphdef, st)))
    forward_only = jax.make_jaxpr(lambda st: loss(nnx.merge(graphdef, st)))(state).jaxpr
    with_backward = jax.make_jaxpr(grad_fn)(state).jaxpr
    per_forward = count_primitive(forward_only, "top_k")
    assert per_forward >= 1
    assert count_primitive(with_backward, "top_k") == per_forward  # not recomputed in the backward
    g_remat = grad_fn(state)
    g_plain = nnx.grad(loss)(plain)
    for a, b in zip(jax.tree.leaves(g_remat), jax.tree.leaves(nnx.state(g_plain))):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("arch", ["dit", "mmdit"])
def test_remat_keep_attention_runs_the_sparse_forward_once(arch, monkeypatch):
    """model.remat_keep_attention: the rematerialised block keeps the sparse kernel's output and lse (named
    in its custom VJP), so the backward does not launch the forward kernel again; gradients unchanged.
    Counted on the Pallas kernels (interpret mode): forward-only program F kernels; the gradient's program
    without the option runs them twice (plus the backward's), with it once."""
    from dsv_jax.dsv import backend

    kernel = backend.sparse_attention
    monkeypatch.setattr(backend, "sparse_attention", lambda *a, **k: kernel(*a, **{**k, "impl": "pallas"}))
    x, t, text, mask = model_inputs((4, 16, 32))  # 4 x 4 x 8 tokens: 8 tiles of 16 (the kernels' smallest)
    half = AttentionPlan(mode="dsv", sparse=True, keep=0.5)
    inputs = {"keep": jnp.full((2, 2), 0.5)}

    def programs(keep_attention):
        model = dsv_model(arch, patch=(1, 4, 4), tile=(2, 2, 4), remat=True, remat_keep_attention=keep_attention)
        graphdef, state = nnx.split(model)

        def loss(st):
            out = nnx.merge(graphdef, st)(x, t, text, mask, attention=half, attention_inputs=inputs)
            return jnp.sum(out * jnp.cos(jnp.arange(out.size).reshape(out.shape)))

        grad_fn = jax.grad(loss)
        return jax.make_jaxpr(loss)(state).jaxpr, jax.make_jaxpr(grad_fn)(state).jaxpr, grad_fn(state)

    forward, recomputing, g_recomputed = programs(False)
    _, keeping, g_kept = programs(True)
    per_forward = count_primitive(forward, "pallas_call")
    assert per_forward >= 1
    assert count_primitive(recomputing, "pallas_call") - count_primitive(keeping, "pallas_call") == per_forward
    for a, b in zip(jax.tree.leaves(g_kept), jax.tree.leaves(g_recomputed)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)


def test_remat_keep_attention_policy_keeps_cudnn_self_attention_outputs():
    """cuDNN cannot run here, so this checks the policy against jax's own cuDNN primitives by object: the
    self-attention forward's outputs (o and softmax statistics) are kept with the option and recomputed
    without; cross attention's (16 text keys for 4096 queries) and other primitives are recomputed."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention

    from dsv_jax.model.attention import remat_policy

    forward = cudnn_attention._dot_product_attention_fwd_p_wrapper
    video = jax.core.ShapedArray((1, 4096, 16, 128), jnp.bfloat16)
    text = jax.core.ShapedArray((1, 16, 16, 128), jnp.bfloat16)
    keep, recompute = remat_policy(keep_attention=True), remat_policy(keep_attention=False)
    assert keep(forward, video, video, video) and not recompute(forward, video, video, video)
    assert not keep(forward, video, text, text)  # cross attention
    assert not keep(jax.lax.dot_general_p, video, video)
    assert not keep(cudnn_attention._dot_product_attention_bwd_p_wrapper, video, video, video)


def test_remat_keep_attention_traces_the_mosaic_gpu_forward_once(monkeypatch):
    """The Hopper path (what an H200 runs) names its residuals too: traced, not run (no GPU here), the
    gradient's program holds its forward kernel once per block with the option and twice without."""
    from dsv_jax.dsv import backend
    from pallas_kernels.sparse_attention_mgpu import sparse_attention_mgpu

    def hopper(q, k, v, kv_index, kv_count, *, impl=None, **options):
        return sparse_attention_mgpu(q, k, v, kv_index, kv_count, interpret=False, **options)

    monkeypatch.setattr(backend, "sparse_attention", hopper)
    x, t, text, mask = model_inputs((8, 32, 32))  # 8 x 8 x 8 tokens: tiles of 64, heads of 64, bf16
    half = AttentionPlan(mode="dsv", sparse=True, keep=0.5)
    inputs = {"keep": jnp.full((2, 2), 0.5)}

    def kernels(keep_attention):
        model = dsv_model(
            "dit",
            patch=(1, 4, 4),
            tile=(4, 4, 4),
            remat=True,
            remat_keep_attention=keep_attention,
            hidden=128,
            dtype="bfloat16",
        )
        graphdef, state = nnx.split(model)
        loss = lambda st: jnp.sum(
            nnx.merge(graphdef, st)(x, t, text, mask, attention=half, attention_inputs=inputs).astype(jnp.float32)
        )
        grad = jax.make_jaxpr(jax.grad(loss))(state).jaxpr
        return count_primitive(jax.make_jaxpr(loss)(state).jaxpr, "custom_partitioning"), count_primitive(
            grad, "custom_partitioning"
        )

    forward, recomputing = kernels(False)
    _, keeping = kernels(True)
    assert forward == 1  # the scanned block's forward kernel
    assert recomputing - keeping == forward


def test_kept_residuals_sit_behind_an_optimization_barrier():
    """name_residuals' values come out of an optimization barrier: without it, XLA on GPU compiled the sparse
    forward's custom call twice when a policy kept its outputs, one copy inside a dynamic-slice fusion
    (experiments/remat_programs.py; experiments/results/RESULTS.md, "Remat: what the compiled step runs")."""
    from pallas_kernels.sparse_attention import RESIDUAL_NAME, name_residuals

    o, lse = jnp.ones((1, 128, 2, 64), jnp.bfloat16), jnp.zeros((1, 2, 128), jnp.float32)
    jaxpr = jax.make_jaxpr(name_residuals)(o, lse).jaxpr
    barrier = [e for e in jaxpr.eqns if e.primitive.name == "optimization_barrier"]
    names = [e for e in jaxpr.eqns if e.params.get("name") == RESIDUAL_NAME]
    assert len(barrier) == 1 and len(names) == 2
    assert {id(e.invars[0]) for e in names} == {id(v) for v in barrier[0].outvars}
    assert list(jaxpr.outvars) == [e.outvars[0] for e in names]


@pytest.mark.parametrize("mode", ["dsv", "dense"])
def test_capture_returns_the_q_k_and_projections_the_block_attends_and_profiles_with(mode):
    """A capturing plan (experiments/granularity.py) returns each block's q, k and, with a predictor, its q_lr,
    k_lr, stacked over blocks; they are the arrays the block's profile measured (its recall curve recomputed
    from them is the same), and capturing leaves the output unchanged."""
    from dsv_jax.dsv.predictor import sample_positions, true_logits
    from dsv_jax.dsv.profiler import recall_curve
    from dsv_jax.model.tokens import grid_shape, token_layout

    model = dsv_model("dit", patch=(1, 4, 4), tile=(2, 2, 2))
    x, t, text, mask = model_inputs((4, 16, 24))
    options = {"keep": 0.5, "profile": True, "analysis": True} if mode == "dsv" else {}
    plan = AttentionPlan(mode=mode, capture=True, **options)
    out, aux = model(x, t, text, mask, attention=plan, return_aux=True)
    np.testing.assert_allclose(out, model(x, t, text, mask, attention="xla"), atol=3e-5)
    s = 4 * 4 * 6
    assert aux["capture/q"].shape == aux["capture/k"].shape == (2, 2, s, 2, 16)  # [blocks, B, S, H, D]
    if mode == "dense":
        assert "capture/q_lr" not in aux
        return
    assert aux["capture/q_lr"].shape == aux["capture/k_lr"].shape == (2, 2, s, 2, 4)
    layout = token_layout(grid_shape((4, 16, 24), (1, 4, 4)), (2, 2, 2))
    positions = layout.valid_positions[sample_positions(layout.n_real, plan.query_stride, plan.max_queries)]
    for i in range(2):
        z = true_logits(aux["capture/q"][i], aux["capture/k"][i], positions, layout.valid, 16**-0.5)
        p = jax.nn.softmax(z, axis=-1)
        curve = recall_curve(p, positions, aux["capture/q_lr"][i], aux["capture/k_lr"][i], 8, 8)
        np.testing.assert_allclose(curve, aux["recall_curve"][i], atol=1e-5)
