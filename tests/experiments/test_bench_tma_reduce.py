"""experiments/bench_tma_reduce.py: its stores land where its places say (jax's GPU interpreter, which has no TMA
reduction), and its reduction kernel lowers for CUDA."""

import jax
import jax.numpy as jnp
import numpy as np

from experiments import bench_tma_reduce as bench

QUICK = {"seq": 128, "heads": 2, "ctas": 2, "per_cta": 6}


def test_store_mode_writes_every_place_in_the_gpu_interpreter():
    row = bench.run_mode("store", 16, 2, QUICK, interpret=True)
    assert row["exact"] is True and row["tiles"] == 12 and row["tile_bytes"] == 16 * 128 * 4


def test_places_cover_row_blocks_and_heads_in_range():
    places = np.asarray(bench.places_of(jax.random.key(0), 256, 4, 16, 3, 50))
    assert places.shape == (3, 50, 2)
    assert places[..., 0].min() >= 0 and places[..., 0].max() < 256 // 16
    assert places[..., 1].min() >= 0 and places[..., 1].max() < 4 and len(np.unique(places[..., 1])) > 1


def test_reduce_kernel_lowers_for_cuda():
    """The reduction (cp.reduce.async.bulk add of fp32 tiles into a Ref) lowers to one Mosaic GPU call."""
    from pallas_kernels.mgpu_common import import_plgpu

    plgpu = import_plgpu()
    kernel = bench.tile_kernel("reduce", 16, 4, 128, 2, 2, 6, False)

    def fn(tile, places):
        target = jax.new_ref(jnp.zeros((128, 2, 128), jnp.float32), memory_space=plgpu.GMEM)
        kernel(tile, places, target)
        return target[...]

    tile = jax.ShapeDtypeStruct((16, 128), jnp.float32)
    places = jax.ShapeDtypeStruct((2, 6, 2), jnp.int32)
    text = jax.jit(fn).trace(tile, places).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 1
