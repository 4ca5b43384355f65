"""`python -m experiments.bench_multigpu` end to end on fake CPU devices (subprocesses: it sets up jax itself)."""

import json
import math
import os
import subprocess
import sys

from tests.conftest import FAST_COMPILE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_bench(tmp_path, *args, devices=2, timeout=240):
    env = dict(
        os.environ,
        PYTHONPATH=ROOT,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}",
    )
    env.pop("OUT", None)  # no copy into the device tool's output folder
    r = subprocess.run(
        [sys.executable, "-m", "experiments.bench_multigpu", "--quick", "--results-dir", str(tmp_path), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    files = list(tmp_path.glob("bench_multigpu*.json"))
    assert len(files) == 1, files
    return files[0].name, json.loads(files[0].read_text()), r.stdout


def test_part3_data_parallel_both_modes(tmp_path):
    name, out, log = run_bench(tmp_path, "--skip-attention", "--skip-train")
    assert name == "bench_multigpu_data_quick.json"
    assert "attention" not in out and "training" not in out
    rows = {r["mode"]: r for r in out["data_parallel"]}
    assert set(rows) == {"equal_tokens", "dual"}
    for r in rows.values():
        assert "skipped" not in r, r
        assert r["steps"] == 8 and len(r["step_times_s"]) == 8
        assert math.isfinite(r["median_step_ms"]) and r["median_step_ms"] > 0
        assert math.isfinite(r["step_cv"]) and r["step_cv"] >= 0
        assert math.isfinite(r["tokens_per_s"]) and r["tokens_per_s"] > 0
        assert r["programs"] >= 1 and r["ooms"] == 0 and r["losses_finite"]
        assert r["compiles_during_timed_steps"] == 0
    ratio = rows["dual"]["tokens_per_s_ratio_dual_over_equal"]
    assert math.isclose(ratio, rows["dual"]["tokens_per_s"] / rows["equal_tokens"]["tokens_per_s"])
    setup = out["data_parallel_setup"]
    assert setup["data_parallel"] == 2 and setup["preset"] == "tiny"
    # global batches are whole multiples of the data-parallel size
    assert all(b % 2 == 0 for bb in setup["batch_sizes"].values() for b in bb)
    assert "dual / equal tokens/s" in log


def test_budget_skips_every_part_with_a_reason(tmp_path):
    name, out, log = run_bench(tmp_path, "--budget-s", "1", "--order", "data", "train", "attention")
    assert name == "bench_multigpu_quick.json" and out["budget_s"] == 1
    rows = out["attention"] + out["training"] + out["data_parallel"]
    assert {r.get("mode") for r in out["data_parallel"]} == {"equal_tokens", "dual"}
    assert len(out["training"]) == 2 and out["attention"][0]["variant"] == "all"
    for r in rows:
        assert r["skipped"].startswith("budget:"), r
        assert "step_s" not in r and "median_ms" not in r and "tokens_per_s" not in r
    assert "skip part 3" in log and "skip part 2" in log
