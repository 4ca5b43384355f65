"""experiments/harness.py, quick_cpu.py and training.py: what the benchmarks share (selections, budgets, the vjp
wrapper, device timing, error text, results files, tables, child processes, the CPU set-up, study setups)."""

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv_jax.config import get_config
from dsv_jax.data.feed import tokens_per_sample
from experiments import harness, quick_cpu, training

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("local_share", [0.0, 0.5, 1.0])
def test_random_selection_counts_order_and_locality(local_share):
    keep = np.array([0.1, 0.3, 0.55])
    seq, q_tile, kv_block = 2048, 64, 32
    index, count = harness.random_selection(
        jax.random.key(3), seq=seq, heads=3, q_tile=q_tile, kv_block=kv_block, keep=keep, local_share=local_share
    )
    blocks, tiles = seq // kv_block, seq // q_tile
    want = np.round(keep * blocks).astype(int)
    assert index.shape == (1, 3, tiles, want.max()) and count.shape == (1, 3, tiles)
    assert (np.asarray(count)[0] == want[:, None]).all()
    for h in range(3):
        for t in range(tiles):
            ids = np.asarray(index)[0, h, t, : want[h]]
            assert (np.diff(ids) > 0).all() and ids.min() >= 0 and ids.max() < blocks  # ascending, distinct
            centre = (t * q_tile + q_tile // 2) // kv_block
            near = int(round(want[h] * local_share))
            first = min(max(centre - near // 2, 0), blocks - near)
            assert set(range(first, first + near)) <= set(ids.tolist())  # the blocks around the tile
    if local_share < 1:  # the rest is random: tiles differ beyond their window
        far = [set(np.asarray(index)[0, 2, t, : want[2]].tolist()) for t in range(tiles)]
        assert len({frozenset(f) for f in far}) == tiles


def test_budget_plans_against_what_is_left():
    budget = harness.Budget(100.0, reserve=10.0, start=time.time() - 30.0)
    assert 59 < budget.left() <= 60
    assert budget.allows(50) and budget.skip_reason(50) is None
    reason = budget.skip_reason(80)
    assert reason.startswith("budget: needs ~80 s, ") and reason.endswith(" s left") and not budget.allows(80)
    assert budget.skip_reason(1, fits=False).startswith("budget:")  # another process decided
    budget.expired = True
    assert not budget.allows(0) and budget.left() == 0
    assert harness.Budget(None).left() == float("inf")


def test_fwd_bwd_is_the_vjp_with_the_cotangent_last():
    ks = jax.random.split(jax.random.key(1), 4)
    x, w, y, cot = (jax.random.normal(k, (5, 5)) for k in ks)
    fn = lambda x, w, y: jnp.tanh(x @ w) * y
    out, grads = harness.fwd_bwd(fn, 2)(x, w, y, cot)
    np.testing.assert_allclose(out, fn(x, w, y), rtol=1e-6)
    want = jax.grad(lambda x, w: jnp.sum(fn(x, w, y) * cot), argnums=(0, 1))(x, w)
    assert len(grads) == 2
    for g, r in zip(grads, want):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)


def test_time_fn_queues_short_calls_back_to_back():
    x = jax.random.normal(jax.random.key(2), (64, 64))
    f = jax.jit(lambda a: a @ a)
    # min_ms well above a loaded machine's stall (the suite runs on 2 busy cores), so the call stays "short"
    t = harness.time_fn(f, x, warmup=1, iters=3, min_ms=200.0)
    assert t["runs"] == 3 and t["calls_per_run"] > 1  # a short call: several per repetition
    assert 0 < t["min_ms"] <= t["median_ms"] <= t["max_ms"] and t["blocking_median_ms"] > 0
    slow = harness.time_fn(lambda: time.sleep(0.02), warmup=1, iters=2, min_ms=5.0)
    assert slow["calls_per_run"] == 1 and slow["median_ms"] >= 20 and "blocking_median_ms" not in slow


def _matmuls(a):  # the expensive part of the profiled program below
    for _ in range(8):
        a = jnp.tanh(a @ a)
    return a


def _cheap_tail(a):
    return jnp.sum(a * 2.0)


def test_device_profile_attributes_time_to_the_function_and_pass_that_made_each_op():
    """device_profile sums the device's op times by the user function (and pass) behind each op: here the
    matmuls' function holds most of the time, forward and backward apart, and nothing is lost on the way
    (the scopes sum to the total)."""
    loss = lambda a: _cheap_tail(_matmuls(a))
    step = jax.jit(jax.grad(loss))
    a = jax.random.normal(jax.random.key(0), (384, 384)) * 0.05
    exe = step.lower(a).compile()
    exe(a).block_until_ready()
    prof = harness.device_profile(lambda: exe(a).block_until_ready(), exe.as_text())
    assert prof["events"] > 0 and prof["device_ms"] > 0
    scopes = {row["scope"]: row["ms"] for row in prof["scopes"]}
    top = max(scopes, key=scopes.get)
    assert "_matmuls" in top and top.split(":")[0] in ("fwd", "bwd"), scopes
    assert any(s.startswith("bwd: _matmuls") for s in scopes) and any(s.startswith("fwd: _matmuls") for s in scopes)
    assert sum(scopes.values()) == pytest.approx(prof["device_ms"], rel=1e-6)


def test_error_text_keeps_the_type_and_cuts_long_messages():
    try:
        raise ValueError("x" * 5000)
    except ValueError as e:
        short, long = harness.error_text(e), harness.error_text(e, trace=True)
    assert short.startswith("ValueError: xxx") and len(short) == 1500
    assert long.startswith(short) and "Traceback" in long and "raise ValueError" in long


def test_write_results_adds_the_environment_and_copies_into_out(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setenv("OUT", str(out))
    path = harness.write_results("probe_quick", {"rows": [1.5]}, str(tmp_path / "results"))
    assert path == str(tmp_path / "results" / "probe_quick.json")
    saved = json.loads(open(path).read())
    assert saved["name"] == "probe_quick" and saved["rows"] == [1.5]
    assert saved["env"]["backend"] == "cpu" and saved["env"]["device_count"] == jax.device_count()
    assert (out / "probe_quick.json").read_text() == open(path).read()


def test_print_table_aligns_columns_and_rounds_floats(capsys):
    harness.print_table([{"name": "a", "ms": 1.23456}, {"name": "longer", "ms": 10.0, "extra": 1}], ["name", "ms"])
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["name    ms  ", "a       1.23", "longer  10  "]


CHILDREN = {
    "child_answers": "from experiments import harness\nprint('noise')\nharness.answer({'ok': True, 'x': 2.5})\n",
    "child_crashes": "import sys\nsys.exit('boom')\n",
    "child_hangs": "import time\ntime.sleep(60)\n",
}


def test_in_child_returns_the_answer_or_why_there_is_none(tmp_path):
    for name, code in CHILDREN.items():
        (tmp_path / f"{name}.py").write_text(code)
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), ROOT]), "JAX_PLATFORMS": "cpu"}
    assert harness.in_child("child_answers", [], 120, env=env) == {"ok": True, "x": 2.5}
    crashed = harness.in_child("child_crashes", [], 60, env=env)
    assert crashed["error"].startswith("child exited 1: ") and "boom" in crashed["error"]
    hung = harness.in_child("child_hangs", [], 1, env=env)
    assert hung == {"error": "no answer within 1 s (deadlock, hang or slow compile)"}


