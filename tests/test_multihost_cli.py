"""`dsv-jax train` as two processes on localhost (jax.distributed, 4 fake CPU devices each), DSV under
context parallelism: SIGTERM to one process stops both at the same step with one checkpoint; the
relaunched pair resumes there and finishes, sampling at the end."""

import json
import os
import signal
import subprocess
import sys
import time

from tests.conftest import FAST_COMPILE, SMALL
from tests.test_multihost import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 12


def launch(workdir, port, env):
    args = [
        "--config",
        "tiny",
        "--workdir",
        workdir,
        "--steps",
        str(STEPS),
        "--no-progress",
        *SMALL,
        "attention=dsv",
        "data.buckets=[[4,16,32]]",
        "data.bucket_weights=[1.0]",
        "model.patch=[1,2,2]",
        "data.tokens_per_batch=1024",
        "dsv.stage1_steps=3",
        "dsv.threshold=0.0",
        "dsv.ladder=[0.5,1.0]",
        "parallel.context=4",
        "train.ckpt_every=1000",
        "train.sample_at_end=true",
        "train.sample_steps=2",
    ]
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dsv_jax",
                "train",
                "--coordinator",
                f"127.0.0.1:{port}",
                "--num-processes",
                "2",
                "--process-id",
                str(i),
                *args,
            ],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]


def finish(procs, timeout=600, status=0):
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, log in zip(procs, logs):
        assert p.returncode == status, log[-4000:]
    return logs


def steps_logged(workdir):
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(x)["step"] for x in f if x.strip() and '"loss"' in x]


def test_cli_two_processes_dsv_context_parallel_stop_on_one_host_resume_and_finish(tmp_path):
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
        XLA_FLAGS=f"--xla_force_host_platform_device_count=4 {FAST_COMPILE}",
        DSV_JAX_CACHE=str(tmp_path / "xla_cache"),
    )
    workdir = str(tmp_path / "run")
    procs = launch(workdir, free_port(), env)
    deadline = time.time() + 500
    while not steps_logged(workdir) and time.time() < deadline and all(p.poll() is None for p in procs):
        time.sleep(0.5)
    assert steps_logged(workdir), "no training step was logged"
    procs[1].send_signal(signal.SIGTERM)  # one host only
    logs = finish(procs, status=143)  # both stopped early, resumable
    stopped = steps_logged(workdir)[-1]
    assert stopped < STEPS, "the stop request did not stop the run"
    ckpts = sorted(int(d) for d in os.listdir(os.path.join(workdir, "checkpoints")) if d.isdigit())
    assert ckpts == [stopped], (ckpts, logs[0][-2000:])  # one consistent checkpoint, at the step both stopped

    logs = finish(launch(workdir, free_port(), env))
    assert f"resumed from step {stopped}" in logs[0] and f"resumed from step {stopped}" in logs[1]
    assert steps_logged(workdir)[-1] == STEPS
    assert os.path.exists(os.path.join(workdir, "samples", f"step_{STEPS:06d}.gif"))
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        recs = [json.loads(x) for x in f if x.strip()]
    assert any(r.get("dsv/stage") == 2 and r.get("dsv/sparse_blocks", 0) > 0 for r in recs)
