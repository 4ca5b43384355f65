"""Block-sparse attention, the definition: input checks, the plain-JAX reference (forward and backward) and
the helpers its Pallas implementations share. Each query tile attends only to the KV blocks it selected:

    o[tile] = softmax(q[tile] k[sel]^T * sm_scale) v[sel],   sel = blocks kv_index[b, h, tile, :kv_count[b, h, tile]]

q, k, v [B, S, H, D] in tile-major token order; query tiles are q_tile consecutive tokens, KV blocks
kv_block consecutive tokens (kv_block = 1 selects single tokens). Entries of kv_index at positions
>= kv_count are ignored whatever they hold.

Padded layouts: kv_valid (optional, int32 [B, S // kv_block]) is the number of valid keys of each KV
block, 0..kv_block; the valid keys of a block are its first kv_valid rows (the token layout puts each
tile's real tokens first), the others are never attended (at kv_block = 1 the entries are 0 or 1). A
selection may hold fully masked blocks; they add nothing. A query row whose selected keys are all masked
(or kv_count = 0) attends to nothing: o = 0, lse = -inf, zero gradients. Query rows that are padding are
computed like any other (finite); the caller drops them.

return_lse: also return lse [B, H, S] fp32, the natural-log log-sum-exp of each query's selected valid
logits (times sm_scale), so partial results over disjoint key sets merge exactly
(`dsv_jax.attention.merge_attention`). The gradient takes a cotangent for lse: d lse_i / d s_ij = p_ij.

sparse_attention_backward: the gradients of one key set's share of a larger attention whose softmax
statistics are given, for callers that merge partial results themselves (the ring of context
parallelism) and hand-write the backward. With o, lse the merged output and log-sum-exp (lse = -inf
for a row that sees no key anywhere) and do, dlse their cotangents, over this call's selected valid keys:

    p_ij = exp(s_ij - lse_i),  delta_i = rowsum(do_i * o_i) - dlse_i,
    dv = p^T do,  ds = p * (do v^T - delta) * sm_scale,  dq = ds k,  dk = ds^T q.

Summed over disjoint key sets that make up the merged attention, these are its gradients; with (o, lse)
this call's own outputs, they are the VJP of sparse_attention(..., return_lse=True).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from pallas_kernels.defaults import KV_BLOCK, Q_TILE

# The custom VJPs name the forward's output and softmax statistics, the residuals their backward reads
# besides q, k, v and the index, so that a jax.checkpoint policy can keep them for the backward instead
# of running the forward kernel a second time (dsv_jax.model.attention.remat_policy(keep_attention=True)).
RESIDUAL_NAME = "sparse_attention_residuals"


def name_residuals(o, lse):
    """A forward's (o, lse) tagged with RESIDUAL_NAME (visible to checkpoint policies), to be used as both its
    output and its VJP's residuals (the layers after attention need o in their backward too).

    Behind an optimization barrier: when a policy kept them (a scanned model stores them into its stack of
    residuals), XLA on GPU (jax 0.11.2) compiled the kernel's custom call twice, one copy inside a
    dynamic-slice fusion; with the barrier it runs once (experiments/remat_programs.py)."""
    o, lse = jax.lax.optimization_barrier((o, lse))
    return checkpoint_name(o, RESIDUAL_NAME), checkpoint_name(lse, RESIDUAL_NAME)


def check_sparse_inputs(q, k, v, kv_index, kv_count, q_tile, kv_block, kv_valid=None):
    """A ValueError naming the argument, its shape and the one expected, before any work."""
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
    if kv_valid is not None:
        if kv_valid.shape != (b, s // kv_block):
            raise ValueError(f"kv_valid must be [B, S // kv_block] = [{b}, {s // kv_block}]; got {kv_valid.shape}")
        if not jnp.issubdtype(kv_valid.dtype, jnp.integer):
            raise ValueError(f"kv_valid must be integers (valid keys per KV block); got {kv_valid.dtype}")


def check_statistics(q, o, lse, do, dlse):
    """The merged statistics and cotangents that sparse_attention_backward takes, checked against q."""
    b, s, h, _ = q.shape
    if o.shape != q.shape or do.shape != q.shape:
        raise ValueError(f"o and do must be [B, S, H, D] = {q.shape}; got {o.shape}, {do.shape}")
    if lse.shape != (b, h, s) or (dlse is not None and dlse.shape != (b, h, s)):
        raise ValueError(
            f"lse and dlse must be [B, H, S] = {(b, h, s)}; got {lse.shape}, {None if dlse is None else dlse.shape}"
        )


def masked_softmax_attend(logits, values):
    """softmax(logits) @ values [..., q, D] (fp32) and the natural-log lse [..., q] of logits [..., q, n]
    (fp32, -inf where masked); values [..., n, D] in its own dtype. A row with every logit masked gives
    o = 0, lse = -inf and zero gradients (no NaN: exp only sees finite differences or -inf)."""
    m = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    m = jnp.where(m == -jnp.inf, 0.0, m)
    e = jnp.exp(logits - m)
    l = jnp.sum(e, axis=-1, keepdims=True)
    some = l > 0.0
    l_safe = jnp.where(some, l, 1.0)
    p = e / l_safe
    o = jnp.einsum("...qn,...nd->...qd", p.astype(values.dtype), values, preferred_element_type=jnp.float32)
    lse = jnp.where(some, m + jnp.log(l_safe), -jnp.inf)[..., 0]
    return o, lse


def sparse_attention_reference(
    q,
    k,
    v,
    kv_index,
    kv_count,
    *,
    q_tile=Q_TILE,
    kv_block=KV_BLOCK,
    sm_scale=None,
    kv_valid=None,
    return_lse=False,
    impl="auto",
):
    """Plain JAX, one query tile at a time (lax.map), so memory is O(S * K * kv_block), never [S, S]."""
    del impl
    check_sparse_inputs(q, k, v, kv_index, kv_count, q_tile, kv_block, kv_valid)
    b, s, h, d = q.shape
    n_sel = kv_index.shape[-1]
    scale = d**-0.5 if sm_scale is None else sm_scale
    k_blocks = k.reshape(b, s // kv_block, kv_block, h, d).transpose(0, 3, 1, 2, 4)  # [B, H, nb, kvb, D]
    v_blocks = v.reshape(b, s // kv_block, kv_block, h, d).transpose(0, 3, 1, 2, 4)
    q_tiles = q.reshape(b, s // q_tile, q_tile, h, d).transpose(1, 0, 3, 2, 4)  # [T, B, H, qt, D]
    if kv_valid is not None:
        kv_valid = jnp.broadcast_to(jnp.clip(kv_valid.astype(jnp.int32), 0, kv_block)[:, None], (b, h, s // kv_block))

    def one_tile(args):
        q_t, idx, count = args  # [B, H, qt, D], [B, H, K], [B, H]
        live = jnp.arange(n_sel)[None, None] < count[..., None]  # [B, H, K]
        idx = jnp.where(live, idx, 0)
        ks = jnp.take_along_axis(k_blocks, idx[..., None, None], axis=2)  # [B, H, K, kvb, D]
        vs = jnp.take_along_axis(v_blocks, idx[..., None, None], axis=2)
        keep = jnp.broadcast_to(live[..., None], (*live.shape, kv_block))  # [B, H, K, kvb]
        if kv_valid is not None:
            n_valid = jnp.take_along_axis(kv_valid, idx, axis=-1)  # [B, H, K]
            keep = keep & (jnp.arange(kv_block) < n_valid[..., None])
        logits = jnp.einsum("bhqd,bhkjd->bhqkj", q_t, ks, preferred_element_type=jnp.float32) * scale
        logits = jnp.where(keep[:, :, None], logits, -jnp.inf).reshape(*logits.shape[:3], n_sel * kv_block)
        return masked_softmax_attend(logits, vs.reshape(b, h, n_sel * kv_block, d))

    out, lse = jax.lax.map(one_tile, (q_tiles, kv_index.transpose(2, 0, 1, 3), kv_count.transpose(2, 0, 1)))
    out = out.transpose(1, 0, 3, 2, 4).reshape(b, s, h, d).astype(q.dtype)
    if not return_lse:
        return out
    return out, lse.transpose(1, 2, 0, 3).reshape(b, h, s)


LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


def lse2_attention_vjp(run_forward, grads):
    """The custom VJP of a kernel family with a base-2 lse (+inf: no key in the Triton-lowering and token
    kernels, -inf in the Mosaic GPU ones; natural_lse reads both): attend(q, k, v, index, count, key_valid,
    launch, with_lse) -> o, or (o, natural lse).

    run_forward(q, k, v, index, count, key_valid, launch) -> (o, lse2); grads(q, k, v, index, count,
    key_valid, o, lse2, do, dlse, launch) -> (dq, dk, dv), dlse None without with_lse. launch (hashable) and
    with_lse are static; the index, counts and key flags get no cotangent."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
    def attend(q, k, v, index, count, key_valid, launch, with_lse: bool):
        o, lse2 = run_forward(q, k, v, index, count, key_valid, launch)
        return (o, natural_lse(lse2)) if with_lse else o

    def forward(q, k, v, index, count, key_valid, launch, with_lse: bool):
        o, lse2 = name_residuals(*run_forward(q, k, v, index, count, key_valid, launch))
        out = (o, natural_lse(lse2)) if with_lse else o
        return out, (q, k, v, index, count, key_valid, o, lse2)

    def backward(launch, with_lse: bool, res, cotangent):
        q, k, v, index, count, key_valid, o, lse2 = res
        do, dlse = cotangent if with_lse else (cotangent, None)
        return *grads(q, k, v, index, count, key_valid, o, lse2, do, dlse, launch), None, None, None

    attend.defvjp(forward, backward)
    return attend


