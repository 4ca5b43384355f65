"""experiments/bench_sparse_mgpu.py: rows of KV granularities (64, 32, 16, tokens) and variants side by side with
cuDNN, each line (sparsity x source of blocks: uniform or the selector's) checked on a sample before it is
timed, every program timed alike; lines that crash or hang are recorded and the run goes on; the pieces of the
Mosaic GPU path computed in jax's GPU interpreter."""

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import experiments.bench_sparse_mgpu as bench
from experiments import harness
from experiments.harness import Budget


@pytest.fixture
def geometry(monkeypatch):
    """The module's geometry globals, restored after the test."""

    def set_(q_tile, kv_block, heads=bench.HEADS, head_dim=bench.HEAD_DIM):
        for name, value in [("Q_TILE", q_tile), ("KV_BLOCK", kv_block), ("HEADS", heads), ("HEAD_DIM", head_dim)]:
            monkeypatch.setattr(bench, name, value)

    return set_


def test_rows_are_one_job_each_with_a_line_per_sparsity_and_source():
    jobs = bench.plan_rows([65536], [0.9, 0.95], [16, 1, 64])
    assert jobs[0]["impl"] == "small_check"
    assert [tuple(c) for c in jobs[0]["cases"]] == [c for c in bench.SMALL_CASES_FINE if c[1] == 16]
    assert jobs[1] == {"seq": 65536, "impl": "cudnn", "lines": [{"blocks": "dense"}]}
    assert [(j["row"], j["impl"], j["options"]) for j in jobs[2:]] == [
        (16, "mgpu", {"q_tile": 128, "kv_block": 16}),
        (1, "auto", {"q_tile": 32, "kv_block": 1}),
        (64, "mgpu", {"q_tile": 128, "kv_block": 64}),
    ]
    lines = [(0.9, "uniform"), (0.9, "selector"), (0.95, "uniform"), (0.95, "selector")]
    assert all([(x["sparsity"], x["blocks"]) for x in j["lines"]] == lines for j in jobs[2:])
    assert all(j.get("keep_multiple") == (256 if j["row"] == 1 else None) for j in jobs[2:])
    assert all(j["parts"] and j["select"] for j in jobs[2:])
    assert [x["blocks"] for x in bench.plan_rows([1024], [0.9], [64], False, ["selector"])[1]["lines"]] == ["selector"]
    with pytest.raises(ValueError, match=r"--rows \[8\]"):
        bench.plan_rows([65536], [0.9], [16, 8])


def test_variants_plan_checks_each_tuning_once_and_times_both_sources():
    variants = [{}, {"q_tile": 128}, {"dq_stages": 3}, {"q_tile": 128, "kv_block": 128}]
    jobs = bench.plan([65536], [0.9], variants)
    assert [j["options"] for j in jobs if j["impl"] == "small_check"] == [{}, {"dq_stages": 3}]
    mgpu = [j for j in jobs if j["impl"] == "mgpu"]
    assert [j["options"] for j in mgpu] == variants
    assert all([x["blocks"] for x in j["lines"]] == ["uniform", "selector"] for j in mgpu)
    assert [x["blocks"] for x in jobs[-1]["lines"]] == ["uniform"] and jobs[-1]["impl"] == "triton"


def test_token_rows_keep_a_multiple_of_256_tokens_per_group(geometry):
    """The DSV authors' lists: 90% of 64k tokens keeps 6554 -> 6656, 95% 3277 -> 3328; 16-token blocks 410."""
    assert bench.kept_blocks(65536, 0.9, 1, 256) == 6656 and bench.kept_blocks(65536, 0.95, 1, 256) == 3328
    assert bench.kept_blocks(65536, 0.9, 16) == 410 and bench.kept_blocks(65536, 0.95, 32) == 102
    _, _, _, _, index, count = bench.inputs(2048, 0.9, heads=2, head_dim=16, q_tile=32, kv_block=1, multiple=256)
    assert index.shape[:3] == (1, 2, 64) and np.all(np.asarray(count) == 256)  # 205 rounded up
    ids = np.asarray(index[0, 0, 0])
    assert len(set(ids.tolist())) == 256 and (np.diff(ids) > 0).all()
    geometry(128, 64)
    assert bench.set_geometry({"q_tile": 64, "fwd_stages": 2}) == {"fwd_stages": 2}
    assert (bench.Q_TILE, bench.KV_BLOCK) == (64, 64)