def test_crash_text_leads_with_the_line_that_says_why_a_process_died():
    trace = "".join(f"    @ 0x{i:x} xla::PjRtCApiClient::CompileAndLoad()\n" for i in range(200))
    output = "W1206 a warning\nF1206 12:00:00 1 gpu_compiler.cc:9] Check failed: ok\n*** Check failure stack:\n" + trace
    text = harness.crash_text(output)
    assert text.startswith("F1206 12:00:00 1 gpu_compiler.cc:9] Check failed: ok\n...\n")
    assert text.endswith(output[-2500:])
    short = "Fatal Python error: Aborted\n  File x.py, line 3"
    assert harness.crash_text(short) == short  # the line is in the tail already
    assert harness.crash_text("x" * 3000) == "x" * 2500


def test_use_cpu_sets_the_platform_and_flags_once(monkeypatch):
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    quick_cpu.use_cpu(devices=4)
    quick_cpu.use_cpu(devices=8)  # a second call keeps the first device count and adds nothing
    assert os.environ["JAX_PLATFORMS"] == "cpu"
    assert os.environ["XLA_FLAGS"] == (
        "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0"
    )
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    monkeypatch.setenv("XLA_FLAGS", "")
    quick_cpu.use_cpu(fast_compile=False)  # a platform set by the caller stays
    assert os.environ["JAX_PLATFORMS"] == "cuda" and os.environ["XLA_FLAGS"] == ""


@pytest.mark.parametrize("setup", ["shapes", "photos"])
def test_study_overrides_build_the_bucket_of_the_asked_tokens(setup):
    for quick, tokens in ((True, 256), (True, 512), (False, 16384)):
        cfg = get_config("tiny", training.study_overrides(setup, tokens, quick=quick))
        (bucket,) = cfg.data.buckets
        assert tokens_per_sample(bucket, cfg.model.patch) == tokens
        assert cfg.data.tokens_per_batch == 2 * tokens and cfg.data.source == (
            "photos" if setup == "photos" else "synthetic"
        )
        assert cfg.model.hidden == (32 if quick else {"shapes": 256, "photos": 768}[setup])
    with pytest.raises(ValueError, match="unknown setup"):
        training.study_overrides("faces", 256, quick=True)
    with pytest.raises(ValueError, match="no study shape for 300 tokens"):
        training.study_overrides(setup, 300, quick=True)