def natural_lse(lse2):
    """A base-2 kernel lse (+inf: no valid key, so that a backward's exp2(s - lse2) is 0, the convention of the
    Triton-lowering and token kernels; -inf, the Mosaic GPU kernels', stays -inf) as the public natural-log lse
    (-inf: no valid key)."""
    return jnp.where(lse2 == jnp.inf, -jnp.inf, lse2 * LN2)


def kernel_lse(lse):
    """Inverse of natural_lse: the public lse as the kernels' base-2 lse (+inf where no key)."""
    lse = lse.astype(jnp.float32)
    return jnp.where(lse == -jnp.inf, jnp.inf, lse / LN2)


def row_term(o, do, dlse=None):
    """delta = rowsum(o * do) - dlse [B, H, S] fp32 of the softmax backward: d lse_i / d s_ij = p_ij, so an
    lse cotangent shifts the row term. One fused XLA reduction (memory-bound, as fast as a kernel)."""
    delta = jnp.einsum("bshd,bshd->bhs", o.astype(jnp.float32), do.astype(jnp.float32))
    return delta if dlse is None else delta - dlse.astype(jnp.float32)


def _share_weight(lse_part, lse):
    """exp(lse_part - lse): the part's share of the merged softmax mass; 0 where either has no key (no NaN)."""
    none = (lse_part == -jnp.inf) | (lse == -jnp.inf)
    return jnp.where(none, 0.0, jnp.exp(jnp.where(none, 0.0, lse_part - lse)))


