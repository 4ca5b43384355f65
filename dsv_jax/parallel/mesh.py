"""The one mesh builder and the sharding rules of parameters and batches.

Mesh axes: data (pure data parallel), fsdp (data parallel with parameters and optimizer state
sharded), context (the sequence of one sample split across devices). Batches shard their leading
axis over (data, fsdp); parameters shard one dimension over fsdp.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dsv_jax.config import ParallelConfig

AXES = ("data", "fsdp", "context")
BATCH_AXES = ("data", "fsdp")


def mesh_shape(cfg: ParallelConfig, num_devices: int) -> tuple[int, int, int]:
    sizes = [cfg.data, cfg.fsdp, cfg.context]
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if num_devices % known:
            raise ValueError(f"parallel sizes {tuple(sizes)} do not divide the {num_devices} devices")
        sizes[sizes.index(-1)] = num_devices // known
    elif known > num_devices:
        raise ValueError(f"parallel sizes {tuple(sizes)} need {known} devices, only {num_devices} present")
    return tuple(sizes)


def make_mesh(cfg: ParallelConfig, devices=None) -> Mesh:
    """Mesh over `devices` (default: all). With explicit sizes smaller than the device count, the
    first data * fsdp * context devices are used."""
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(cfg, len(devices))
    used = devices[: math.prod(shape)]
    try:  # topology-aware device order where jax knows the platform
        grid = mesh_utils.create_device_mesh(shape, devices=used)
    except (ValueError, NotImplementedError, AssertionError):
        grid = np.asarray(used).reshape(shape)
    return Mesh(grid, AXES)


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    return NamedSharding(mesh, P(BATCH_AXES, *([None] * (ndim - 1))))


def data_parallel_size(mesh: Mesh) -> int:
    return mesh.shape["data"] * mesh.shape["fsdp"]


def fsdp_spec(path: str, shape: tuple[int, ...], fsdp: int, min_size: int = 2**14) -> P:
    """Shard the largest dimension divisible by the fsdp degree (never the stacked-layer axis)."""
    if fsdp == 1 or math.prod(shape) < min_size:
        return P()
    first = 1 if "blocks" in path else 0
    dims = sorted(range(first, len(shape)), key=lambda d: -shape[d])
    for d in dims:
        if shape[d] % fsdp == 0:
            spec = [None] * len(shape)
            spec[d] = "fsdp"
            return P(*spec)
    return P()


def state_shardings(abstract_tree, mesh: Mesh):
    """NamedShardings for a pytree of parameters (or anything shaped like them, e.g. optimizer moments)."""
    fsdp = mesh.shape["fsdp"]

    def rule(path, leaf):
        shape = getattr(leaf, "shape", ())
        return NamedSharding(mesh, fsdp_spec(jax.tree_util.keystr(path), tuple(shape), fsdp))

    return jax.tree_util.tree_map_with_path(rule, abstract_tree)
