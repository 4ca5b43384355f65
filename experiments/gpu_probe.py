"""One-shot probe of the GPU machine: versions, the foundation training on the GPU, a 2.7B train step
at 16k tokens with cuDNN attention, and whether Pallas' Triton and Mosaic GPU lowerings run.

    python -m experiments.gpu_probe
"""

from __future__ import annotations

import importlib.metadata as md
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp

from dsv_jax.config import get_config
from experiments import harness
from experiments.training import time_train_step


def versions():
    out = {}
    for p in [
        "jax",
        "jaxlib",
        "flax",
        "optax",
        "orbax-checkpoint",
        "numpy",
        "scipy",
        "omegaconf",
        "grain",
        "tensorboardX",
        "tqdm",
        "imageio",
        "av",
        "triton",
        "jax-cuda13-plugin",
    ]:
        try:
            out[p] = md.version(p)
        except md.PackageNotFoundError:
            out[p] = None
    return out


def pallas_triton_add():
    from jax.experimental import pallas as pl

    def kernel(x_ref, y_ref, o_ref):
        o_ref[...] = x_ref[...] + y_ref[...]

    x = jnp.arange(1024, dtype=jnp.float32)
    o = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x, x)
    return float(jnp.abs(o - 2 * x).max())


def mosaic_attention():
    from jax.experimental.pallas.ops.gpu import attention_mgpu as am

    b, s, h, d = 1, 4096, 4, 128
    ks = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, (b, s, h, d), jnp.float16) for kk in ks)
    cfg = am.TuningConfig(block_q=64, block_kv=64, max_concurrent_steps=2)
    o = am.attention(q, k, v, cfg)
    ref = jax.nn.dot_product_attention(q, k, v)
    return harness.rel_error(o, ref)


def step_2p7b(seq_frames=16):
    """The 2.7B preset's train step at seq_frames x 64 x 64 latents (16k tokens): median of 4 steps after 2."""
    r = time_train_step(get_config("2.7b", ["text.max_len=64"]), (seq_frames, 64, 64), 4, warmup=2)
    return {
        "tokens": r["tokens"],
        "compile_s": r["compile_s"],
        "step_ms": 1e3 * r["step_s"],
        "tokens_per_s": r["tokens_per_s"],
        "loss": r["loss"],
        "peak_bytes": harness.peak_memory_bytes(),
    }


def main():
    out = os.environ.get("OUT", "/tmp")
    res = {"versions": versions()}
    print(res["versions"], flush=True)
    for name, fn in [
        ("pallas_triton_add_err", pallas_triton_add),
        ("mosaic_attention_f16_relerr", mosaic_attention),
        ("step_2p7b_16k", step_2p7b),
    ]:
        t0 = time.perf_counter()
        try:
            res[name] = fn()
        except Exception as e:
            res[name] = {"error": harness.error_text(e, trace=True)}
        print(name, round(time.perf_counter() - t0, 1), "s:", str(res[name])[:800], flush=True)
    t0 = time.perf_counter()
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "dsv_jax",
            "train",
            "--config",
            "tiny",
            "--workdir",
            "/tmp/tiny",
            "--steps",
            "60",
            "--no-progress",
            "train.sample_steps=10",
        ],
        capture_output=True,
        text=True,
    )
    res["tiny_train"] = {"rc": r.returncode, "seconds": time.perf_counter() - t0, "tail": (r.stdout + r.stderr)[-1500:]}
    print("tiny train", res["tiny_train"], flush=True)
    harness.write_results("gpu_probe", res)
    # The installed jax's Pallas sources, to read this version's API offline.
    root = os.path.dirname(jax.__file__)
    subprocess.run(
        ["tar", "czf", os.path.join(out, "pallas_src.tgz"), "-C", root, "experimental/pallas", "_src/pallas"],
        check=False,
    )


if __name__ == "__main__":
    main()
