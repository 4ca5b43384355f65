"""Selection of each query tile's KV blocks from low-rank projections: the public entry point.

The definition (proxies, block scores, padded layouts) and the helpers dsv_jax shares are the
reference's, `pallas_kernels.lowrank_topk_reference`, whose names are re-exported here; `impl` picks the
Pallas kernel (pallas_kernels.lowrank_topk_triton) or the reference.
"""

from __future__ import annotations

import jax

from pallas_kernels.defaults import KV_BLOCK, Q_TILE
from pallas_kernels.lowering import log_fallback, triton_missing
from pallas_kernels.lowrank_topk_reference import (
    block_mean_keys,
    block_scores,
    check_topk_inputs,
    lowrank_topk_reference,
    reduce_block,
    row_flags,
    tile_proxies,
)
from pallas_kernels.tuning import for_device

__all__ = [
    "block_mean_keys",
    "block_scores",
    "check_topk_inputs",
    "lowrank_topk",
    "lowrank_topk_reference",
    "reduce_block",
    "row_flags",
    "tile_proxies",
]


def lowrank_topk(
    q_lr, k_lr, top_k, *, q_tile=Q_TILE, kv_block=KV_BLOCK, block_reduce="mean", kv_valid=None, impl="auto"
):
    """impl: "pallas" (fused select kernel; interpret mode off GPU), "xla" (the reference), or "auto":
    Pallas on a GPU, else XLA. Returns int32 [B, H, S // q_tile, top_k], ascending per row."""
    if impl not in ("auto", "pallas", "xla"):
        raise ValueError(f"impl={impl!r} is not one of 'auto', 'pallas', 'xla'")
    check_topk_inputs(q_lr, k_lr, top_k, q_tile, kv_block, block_reduce, kv_valid)
    on_gpu = jax.default_backend() == "gpu"
    missing = triton_missing() if impl != "xla" else None
    if missing and impl == "pallas":
        raise ValueError(f"lowrank_topk(impl='pallas') needs the Pallas Triton lowering: {missing}")
    if missing and on_gpu:
        log_fallback("lowrank_topk", "XLA reference", missing)
    if impl == "xla" or (impl == "auto" and not on_gpu) or missing:
        return lowrank_topk_reference(
            q_lr, k_lr, top_k, q_tile=q_tile, kv_block=kv_block, block_reduce=block_reduce, kv_valid=kv_valid
        )
    from pallas_kernels.lowrank_topk_triton import lowrank_topk_pallas  # imports Pallas' Triton lowering

    return lowrank_topk_pallas(
        q_lr,
        k_lr,
        top_k,
        q_tile=q_tile,
        kv_block=kv_block,
        block_reduce=block_reduce,
        tuning=for_device()[1],
        interpret=not on_gpu,
        kv_valid=kv_valid,
    )
