"""What a long command shows while it works (dsv_jax/progress.py): a bar only on a terminal, else status
lines at least every N seconds; tqdm's plain bar where ipywidgets is missing (no notebook warning)."""

import logging
import subprocess
import sys
import time

import pytest

from dsv_jax.progress import Heartbeat, duration, on_terminal


def test_heartbeat_logs_the_status_at_least_every_interval_and_say_resets_it(caplog):
    caplog.set_level(logging.INFO, logger="dsv_jax")
    calls = []

    def status():
        calls.append(time.monotonic())
        return f"step {len(calls)}"

    with Heartbeat(0.05, status) as beat:
        time.sleep(0.4)
        beat.say("compiling the train step for bucket %s ...", "8x32x32")
        said = time.monotonic()
        time.sleep(0.02)
    lines = [r.getMessage() for r in caplog.records]
    assert "compiling the train step for bucket 8x32x32 ..." in lines
    assert 4 <= len(calls) <= 9, calls  # about every 0.05 s over 0.4 s (a loaded machine may lag)
    assert all(b - a < 0.3 for a, b in zip(calls, calls[1:])), calls  # never a long silence
    assert not any(said <= t < said + 0.04 for t in calls)  # `say` counts as a line
    assert lines.count("step 1") == 1 and f"step {len(calls)}" in lines
    n = len(calls)
    time.sleep(0.15)
    assert len(calls) == n  # stopped with the block

    with Heartbeat(0.01, status, enabled=False):  # a bar shows progress instead
        time.sleep(0.1)
    assert len(calls) == n
    with pytest.raises(ValueError, match="must be > 0"):
        Heartbeat(0, status)


def test_no_bar_off_a_terminal_and_durations_read_easily(tmp_path):
    with open(tmp_path / "log", "w") as f:
        assert not on_terminal(f)
    assert [duration(s) for s in (3.4, 185, 7620)] == ["3 s", "3 min 05 s", "2 h 07 min"]


def test_no_notebook_bar_without_ipywidgets():
    """Importing the trainer and prepare-data loads tqdm's plain bar where ipywidgets is missing: tqdm.auto
    would warn `IProgress not found` in a notebook (examples/quickstart.ipynb)."""
    code = (
        "import importlib.util, sys\n"
        "import dsv_jax.train.trainer, dsv_jax.data.prepare\n"
        "from dsv_jax.progress import tqdm_class\n"
        "bar = tqdm_class()\n"
        "print(importlib.util.find_spec('ipywidgets') is None, 'tqdm.autonotebook' in sys.modules, bar.__module__)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    missing, notebook, module = r.stdout.split()
    if missing == "True":
        assert notebook == "False" and module == "tqdm.std", r.stdout
    else:
        assert module in ("tqdm.std", "tqdm.asyncio", "tqdm.notebook", "tqdm.auto"), r.stdout
