"""Selection of each query tile's KV blocks from low-rank projections.

A query tile's proxy is the mean of its q_lr rows. A KV block's score is the proxy's dot product with
each k_lr row of the block, reduced over the block by `block_reduce` ("mean" or "max"). The result
holds, per (batch, head, query tile), the ids of the top_k highest-scoring blocks, ascending.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def check_topk_inputs(q_lr, k_lr, top_k, q_tile, kv_block, block_reduce):
    if q_lr.ndim != 4 or k_lr.shape != q_lr.shape:
        raise ValueError(f"q_lr and k_lr must share one shape [B, S, H, r]; got {q_lr.shape}, {k_lr.shape}")
    s = q_lr.shape[1]
    if s % q_tile or s % kv_block:
        raise ValueError(f"sequence length {s} must be divisible by q_tile={q_tile} and kv_block={kv_block}")
    if not 1 <= top_k <= s // kv_block:
        raise ValueError(f"top_k={top_k} must be in 1..{s // kv_block} (the number of KV blocks)")
    if block_reduce not in ("mean", "max"):
        raise ValueError(f"block_reduce={block_reduce!r} is not 'mean' or 'max'")


def block_scores(q_lr, k_lr, *, q_tile=64, kv_block=64, block_reduce="mean", tiles=None):
    """Scores [B, H, T, S // kv_block] in fp32 (materialised: the reference's way) of every query tile
    (T = S // q_tile), or of the query tiles `tiles` (int array [T]) only."""
    b, s, h, r = q_lr.shape
    proxy = jnp.mean(q_lr.astype(jnp.float32).reshape(b, s // q_tile, q_tile, h, r), axis=2)  # [B, T, H, r]
    if tiles is not None:
        proxy = proxy[:, tiles]
    scores = jnp.einsum("bthr,bshr->bhts", proxy, k_lr.astype(jnp.float32))
    scores = scores.reshape(b, h, proxy.shape[1], s // kv_block, kv_block)
    return jnp.mean(scores, -1) if block_reduce == "mean" else jnp.max(scores, -1)


def lowrank_topk_reference(q_lr, k_lr, top_k, *, q_tile=64, kv_block=64, block_reduce="mean", impl="auto"):
    del impl
    check_topk_inputs(q_lr, k_lr, top_k, q_tile, kv_block, block_reduce)
    scores = block_scores(q_lr, k_lr, q_tile=q_tile, kv_block=kv_block, block_reduce=block_reduce)
    _, idx = jax.lax.top_k(scores, top_k)
    return jnp.sort(idx, axis=-1).astype(jnp.int32)


def lowrank_topk(q_lr, k_lr, top_k, *, q_tile=64, kv_block=64, block_reduce="mean", impl="auto"):
    """impl: "pallas" (fused select kernel; interpret mode off GPU), "xla" (the reference), or "auto":
    Pallas on a GPU, else XLA."""
    if impl not in ("auto", "pallas", "xla"):
        raise ValueError(f"impl={impl!r} is not one of 'auto', 'pallas', 'xla'")
    check_topk_inputs(q_lr, k_lr, top_k, q_tile, kv_block, block_reduce)
    on_gpu = jax.default_backend() == "gpu"
    if impl == "xla" or (impl == "auto" and not on_gpu):
        return lowrank_topk_reference(q_lr, k_lr, top_k, q_tile=q_tile, kv_block=kv_block, block_reduce=block_reduce)
    from pallas_kernels.lowrank_topk_triton import lowrank_topk_pallas  # noqa: PLC0415
    from pallas_kernels.tuning import for_device  # noqa: PLC0415

    return lowrank_topk_pallas(q_lr, k_lr, top_k, q_tile=q_tile, kv_block=kv_block, block_reduce=block_reduce,
                               tuning=for_device()[1], interpret=not on_gpu)
