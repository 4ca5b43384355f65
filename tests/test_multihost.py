"""Two processes on localhost (jax.distributed, CPU, 4 devices each) train on one prepared dataset:
the same bucket at every step, disjoint samples per host, checkpoint, restore, identical continuation."""

import json
import os
import socket
import subprocess
import sys

from tests.conftest import FAST_COMPILE
from tests.data_helpers import prepared_dataset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_share_buckets_split_samples_and_resume(tmp_path):
    dataset = prepared_dataset(str(tmp_path), images=17, videos=11, seed=3)
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
        XLA_FLAGS=f"--xla_force_host_platform_device_count=4 {FAST_COMPILE}",
        DSV_JAX_CACHE=str(tmp_path / "xla_cache"),
    )
    port = free_port()
    outs = [str(tmp_path / f"out{i}.json") for i in range(2)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                os.path.join(ROOT, "tests", "multihost_worker.py"),
                str(i),
                str(port),
                dataset,
                str(tmp_path / "run"),
                outs[i],
            ],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=540)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
    a, b = (json.load(open(o)) for o in outs)
    assert a["starts"] == b["starts"] == [0, 2]  # the second phase restored the step-2 checkpoint
    assert a["steps"] == b["steps"] == [1, 2, 3, 4]
    assert a["buckets"] == b["buckets"]  # one shared bucket schedule
    assert len(set(a["buckets"])) == 2 or len(a["buckets"]) == 4
    for step, (ia, ib, batch) in enumerate(zip(a["ids"], b["ids"], a["batch"])):
        assert len(ia) == len(ib) == batch // 2, step
        assert not set(ia) & set(ib), f"step {step + 1}: both hosts fed records {set(ia) & set(ib)}"
    assert a["ids"] == a["ref_ids"] and b["ids"] == b["ref_ids"]  # restored mid-stream, same sequence
    assert a["losses"] == b["losses"]  # one global computation
    assert a["ref_state"] == b["ref_state"]  # the iterator state is host-independent (one JSON in the checkpoint)
