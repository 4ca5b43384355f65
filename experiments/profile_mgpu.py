"""Run each Mosaic GPU kernel of block-sparse attention (forward, dQ, dK/dV) twice on fixed inputs, so that a
profiler wrapped around this process reads their hardware counters:

    XLA_PYTHON_CLIENT_PREALLOCATE=false ncu --clock-control none -k regex:dsv_sparse --set full \\
        python -m experiments.profile_mgpu [--seq 32768] [--sparsity 0.9] [--options '{"fwd_stages": 2}']

(Without the preallocation switched off, ncu saves and restores jax's whole memory pool around every replay
of a kernel: minutes per kernel. The kernels are named dsv_sparse_fwd, dsv_sparse_dq, dsv_sparse_dkdv.)

The inputs are made on the host (numpy) and copied over, and the index is sanitized and transposed
beforehand, so the kernels launched are the three Mosaic GPU kernels in that order (each twice), plus the
einsum for delta. Shapes as experiments/bench_sparse_mgpu.py (B=1, H=16, D=128, bf16, kv_block 64, q_tile
--q-tile (64), uniformly random blocks, full counts). Prints each kernel's faster of two wall times (under a
profiler: its replay time).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.bench_sparse_mgpu import HEAD_DIM, HEADS, KV_BLOCK, Q_TILE


def host_inputs(seq, sparsity, q_tile=Q_TILE, seed=0):
    """q, k, v, w (bf16 normal) and a uniformly random full-count selection, made with numpy."""
    rng = np.random.default_rng(seed)
    x = lambda: jnp.asarray(rng.standard_normal((1, seq, HEADS, HEAD_DIM), np.float32), jnp.bfloat16)
    tiles, blocks = seq // q_tile, seq // KV_BLOCK
    keep = round((1.0 - sparsity) * blocks)
    ids = np.sort(np.argsort(rng.random((1, HEADS, tiles, blocks)), axis=-1)[..., :keep], axis=-1)
    return x(), x(), x(), x(), jnp.asarray(ids, jnp.int32), jnp.full((1, HEADS, tiles), keep, jnp.int32)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--sparsity", type=float, default=0.9)
    parser.add_argument("--q-tile", type=int, default=Q_TILE, help="query rows per selection tile (64 or 128)")
    parser.add_argument("--options", default="{}", help="JSON tuning of the Mosaic GPU path")
    parser.add_argument("--interpret", action="store_true", help="jax's GPU interpreter (a CPU smoke run)")
    args = parser.parse_args()

    from pallas_kernels import sparse_attention_mgpu as mgpu
    from pallas_kernels import sparse_attention_mgpu_bwd as bwd
    from pallas_kernels import sparse_attention_mgpu_fwd as fwd
    from pallas_kernels.sparse_index import dkdv_worklist, sanitize_index

    options = json.loads(args.options)
    if {"q_tile", "kv_block"} & set(options):
        parser.error("--options is the kernels' tuning; the geometry is --q-tile (kv_block is 64)")
    q, k, v, w, index, count = host_inputs(args.seq, args.sparsity, args.q_tile)
    cfg = dataclasses.replace(mgpu.default_config(args.q_tile, KV_BLOCK, HEAD_DIM, HEAD_DIM ** -0.5,
                                                  interpret=args.interpret), **options)
    index, count = jax.block_until_ready(sanitize_index(index, count, args.seq // KV_BLOCK))
    order, starts, _, per_tile = dkdv_worklist(index, count, kv_block=KV_BLOCK, rows=cfg.dkdv_rows,
                                               seq_len=args.seq)
    tiles = jax.block_until_ready(order // per_tile)
    forward = jax.jit(lambda q, k, v: fwd.forward(q, k, v, index, count, None, cfg))
    dq = jax.jit(lambda q, k, v, w, lse2, delta: bwd.dq(q, k, v, w, lse2, delta, index, count, None, cfg))
    dkdv = jax.jit(lambda q, k, v, w, lse2, delta: bwd.dkdv(q, k, v, w, lse2, delta, tiles, starts, None, cfg))
    # Compile everything first, so that the profiled launches come in a fixed order.
    o, lse2 = jax.block_until_ready(forward(q, k, v))
    delta = jax.block_until_ready(jnp.einsum("bshd,bshd->bhs", o.astype(jnp.float32), w.astype(jnp.float32)))
    args6 = (q, k, v, w, lse2, delta)
    jax.block_until_ready((dq(*args6), dkdv(*args6)))
    for name, fn, fn_args in [("fwd", forward, (q, k, v)), ("dq", dq, args6), ("dkdv", dkdv, args6)]:
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*fn_args))
            times.append((time.perf_counter() - t0) * 1e3)
        print(f"{name}: {min(times):.2f} ms (wall, includes launch; under a profiler: replay time)", flush=True)


if __name__ == "__main__":
    main()
