"""experiments/bench_sparse_mgpu.py --rows: KV granularities 64, 32, 16 and 1 side by side with cuDNN in one run,
each checked before it is timed; the pieces of a 16-row-block run computed in jax's GPU interpreter."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import experiments.bench_sparse_mgpu as bench
from experiments.harness import Budget


def test_rows_run_in_the_order_given_checked_at_the_first_sparsity():
    jobs = bench.plan_rows([65536], [0.9, 0.95], [16, 1, 64])
    assert jobs[0]["impl"] == "small_check"
    assert [tuple(c) for c in jobs[0]["cases"]] == [c for c in bench.SMALL_CASES_FINE if c[1] == 16]
    assert jobs[1] == {"seq": 65536, "impl": "cudnn"}
    rows = [(j["row"], j["sparsity"], j["impl"], j["check"], j["options"]) for j in jobs[2:]]
    assert rows == [
        (16, 0.9, "mgpu", True, {"q_tile": 128, "kv_block": 16}),
        (16, 0.95, "mgpu", False, {"q_tile": 128, "kv_block": 16}),
        (1, 0.9, "auto", True, {"q_tile": 32, "kv_block": 1}),
        (1, 0.95, "auto", False, {"q_tile": 32, "kv_block": 1}),
        (64, 0.9, "mgpu", True, {"q_tile": 128, "kv_block": 64}),
        (64, 0.95, "mgpu", False, {"q_tile": 128, "kv_block": 64}),
    ]
    assert all(j.get("keep_multiple") == (256 if j["row"] == 1 else None) for j in jobs[2:])
    assert all(j["parts"] and j["select"] for j in jobs[2:])
    with pytest.raises(ValueError, match=r"--rows \[8\]"):
        bench.plan_rows([65536], [0.9], [16, 8])


def test_token_rows_keep_a_multiple_of_256_tokens_per_group():
    """The DSV authors' lists: 90% of 64k tokens keeps 6554 -> 6656, 95% 3277 -> 3328; 16-token blocks 410."""
    assert bench.kept_blocks(65536, 0.9, 1, 256) == 6656 and bench.kept_blocks(65536, 0.95, 1, 256) == 3328
    assert bench.kept_blocks(65536, 0.9, 16) == 410 and bench.kept_blocks(65536, 0.95, 32) == 102
    _, _, _, _, index, count = bench.inputs(2048, 0.9, heads=2, head_dim=16, q_tile=32, kv_block=1, multiple=256)
    assert index.shape[:3] == (1, 2, 64) and np.all(np.asarray(count) == 256)  # 205 rounded up
    ids = np.asarray(index[0, 0, 0])
    assert len(set(ids.tolist())) == 256 and (np.diff(ids) > 0).all()


def test_a_row_that_fails_its_check_is_reported_and_not_timed_at_any_sparsity():
    jobs = bench.plan_rows([65536], [0.9, 0.95], [16, 32], small_check=False)
    ran = []
    t = lambda ms: {"median_ms": ms, "min_ms": ms * 0.9, "max_ms": ms * 1.2}

    def runner(job, timeout_s):
        ran.append((job["impl"], job.get("row"), job.get("sparsity")))
        if job["impl"] == "cudnn":
            return {"job": job, "fwd": t(60.0), "fwd_bwd": t(218.0), "fwd_tflops": 500.0, "fwd_bwd_tflops": 588.0}
        if job["row"] == 16:
            return {"job": job, "check": {"correct": False, "errors": {"o": 0.5, "dq": 0.1, "dk": 0.1, "dv": 0.1}}}
        out = {"job": job, "path": "mgpu", "kept_keys": 6560, "fwd": t(6.4), "fwd_bwd": t(29.0)}
        out.update(fwd_tflops=550.0, fwd_bwd_tflops=424.0)
        out["with_selection"] = {"top_k": 205, "select": t(1.0), "select_fwd_bwd": t(30.0)}
        if job["check"]:
            out["check"] = {"correct": True, "errors": {"o": 2e-3, "dq": 2e-3, "dk": 2e-3, "dv": 2e-3}}
        return out

    results, skipped = bench.run_jobs(jobs, Budget(None), 180.0, runner)
    assert not skipped and ("mgpu", 16, 0.95) not in ran and ("mgpu", 32, 0.95) in ran
    rows = {(r["kv_block"], r["sparsity"]): r for r in bench.summarise(results) if r["impl"] != "cudnn"}
    assert rows[16, 0.9]["status"] == "FAILED check: not timed" and "fwd_bwd_ms" not in rows[16, 0.9]
    assert "row 16 failed at sparsity 0.9" in rows[16, 0.95]["status"]
    good = rows[32, 0.95]
    assert "status" not in good and good["path"] == "mgpu" and good["q_tile"] == 128
    assert good["bwd_ms"] == pytest.approx(29.0 - 6.4) and good["fb_spread"] == "26.1-34.8"
    assert good["fwd_bwd_speedup"] == pytest.approx(218.0 / 29.0)
    assert good["select_fwd_bwd_speedup"] == pytest.approx(218.0 / 30.0)
    assert good["fwd_bwd_vs_cudnn_rate"] == pytest.approx(424.0 / 588.0)


