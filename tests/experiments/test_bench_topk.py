"""experiments/bench_topk.py's attention mass captured by a selection against the exact top-k's, and its
projected inputs (a rank-16 predictor of full q, k)."""

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import harness
from experiments.bench_sparse_attention import exact_topk
from experiments.bench_topk import (
    FAULT_ENV,
    WATCHDOG,
    block_mass,
    ids_fingerprint,
    mass_captured,
    mass_table,
    ordered_variants,
    plan,
    projected_inputs,
    run,
    run_job,
    summarise,
    top_k_of,
)
from pallas_kernels.lowrank_topk import lowrank_topk_reference

SEQ, HEADS, Q_TILE = 512, 2, 64
TILES = np.array([0, 3, 7])


@pytest.fixture(scope="module")
def inputs():
    return projected_inputs(jax.random.key(0), SEQ, HEADS, 32, 16)


def test_projected_inputs_predict_the_true_logits_at_their_scale(inputs):
    q, k, q_lr, k_lr = (np.asarray(x, np.float32) for x in inputs)
    assert q.shape == k.shape == (1, SEQ, HEADS, 32) and q_lr.shape == k_lr.shape == (1, SEQ, HEADS, 16)
    for h in range(HEADS):
        true = (q[0, ::8, h] @ k[0, :, h].T).ravel() / np.sqrt(32)
        low = (q_lr[0, ::8, h] @ k_lr[0, :, h].T).ravel() / np.sqrt(16)
        assert np.corrcoef(true, low)[0, 1] > 0.5  # a predictor, not noise
        assert 0.5 < (true @ low) / (true @ true) < 1.5  # q_lr k_lr^T / sqrt(r) estimates q k^T / sqrt(D)


@pytest.mark.parametrize("kv_block", [1, 16])
def test_mass_captured_is_one_for_the_exact_selection_and_less_for_a_perturbed_one(inputs, kv_block):
    q, k, q_lr, k_lr = inputs
    table = mass_table(q, k, q_tile=Q_TILE, tiles=TILES)
    assert table.shape == (1, HEADS, len(TILES), SEQ)
    np.testing.assert_allclose(jnp.sum(table, -1), 1.0, rtol=1e-5)  # each tile's mean softmax row
    masses = block_mass(table, kv_block)
    top_k = SEQ // kv_block // 8
    exact = exact_topk(q_lr, k_lr, top_k, q_tile=Q_TILE, kv_block=kv_block, tiles=TILES)
    # the reference selection (fp32 on the CPU) is the exact one, and captures all of its mass
    ids = lowrank_topk_reference(q_lr, k_lr, top_k, q_tile=Q_TILE, kv_block=kv_block)[:, :, TILES]
    np.testing.assert_array_equal(ids, exact)
    got = mass_captured(ids, exact, masses)
    assert got["mean"] == pytest.approx(1.0) and got["min"] == pytest.approx(1.0) and 0 < got["exact_mass"] < 1
    # swapping each list's best block (by true mass) for the selection's worst unselected one loses mass
    best = jnp.argmax(jnp.take_along_axis(masses, exact, -1), axis=-1, keepdims=True)
    outside = jnp.where(jax.nn.one_hot(exact, masses.shape[-1]).sum(-2) > 0, jnp.inf, masses)
    perturbed = jnp.where(jnp.arange(top_k) == best, jnp.argmin(outside, -1, keepdims=True), exact)
    lost = mass_captured(perturbed, exact, masses)
    assert lost["min"] <= lost["mean"] < 0.99 and lost["exact_mass"] == pytest.approx(got["exact_mass"])


def test_ids_fingerprint_tells_any_change_of_an_id_or_its_place():
    ids = jax.random.randint(jax.random.key(1), (1, 2, 8, 33), 0, 1000, jnp.int32)
    same = ids_fingerprint(jnp.array(np.asarray(ids)))
    assert same == ids_fingerprint(ids) and len(same) == 16
    assert ids_fingerprint(ids.at[0, 1, 5, 7].add(1)) != same  # one id
    assert ids_fingerprint(ids.at[0, 0, 0, :2].set(ids[0, 0, 0, 1::-1])) != same  # two ids swapped
    assert ids_fingerprint(ids.reshape(1, 2, 33, 8)) == same  # the flat order is what counts


