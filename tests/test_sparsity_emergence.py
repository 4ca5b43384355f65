"""experiments/sparsity_emergence.py on tiny settings (CPU, interpret-mode kernels), in subprocesses:
a fresh study, a rerun that resumes from its checkpoints, and a budget that stops it at once."""

import json
import os
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_study(tmp_path, *args, timeout=400):
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    env.pop("OUT", None)  # no copy into the device tool's output folder
    env.pop("XLA_FLAGS", None)  # one CPU device, as on a GPU machine (conftest's 8 fake devices are for tests)
    r = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "sparsity_emergence.py"), "--quick",
                        "--results-dir", str(tmp_path / "results"), "--workdir", str(tmp_path / "work"), *args],
                       capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    with open(tmp_path / "results" / "sparsity_emergence_quick.json") as f:
        return json.load(f), r.stdout + r.stderr


def test_study_records_resumes_and_stops_at_the_budget(tmp_path):
    out, _ = run_study(tmp_path, "--steps", "2")
    assert set(out["runs"]) == {"256", "512"} and out["parameters"] > 0
    for s, run in out["runs"].items():
        assert sorted(run["records"], key=int) == ["0", "2"] and run["train"][-1]["step"] == 2
        rec = run["records"]["2"]
        assert rec["tokens"] == int(s)
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
    summary = out["summary"]
    assert summary["step"] == 2 and summary["tokens"] == [256, 512]
    assert all(np.isfinite(summary["fit"]["0.95"][k]["b"]) for k in ("tokens", "blocks", "rule", "predictor"))
    assert {p.name for p in (tmp_path / "results").glob("*.png")} == {"sparsity_emergence_steps_quick.png",
                                                                       "sparsity_emergence_tokens_quick.png"}

    out, log = run_study(tmp_path, "--steps", "4", "--tokens", "256")
    assert "resumed from step 2" in log and "resuming the records" in log
    run = out["runs"]["256"]
    assert sorted(run["records"], key=int) == ["0", "2", "4"] and run["train"][-1]["step"] == 4

    out, log = run_study(tmp_path, "--steps", "6", "--tokens", "256", "--budget-s", "0", "--reserve-s", "0")
    assert out["budget_expired"] and "budget: S=256 stays at step 4" in log
    assert sorted(out["runs"]["256"]["records"], key=int) == ["0", "2", "4"]  # kept, nothing lost
