"""Sparse attention backends ("dsv", "window") and the block glue that runs a plan.

Registered backends (`dsv_jax.attention.attention(q, k, v, backend=...)`):

    backend="dsv"     options: either kv_index / kv_count (a selection), or q_lr, k_lr, top_k and
                      optionally keep (per-head ratios [H]); q_tile, kv_block, block_reduce
    backend="window"  options: grid (token grid t, h, w), tile (3D tile), fraction (WA-M 1/3, WA-L 2/3)

Both run `pallas_kernels.sparse_attention.sparse_attention` (impl="auto"). With `kv_lens` (a padded
layout: the valid keys are a prefix that does not end on a tile boundary) they fall back to the dense
backend, since a partly padded KV block cannot be masked by the kernel.

Block glue: `self_attention` (DiT) and `joint_attention` (MMDiT) run an `AttentionPlan`: predictor
projections and loss, selection, profiling, and the attention, returning (output, aux). In MMDiT only
video-video attention is sparse: video queries combine their sparse video part with a dense text part
through log-sum-exp (`merge_attention`), computed here in plain JAX because the kernel returns no
log-sum-exp; text queries attend densely to everything.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np

from dsv_jax.attention.registry import attention, register_backend
from dsv_jax.dsv.plan import AttentionPlan
from dsv_jax.dsv.predictor import predictor_loss, sample_positions, true_logits
from dsv_jax.dsv.profiler import profile_rows
from dsv_jax.dsv.selection import select_kv, window_selection
from pallas_kernels.sparse_attention import sparse_attention

log = logging.getLogger("dsv_jax")


# -- registered backends ----------------------------------------------------------------------------

@register_backend("dsv")
def dsv_attention(q, k, v, *, kv_lens, sm_scale, kv_index=None, kv_count=None, q_lr=None, k_lr=None, top_k=None,
                  keep=None, q_tile=64, kv_block=64, block_reduce="mean", dense_backend="auto", return_lse=False):
    if kv_lens is not None:
        return attention(q, k, v, backend=dense_backend, kv_lens=kv_lens, sm_scale=sm_scale, return_lse=return_lse)
    if kv_index is None:
        if q_lr is None or k_lr is None or top_k is None:
            raise TypeError("backend 'dsv' needs kv_index and kv_count, or q_lr, k_lr and top_k")
        kv_index, kv_count = select_kv(q_lr, k_lr, top_k, keep, q_tile=q_tile, kv_block=kv_block,
                                       block_reduce=block_reduce)
    elif kv_count is None:
        kv_count = jnp.full(kv_index.shape[:3], kv_index.shape[-1], jnp.int32)
    return sparse_attention(q, k, v, kv_index, kv_count, q_tile=q_tile, kv_block=kv_block, sm_scale=sm_scale,
                            return_lse=return_lse, impl="auto")


def window_kv(batch: int, heads: int, grid, tile, fraction: float):
    """(kv_index, kv_count) of the window baseline for a token grid split into `tile`s (tile-major)."""
    tile = tuple(min(int(t), int(g)) for t, g in zip(tile, grid))
    if any(g % t for g, t in zip(grid, tile)):
        raise ValueError(f"window attention needs a token grid {tuple(grid)} divisible by the tile {tile}")
    idx = window_selection(tuple(g // t for g, t in zip(grid, tile)), float(fraction))
    kv_index = jnp.broadcast_to(jnp.asarray(idx), (batch, heads, *idx.shape))
    return kv_index, jnp.full(kv_index.shape[:3], idx.shape[1], jnp.int32)


@register_backend("window")
def window_attention(q, k, v, *, kv_lens, sm_scale, grid, tile, fraction=1 / 3, dense_backend="auto",
                     return_lse=False):
    if kv_lens is not None:
        return attention(q, k, v, backend=dense_backend, kv_lens=kv_lens, sm_scale=sm_scale, return_lse=return_lse)
    tile = tuple(min(int(t), int(g)) for t, g in zip(tile, grid))
    kv_index, kv_count = window_kv(q.shape[0], q.shape[2], grid, tile, fraction)
    size = int(np.prod(tile))
    return sparse_attention(q, k, v, kv_index, kv_count, q_tile=size, kv_block=size, sm_scale=sm_scale,
                            return_lse=return_lse, impl="auto")


# -- sparse attention with log-sum-exp, for merging with dense text attention (MMDiT) ---------------

def sparse_attention_lse(q, k, v, kv_index, kv_count, *, q_tile, kv_block, sm_scale):
    """Block-sparse attention (same semantics as `sparse_attention`) that also returns the log-sum-exp
    [B, S, H] of each query's selected logits. Plain JAX, one query tile at a time (no [S, S] matrix)."""
    b, s, h, d = q.shape
    n_sel = kv_index.shape[-1]
    kb = k.reshape(b, s // kv_block, kv_block, h, d).transpose(0, 3, 1, 2, 4)
    vb = v.reshape(b, s // kv_block, kv_block, h, d).transpose(0, 3, 1, 2, 4)
    qt = q.reshape(b, s // q_tile, q_tile, h, d).transpose(1, 0, 3, 2, 4)

    def one_tile(args):
        q_t, idx, count = args
        valid = jnp.arange(n_sel) < count[..., None]
        idx = jnp.where(valid, idx, 0)
        ks = jnp.take_along_axis(kb, idx[..., None, None], axis=2)
        vs = jnp.take_along_axis(vb, idx[..., None, None], axis=2)
        logits = jnp.einsum("bhqd,bhkjd->bhqkj", q_t, ks, preferred_element_type=jnp.float32) * sm_scale
        logits = jnp.where(valid[:, :, None, :, None], logits, -jnp.inf).reshape(*logits.shape[:3], -1)
        lse = jax.nn.logsumexp(logits, axis=-1)
        p = jnp.exp(logits - lse[..., None]).reshape(*logits.shape[:3], n_sel, kv_block)
        o = jnp.einsum("bhqkj,bhkjd->bhqd", p.astype(v.dtype), vs, preferred_element_type=jnp.float32)
        return o, lse

    o, lse = jax.lax.map(one_tile, (qt, kv_index.transpose(2, 0, 1, 3), kv_count.transpose(2, 0, 1)))
    return (o.transpose(1, 0, 3, 2, 4).reshape(b, s, h, d),
            lse.transpose(1, 0, 3, 2).reshape(b, s, h))


def dense_attention_lse(q, k, v, kv_lens, sm_scale):
    """Dense attention of q [B, Sq, H, D] over a short k, v [B, L, H, D] (text), with log-sum-exp [B, Sq, H]."""
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * sm_scale
    logits = jnp.where(jnp.arange(k.shape[1])[None, None, None] < kv_lens[:, None, None, None], logits, -jnp.inf)
    lse = jax.nn.logsumexp(logits, axis=-1)
    o = jnp.einsum("bhqk,bkhd->bqhd", jnp.exp(logits - lse[..., None]).astype(v.dtype), v,
                   preferred_element_type=jnp.float32)
    return o, lse.transpose(0, 2, 1)


def merge_attention(o1, lse1, o2, lse2):
    """Attention over the union of two disjoint key sets from each part's output and log-sum-exp."""
    m = jnp.maximum(lse1, lse2)
    w1, w2 = jnp.exp(lse1 - m)[..., None], jnp.exp(lse2 - m)[..., None]
    return (w1 * o1 + w2 * o2) / (w1 + w2)


# -- block glue --------------------------------------------------------------------------------------

def _geometry(plan: AttentionPlan, layout, seq_len: int):
    """(q_tile, kv_block) of a sparse plan on this layout, or None where it must run dense."""
    if layout is None or layout.padded:
        return None
    q_tile = layout.tile_size
    kv_block = layout.tile_size if plan.mode == "window" or not plan.kv_block else plan.kv_block
    if seq_len % kv_block:
        log.warning("DSV: KV block %d does not divide the sequence of %d tokens; dense attention for this shape",
                    kv_block, seq_len)
        return None
    return q_tile, kv_block


def plan_selection(q, k, x, ctx, plan, predictor, inputs):
    """Predictor, selection and profiling of one block's video tokens.

    Returns (selection or None, (q_tile, kv_block) or None, aux). `selection` is what the attention
    should use (only when the plan attends sparsely); aux holds predictor loss and profile stats."""
    layout = ctx.layout
    b, s, h, d = q.shape
    scale = d ** -0.5
    aux = {}
    geometry = _geometry(plan, layout, s)
    positions = sample_positions(ctx.n_real, plan.query_stride, plan.max_queries)
    if plan.mode == "dsv" and predictor is None and (plan.predictor or plan.selects):
        raise ValueError("a DSV plan that selects or trains needs the block's predictor: build the model with "
                         "attention=dsv (Config.predictor_rank > 0)")
    need_lr = plan.mode == "dsv" and (plan.predictor or (plan.selects and geometry is not None))
    z = true_logits(q, k, positions, ctx.n_real, scale) if (plan.predictor or plan.profile) else None
    q_lr = k_lr = None
    if need_lr:
        q_lr, k_lr = predictor(jax.lax.stop_gradient(x), layout.coords)
    if plan.mode == "dsv" and plan.predictor:
        aux["predictor_loss"] = predictor_loss(q_lr, k_lr, z, positions, ctx.n_real, center=plan.center_logits)
    selection = None
    if geometry is not None:
        q_tile, kv_block = geometry
        if plan.mode == "window":
            selection = window_kv(b, h, layout.grid, layout.tile, plan.window)
        elif plan.selects and q_lr is not None:
            keep = None if inputs is None else inputs.get("keep")
            selection = select_kv(q_lr, k_lr, plan.top_k(s // kv_block), keep, q_tile=q_tile, kv_block=kv_block,
                                  block_reduce=plan.block_reduce)
    if plan.profile:
        q_tile, kv_block = geometry or (1, 1)
        lowrank = (q_lr, k_lr) if plan.mode == "dsv" and geometry is not None and q_lr is not None else None
        aux.update(profile_rows(z, positions, ctx.n_real, theta=plan.theta, percentile=plan.percentile,
                                coords=layout.coords, selection=selection, q_tile=q_tile, kv_block=kv_block,
                                lowrank=lowrank, block_reduce=plan.block_reduce, analysis=plan.analysis,
                                exact=(q, k) if geometry is not None else None))
    attend = selection if (selection is not None and plan.sparse) else None
    return attend, geometry, aux


def self_attention(q, k, v, x, ctx, plan, predictor=None, inputs=None):
    """DiT video self-attention under `plan` (a backend name or an AttentionPlan). -> (o, aux)."""
    if not isinstance(plan, AttentionPlan) or plan.mode == "dense" and not plan.profile:
        backend = plan.backend if isinstance(plan, AttentionPlan) else plan
        return attention(q, k, v, backend=backend, kv_lens=ctx.video_lens), {}
    selection, geometry, aux = plan_selection(q, k, x, ctx, plan, predictor, inputs)
    if selection is None:
        return attention(q, k, v, backend=plan.backend, kv_lens=ctx.video_lens), aux
    q_tile, kv_block = geometry
    o = attention(q, k, v, backend="dsv", kv_index=selection[0], kv_count=selection[1], q_tile=q_tile,
                  kv_block=kv_block)
    return o, aux


def joint_attention(video, text, ctx, plan, x=None, predictor=None, inputs=None):
    """MMDiT joint attention over video + text tokens. -> (o_video, o_text, aux).

    Dense: one call over [real video, text, video padding] masked by length (the valid keys are a
    prefix). Sparse: video->video through the selection, video->text dense, merged by log-sum-exp;
    text queries dense over all valid keys."""
    dense = not isinstance(plan, AttentionPlan) or plan.mode == "dense" and not plan.profile
    backend = plan.backend if isinstance(plan, AttentionPlan) else plan
    aux, selection = {}, None
    if not dense:
        selection, geometry, aux = plan_selection(video[0], video[1], x, ctx, plan, predictor, inputs)
    n = ctx.n_real
    if selection is None:
        q, k, v = (jnp.concatenate([a[:, :n], b, a[:, n:]], axis=1) for a, b in zip(video, text))
        o = attention(q, k, v, backend=backend, kv_lens=n + ctx.text_lens)
        lt = text[0].shape[1]
        return jnp.concatenate([o[:, :n], o[:, n + lt:]], axis=1), o[:, n:n + lt], aux
    (qv, kv, vv), (qt, kt, vt) = video, text
    scale = qv.shape[-1] ** -0.5
    q_tile, kv_block = geometry
    o_vv, lse_vv = sparse_attention_lse(qv, kv, vv, *selection, q_tile=q_tile, kv_block=kv_block, sm_scale=scale)
    o_vt, lse_vt = dense_attention_lse(qv, kt, vt, ctx.text_lens, scale)
    ov = merge_attention(o_vv, lse_vv, o_vt, lse_vt).astype(qv.dtype)
    k_all, v_all = jnp.concatenate([kv, kt], axis=1), jnp.concatenate([vv, vt], axis=1)
    ot = attention(qt, k_all, v_all, backend=backend, kv_lens=kv.shape[1] + ctx.text_lens)
    return ov, ot, aux