def test_plan_runs_the_default_at_every_size_first_and_precision_variants_last():
    variants = ordered_variants([{"precision": "ieee"}, {"sample": 0}, {}])
    assert variants == [{}, {"sample": 0}, {"precision": "ieee"}]
    cfg = {"seqs": [32768, 131072], "kv_blocks": [1, 64], "sparsities": [0.9, 0.95], "attention_seqs": [131072]}
    jobs = plan(cfg, variants)
    assert [(j["kind"], j["seq"]) for j in jobs] == [
        ("select", 32768),
        ("select", 131072),
        ("attention", 131072),
        ("select", 32768),
        ("select", 131072),
    ]
    assert {r["variant"] for j in jobs[:2] for r in j["rows"]} == {"{}"}
    later = [r["variant"] for r in jobs[3]["rows"]]
    assert later == ['{"sample": 0}'] * 4 + ['{"precision": "ieee"}'] * 4  # variant by variant
    assert [(r["kv_block"], r["sparsity"]) for r in jobs[0]["rows"]] == [(1, 0.9), (1, 0.95), (64, 0.9), (64, 0.95)]


KEYS = [{"seq": 256, "kv_block": b, "sparsity": 0.5, "variant": v} for v in ("{}", '{"sample": 0}') for b in (16, 64)]


def scripted_runner(script):
    """A stand-in for run_child that runs no process: the n-th call plays script[n] on the rows it is given:
    ("ok", n) finishes n rows and answers; ("die", n, stage, scope, error) finishes n rows, enters `stage` (of
    the next row where scope is None) and ends without an answer, with in_child's `error`."""
    calls = []

    def runner(job, timeout_s):
        step = script[len(calls)]
        calls.append(job["rows"])
        records = [{"row": {**key, "top_k": 2, "select_ms": 1.0}} for key in job["rows"][: step[1]]]
        if step[0] == "ok":
            return {"finished": True}, records
        _, n, stage, scope, error = step
        row = {**job["rows"][n], "top_k": 2, "tuning": "T"} if scope is None else None
        records.append({"running": stage, "scope": job["rows"][n] if scope is None else scope, "row": row})
        return {"error": error}, records

    return runner, calls


def test_run_job_records_a_crash_in_the_rows_it_takes_down_and_goes_on():
    job = {"kind": "select", "seq": 256, "cfg": {}, "rows": KEYS}
    hang = "child exited 1: Timeout (0:01:00)!\nThread 0x1 (most recent call first):"
    runner, calls = scripted_runner(
        [
            ("die", 1, "compile", None, "child exited -6: F1206 Check failed: bad"),  # the second row aborts
            ("die", 0, "sampled scores and block masses", {"seq": 256, "kv_block": 16}, hang),  # kv_block 16's
            ("ok", 1),
        ]
    )
    rows, children = run_job(job, harness.Budget(600, start=time.time()), 60, runner)
    assert calls == [KEYS, KEYS[2:], KEYS[3:]]  # each new child gets the rows still to run
    by_key = {(r["kv_block"], r["variant"]): r for r in rows}
    assert len(rows) == 4 and "select_ms" in by_key[16, "{}"] and "select_ms" in by_key[64, '{"sample": 0}']
    crashed = by_key[64, "{}"]
    assert crashed["status"] == "crashed" and crashed["stage"] == "compile" and crashed["tuning"] == "T"
    assert "Check failed: bad" in crashed["error"] and "select_ms" not in crashed
    timed_out = by_key[16, '{"sample": 0}']  # the shared stage that hung took down the row that needed it
    assert timed_out["status"] == "timed out" and timed_out["stage"] == "sampled scores and block masses"
    assert timed_out["top_k"] == top_k_of(256, 16, 0.5) and timed_out["error"] == hang
    assert [c["ended"] for c in children] == ["crashed", "timed out", "finished"]


def test_run_job_gives_up_on_a_child_that_dies_before_any_stage_and_skips_past_the_budget():
    job = {"kind": "select", "seq": 256, "cfg": {}, "rows": KEYS}
    runner_calls = []

    def no_stage(job, timeout_s):  # ends at once, leaving no record: every row is lost, none is retried
        runner_calls.append(job)
        return {"error": "child exited 1: ImportError: x"}, []

    rows, children = run_job(job, harness.Budget(600, start=time.time()), 60, no_stage)
    assert len(runner_calls) == 1 and [r["status"] for r in rows] == ["crashed"] * 4
    assert {r["stage"] for r in rows} == {"start"} and len(children) == 1
    rows, children = run_job(job, harness.Budget(20, start=time.time()), 60, no_stage)  # 20 s: no room for a row
    assert len(runner_calls) == 1 and children == [] and [r["skipped"] for r in rows] == ["time budget"] * 4
    assert rows[0]["top_k"] == top_k_of(256, 16, 0.5) == 8


