"""`python -m experiments.sparsity_emergence`: the study end to end on tiny settings (CPU, subprocesses: a fresh
run, a rerun that resumes from its checkpoints, a budget that stops it at once), and its summary."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import FAST_COMPILE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_study(tmp_path, *args, timeout=400):
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    env.pop("OUT", None)  # no copy into the device tool's output folder
    env["XLA_FLAGS"] = FAST_COMPILE  # one CPU device, as on a GPU machine (conftest's 8 fake devices are for tests)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.sparsity_emergence",
            "--quick",
            "--results-dir",
            str(tmp_path / "results"),
            "--workdir",
            str(tmp_path / "work"),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    with open(tmp_path / "results" / "sparsity_emergence_quick.json") as f:
        return json.load(f), r.stdout + r.stderr


def test_study_records_resumes_and_stops_at_the_budget(tmp_path):
    # one S keeps CI time down (the train steps' compiles dominate); the summary over S is tested below
    out, _ = run_study(tmp_path, "--tokens", "256", "--steps", "2")
    run = out["runs"]["256"]
    assert out["parameters"] > 0 and sorted(run["records"], key=int) == ["0", "2"] and run["train"][-1]["step"] == 2
    rec = run["records"]["2"]
    assert rec["tokens"] == 256
    keep = rec["t"]["0.5"]["keep"]
    for theta in ("0.9", "0.95"):
        k = {kind: np.asarray(v) for kind, v in keep[theta].items()}
        assert set(k) == {"tokens", "blocks", "rule", "predictor"}
        assert all(v.shape == (2, 2) and ((v > 0) & (v <= 1)).all() for v in k.values())  # [blocks, heads]
        # the best single keys need no more than the best blocks, which need no more than any block rule
        assert (k["tokens"] <= k["blocks"]).all() and (k["blocks"] <= k["rule"]).all()
        assert (k["blocks"] <= k["predictor"]).all()
    assert (np.asarray(keep["0.9"]["tokens"]) <= np.asarray(keep["0.95"]["tokens"])).all()
    ctl = rec["controller"]
    assert len(ctl["rungs"]) == 2 and ctl["sparse_blocks"] == sum(r > 0 for r in ctl["rungs"])
    assert ctl["profiles"] >= 1 and np.shape(ctl["head_keep"]) == (2, 2)
    assert out["summary"]["step"] == 2 and out["summary"]["fit"]["0.95"]["tokens"] is None  # one S: no fit
    assert {p.name for p in (tmp_path / "results").glob("*.png")} == {
        "sparsity_emergence_steps_quick.png",
        "sparsity_emergence_tokens_quick.png",
    }

    out, log = run_study(tmp_path, "--tokens", "256", "--steps", "4")
    assert "resumed from step 2" in log and "resuming the records" in log
    run = out["runs"]["256"]
    assert sorted(run["records"], key=int) == ["0", "2", "4"] and run["train"][-1]["step"] == 4

    out, log = run_study(tmp_path, "--tokens", "256", "--steps", "6", "--budget-s", "0", "--reserve-s", "0")
    assert out["budget_expired"] and "budget: S=256 stays at step 4" in log
    assert sorted(out["runs"]["256"]["records"], key=int) == ["0", "2", "4"]  # kept, nothing lost


def test_summary_fits_keep_against_tokens(tmp_path):
    from experiments import sparsity_emergence as study

    def record(scale):  # keep ratios [2 blocks, 2 heads] per selection kind, the same at both thetas
        keep = {
            k: (scale * np.array([[0.5, 0.7], [0.9, 0.9]]) * f).tolist()
            for k, f in zip(study.KINDS, (1.0, 1.1, 1.2, 1.3))
        }
        return {"t": {"0.5": {"keep": {"0.9": keep, "0.95": keep}}}, "controller": {"sparse_blocks": 0}}

    runs = {
        "256": {"records": {"0": record(1.0), "2": record(1.0)}},
        "1024": {"records": {"2": record(0.25), "4": record(0.2)}},
    }
    summary = study.summarise(runs)
    assert summary["step"] == 2 and summary["tokens"] == [256, 1024]
    assert summary["keep"]["0.95"]["tokens"] == pytest.approx([0.75, 0.1875])
    fit = summary["fit"]["0.95"]["tokens"]
    assert fit["b"] == pytest.approx(-1.0) and fit["a"] * 256 ** fit["b"] == pytest.approx(0.75)  # 4x S: 1/4 keep
    assert study.headline(record(1.0))["0.9"]["blocks"] == pytest.approx((0.75 * 1.1, 0.6 * 1.1))  # mean, sparsest
    paths = study.plot(runs, summary, str(tmp_path), "_test")
    assert [os.path.basename(p) for p in paths] == [
        "sparsity_emergence_steps_test.png",
        "sparsity_emergence_tokens_test.png",
    ]
    paths = study.plot(runs, summary, str(tmp_path), "", "sparsity_emergence_long")  # --name's files
    assert [os.path.basename(p) for p in paths] == [
        "sparsity_emergence_long_steps.png",
        "sparsity_emergence_long_tokens.png",
    ]