def test_remat_programs_reads_kernels_from_lowered_and_compiled_text():
    """experiments/remat_programs.py: custom calls counted by target and result types in StableHLO and HLO
    text, attention kernels placed in their computation, sparse forwards told from dQ and dK/dV."""
    from experiments.remat_programs import attention_calls, compiled_calls, lowered_calls, sparse_forwards

    lowered = (
        "  %4:2 = stablehlo.custom_call @mosaic_gpu_v2(%1, %2) {api_version = 2 : i32} : (tensor<8xi32>) "
        "-> (tensor<1x64x2x64xbf16>, tensor<1x2x64xf32>)\n"
        "  %5 = stablehlo.custom_call @mosaic_gpu_v2(%1) : (tensor<8xi32>) -> tensor<1x64x2x64xbf16>\n"
    )
    assert lowered_calls(lowered) == {
        "mosaic_gpu_v2 x2 tensor<1x64x2x64xbf16>": 1,
        "mosaic_gpu_v2 x1 tensor<1x64x2x64xbf16>": 1,
    }
    compiled = (
        "HloModule jit_step, entry_computation_layout={(f32[])->f32[]}\n\n"
        "%fused_body.3 (p: bf16[8]) -> bf16[8] {\n"
        '  %a = (bf16[1,64,2,64]{3,2,1,0}, f32[1,2,64]{2,1,0}) custom-call(%p), custom_call_target="mosaic_gpu_v2", '
        'metadata={op_name="jit(step)/jvp()/while/body/entry"}\n'
        "}\n\n"
        "ENTRY %main.9 (p: bf16[8]) -> bf16[8] {\n"
        "  %b = (bf16[1,64,2,64]{3,2,1,0}, bf16[1,64,2,64]{3,2,1,0}) custom-call(%p), "
        'custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(step)/transpose(jvp())/entry"}\n'
        '  %c = f32[4,4]{1,0} custom-call(%p), custom_call_target="__cublas$gemm"\n'
        "}\n"
    )
    assert compiled_calls(compiled) == {"mosaic_gpu_v2 x2 bf16[1,64,2,64]": 2, "__cublas$gemm x1 f32[4,4]": 1}
    calls = attention_calls(compiled)
    assert [(c["computation"], c["results"], c["op_name"].split("/")[1]) for c in calls] == [
        ("fused_body.3", "(bf16[1,64,2,64], f32[1,2,64])", "jvp()"),
        ("main.9", "(bf16[1,64,2,64], bf16[1,64,2,64])", "transpose(jvp())"),
    ]
    assert sparse_forwards(calls) == 1


def test_motion_probe_measures_a_clips_displacement_along_its_direction():
    """experiments/motion_probe.py: the embedded clips' objects move several pixels along their captioned
    direction by its centroid measure, the reversed clips the other way, a still clip not at all."""
    from experiments.motion_probe import centroid_shift, flipped, moving_clips

    clips, captions, directions = moving_clips(6, (8, 32, 32))
    along = (centroid_shift(clips) * directions).sum(-1)
    assert np.all(along > 3.0), along
    assert np.all((centroid_shift(clips[:, ::-1]) * directions).sum(-1) < -3.0)
    assert np.abs(centroid_shift(np.repeat(clips[:, :1], 8, axis=1))).max() < 1e-9
    assert flipped("a small red circle moving left") == "a small red circle moving right"
    assert all(c.rsplit(" ", 1)[1] in ("left", "right", "up", "down") for c in captions)


def test_bench_sparse_mgpu_pieces_compute_the_gradients_in_the_gpu_interpreter(monkeypatch):
    """`pieces` (timed by bench_sparse_mgpu, run under ncu by profile_mgpu): the forward, the transposed index,
    dQ and dK/dV as separate calls give the reference's o, dq, dk, dv (lse2 and delta made as the VJP does)."""
    import jax.numpy as jnp
    import numpy as np

    import experiments.bench_sparse_mgpu as bench
    from pallas_kernels.sparse_attention import sparse_attention_reference

    monkeypatch.setattr(bench, "Q_TILE", 64)
    monkeypatch.setattr(bench, "KV_BLOCK", 64)
    monkeypatch.setattr(bench, "HEAD_DIM", 64)
    q, k, v, w, index, count = bench.inputs(256, 0.5, heads=1, head_dim=64)
    calls = bench.pieces(q, k, v, w, index, count, {"fwd_stages": 1}, interpret=True)
    assert [(name, products) for name, _, _, products in calls] == [("fwd", 2), ("worklist", 0), ("dq", 3), ("dkdv", 4)]
    outs = {name: fn(*args) for name, fn, args, _ in calls}
    ref = lambda q, k, v: sparse_attention_reference(q, k, v, index, count, q_tile=64, kv_block=64)
    o, pullback = jax.vjp(ref, *(x.astype(jnp.float32) for x in (q, k, v)))
    dq, dk, dv = pullback(w.astype(jnp.float32))
    err = lambda a, b: float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))
    assert err(outs["fwd"][0], o) < 1e-2
    assert err(outs["dq"], dq) < 2e-2
    assert err(outs["dkdv"][0], dk) < 2e-2 and err(outs["dkdv"][1], dv) < 2e-2