def sparse_attention_reference_backward(
    q,
    k,
    v,
    kv_index,
    kv_count,
    o,
    lse,
    do,
    dlse=None,
    *,
    q_tile=Q_TILE,
    kv_block=KV_BLOCK,
    sm_scale=None,
    kv_valid=None,
):
    """sparse_attention_backward in plain JAX. With w = exp(lse_b - lse) for this call's (o_b, lse_b) and the
    merged lse held constant, o_b * w = p v and w = rowsum(p); so the VJP of (q, k, v) -> (o_b * w, w) with
    cotangents (do, -delta) is sum_ij p_ij (do_i.v_j - delta_i) differentiated: exactly the gradients."""
    merged = jax.lax.stop_gradient(lse.astype(jnp.float32))

    def share(q, k, v):
        o_b, lse_b = sparse_attention_reference(
            q,
            k,
            v,
            kv_index,
            kv_count,
            q_tile=q_tile,
            kv_block=kv_block,
            sm_scale=sm_scale,
            kv_valid=kv_valid,
            return_lse=True,
        )
        w = _share_weight(lse_b, merged)
        return o_b.astype(jnp.float32) * jnp.swapaxes(w, 1, 2)[..., None], w

    _, pullback = jax.vjp(share, q, k, v)
    return pullback((do.astype(jnp.float32), -row_term(o, do, dlse)))


def dense_masked_reference(q, k, v, index, count, kv_valid, *, q_tile, kv_block, sm_scale):
    """(o, lse) of block-sparse attention with per-block valid keys, as one dense masked softmax in
    float32 (small shapes only: [B, H, S, S]): an independent check of the kernels and of the per-tile
    reference above, which walks the selection as the kernels do. Rows with no valid key: o = 0, lse = -inf."""
    b, s, h, d = q.shape
    blocks = s // kv_block
    live = jnp.arange(index.shape[-1]) < count[..., None]
    picked = jax.nn.one_hot(jnp.where(live, index, blocks), blocks + 1, dtype=jnp.bool_)[..., :blocks]
    mask = jnp.repeat(jnp.repeat(jnp.any(picked, axis=-2), q_tile, axis=2), kv_block, axis=3)  # [B, H, S, S]
    if kv_valid is not None:
        key_ok = (jnp.arange(s) % kv_block)[None] < jnp.repeat(kv_valid, kv_block, axis=1)  # [B, S]
        mask = mask & key_ok[:, None, None, :]
    f32 = lambda x: x.astype(jnp.float32)
    logits = jnp.where(mask, jnp.einsum("bqhd,bkhd->bhqk", f32(q), f32(k)) * sm_scale, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.exp(logits - m)
    l = jnp.sum(e, axis=-1, keepdims=True)
    empty = l == 0.0
    o = jnp.einsum("bhqk,bkhd->bqhd", e / jnp.where(empty, 1.0, l), f32(v))
    lse = jnp.where(empty, -jnp.inf, m + jnp.log(jnp.where(empty, 1.0, l)))[..., 0]
    return o, lse
