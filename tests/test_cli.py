"""The user's path: the CLI in a subprocess, as the README runs it."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.conftest import SMALL


def run_cli(*args, timeout=600, **kw):
    return subprocess.run([sys.executable, "-m", "dsv_jax", *args], capture_output=True, text=True,
                          timeout=timeout, **kw)


def metrics(workdir):
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(x) for x in f if x.strip()]


def test_train_then_sample_gif(tmp_path):
    wd = str(tmp_path / "run")
    r = run_cli("train", "--config", "tiny", "--workdir", wd, "--steps", "3", "--no-progress", *SMALL,
                "train.sample_at_end=true", "train.sample_steps=2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "trained to step 3" in r.stdout
    assert os.path.exists(os.path.join(wd, "samples", "step_000003.gif"))
    out = str(tmp_path / "clip.gif")
    r = run_cli("sample", "--workdir", wd, "--out", out, "--prompt", "a red circle moving left",
                "--prompt", "a blue square", "--steps", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    import imageio.v3 as iio

    frames = iio.imread(out, index=None)
    assert frames.shape[0] == 4 and frames.shape[1] == 16 and frames.shape[2] == 2 * 16 + 1  # 4 frames, 2 clips
    # eval: the held-out loss the trainer logged at the end, and the semantic score of generated clips
    report = str(tmp_path / "eval.json")
    r = run_cli("eval", "--workdir", wd, "--clips", "3", "--steps", "2", "--json", report)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "held-out loss" in r.stdout and "semantic score" in r.stdout and "ground-truth clips" in r.stdout
    with open(report) as f:
        result = json.load(f)
    logged = [m for m in metrics(wd) if "eval_loss" in m][-1]
    assert result["step"] == 3 and result["held_out"]["eval_loss"] == pytest.approx(logged["eval_loss"], rel=1e-4)
    semantic = result["semantic"]
    assert len(semantic["captions"]) == 3 and semantic["truth"]["accuracy"] >= 0.9
    assert set(semantic["score"]["questions"]) == {"colour", "shape", "motion"}


def test_sigterm_saves_and_rerun_resumes(tmp_path):
    wd = str(tmp_path / "run")
    args = ["train", "--config", "tiny", "--workdir", wd, "--steps", "100000", "--no-progress", *SMALL,
            "train.ckpt_every=100000"]
    proc = subprocess.Popen([sys.executable, "-m", "dsv_jax", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and not any("loss" in m for m in metrics(wd)):
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    last = max(m["step"] for m in metrics(wd) if "loss" in m)
    saved = sorted(int(d) for d in os.listdir(os.path.join(wd, "checkpoints")) if d.isdigit())
    assert saved and saved[-1] == last, (saved, last)
    # the same command picks up where it stopped
    r = run_cli("train", "--config", "tiny", "--workdir", wd, "--steps", str(last + 2), "--no-progress", *SMALL)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from step {last}" in r.stderr
    steps = [m["step"] for m in metrics(wd) if "loss" in m]
    assert steps[-2:] == [last + 1, last + 2]


@pytest.mark.parametrize("args, needle", [
    (["train", "--config", "huge"], "unknown preset 'huge'"),
    (["train", "--config", "tiny", "model.nope=1"], "valid keys"),
    (["sample", "--workdir", "/nonexistent/run", "--out", "x.gif"], "no checkpoint"),
])
def test_errors_are_clear(args, needle):
    r = run_cli(*args, timeout=120)
    assert r.returncode == 2 and needle in r.stderr, r.stderr[-2000:]
