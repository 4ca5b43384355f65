"""How fast Hopper's TMA adds tiles into global memory (cp.reduce.async.bulk.tensor .add.f32), against TMA
loads and stores of the same tiles: the rate that decides whether a backward can reduce-add dK/dV partials per
query tile instead of re-reading Q and dO per KV block (docs/kernels/mgpu_notes.md, "Fine KV blocks").

    python -m experiments.bench_tma_reduce            # GPU, ~1 min
    python -m experiments.bench_tma_reduce --quick    # GPU interpreter on the CPU: store and load (no TMA reduction)

Each CTA (one warpgroup) takes `per_cta` tiles of [rows, heads of 1, 128] at random row blocks and heads of an
[S, H, 128] array (the layout of dK / dV), and either
  reduce   adds its fp32 SMEM tile into them (the array starts at zero; the sums are checked exactly: every tile
           adds small integers),
  store    overwrites them with it (fp32),
  load     reads them into SMEM (bf16 [rows, 128], as the dK/dV kernels stream Q and dO),
keeping at most `depth` copies in flight. Places spread over all heads (512 MB of fp32 at S = 64k, H = 16: most
miss L2) or over one head (32 MB, as the attention kernels' resident CTAs share a head). Reports GB/s of tile bytes
per mode, spread and tile shape.
Results: experiments/results/bench_tma_reduce.json.
"""

from __future__ import annotations

import experiments.quick_cpu  # noqa: F401 (first: --quick puts jax on the CPU before it starts)

# isort: split

import argparse
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from experiments import harness
from pallas_kernels.mgpu_common import gpu_interpreter, import_plgpu

SIZES = {
    "gpu": {
        "seq": 65536,
        "heads": 16,
        "ctas": 132 * 4,
        "per_cta": 2048,
        "rows": (16, 64),
        "depth": (8,),
        "modes": ("reduce", "store", "load"),
        "spreads": ("all_heads", "one_head"),
    },
    # the GPU interpreter has no TMA reduction
    "quick": {
        "seq": 256,
        "heads": 2,
        "ctas": 2,
        "per_cta": 8,
        "rows": (16,),
        "depth": (2,),
        "modes": ("store", "load"),
    },
}
HEAD_DIM = 128


@functools.cache
def tile_kernel(mode: str, rows: int, depth: int, seq: int, heads: int, ctas: int, per_cta: int, interpret: bool):
    """fn(tile, places, target) running `mode` over the tiles places[c, i] = (row block, head) of CTA c.
    target [S, H, D] is a jax Ref (load: each CTA writes its last tile back to rows 0.. of head 0)."""
    plgpu = import_plgpu()
    dtype = jnp.bfloat16 if mode == "load" else jnp.float32

    def body(tile_ref, places_ref, target_ref, smem, ready):
        c = lax.axis_index("c")
        plgpu.copy_gmem_to_smem(tile_ref, smem, ready)
        plgpu.barrier_wait(ready)

        def step(i, _):
            block, head = places_ref[c, i, 0], places_ref[c, i, 1]
            place = target_ref.at[pl.ds(block * rows, rows), head]
            if mode == "load":
                plgpu.copy_gmem_to_smem(place, smem, ready)
                plgpu.barrier_wait(ready)  # one load in flight per CTA; `depth` CTAs per SM overlap them
            else:
                plgpu.copy_smem_to_gmem(smem, place, reduction_op="add" if mode == "reduce" else None)
                plgpu.wait_smem_to_gmem(depth, wait_read_only=True)
            return ()

        lax.fori_loop(0, per_cta, step, ())
        if mode == "load":  # one write, so that the kernel has an effect and XLA keeps it
            plgpu.copy_smem_to_gmem(smem, target_ref.at[pl.ds(0, rows), 0])
        plgpu.wait_smem_to_gmem(0)

    def kernel(tile_ref, places_ref, target_ref):
        pl.run_scoped(
            lambda smem, ready: body(tile_ref, places_ref, target_ref, smem, ready),
            plgpu.SMEM((rows, HEAD_DIM), dtype),
            plgpu.Barrier(num_arrivals=1),
        )

    mesh = plgpu.Mesh(grid=(ctas,), grid_names=("c",))
    # pl.kernel, not plgpu.kernel: jax 0.10's plgpu.kernel rejects a Ref operand (its vmap wrapper)
    call = pl.kernel(kernel, out_type=(), mesh=mesh, interpret=gpu_interpreter() if interpret else False)
    return call


