"""Sharding of the sparse attention kernels over batch and heads (custom_partitioning).

A kernel call is opaque to XLA's SPMD partitioner, which would gather every operand onto every device.
Batch entries and heads are independent (the dK/dV work list too), so the forward and the backward are
declared partitionable over B and H: each device runs them on its own (batch, head) shard. S and D stay
whole; splitting S is context parallelism's job (shard_map). On one device, or inside shard_map, this is
the plain call. Shared by the Triton-lowering and the Mosaic GPU kernels.
"""

from __future__ import annotations

from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def _spec(layout: str, b, h):
    """PartitionSpec of an array whose dims are named by `layout` (e.g. "bshd"): only b and h are split."""
    return P(*(b if dim == "b" else h if dim == "h" else None for dim in layout))


def partitioned_over_batch_and_heads(call, operands: tuple[str, ...], results: tuple[str, ...]):
    """call(*arrays, static) as a custom_partitioning op. Layouts name each array's dims ("bshd",
    "bhtk", ...); the mesh axes of B and H are read from the first operand, whose layout starts "bsh"."""
    op = custom_partitioning(call, static_argnums=(len(operands),))

    def shardings(mesh, arg_shapes):
        spec = getattr(arg_shapes[0].sharding, "spec", None)  # q's: [B, S, H, D]
        b, h = (None, None) if spec is None else ((*spec, None, None, None)[0], (*spec, None, None, None)[2])
        named = lambda layouts: tuple(NamedSharding(mesh, _spec(lay, b, h)) for lay in layouts)
        out = named(results)
        return named(operands), out if len(out) > 1 else out[0]

    def infer(static, mesh, arg_shapes, result_shape):
        return shardings(mesh, arg_shapes)[1]

    def partition(static, mesh, arg_shapes, result_shape):
        arg_shardings, result_shardings = shardings(mesh, arg_shapes)
        return mesh, lambda *arrays: call(*arrays, static), result_shardings, arg_shardings

    rule = ", ".join(" ".join(lay) for lay in operands) + " -> " + ", ".join(" ".join(lay) for lay in results)
    dims = "".join(operands + results)
    whole = tuple(sorted(set(dims) - {"b", "h"}, key=dims.index))  # Shardy wants them in factor order
    op.def_partition(
        partition=partition, infer_sharding_from_operands=infer, sharding_rule=rule, need_replication_factors=whole
    )
    return op
