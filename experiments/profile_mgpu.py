"""Run each Mosaic GPU kernel of block-sparse attention (forward, dQ, dK/dV) twice on fixed inputs, so that a
profiler wrapped around this process reads their hardware counters:

    XLA_PYTHON_CLIENT_PREALLOCATE=false ncu --clock-control none -k regex:dsv_sparse --set full \\
        python -m experiments.profile_mgpu [--seq 32768] [--sparsity 0.9] [--q-tile 128] [--kv-block 16] \
            [--options '{"fwd_stages": 2}']

(Without the preallocation switched off, ncu saves and restores jax's whole memory pool around every replay
of a kernel: minutes per kernel. The kernels are named dsv_sparse_fwd, dsv_sparse_dq, dsv_sparse_dkdv (at
--kv-block 16 or 32: dsv_sparse_dkdv_fine; where the backward is fused, as by default at 16 with --q-tile 128, one
dsv_sparse_bwd_fused instead of dQ and dK/dV), so
`-k regex:dsv_sparse` skips the XLA kernels around them.) Inputs and pieces are experiments/bench_sparse_mgpu.py's
(B=1, H=16, D=128, bf16, uniformly random blocks, full counts); everything is compiled before the
timed runs, so the profiled launches come in a fixed order. Prints each piece's faster of two wall times (under a
profiler: its replay time).
"""

from __future__ import annotations

import argparse
import json
import time

import jax

from experiments import bench_sparse_mgpu as bench


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--sparsity", type=float, default=0.9)
    parser.add_argument("--q-tile", type=int, default=bench.Q_TILE, help="query rows per selection tile (64 or 128)")
    parser.add_argument("--kv-block", type=int, default=bench.KV_BLOCK, help="keys per selected block (16, 32, 64)")
    parser.add_argument("--options", default="{}", help="JSON tuning of the Mosaic GPU path")
    parser.add_argument("--interpret", action="store_true", help="jax's GPU interpreter (a CPU smoke run)")
    args = parser.parse_args()

    options = json.loads(args.options)
    if set(bench.GEOMETRY_KEYS) & set(options):
        parser.error("--options is the kernels' tuning; the geometry is --q-tile and --kv-block")
    bench.set_geometry({"q_tile": args.q_tile, "kv_block": args.kv_block})
    q, k, v, w, index, count = bench.inputs(args.seq, args.sparsity)
    calls = bench.pieces(q, k, v, w, index, count, options, interpret=args.interpret)
    # pieces() has run the forward once; compiling the backward kernels now makes the first dsv_sparse launches
    # forward, dQ, dK/dV (or forward, fused backward): ncu -c 3 (-c 2) profiles one of each
    jax.block_until_ready([fn(*fn_args) for name, fn, fn_args, _ in calls if name in ("dq", "dkdv", "fused")])
    for name, fn, fn_args, _ in calls:
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*fn_args))
            times.append((time.perf_counter() - t0) * 1e3)
        print(f"{name}: {min(times):.2f} ms (wall, includes launch; under a profiler: replay time)", flush=True)


if __name__ == "__main__":
    main()
