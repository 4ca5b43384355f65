"""Video attention inside a transformer block: runs the block's attention plan.

A plan is a dense backend name, or a `dsv_jax.dsv.plan.AttentionPlan` (DSV or the window baseline).
For a DSV plan one call does, on the block's video tokens:

    predictor:  q_lr, k_lr = predictor(stop_gradient(x))           (when the plan trains or selects)
    loss:       predictor loss of sampled query rows vs the true logits (training)
    selection:  top-k KV blocks per query tile (DSV) or the static window lists
    profile:    sparsity / recall statistics of the sampled rows (profile steps)
    attention:  sparse through the selection, or dense

and returns (output, aux), aux holding the predictor loss and profile statistics. In MMDiT only
video-video attention is sparse: video queries merge their sparse video part with a dense text part
by log-sum-exp; text queries attend densely to every valid key.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

from dsv_jax.attention import attention
from dsv_jax.attention.rope import rope_angles
from dsv_jax.dsv import backend as sparse_backends
from dsv_jax.dsv.plan import AttentionPlan
from dsv_jax.dsv.predictor import predictor_loss, sample_positions, true_logits
from dsv_jax.dsv.profiler import profile_rows
from dsv_jax.dsv.selection import select_kv

log = logging.getLogger("dsv_jax")


def _geometry(plan: AttentionPlan, layout, seq_len: int):
    """(q_tile, kv_block) of a sparse plan on this layout, or None where it must run dense."""
    if layout is None or layout.padded:  # TODO(kv_valid): padded layouts through the kernels' key counts
        return None
    q_tile = layout.tile_size
    kv_block = layout.tile_size if plan.mode == "window" or not plan.kv_block else plan.kv_block
    if seq_len % kv_block:
        log.warning("DSV: KV block %d does not divide the sequence of %d tokens; dense attention for this shape",
                    kv_block, seq_len)
        return None
    return q_tile, kv_block


def _lowrank(predictor, x, layout):
    """The predictor's q_lr, k_lr [B, S, H, r] of the block input x (detached here)."""
    rope = jnp.asarray(rope_angles(layout.coords, predictor.rank, predictor.rope_theta)) if predictor.rope else None
    return predictor(jax.lax.stop_gradient(x), rope)