def places_of(key, seq, heads, rows, ctas, per_cta, spread="all_heads"):
    """[ctas, per_cta, 2] (row block, head) places, uniformly random; spread "one_head": all in head 0 (the
    resident CTAs of the attention kernels share one head: a 64k x 128 fp32 array per head is 32 MB, against the
    H200's 50 MB of L2)."""
    blocks = jax.random.randint(key, (ctas, per_cta), 0, seq // rows, jnp.int32)
    head = jax.random.randint(jax.random.fold_in(key, 1), (ctas, per_cta), 0, heads, jnp.int32)
    if spread == "one_head":
        head = jnp.zeros_like(head)
    return jnp.stack([blocks, head], axis=-1)


def run_mode(mode, rows, depth, z, interpret, spread="all_heads"):
    seq, heads, ctas, per_cta = z["seq"], z["heads"], z["ctas"], z["per_cta"]
    plgpu = import_plgpu()
    kernel = tile_kernel(mode, rows, depth, seq, heads, ctas, per_cta, interpret)
    key = jax.random.key(rows * 131 + depth)
    places = places_of(key, seq, heads, rows, ctas, per_cta, spread)
    dtype = jnp.bfloat16 if mode == "load" else jnp.float32
    # small integers: every sum of them is exact in fp32, whatever the order of the adds
    tile = jax.random.randint(jax.random.fold_in(key, 2), (rows, HEAD_DIM), -4, 5).astype(dtype)

    if mode == "load":
        source = jax.random.normal(jax.random.fold_in(key, 3), (seq, heads, HEAD_DIM), dtype)

        def fn(tile, places, source):
            ref = jax.new_ref(source, memory_space=plgpu.GMEM)
            kernel(tile, places, ref)
            return ref[0, 0, 0]

        fn = jax.jit(fn)
        args = (tile, places, source)
        check = None
    else:

        def fn(tile, places):
            target = jax.new_ref(jnp.zeros((seq, heads, HEAD_DIM), jnp.float32), memory_space=plgpu.GMEM)
            kernel(tile, places, target)
            return target[...]

        fn = jax.jit(fn)
        args = (tile, places)
        out = np.asarray(fn(*args))
        p = np.asarray(places).reshape(-1, 2)
        hits = np.zeros((seq // rows, heads), np.int64)
        np.add.at(hits, (p[:, 0], p[:, 1]), 1)
        t = np.asarray(tile, np.float64)
        if mode == "reduce":
            want = hits[:, None, :, None] * t[None, :, None, :]
        else:
            want = (hits > 0)[:, None, :, None] * t[None, :, None, :]
        want = want.reshape(seq, heads, HEAD_DIM)
        check = bool(np.array_equal(out, want))
    timing = harness.time_fn(fn, *args, min_ms=50.0)
    tile_bytes = rows * HEAD_DIM * jnp.dtype(dtype).itemsize
    total = tile_bytes * ctas * per_cta
    return {
        "mode": mode,
        "spread": spread,
        "rows": rows,
        "depth": depth,
        "dtype": jnp.dtype(dtype).name,
        "tile_bytes": tile_bytes,
        "tiles": ctas * per_cta,
        "exact": check,
        "median_ms": timing["median_ms"],
        "spread_pct": timing["spread_pct"],
        "gb_per_s": total / (timing["median_ms"] * 1e-3) / 1e9,
    }


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="jax's GPU interpreter on the CPU, tiny sizes")
    args = p.parse_args()
    if not args.quick and not harness.on_gpu():
        sys.exit("bench_tma_reduce.py measures the GPU; use --quick on a CPU")
    t0 = time.perf_counter()
    z = SIZES["quick" if args.quick else "gpu"]
    rows = []
    for spread in z["spreads"]:
        for r in z["rows"]:
            for depth in z["depth"]:
                for mode in z["modes"]:
                    try:
                        rows.append(run_mode(mode, r, depth, z, args.quick, spread))
                    except Exception as e:  # one mode's failure must not cost the others
                        rows.append({"mode": mode, "spread": spread, "rows": r, "error": harness.error_text(e)})
    for r in rows:
        if "error" in r:
            print(f"{r['mode']} rows={r['rows']}: {r['error']}")
    harness.print_table(
        [r for r in rows if "error" not in r],
        ["mode", "spread", "rows", "depth", "dtype", "tile_bytes", "exact", "median_ms", "spread_pct", "gb_per_s"],
    )
    harness.write_results(
        "bench_tma_reduce" + ("_quick" if args.quick else ""),
        {
            "seq": z["seq"],
            "heads": z["heads"],
            "head_dim": HEAD_DIM,
            "ctas": z["ctas"],
            "tiles_per_cta": z["per_cta"],
            "copy_tbps": None if args.quick else harness.copy_bandwidth_tbps(),
            "rows": rows,
            "wall_s": time.perf_counter() - t0,
        },
    )


if __name__ == "__main__":
    main()
