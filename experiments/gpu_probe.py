"""One-shot probe of the GPU machine: versions, the foundation training on the GPU, a 2.7B train step
at 16k tokens with cuDNN attention, and whether Pallas' Triton and Mosaic GPU lowerings run."""

from __future__ import annotations

import argparse
import importlib.metadata as md
import os
import subprocess
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

from experiments import harness


def versions():
    out = {}
    for p in ["jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "scipy", "omegaconf", "grain",
              "tensorboardX", "tqdm", "imageio", "av", "triton", "jax-cuda13-plugin"]:
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
    from flax import nnx
    from dsv_jax.config import get_config
    from dsv_jax.train.step import abstract_model, init_state, make_train_step

    cfg = get_config("2.7b", ["text.max_len=64"])
    graphdef, _ = abstract_model(cfg)
    state = jax.jit(lambda: init_state(cfg))()
    step = jax.jit(make_train_step(cfg, graphdef, "auto"), donate_argnums=(0,))
    b, (t, h, w) = 1, (seq_frames, 64, 64)
    batch = {"latents": jax.random.normal(jax.random.key(0), (b, t, h, w, 16)),
             "text_ids": jnp.ones((b, 64), jnp.int32), "text_mask": jnp.ones((b, 64), bool)}
    t0 = time.perf_counter()
    compiled = step.lower(state, batch, jnp.float32(1e-4)).compile()
    compile_s = time.perf_counter() - t0
    times = []
    for i in range(6):
        t0 = time.perf_counter()
        state, m = compiled(state, batch, jnp.float32(1e-4))
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t0)
    tokens = b * t * (h // 2) * (w // 2)
    med = float(np.median(times[2:]))
    return {"tokens": tokens, "compile_s": compile_s, "step_ms": med * 1e3, "tokens_per_s": tokens / med,
            "loss": float(m["loss"]), "peak_bytes": harness.peak_memory_bytes()}


def main():
    out = os.environ.get("OUT", "/tmp")
    res = {"versions": versions()}
    print(res["versions"], flush=True)
    for name, fn in [("pallas_triton_add_err", pallas_triton_add), ("mosaic_attention_f16_relerr", mosaic_attention),
                     ("step_2p7b_16k", step_2p7b)]:
        t0 = time.perf_counter()
        try:
            res[name] = fn()
        except Exception as e:
            res[name] = {"error": f"{type(e).__name__}: {e}"[:3000], "trace": traceback.format_exc()[-3000:]}
        print(name, round(time.perf_counter() - t0, 1), "s:", str(res[name])[:800], flush=True)
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "dsv_jax", "train", "--config", "tiny", "--workdir", "/tmp/tiny",
                        "--steps", "60", "--no-progress", "train.sample_steps=10"], capture_output=True, text=True)
    res["tiny_train"] = {"rc": r.returncode, "seconds": time.perf_counter() - t0, "tail": (r.stdout + r.stderr)[-1500:]}
    print("tiny train", res["tiny_train"], flush=True)
    harness.write_results("gpu_probe", res)
    # The installed jax's Pallas sources, to read this version's API offline.
    root = os.path.dirname(jax.__file__)
    subprocess.run(["tar", "czf", os.path.join(out, "pallas_src.tgz"), "-C", root, "experimental/pallas",
                    "_src/pallas"], check=False)


if __name__ == "__main__":
    main()
