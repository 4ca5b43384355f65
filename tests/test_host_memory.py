"""dsv_jax.host_memory: a large buffer that a worker thread frees must not be faulted in afresh each time."""

import os
import subprocess
import sys
import textwrap

import pytest

from dsv_jax import host_memory

# What XLA:CPU does each step, without jax: a worker thread mallocs a buffer larger than a thread arena's
# 64 MB heap (96 MB), writes it and frees it. Prints the page faults per round after the first.
PROBE = textwrap.dedent("""
    import ctypes, resource, sys, threading
    if sys.argv[1] == "keep":
        from dsv_jax.host_memory import keep_freed_memory
        assert keep_freed_memory(), "not applied"
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    size, faults = 96 << 20, []

    def worker():
        for _ in range(4):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            buf = libc.malloc(size)
            ctypes.memset(buf, 1, size)
            libc.free(buf)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    print(sum(faults[1:]) / 3)
""")


def huge_pages_always() -> bool:
    """Transparent huge pages for every mapping: a fresh 96 MB map then faults ~48 times, not 24576."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[always]" in f.read()
    except OSError:
        return False


def faults_per_round(mode: str) -> float:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("DSV_JAX_HOST_MALLOC", None)
    env.pop("GLIBC_TUNABLES", None)
    out = subprocess.run([sys.executable, "-c", PROBE, mode], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return float(out.stdout.split()[-1])


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or huge_pages_always(),
    reason="counts 4 KiB page faults of glibc's maps (Linux, THP not 'always')",
)
def test_kept_memory_stops_the_per_round_page_faults():
    system, kept = faults_per_round("system"), faults_per_round("keep")
    pages = (96 << 20) // 4096
    assert system > 0.9 * pages, system  # glibc maps the buffer afresh every round
    assert kept < 0.05 * pages, kept  # one arena, no mmap: the heap keeps it


def test_the_cli_applies_it_before_jax_is_imported(tmp_path):
    script = textwrap.dedent(f"""
        import sys
        import dsv_jax.cli as cli
        seen = []
        cli.keep_freed_memory = lambda: seen.append("jaxlib" in sys.modules)
        code = cli.main(["eval", "--workdir", {str(tmp_path / "missing")!r}])
        cli.main(["presets"])
        print(code, seen)
    """)
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert out.stdout.split("\n")[-2] == "2 [False]", out.stdout[-500:] + out.stderr[-1500:]  # presets: not called


@pytest.mark.parametrize(
    "platforms, cpu",
    [("cpu", True), ("cpu,cuda", True), ("cuda,cpu", False), ("cuda", False), ("tpu", False), (" CPU ", True)],
)
def test_jax_platforms_decides_when_set(monkeypatch, platforms, cpu):
    monkeypatch.setenv("JAX_PLATFORMS", platforms)
    assert host_memory.runs_on_cpu() is cpu


def test_never_on_an_accelerator_or_when_told_not_to(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    assert not host_memory.keep_freed_memory()
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("DSV_JAX_HOST_MALLOC", "system")
    assert not host_memory.keep_freed_memory()


def test_without_jax_platforms_an_installed_accelerator_plugin_decides(monkeypatch):
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setattr(
        host_memory.importlib.util, "find_spec", lambda name: object() if name == "jax_cuda13_plugin" else None
    )
    assert not host_memory.runs_on_cpu()
    monkeypatch.setattr(host_memory.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(host_memory.importlib.metadata, "entry_points", lambda group: ["xla_neuron"])
    assert not host_memory.runs_on_cpu()  # a plugin registered under jax_plugins
    monkeypatch.setattr(host_memory.importlib.metadata, "entry_points", lambda group: [])
    assert host_memory.runs_on_cpu()