def test_block_reads_tell_a_concentrated_selection_from_a_uniform_one():
    seq, kv_block, q_tile = 8192, 64, 64
    index, count = bench.uniform_selection(seq, 16, heads=2, q_tile=q_tile, kv_block=kv_block)
    uniform = bench.block_reads(index, count, seq // kv_block)
    assert uniform["distinct"] == 128 and uniform["distinct_share"] == 1.0
    assert 0.8 < uniform["cv_vs_uniform"] < 1.25 and uniform["effective_share"] > 0.9
    # every tile reads blocks 0-15 but the last two entries, which it draws from blocks 16-127
    tiles = seq // q_tile
    rest = jax.random.randint(jax.random.key(0), (1, 2, tiles, 2), 16, 128)
    skewed = jnp.concatenate([jnp.broadcast_to(jnp.arange(14), (1, 2, tiles, 14)), rest], axis=-1)
    reads = bench.block_reads(skewed, count, seq // kv_block)
    assert reads["cv_vs_uniform"] > 3 and reads["effective_share"] < 0.5 and reads["distinct"] <= 128
    # counts limit the reads: a tile that keeps 1 block reads only its first entry
    one = bench.block_reads(skewed, jnp.ones_like(count), seq // kv_block)
    assert one["distinct"] == 1 and one["effective_share"] == pytest.approx(1 / 128)


def test_the_selector_concentrates_its_reads_on_random_inputs(geometry):
    """What RESULTS says of the selector's lines: on random rank-16 inputs its picks gather on blocks whose mean
    key is long (cv of the reads several times a uniform choice's), while each head still reads most blocks."""
    geometry(128, 64, heads=2)
    seq = 16384
    top_k = bench.kept_blocks(seq, 0.9, 64)
    index = bench.select_fn(top_k)(*bench.lowrank_inputs(seq))
    reads = bench.block_reads(index, jnp.full(index.shape[:3], top_k), seq // 64)
    assert reads["cv_vs_uniform"] > 1.5 and reads["distinct_share"] > 0.9 and reads["effective_share"] < 0.9


def test_sampled_check_passes_the_path_and_finds_a_wrong_gradient(geometry):
    """The check of every line: the path's o, dq, dk, dv on the line's own selection against the reference on
    sampled tiles and blocks (with every tile that reads them), passing the XLA path, failing it where one
    key row's dk is off."""
    geometry(64, 16, heads=2, head_dim=32)
    seq = 1024
    q, k, v, w = harness.random_qkv(jax.random.key(0), seq, 2, 32)
    index, count = bench.uniform_selection(seq, 12)
    _, fwd_bwd = bench.attention_fns("auto")
    o, (dq, dk, dv) = fwd_bwd(q, k, v, index, count, w)
    sample = dict(heads=2, tiles=3, blocks=2, max_tiles=16)
    ok = bench.sampled_check(q, k, v, w, index, count, (o, dq, dk, dv), **sample)
    assert ok["correct"] and ok["max_err"] < 1e-2 and ok["heads"] == [0, 1] and ok["blocks"] == 4
    assert 6 <= ok["tiles"] <= 32
    # the blocks it checks: each head's random one and its least read one; make every key row of head 1 wrong
    bad = bench.sampled_check(q, k, v, w, index, count, (o, dq, dk.at[0, :, 1].multiply(1.5), dv), **sample)
    assert not bad["correct"] and bad["errors"]["dk"] > 0.1 and bad["errors"]["dq"] == ok["errors"]["dq"]
    # a plan covers every tile that reads its blocks
    rng = np.random.default_rng(0)
    index_h, count_h = np.asarray(index[0, 0]), np.asarray(count[0, 0])
    tiles, blocks = bench.check_plan(index_h, count_h, seq // 16, rng, tiles=2, blocks=2, max_tiles=16)
    readers = {t for t in range(seq // 64) for b in blocks if b in index_h[t, : count_h[t]]}
    assert len(blocks) == 2 and readers <= set(tiles) and len(tiles) <= 16


def test_time_fn_with_fixed_calls_times_every_program_alike():
    x = jax.random.normal(jax.random.key(2), (64, 64))
    calls = []
    f = jax.jit(lambda a: a @ a)

    def counted(a):
        calls.append(1)
        return f(a)

    t = harness.time_fn(counted, x, warmup=2, iters=3, calls=4)
    assert t["calls_per_run"] == 4 and t["runs"] == 3 and t["warmup"] == 2 and len(calls) == 2 + 3 * 4
    assert "blocking_median_ms" not in t and t["min_ms"] <= t["median_ms"] <= t["max_ms"]
    slow = harness.time_fn(lambda: time.sleep(0.01), warmup=0, iters=2, calls=2)
    assert slow["calls_per_run"] == 2 and slow["median_ms"] >= 10
    with pytest.raises(ValueError, match="calls=0"):
        harness.time_fn(counted, x, calls=0)


def _job(lines):
    return {"seq": 65536, "impl": "mgpu", "options": {"q_tile": 128, "kv_block": 16}, "row": 16, "lines": lines}


def test_a_line_that_crashes_or_hangs_is_recorded_and_the_rest_runs_on():
    lines = bench.lines_of([0.9, 0.95], ["uniform", "selector"])
    children = []

    def runner(job, timeout_s):
        children.append([(x["sparsity"], x["blocks"]) for x in job["lines"]])
        first, *rest = job["lines"]
        if len(children) == 1:  # one line done, then a hang in the second line's timing (the watchdog)
            out = [{"stage": "selection", "key": first}, {"line": {**first, "measured": True}}]
            out += [{"stage": "compile and check", "key": rest[0]}, {"stage": "time", "key": rest[0]}]
            return out, "child exited 1: Fatal Python error\nTimeout (0:01:30)!\nThread 0x01"
        if len(children) == 2:  # an abort before the first line
            return [{"stage": "inputs", "key": None}], "child exited -6: Check failed: boom"
        return [{"line": {**x, "measured": True}} for x in job["lines"]], ""

    out = bench.run_job(_job(lines), Budget(None), 90.0, runner)
    assert children == [
        [(0.9, "uniform"), (0.9, "selector"), (0.95, "uniform"), (0.95, "selector")],
        [(0.95, "uniform"), (0.95, "selector")],
    ]
    got = {(r["sparsity"], r["blocks"]): r for r in out}
    assert got[0.9, "uniform"]["measured"] and got[0.9, "uniform"]["job"]["row"] == 16
    assert got[0.9, "selector"]["status"] == "timed out" and got[0.9, "selector"]["stage"] == "time"
    # a child that died outside any line takes the lines left with it (they would die again)
    assert got[0.95, "uniform"]["status"] == got[0.95, "selector"]["status"] == "crashed"
    assert got[0.95, "uniform"]["stage"] == "inputs" and "Check failed" in got[0.95, "uniform"]["error"]
    rows = bench.summarise(out)
    assert [r["status"] for r in rows[1:]] == ["timed out (time)", "crashed (inputs)", "crashed (inputs)"]


def test_lines_the_budget_leaves_no_time_for_are_skipped():
    lines = bench.lines_of([0.9], ["uniform", "selector"])

    def runner(job, timeout_s):  # the child stops at its deadline after one line
        return [{"line": {**job["lines"][0], "measured": True}}], ""

    out = bench.run_job(_job(lines), Budget(None), 90.0, runner)
    assert out[0]["measured"] and out[1]["skipped"] == "time budget"
    spent = Budget(10.0, start=time.time() - 20.0)
    assert [r["skipped"] for r in bench.run_job(_job(lines), spent, 90.0, runner)] == ["time budget"] * 2


def test_summary_reports_each_line_against_the_cudnn_line_of_its_run():
    t = lambda ms: {"median_ms": ms, "min_ms": ms * 0.9, "max_ms": ms * 1.2, "calls_per_run": 4}
    dense = {"job": {"seq": 65536, "impl": "cudnn"}, "blocks": "dense", "fwd": t(60.0), "fwd_bwd": t(218.0)}
    dense.update(fwd_tflops=500.0, fwd_bwd_tflops=588.0)
    head = {"seq": 65536, "impl": "mgpu", "options": {"q_tile": 128, "kv_block": 16}, "row": 16}
    good = {"job": head, "sparsity": 0.95, "blocks": "selector", "path": "mgpu", "fwd": t(6.4), "fwd_bwd": t(29.0)}
    good.update(fwd_tflops=550.0, fwd_bwd_tflops=424.0, select=t(1.0), select_fwd_bwd=t(30.0), top_k=205)
    good["check"] = {"correct": True, "max_err": 3e-3, "errors": {}}
    good["reads"] = {"distinct": 4000.0, "cv": 0.7, "cv_vs_uniform": 3.6, "effective_share": 0.67}
    failed = {"job": head, "sparsity": 0.9, "blocks": "uniform", "status": "FAILED check: not timed"}
    failed["check"] = {"correct": False, "max_err": 0.5, "errors": {}}
    rows = bench.summarise([dense, failed, good])
    assert rows[0]["blocks"] == "dense" and "kv_block" not in rows[0]
    assert rows[1]["status"] == "FAILED check: not timed" and "fwd_bwd_ms" not in rows[1] and rows[1]["max_err"] == 0.5
    row = rows[2]
    assert "status" not in row and row["blocks"] == "selector" and row["kv_block"] == 16 and row["q_tile"] == 128
    assert row["bwd_ms"] == pytest.approx(29.0 - 6.4) and row["fb_spread"] == "26.1-34.8" and row["calls_per_rep"] == 4
    assert row["fwd_bwd_speedup"] == pytest.approx(218.0 / 29.0)
    assert row["select_fwd_bwd_speedup"] == pytest.approx(218.0 / 30.0) and row["select_ms"] == 1.0
    assert row["fwd_bwd_vs_cudnn_rate"] == pytest.approx(424.0 / 588.0)
    assert row["reads_cv_vs_uniform"] == 3.6 and row["max_err"] == 3e-3


def test_a_line_that_fails_its_check_is_not_timed(monkeypatch, geometry):
    geometry(64, 64, heads=1, head_dim=16)
    monkeypatch.setattr(bench, "sampled_check", lambda *a, **k: {"correct": False, "max_err": 1.0, "errors": {}})

    def no_timing(*a, **k):
        raise AssertionError("timed a line that failed its check")

    monkeypatch.setattr(bench, "timed", no_timing)
    job = {"seq": 256, "impl": "auto", "options": {}, "select": True, "parts": True}
    q, k, v, w = harness.random_qkv(jax.random.key(0), 256, 1, 16)
    fwd, fwd_bwd = bench.attention_fns("auto")
    line = bench.measure_line(job, {"sparsity": 0.5, "blocks": "selector"}, q, k, v, w, fwd, fwd_bwd, print, {})
    assert line["status"] == "FAILED check: not timed" and "fwd_bwd" not in line and line["top_k"] == 2
    assert line["reads"]["distinct"] >= 2 and "select" not in line


def test_a_child_measures_its_lines_and_one_that_aborts_is_recorded(monkeypatch):
    """Real child processes on the CPU (sparse_attention's XLA path): every line answered as it finishes; an
    abort in one line's timing costs that line, a new child measures the rest."""
    fault = [{"fault": "abort", "stage": "time", "key": {"sparsity": 0.5, "blocks": "selector"}}]
    monkeypatch.setenv(bench.FAULT_ENV, json.dumps(fault))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    job = {"seq": 512, "impl": "auto", "options": {"q_tile": 64, "kv_block": 64}, "heads": 1, "head_dim": 32}
    job.update(lines=bench.lines_of([0.5, 0.75], ["uniform", "selector"]), select=True, parts=True)
    job.update(timing={"warmup": 1, "reps": 2, "calls": 2})
    out = bench.run_job(job, Budget(None), 120.0)
    got = {(r["sparsity"], r["blocks"]): r for r in out}
    assert got[0.5, "selector"]["status"] == "crashed" and got[0.5, "selector"]["stage"] == "time"
    for key in [(0.5, "uniform"), (0.75, "uniform"), (0.75, "selector")]:
        line = got[key]
        assert line["check"]["correct"] and line["fwd_bwd"]["calls_per_run"] == 2 and line["path"] == "xla"
    assert got[0.75, "selector"]["select_fwd_bwd"]["runs"] == 2 and "select" not in got[0.75, "uniform"]


def test_pieces_of_16_row_blocks_compute_the_gradients_in_the_gpu_interpreter(geometry):
    """`pieces` at kv_block 16 time the fine dK/dV kernel: forward, transposed index, dQ and dK/dV as separate
    calls give the reference's o, dq, dk, dv."""
    from pallas_kernels.sparse_attention import sparse_attention_reference

    geometry(64, 16, head_dim=64)
    q, k, v, w, index, count = bench.inputs(128, 0.75, heads=1, head_dim=64)
    calls = bench.pieces(q, k, v, w, index, count, {"fwd_stages": 1, "fwd_programs": 0}, interpret=True)
    outs = {name: fn(*args) for name, fn, args, _ in calls}
    ref = lambda q, k, v: sparse_attention_reference(q, k, v, index, count, q_tile=64, kv_block=16)
    o, pullback = jax.vjp(ref, *(x.astype(jnp.float32) for x in (q, k, v)))
    dq, dk, dv = pullback(w.astype(jnp.float32))
    err = lambda a, b: float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))
    assert err(outs["fwd"][0], o) < 1e-2 and err(outs["dq"], dq) < 2e-2
    assert err(outs["dkdv"][0], dk) < 2e-2 and err(outs["dkdv"][1], dv) < 2e-2


def test_pieces_of_the_fused_backward_compute_the_gradients_in_the_gpu_interpreter(geometry):
    """With fused_backward at kv_block 16 and 128-row query tiles, `pieces` are the forward and the one fused
    kernel (five products a pair), and its dq, dk, dv are the reference's."""
    from pallas_kernels.sparse_attention import sparse_attention_reference

    geometry(128, 16, head_dim=64)
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
