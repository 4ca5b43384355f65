"""Meshes, shardings and (with the context axis) context-parallel attention."""

from dsv_jax.parallel.mesh import AXES, batch_sharding, data_parallel_size, make_mesh, state_shardings

__all__ = ["AXES", "make_mesh", "batch_sharding", "data_parallel_size", "state_shardings"]
