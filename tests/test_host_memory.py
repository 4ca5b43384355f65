"""dsv_jax.host_memory: the CPU step must not fault its temporary buffers in again every call."""

import os
import subprocess
import sys
import textwrap

import pytest

from dsv_jax import host_memory

# Page faults per call of a jitted program whose buffers (38 MB each: above 32 MB, the largest
# size glibc serves from its heap by default) come from XLA's worker threads.
PROBE = textwrap.dedent("""
    import resource, sys
    if sys.argv[1] == "keep":
        from dsv_jax.host_memory import keep_freed_memory
        assert keep_freed_memory(), "not applied"
    import jax, jax.numpy as jnp

    @jax.jit
    def step(x):
        y = jnp.sin(x) * 2.0 + 1.0
        return (jnp.cos(y) @ y * jnp.tanh(y)).sum()

    x = jax.random.normal(jax.random.key(0), (3072, 3072))
    for _ in range(2):
        step(x).block_until_ready()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(4):
        step(x).block_until_ready()
    print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 4)
""")


def faults_per_call(mode: str) -> float:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    env.pop("DSV_JAX_HOST_MALLOC", None)
    out = subprocess.run([sys.executable, "-c", PROBE, mode], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return float(out.stdout.split()[-1])


def huge_pages_always() -> bool:
    """Transparent huge pages for every mapping: a fresh 38 MB map then faults ~19 times, not 9216."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[always]" in f.read()
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux") or huge_pages_always(),
                    reason="counts 4 KiB page faults of glibc's maps (Linux, THP not 'always')")
def test_kept_memory_stops_the_per_call_page_faults():
    system, kept = faults_per_call("system"), faults_per_call("keep")
    # one 38 MB buffer is 9216 pages: without the setting every call maps its buffers afresh
    assert system > 9216, system
    assert kept < 0.2 * system, (kept, system)


def test_only_on_the_cpu_and_never_when_told_not_to(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    assert not host_memory.runs_on_cpu()
    assert not host_memory.keep_freed_memory()
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert host_memory.runs_on_cpu()
    monkeypatch.setenv("DSV_JAX_HOST_MALLOC", "system")
    assert not host_memory.keep_freed_memory()


def test_without_jax_platforms_an_installed_accelerator_plugin_decides(monkeypatch):
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setattr(host_memory.importlib.util, "find_spec",
                        lambda name: object() if name == "jax_cuda13_plugin" else None)
    assert not host_memory.runs_on_cpu()
    monkeypatch.setattr(host_memory.importlib.util, "find_spec", lambda name: None)
    assert host_memory.runs_on_cpu()
