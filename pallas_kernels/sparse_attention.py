"""Block-sparse attention: each query tile attends only to the KV blocks it selected.

    o[tile] = softmax(q[tile] k[sel]^T * sm_scale) v[sel],   sel = blocks kv_index[b, h, tile, :kv_count[b, h, tile]]

q, k, v [B, S, H, D] in tile-major token order; query tiles are q_tile consecutive tokens, KV blocks
kv_block consecutive tokens (kv_block = 1 selects single tokens). Entries of kv_index at positions
>= kv_count are ignored whatever they hold.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def check_sparse_inputs(q, k, v, kv_index, kv_count, q_tile, kv_block):
    if q.ndim != 4 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q, k, v must share one shape [B, S, H, D]; got {q.shape}, {k.shape}, {v.shape}")
    b, s, h, _ = q.shape
    if s % q_tile or s % kv_block:
        raise ValueError(f"sequence length {s} must be divisible by q_tile={q_tile} and kv_block={kv_block}")
    tiles = s // q_tile
    if kv_index.ndim != 4 or kv_index.shape[:3] != (b, h, tiles):
        raise ValueError(f"kv_index must be [B, H, S // q_tile, K] = [{b}, {h}, {tiles}, K]; got {kv_index.shape}")
    if kv_count.shape != (b, h, tiles):
        raise ValueError(f"kv_count must be [B, H, S // q_tile] = [{b}, {h}, {tiles}]; got {kv_count.shape}")
    if not (jnp.issubdtype(kv_index.dtype, jnp.integer) and jnp.issubdtype(kv_count.dtype, jnp.integer)):
        raise ValueError(f"kv_index and kv_count must be integers; got {kv_index.dtype}, {kv_count.dtype}")


def sparse_attention_reference(q, k, v, kv_index, kv_count, *, q_tile=64, kv_block=64, sm_scale=None, impl="auto"):
    """Plain JAX, one query tile at a time (lax.map), so memory is O(S * K * kv_block), never [S, S]."""
    del impl
    check_sparse_inputs(q, k, v, kv_index, kv_count, q_tile, kv_block)
    b, s, h, d = q.shape
    n_sel = kv_index.shape[-1]
    scale = d ** -0.5 if sm_scale is None else sm_scale
    k_blocks = k.reshape(b, s // kv_block, kv_block, h, d).transpose(0, 3, 1, 2, 4)  # [B, H, nb, kvb, D]
    v_blocks = v.reshape(b, s // kv_block, kv_block, h, d).transpose(0, 3, 1, 2, 4)
    q_tiles = q.reshape(b, s // q_tile, q_tile, h, d).transpose(1, 0, 3, 2, 4)  # [T, B, H, qt, D]

    def one_tile(args):
        q_t, idx, count = args  # [B, H, qt, D], [B, H, K], [B, H]
        valid = jnp.arange(n_sel)[None, None] < count[..., None]  # [B, H, K]
        idx = jnp.where(valid, idx, 0)
        ks = jnp.take_along_axis(k_blocks, idx[..., None, None], axis=2)  # [B, H, K, kvb, D]
        vs = jnp.take_along_axis(v_blocks, idx[..., None, None], axis=2)
        logits = jnp.einsum("bhqd,bhkjd->bhqkj", q_t, ks, preferred_element_type=jnp.float32) * scale
        logits = jnp.where(valid[:, :, None, :, None], logits, -jnp.inf)
        p = jax.nn.softmax(logits.reshape(*logits.shape[:3], -1), axis=-1).reshape(logits.shape)
        return jnp.einsum("bhqkj,bhkjd->bhqd", p.astype(v.dtype), vs, preferred_element_type=jnp.float32)

    out = jax.lax.map(one_tile, (q_tiles, kv_index.transpose(2, 0, 1, 3), kv_count.transpose(2, 0, 1)))
    return out.transpose(1, 0, 3, 2, 4).reshape(b, s, h, d).astype(q.dtype)


def sparse_attention(q, k, v, kv_index, kv_count, *, q_tile=64, kv_block=64, sm_scale=None, impl="auto"):
    """impl: "pallas" (the Pallas kernels; interpret mode off GPU), "xla" (the reference), or "auto":
    Pallas on a GPU when the geometry is supported (power-of-two q_tile in 16..128 and kv_block; one dtype
    for q, k, v), else XLA. The Pallas path assumes the live ids of a tile are distinct (as selections are)."""
    if impl not in ("auto", "pallas", "xla"):
        raise ValueError(f"impl={impl!r} is not one of 'auto', 'pallas', 'xla'")
    check_sparse_inputs(q, k, v, kv_index, kv_count, q_tile, kv_block)
    from pallas_kernels import sparse_attention_triton as triton_path  # noqa: PLC0415 (keeps import light)
    from pallas_kernels.tuning import for_device  # noqa: PLC0415

    on_gpu = jax.default_backend() == "gpu"
    if impl == "auto":
        same_dtype = q.dtype == k.dtype == v.dtype
        impl = "pallas" if on_gpu and same_dtype and triton_path.supported(q_tile, kv_block) is None else "xla"
    if impl == "xla":
        return sparse_attention_reference(q, k, v, kv_index, kv_count, q_tile=q_tile, kv_block=kv_block,
                                          sm_scale=sm_scale)
    scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    if on_gpu:
        from pallas_kernels import sparse_attention_mgpu  # noqa: PLC0415

        if sparse_attention_mgpu.verified(q, q_tile, kv_block):  # opt-in: sparse_attention_mgpu.verify()
            return sparse_attention_mgpu.sparse_attention_mgpu(q, k, v, kv_index, kv_count, q_tile=q_tile,
                                                               kv_block=kv_block, sm_scale=scale)
    return triton_path.sparse_attention_pallas(q, k, v, kv_index, kv_count, q_tile=q_tile, kv_block=kv_block,
                                               sm_scale=scale, tuning=for_device()[0], interpret=not on_gpu)