def test_summarise_orders_the_rows_and_compares_ids_with_the_first_variant():
    variants = [{}, {"sample": 0}, {"precision": "ieee"}]
    cfg = {"seqs": [256], "kv_blocks": [1, 64], "sparsities": [0.5]}
    row = lambda b, v, fp: {"seq": 256, "kv_block": b, "sparsity": 0.5, "variant": json.dumps(v), "ids_fingerprint": fp}
    rows = [row(64, variants[1], "z"), row(1, variants[2], "c"), row(1, variants[0], "b"), row(64, variants[0], "a")]
    rows.append({**row(1, variants[1], "b"), "select_ms": 2.0})
    rows[1].pop("ids_fingerprint")  # a row that failed before its ids were fingerprinted
    attention = [{"seq": 256, "sparsity": 0.5, "kv_block": 1, "fwd_bwd_ms": 8.0}]
    out = summarise(rows, attention, cfg, variants)
    assert [(r["kv_block"], r["variant"]) for r in out] == [(b, json.dumps(v)) for b in (1, 64) for v in variants][:5]
    assert [r.get("same_ids_as_first") for r in out] == [None, True, None, None, False]
    assert [r.get("share_of_attention") for r in out] == [None, 0.25, None, None, None]


TINY = dict(
    seqs=[256],
    sparsities=[0.5],
    kv_blocks=[16, 64],
    inputs="projected",
    heads=1,
    rank=16,
    q_tile=64,
    head_dim=32,
    token_group=16,
    iters=1,
    attention_seqs=[],
)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_child_that_aborts_costs_its_row_only(monkeypatch):
    """Real children (interpret mode): the first aborts at a row's compile, as XLA did; the next child measures
    the row after it."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0")
    monkeypatch.setenv(FAULT_ENV, json.dumps([{"fault": "abort", "kv_block": 16}]))
    rows, attention, children = run(dict(TINY, variants=[{}]), [{}], harness.Budget(600, start=time.time()), 60)
    assert attention == [] and [c["ended"] for c in children] == ["crashed", "finished"]
    aborted, measured = rows
    assert (aborted["kv_block"], aborted["status"], aborted["stage"]) == (16, "crashed", "compile")
    assert aborted["error"].startswith("child exited -6: ") and "Fatal Python error: Aborted" in aborted["error"]
    assert aborted["tuning"] and "select_ms" not in aborted  # the row as far as it got
    assert measured["kv_block"] == 64 and not {"status", "error", "skipped"} & set(measured)
    assert measured["mass_captured_full"] == pytest.approx(1.0) and measured["recall"] == 1.0
    assert measured["select_ms"] > 0 and len(measured["ids_fingerprint"]) == 16


HANGS = """import sys
from experiments.bench_topk import Progress
progress = Progress(sys.argv[1], 1.0)
progress.stage("inputs", {"seq": 256})
progress.done({"seq": 256, "kv_block": 64})
progress.stage("compile", {"seq": 256, "kv_block": 16}, {"seq": 256, "kv_block": 16, "tuning": "T"})
print("not reached")
"""


def test_a_stage_past_its_time_limit_ends_the_child_and_leaves_its_record(monkeypatch, tmp_path):
    (tmp_path / "child_hangs_at_compile.py").write_text(HANGS)
    monkeypatch.setenv(FAULT_ENV, json.dumps([{"fault": "hang", "kv_block": 16}]))
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), ROOT])}
    progress = tmp_path / "progress.jsonl"
    got = harness.in_child("child_hangs_at_compile", [str(progress)], 60, env=env)
    assert got["error"].startswith("child exited 1: ") and WATCHDOG.search(got["error"])
    assert "Timeout (0:00:01)!" in got["error"] and "not reached" not in got["error"]
    records = [json.loads(line) for line in progress.read_text().splitlines()]
    assert [r.get("running") for r in records] == ["inputs", None, "compile"]
    assert records[-1]["row"]["tuning"] == "T" and records[1] == {"row": {"seq": 256, "kv_block": 64}}


def test_quick_run_writes_its_own_file(monkeypatch):
    """A --quick CPU run writes bench_topk_quick.json, never a GPU run's bench_topk.json (a quick run once
    overwrote the committed one)."""
    from experiments import bench_topk

    written = []
    monkeypatch.setattr(bench_topk, "run", lambda cfg, variants, budget, timeout: ([], [], []))
    monkeypatch.setattr(bench_topk.harness, "write_results", lambda name, payload: written.append(name))
    monkeypatch.setattr("sys.argv", ["bench_topk", "--quick"])
    bench_topk.main()
    monkeypatch.setattr("sys.argv", ["bench_topk", "--name", "probe"])
    bench_topk.main()
    assert written == ["bench_topk_quick", "probe"]
