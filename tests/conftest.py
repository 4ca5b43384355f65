"""Tests run on the CPU with 8 fake devices (set before jax is imported anywhere)."""

import gc
import os
import subprocess
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Triton's interpreter runs the token kernels here (tests/test_sparse_attention_token.py); triton decorates its
# own library for the interpreter only if this is set when it is first imported. Nothing else reads it.
os.environ.setdefault("TRITON_INTERPRET", "1")


def _xla_accepts(flag: str) -> bool:
    """Whether this jaxlib's XLA knows `flag` (an unknown flag in XLA_FLAGS aborts the process)."""
    env = dict(os.environ, XLA_FLAGS=flag, JAX_PLATFORMS="cpu")
    probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env, capture_output=True)
    return probe.returncode == 0


# XLA:CPU's cheapest compile, for the suite and the processes its tests start (tests/test_multihost.py
# and others set XLA_FLAGS themselves): the tests run small programs, mostly compile time, whose results
# do not depend on these. Optimisation level 0 halves the compile time; the older (LLVM IR) fusion
# emitters compile the train steps about 2.5 times faster than the MLIR ones (same losses).
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    fast = ["--xla_backend_optimization_level=0"]
    if _xla_accepts("--xla_cpu_use_fusion_emitters=false"):  # a later XLA may drop the flag
        fast.append("--xla_cpu_use_fusion_emitters=false")
    os.environ["XLA_FLAGS"] = " ".join([flags, "--xla_force_host_platform_device_count=8", *fast]).strip()
# the same for a test's subprocess that sets its own XLA_FLAGS
FAST_COMPILE = " ".join(
    ["--xla_backend_optimization_level=0"]
    + [f for f in os.environ["XLA_FLAGS"].split() if f.startswith("--xla_cpu_use_fusion_emitters")]
)

import pytest  # noqa: E402

from dsv_jax.config import get_config  # noqa: E402


@pytest.fixture
def abstract_gpu():
    """The test lowers for an abstract H100. Lowering a Pallas kernel to Triton for CUDA asks for the GPU's
    compute capability from jaxlib 0.11 on ("No supported GPU devices found" on a CPU); an abstract mesh
    whose device is a GPU answers it without one (jaxlib 0.10.2 accepts the same context)."""
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

    device = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
    with use_abstract_mesh(AbstractMesh((1,), ("gpu",), (AxisType.Explicit,), abstract_device=device)):
        yield


# Tests that lower Pallas kernels to Triton for CUDA (no GPU needed)
triton_lowering_on_cpu = pytest.mark.usefixtures("abstract_gpu")

# A model small enough to compile in seconds; two buckets so bucket scheduling is exercised.
SMALL = [
    "model.hidden=32",
    "model.heads=2",
    "model.depth=2",
    "model.text_dim=16",
    "model.patch=[1,4,4]",
    "data.buckets=[[1,16,16],[4,16,16]]",
    "data.bucket_weights=[0.5,0.5]",
    "data.tokens_per_batch=64",
    "text.max_len=8",
    "text.hash_buckets=8",
    "train.log_every=1",
    "train.eval_batches=1",
    "train.sample_at_end=false",
    "train.warmup_steps=2",
]


def small_config(*overrides, preset="tiny"):
    return get_config(preset, SMALL + list(overrides))


@pytest.fixture
def small_cfg():
    return small_config


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Each test (its fixtures too) runs with the objects made before it frozen: the garbage collector
    ignores them until the test ends. imageio's PyAV plugin runs a full gc.collect() whenever it closes a
    file, and in a worker that has run many tests (jax, compiled programs) each full collection takes
    about half a second: writing and preparing a 28-file dataset took 30 s, 2 s without that.
    Automatic full collections stay as rare as in a large heap (none within a test): with the heap
    frozen they would otherwise come every few thousand allocations and move the moment garbage is
    collected into the test (asyncio then logs, say, "Task exception was never retrieved" for the
    tasks of a failed checkpoint read while the test watches the log)."""
    threshold = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(threshold[0], threshold[1], 2**31 - 1)
    try:
        return (yield)
    finally:
        gc.set_threshold(*threshold)
        gc.unfreeze()


# The longest tests (CPU seconds on a 2-core machine; several run two processes or the CLI), first:
# with pyproject.toml's --maxschedchunk=1, `pytest -n 2` hands each worker the next test in collection
# order when it is nearly done, so the long tests start early and short ones fill the end instead of
# one long test running alone while the other worker idles.
SLOW_FIRST = [
    "tests/test_multihost_cli.py",
    "tests/test_dsv.py",
    "tests/test_context_dsv.py::test_cli_dsv_on_eight_context_devices_matches_one_device",
    "tests/test_multihost.py",
    "tests/test_cli.py::test_train_then_sample_gif",
    "tests/test_fit_cost.py",
    "tests/experiments/test_sparsity_emergence.py::test_study_records_resumes_and_stops_at_the_budget",
    "tests/experiments/test_granularity.py::test_study_measures_every_granularity_and_resumes",
    "tests/test_train.py::test_restore_onto_fewer_devices",
    "tests/test_export.py::test_precomputed_run_from_a_config_file_exports_loads_and_samples",
    "tests/test_cli.py::test_sigterm_saves_and_rerun_resumes",
    "tests/test_train.py::test_resume_gives_the_same_run",
    "tests/test_pipeline.py::test_trainer_resumes_the_identical_batch_sequence_and_never_compiles_after_warmup",
    "tests/test_notebook.py::test_quickstart_notebook_executes",
    "tests/test_train.py::test_loss_decreases_on_eight_devices_with_fsdp",
    "tests/experiments/test_bench_multigpu.py::test_part3_data_parallel_both_modes",
    "tests/test_context_parallel.py::test_cli_trains_with_context_parallelism",
    "tests/test_context_multiprocess.py",
]


def _slow_rank(nodeid: str) -> int:
    for i, prefix in enumerate(SLOW_FIRST):
        if nodeid == prefix or nodeid.startswith((prefix + "::", prefix + "[")):
            return i
    return len(SLOW_FIRST)


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: _slow_rank(item.nodeid))  # stable: the rest keep their order
