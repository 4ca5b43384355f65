"""Sharding of the kernels' calls (custom_partitioning): sparse attention over batch and heads, AdaLN over rows.

A kernel call is opaque to XLA's SPMD partitioner, which would gather every operand onto every device.
Batch entries and heads are independent (the dK/dV work list too), so the forward and the backward are
declared partitionable over B and H: each device runs them on its own (batch, head) shard. S and D stay
whole; splitting S is context parallelism's job (shard_map). On one device, or inside shard_map, this is
the plain call. Shared by the Triton-lowering and the Mosaic GPU kernels.

AdaLN ([B, N, C] rows) is declared partitionable over B and N: rows are independent and C stays whole,
each device runs the kernel on its own rows, and the [B, C] results (the backward's sums over N) are
summed over the mesh axes that split N.
"""

from __future__ import annotations

import inspect

import jax
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


_ROW_SPECS = {"bnc": lambda b, n: P(b, n, None), "bn": lambda b, n: P(b, n), "bc": lambda b, n: P(b, None)}


def _row_axes(sharding):
    """Mesh axes of the B and N dimensions of a [B, N, C] operand's sharding."""
    if not isinstance(sharding, NamedSharding):
        raise NotImplementedError(
            f"the fused AdaLN shards with NamedSharding (a mesh); got {sharding}. "
            "Use impl='xla' (model.adaln_impl=xla) for this sharding."
        )
    spec = (*sharding.spec, None, None)
    return spec[0], spec[1]


def partitioned_over_rows(call, operands: tuple[str, ...], results: tuple[str, ...]):
    """call(*arrays, *static) as a custom_partitioning op; operands/results are "bnc" | "bn" | "bc"."""
    n_static = len(inspect.signature(call).parameters) - len(operands)
    op = custom_partitioning(call, static_argnums=tuple(range(len(operands), len(operands) + n_static)))

    def shardings(mesh, arg_shapes):
        b, n = _row_axes(arg_shapes[0].sharding)
        named = lambda kinds: tuple(NamedSharding(mesh, _ROW_SPECS[k](b, n)) for k in kinds)
        return n, named(operands), named(results)

    def infer(*args):
        *_, mesh, arg_shapes, _ = args
        return shardings(mesh, arg_shapes)[2]

    def partition(*args):
        *static, mesh, arg_shapes, _ = args
        n, arg_shardings, result_shardings = shardings(mesh, arg_shapes)

        def per_shard(*arrays):
            outs = call(*arrays, *static)
            if n is None:
                return outs
            return tuple(jax.lax.psum(o, n) if kind == "bc" else o for o, kind in zip(outs, results))

        return mesh, per_shard, result_shardings, arg_shardings

    rule = ", ".join(" ".join(k) for k in operands) + " -> " + ", ".join(" ".join(k) for k in results)
    op.def_partition(
        partition=partition, infer_sharding_from_operands=infer, sharding_rule=rule, need_replication_factors=("c",)
    )
    return op
