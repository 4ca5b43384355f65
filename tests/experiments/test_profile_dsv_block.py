"""experiments/profile_dsv_block.py: the one-block DSV step's device time by category, and (on the CPU) what the
GPU programs of each KV block run, from their jaxpr and their lowering for CUDA."""

import jax
import jax.numpy as jnp
import pytest

from experiments import profile_dsv_block as prof


def test_profiled_ops_fall_into_the_categories_of_a_dsv_step():
    op = lambda scope, kernel="fusion": {"scope": scope, "kernel": kernel, "ms": 1.0, "op": "x", "calls": 1}
    assert prof.category(
        op("bwd: sparse_attention_mgpu (sparse_attention_mgpu.py:203)", "entry_mosaic_gpu_kernel")
    ) == ("sparse kernel (bwd)")
    assert prof.category(op("bwd: dkdv_worklist (sparse_index.py:80)")) == "sparse index and delta (bwd)"
    assert prof.category(op("fwd: keep_best (selection.py:77)")) == "selection (fwd)"
    assert prof.category(op("fwd: _select (lowrank_topk_triton.py:199)")) == "selection (fwd)"
    assert prof.category(op("bwd: predictor_loss (predictor.py:90)")) == "predictor (bwd)"
    assert prof.category(op("bwd: _attend (dense.py:74)")) == "text cross attention"
    assert prof.category(op("remat: Linear.__call__ (linear.py:422)")) == "rest"
    assert prof.category({"scope": "", "kernel": "", "ms": 1.0}) == "rest"
    ops = [
        op("fwd: sparse_attention_mgpu (sparse_attention_mgpu.py:203)", "mosaic"),
        {**op("bwd: sparse_attention_mgpu (sparse_attention_mgpu.py:203)", "mosaic"), "ms": 3.0},
        op("fwd: keep_best (selection.py:77)"),
    ]
    got = prof.summarise_profile({"ops": ops})
    assert got["categories"] == {"sparse kernel (bwd)": 3.0, "sparse kernel (fwd)": 1.0, "selection (fwd)": 1.0}
    assert [(k["pass"], k["ms"]) for k in got["kernels"]] == [("bwd", 3.0), ("fwd", 1.0)]


def test_jaxpr_ops_count_what_a_program_runs_inside_its_loops_and_derivatives():
    def f(x, idx):
        def body(c, _):
            order = jnp.argsort(c * x, axis=-1)
            return c + jnp.take_along_axis(x, order, axis=-1).sum(), None

        c, _ = jax.lax.scan(jax.checkpoint(body), 0.0, None, length=3)
        return c + x[idx].sum()

    x = jnp.ones((4, 8))
    jaxpr = jax.make_jaxpr(jax.grad(f))(x, jnp.array([0, 2]))
    got = prof.jaxpr_ops(jaxpr.jaxpr)
    assert got["counts"]["sort"] >= 1 and got["elements"]["sort"] >= 32  # the scan's body, once
    assert got["counts"]["gather"] >= 2 and "scatter-add" in got["counts"]  # the backward of the gathers
    assert all(places for places in got["largest_by_source"].values())


@pytest.mark.parametrize("kv_block", [16])
def test_a_variant_is_compiled_timed_and_profiled_on_the_cpu(monkeypatch, kv_block):
    """`measure` (a child's work) on the tiny preset's step: its step time, the device time by category
    (the selection and the sparse attention's XLA path among them) and the top ops."""
    monkeypatch.setattr(prof, "PRESET", "tiny")
    monkeypatch.setattr(prof, "SHAPE", (4, 32, 32))  # 4 x 8 x 8 tokens at the tiny preset's 1x4x4 patches
    monkeypatch.setattr(prof, "VARIANTS", {"v": [f"dsv.kv_block={kv_block}", "model.tile=[1,4,8]"]})
    out = prof.measure({"variant": "v", "predictor": False, "steps": 1})
    assert "error" not in out, out.get("error")
    assert out["q_tile"] == 32 and out["kv_block"] == kv_block and out["step_s"] > 0 and out["compiles_timed"] == 0
    assert out["device_ms"] > 0 and any(c.startswith("selection") for c in out["categories"])
    assert sum(out["categories"].values()) == pytest.approx(out["device_ms"], rel=1e-6)