def plan_selection(q, k, x, ctx, plan, predictor, inputs):
    """Predictor, selection and profiling of one block's video tokens.

    Returns (selection or None, (q_tile, kv_block) or None, aux). `selection` is what the attention
    should use (only when the plan attends sparsely); aux holds predictor loss and profile stats."""
    layout = ctx.layout
    b, s, h, d = q.shape
    scale = d ** -0.5
    aux = {}
    geometry = _geometry(plan, layout, s)
    positions = layout.valid_positions[sample_positions(ctx.n_real, plan.query_stride, plan.max_queries)]
    if plan.mode == "dsv" and predictor is None and (plan.predictor or plan.selects):
        raise ValueError("a DSV plan that selects or trains needs the block's predictor: build the model with "
                         "attention=dsv (Config.predictor_rank > 0)")
    need_lr = plan.mode == "dsv" and (plan.predictor or (plan.selects and geometry is not None))
    z = true_logits(q, k, positions, layout.valid, scale) if (plan.predictor or plan.profile) else None
    q_lr = k_lr = None
    if need_lr:
        q_lr, k_lr = _lowrank(predictor, x, layout)
    if plan.mode == "dsv" and plan.predictor:
        aux["predictor_loss"] = predictor_loss(q_lr, k_lr, z, positions, layout.valid, center=plan.center_logits)
    selection = None
    if geometry is not None:
        q_tile, kv_block = geometry
        if plan.mode == "window":
            selection = sparse_backends.window_kv(b, h, layout.grid, layout.tile, plan.window)
        elif plan.selects and q_lr is not None:
            keep = None if inputs is None else inputs.get("keep")
            # under context parallelism the selection runs where the query tiles live
            select = getattr(plan.backend, "select_kv", select_kv)
            selection = select(q_lr, k_lr, plan.top_k(s // kv_block), keep, q_tile=q_tile, kv_block=kv_block,
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


def _is_dense(plan) -> bool:
    return not isinstance(plan, AttentionPlan) or plan.mode == "dense" and not plan.profile


def _backend(plan):
    return plan.backend if isinstance(plan, AttentionPlan) else plan


def context_backend(plan):
    """The context-parallel backend a plan runs on (`dsv_jax.parallel.ContextAttention`: it keeps
    activations sharded over the sequence and attends to text per device), or None."""
    backend = _backend(plan)
    return backend if hasattr(backend, "constrain") else None


CONTEXT_STATS = ("requested_blocks", "overflow_blocks", "fallback")


def _attend(q, k, v, plan, aux, **kw):
    """Attention of a non-dense plan: sparse through a selection (kv_index / kv_count in kw) or dense.
    On a context-parallel backend the exchange statistics go into aux as cp/... (every block reports
    the same keys, so blocks with different plans stack)."""
    backend = plan.backend
    if context_backend(plan) is not None:
        o, stats = attention(q, k, v, backend=backend, return_stats=True, **kw)
        aux.update({f"cp/{name}": stats[name] for name in CONTEXT_STATS})
        return o
    return attention(q, k, v, backend="dsv" if "kv_index" in kw else backend, **kw)


def _key_mask(ctx) -> dict:
    """The dense attention keyword that masks a padded layout's padding keys (nothing when unpadded)."""
    return {"kv_mask": jnp.asarray(ctx.layout.valid)} if ctx.layout.padded else {}


def self_attention(q, k, v, x, ctx, plan, predictor=None, inputs=None):
    """DiT video self-attention under `plan` (a backend name or an AttentionPlan). -> (o, aux)."""
    if _is_dense(plan):
        return attention(q, k, v, backend=_backend(plan), **_key_mask(ctx)), {}
    selection, geometry, aux = plan_selection(q, k, x, ctx, plan, predictor, inputs)
    if selection is None:
        return _attend(q, k, v, plan, aux, **_key_mask(ctx)), aux
    q_tile, kv_block = geometry
    o = _attend(q, k, v, plan, aux, kv_index=selection[0], kv_count=selection[1], q_tile=q_tile, kv_block=kv_block)
    return o, aux


def joint_attention(video, text, ctx, plan, x=None, predictor=None, inputs=None):
    """MMDiT joint attention over video + text tokens. -> (o_video, o_text, aux).

    Dense: one call over [video, text], the padding of both masked (by length where the video layout
    is unpadded: the valid keys are then a prefix). Sparse: video->video through the selection,
    video->text dense, merged by log-sum-exp; text queries dense over all valid keys."""
    backend = _backend(plan)
    aux, selection = {}, None
    if not _is_dense(plan):
        selection, geometry, aux = plan_selection(video[0], video[1], x, ctx, plan, predictor, inputs)
    if selection is None:
        s = video[0].shape[1]
        q, k, v = (jnp.concatenate([a, b], axis=1) for a, b in zip(video, text))
        o = attention(q, k, v, backend=backend, **_joint_keys(ctx, s, text[0].shape[1]))
        return o[:, :s], o[:, s:], aux
    (qv, kv, vv), (qt, kt, vt) = video, text
    scale = qv.shape[-1] ** -0.5
    q_tile, kv_block = geometry
    o_vv, lse_vv = sparse_attention_lse(qv, kv, vv, *selection, q_tile=q_tile, kv_block=kv_block, sm_scale=scale)
    o_vt, lse_vt = dense_attention_lse(qv, kt, vt, ctx.text_lens, scale)
    ov = merge_attention(o_vv, lse_vv, o_vt, lse_vt).astype(qv.dtype)
    k_all, v_all = jnp.concatenate([kv, kt], axis=1), jnp.concatenate([vv, vt], axis=1)
    ot = attention(qt, k_all, v_all, backend=backend, **_joint_keys(ctx, kv.shape[1], kt.shape[1]))
    return ov, ot, aux


def _joint_keys(ctx, s: int, lt: int) -> dict:
    """Key masking of the joint [video (s), text (lt)] sequence: a length where the video is unpadded."""
    if not ctx.layout.padded:
        return {"kv_lens": s + ctx.text_lens}
    text_valid = jnp.arange(lt)[None] < ctx.text_lens[:, None]
    video_valid = jnp.broadcast_to(jnp.asarray(ctx.layout.valid), (text_valid.shape[0], s))
    return {"kv_mask": jnp.concatenate([video_valid, text_valid], axis=1)}


# -- plain-JAX parts with log-sum-exp (MMDiT until the kernel returns it) --------------------------

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
