"""Shared measuring code of the benchmark scripts: timing, bandwidth, memory, results files.

Method (see experiments/results/RESULTS.md): warm up, block on results, median of several runs on
fresh random data, correctness against the reference before timing, FLOPs/bytes against ceilings.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

# Ceilings measured on the H200 (DESIGN.md); benchmarks also measure their own copy bandwidth.
H200_BF16_TFLOPS = 659.0  # bf16 matmul 8192^3
H200_COPY_TBPS = 2.8  # elementwise copy, read + write


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def device_info() -> dict[str, Any]:
    d = jax.devices()[0]
    return {"jax": jax.__version__, "backend": jax.default_backend(), "device": d.device_kind,
            "device_count": jax.device_count(), "python": platform.python_version()}


def block(x):
    return jax.block_until_ready(x)


def time_fn(fn: Callable, *args, warmup: int = 2, iters: int = 10, make_args: Callable | None = None) -> dict:
    """Median / min / max wall time (ms) of fn(*args), blocking on the result each run.

    make_args(i), if given, supplies fresh inputs for run i (generated outside the timed region)."""
    for i in range(warmup):
        block(fn(*(make_args(i) if make_args else args)))
    times = []
    for i in range(iters):
        a = make_args(warmup + i) if make_args else args
        block(a)
        t0 = time.perf_counter()
        block(fn(*a))
        times.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times),
            "spread_pct": 100.0 * (max(times) - min(times)) / statistics.median(times), "runs": iters}


def copy_bandwidth_tbps(n_bytes: int = 2 << 30) -> float:
    """Achieved read+write bandwidth of an elementwise copy-like op (x + 1) over n_bytes of bf16."""
    x = jax.random.normal(jax.random.key(0), (n_bytes // 2,), jnp.bfloat16)
    f = jax.jit(lambda a: a + jnp.bfloat16(1))
    t = time_fn(f, x, warmup=2, iters=10)["median_ms"]
    return 2 * n_bytes / (t * 1e-3) / 1e12


def compiled_memory(fn: Callable, *args) -> dict[str, int]:
    """Compiled memory analysis of jit(fn)(*args): temp (activations), argument and output bytes."""
    m = jax.jit(fn).lower(*args).compile().memory_analysis()
    if m is None:
        return {}
    return {"temp_bytes": int(m.temp_size_in_bytes), "argument_bytes": int(m.argument_size_in_bytes),
            "output_bytes": int(m.output_size_in_bytes)}


def peak_memory_bytes() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def rel_error(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def write_results(name: str, payload: dict[str, Any], directory: str | None = None) -> str:
    """Write experiments/results/<name>.json (or <directory>/<name>.json), and a copy into $OUT if set."""
    directory = directory or RESULTS_DIR
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{name}.json")
    out_dir = os.environ.get("OUT")  # the device tool brings $OUT back
    payload = {"name": name, "env": device_info(), "time": time.strftime("%Y-%m-%d %H:%M:%S"), **payload}
    text = json.dumps(payload, indent=2, default=float)
    with open(path, "w") as f:
        f.write(text)
    if out_dir:
        with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
            f.write(text)
    return path


def print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    def fmt(v):
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    widths = {c: max(len(c), *(len(fmt(r.get(c, ""))) for r in rows)) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(fmt(r.get(c, "")).ljust(widths[c]) for c in columns))


# -- the training setup of the quality and sparsity studies (one place for both) ------------------------
# quality_parity.py (issue 4: moving shapes; issue 17: photos) and sparsity_emergence.py train on one
# bucket of the embedded data at a given number of tokens per sample, patch 1x2x2, from the tiny preset.

# latent (T, H, W) of the bucket with this many tokens per sample at patch 1x2x2 (the first two: --quick)
STUDY_SHAPES = {256: (4, 16, 16), 512: (4, 16, 32), 16384: (16, 64, 64), 32768: (16, 64, 128),
                65536: (16, 128, 128)}
STUDY_MODELS = {
    # issue 4's quality-parity model: 4 blocks of 4 heads x 64 (hidden 256)
    "shapes": ["model.hidden=256", "model.heads=4", "model.depth=4", "model.text_dim=64"],
    # issue 17's model on photos: 8 blocks of 12 heads x 64 (hidden 768), 109M parameters
    "photos": ["model.hidden=768", "model.heads=12", "model.depth=8", "model.text_dim=256", "text.max_len=20"],
}
QUICK_MODEL = ["model.hidden=32", "model.heads=2", "model.depth=2", "model.text_dim=16", "text.hash_buckets=8",
               "model.remat=false"]


def study_overrides(setup: str, tokens: int, *, quick: bool, tokens_per_batch: int | None = None) -> list[str]:
    """Model and data overrides of a study `setup` ("shapes" | "photos") at one bucket of `tokens` tokens per
    sample, with tokens_per_batch (default 2 x tokens: two samples a step) under equal-token batching."""
    if setup not in STUDY_MODELS:
        raise ValueError(f"unknown setup {setup!r}: choose from {sorted(STUDY_MODELS)}")
    if tokens not in STUDY_SHAPES:
        raise ValueError(f"no study shape for {tokens} tokens per sample: choose from {sorted(STUDY_SHAPES)}")
    t, h, w = STUDY_SHAPES[tokens]
    if quick:
        model = QUICK_MODEL + ["model.tile=[2,4,4]", f"text.max_len={20 if setup == 'photos' else 8}"]
    else:
        model = STUDY_MODELS[setup] + ["model.tile=[4,4,4]"]  # 64-token 3D tiles: the kernels' KV block
    source = "photos" if setup == "photos" else "synthetic"
    return model + ["model.patch=[1,2,2]", f"data.source={source}", f"data.buckets=[[{t},{h},{w}]]",
                    "data.bucket_weights=[1]", f"data.tokens_per_batch={tokens_per_batch or 2 * tokens}"]