def test_measure_does_not_time_a_kernel_whose_check_fails(monkeypatch):
    monkeypatch.setattr(bench, "check", lambda *a, **k: {"correct": False, "errors": {"o": 1.0}, "finite": True})

    def no_timing(*a, **k):
        raise AssertionError("timed a kernel that failed its check")

    monkeypatch.setattr(bench, "attention_fns", no_timing)
    monkeypatch.setattr(bench, "inputs", no_timing)
    job = {"seq": 1024, "sparsity": 0.9, "impl": "mgpu", "options": {"q_tile": 128, "kv_block": 16}, "check": True}
    out = bench.measure(job)
    assert "error" not in out and out["check"]["correct"] is False and "fwd_bwd" not in out


def test_pieces_of_16_row_blocks_compute_the_gradients_in_the_gpu_interpreter(monkeypatch):
    """`pieces` at kv_block 16 time the fine dK/dV kernel: forward, transposed index, dQ and dK/dV as separate
    calls give the reference's o, dq, dk, dv."""
    from pallas_kernels.sparse_attention import sparse_attention_reference

    monkeypatch.setattr(bench, "Q_TILE", 64)
    monkeypatch.setattr(bench, "KV_BLOCK", 16)
    monkeypatch.setattr(bench, "HEAD_DIM", 64)
    q, k, v, w, index, count = bench.inputs(128, 0.75, heads=1, head_dim=64)
    calls = bench.pieces(q, k, v, w, index, count, {"fwd_stages": 1, "fwd_programs": 0}, interpret=True)
    outs = {name: fn(*args) for name, fn, args, _ in calls}
    ref = lambda q, k, v: sparse_attention_reference(q, k, v, index, count, q_tile=64, kv_block=16)
    o, pullback = jax.vjp(ref, *(x.astype(jnp.float32) for x in (q, k, v)))
    dq, dk, dv = pullback(w.astype(jnp.float32))
    err = lambda a, b: float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))
    assert err(outs["fwd"][0], o) < 1e-2 and err(outs["dq"], dq) < 2e-2
    assert err(outs["dkdv"][0], dk) < 2e-2 and err(outs["dkdv"][1], dv) < 2e-2


def test_pieces_of_the_fused_backward_compute_the_gradients_in_the_gpu_interpreter(monkeypatch):
    """With fused_backward at kv_block 16 and 128-row query tiles, `pieces` are the forward and the one fused
    kernel (five products a pair), and its dq, dk, dv are the reference's."""
    from pallas_kernels.sparse_attention import sparse_attention_reference

    monkeypatch.setattr(bench, "Q_TILE", 128)
    monkeypatch.setattr(bench, "KV_BLOCK", 16)
    monkeypatch.setattr(bench, "HEAD_DIM", 64)
    q, k, v, w, index, count = bench.inputs(256, 0.75, heads=1, head_dim=64)
    options = {"fwd_stages": 1, "fwd_programs": 0, "fused_backward": True}
    calls = bench.pieces(q, k, v, w, index, count, options, interpret=True)
    assert [(name, products) for name, _, _, products in calls] == [("fwd", 2), ("fused", 5)]
    outs = {name: fn(*args) for name, fn, args, _ in calls}
    ref = lambda q, k, v: sparse_attention_reference(q, k, v, index, count, q_tile=128, kv_block=16)
    _, pullback = jax.vjp(ref, *(x.astype(jnp.float32) for x in (q, k, v)))
    err = lambda a, b: float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))
    for got, want in zip(outs["fused"], pullback(w.astype(jnp.float32)), strict=True):
        assert err(got, want) < 2e-2