def test_bench_sparse_mgpu_parts_give_executed_rates_and_their_fraction_of_the_ceiling(monkeypatch):
    """`parts`: each kernel's executed TFLOP/s from its products per (tile, block) pair, and that rate over
    the bf16 matmul ceiling; the transposed index (no products) only its time."""
    import jax.numpy as jnp
    import pytest

    import experiments.bench_sparse_mgpu as bench
    from experiments import harness

    monkeypatch.setattr(
        bench, "pieces", lambda *a, **k: [("fwd", None, (), 2), ("worklist", None, (), 0), ("dkdv", None, (), 4)]
    )
    monkeypatch.setattr(bench, "timed", lambda fn, *a, **k: {"median_ms": 2.0})
    seq = 1024
    q = jnp.zeros((1, seq, bench.HEADS, bench.HEAD_DIM), jnp.bfloat16)
    count = jnp.full((1, bench.HEADS, seq // bench.Q_TILE), 3, jnp.int32)
    out = bench.parts(q, q, q, q, None, count, {})
    unit = 2.0 * bench.HEADS * seq * 3 * bench.KV_BLOCK * bench.HEAD_DIM  # one 64 x kept x D product, all heads
    assert out["fwd_executed_tflops"] == pytest.approx(2 * unit / 2.0 / 1e9)
    assert out["dkdv_executed_tflops"] == pytest.approx(2 * out["fwd_executed_tflops"])
    assert out["fwd_of_ceiling"] == pytest.approx(out["fwd_executed_tflops"] / harness.H200_BF16_MAX_TFLOPS)
    assert out["worklist_kernel_ms"] == 2.0 and "worklist_executed_tflops" not in out


def test_bench_topk_bracket_passes_replay_the_worst_brackets():
    """With 100 keys tied at the k-th score no threshold has exactly top_k keys above it, so the bracket closes
    only at hi = lo + 1: 32 // radix_bits passes from the whole int32 range, one more when a seeded first pass
    spans a bracket below tau; a tile whose first pass lands a threshold on exactly top_k keys stops there."""
    from experiments.bench_topk import bracket_passes
    from pallas_kernels.lowrank_topk_triton import sortable_key

    values = np.full(512, -np.inf, np.float32)
    values[:10], values[10:110] = 5.0, -1.7e38
    row = np.sort(np.asarray(sortable_key(jnp.asarray(values))).astype(np.int64))
    assert [bracket_passes(row, 60, bits) for bits in (1, 2, 4, 8)] == [32, 16, 8, 4]
    below = int(np.asarray(sortable_key(jnp.float32(-1.8e38))))
    assert bracket_passes(row, 60, 4, seed=(below, below)) == 9
    assert bracket_passes(row, 10, 4, seed=(int(row[-11]), int(row[-1]))) == 1


def test_bench_topk_recall_and_pass_model():
    """bench_topk's checks: the reference's ids have recall 1 and a shifted id list less; the pass replay counts
    fewer passes for a seeded first pass than for even splits."""
    from experiments.bench_sparse_attention import lowrank_inputs
    from experiments.bench_topk import passes_model, recall, sampled_scores
    from pallas_kernels.lowrank_topk import lowrank_topk_reference
    from pallas_kernels.tuning import TopkTuning

    q_lr, k_lr = lowrank_inputs(jax.random.key(512), 512, 2, 16)
    tiles = np.array([0, 3, 7])
    sampled = sampled_scores(q_lr, k_lr, q_tile=64, kv_block=1, tiles=tiles)
    ids = lowrank_topk_reference(q_lr.astype(jnp.float32), k_lr.astype(jnp.float32), 51, q_tile=64, kv_block=1)
    assert recall(ids, sampled, 51, tiles=tiles) == 1.0
    assert recall((ids + 1) % 512, sampled, 51, tiles=tiles) < 0.9
    even = passes_model(sampled, 51, tuning=TopkTuning(sample=0))
    seeded = passes_model(sampled, 51, tuning=TopkTuning(sample=16))
    assert 1.0 <= seeded < even
