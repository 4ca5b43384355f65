"""context_attention across 2 processes (jax.distributed on localhost, 4 CPU devices each, gloo):
the multi-controller path that multi-node GPU runs take, with outputs and gradients checked in each
process against single-device attention (see tests/workers/context_multiprocess.py)."""

import os
import socket
import subprocess
import sys

from tests.conftest import FAST_COMPILE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_context_attention_across_two_processes():
    port = str(free_port())
    env = dict(os.environ, XLA_FLAGS=FAST_COMPILE)  # the worker sets its 4 devices
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.workers.context_multiprocess", str(i), port],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=400)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for i, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"process {i} failed:\n{out[-4000:]}"
        for name in ("ring", "hybrid", "hybrid-selective"):
            assert f"process {i}: {name} ok" in out, out[-4000:]
