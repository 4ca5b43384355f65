"""Meshes, shardings and context-parallel attention (HCP, SCP, hybrid) over the mesh's `context` axis."""

from dsv_jax.parallel.context import (
    STRATEGIES,
    ContextAttention,
    ContextPlan,
    context_attention,
    select_kv_blocks,
    selective_capacity,
)
from dsv_jax.parallel.mesh import AXES, batch_sharding, data_parallel_size, make_mesh, state_shardings

__all__ = [
    "AXES",
    "make_mesh",
    "batch_sharding",
    "data_parallel_size",
    "state_shardings",
    "context_attention",
    "ContextAttention",
    "ContextPlan",
    "STRATEGIES",
    "select_kv_blocks",
    "selective_capacity",
]
