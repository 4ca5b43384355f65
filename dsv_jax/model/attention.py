"""Video attention inside a transformer block: runs the block's attention plan.

A plan is a dense backend name, or a `dsv_jax.dsv.plan.AttentionPlan` (DSV, the window baseline, any
registered variant) whose `backend` is a dense backend name or a `ContextBackend` (context parallelism,
`dsv_jax.parallel`). This glue never asks which mode a plan is: one call does, on the block's video tokens,

    geometry:   plan.geometry(layout)                     query tiles, KV blocks (None: dense on this shape)
    selection:  plan.selection(...)                       DSV: predictor(stop_gradient(x)), its loss on
                                                          sampled query rows, top-k KV blocks per query
                                                          tile; window: the static lists
    profile:    sparsity / recall statistics of the sampled rows (profile steps)
    capture:    the block's q, k (and q_lr, k_lr) themselves, for an analysis outside the model
    attention:  sparse through the selection, or dense

and returns (output, aux), aux holding the predictor loss, profile statistics and, under context
parallelism, the exchange statistics (cp/...). Padded token layouts (grids that do not divide into
tiles) run sparse too: the kernels mask each KV block's padding keys by count (`kv_valid`), dense
attention by a key mask. In MMDiT only video-video attention is sparse: video queries merge their
sparse video part with the dense text part by log-sum-exp; text queries attend densely to every key.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from dsv_jax.attention import attention, merge_attention
from dsv_jax.attention.context import ContextBackend
from dsv_jax.dsv.plan import AttentionPlan
from dsv_jax.dsv.predictor import sample_positions, true_logits
from dsv_jax.dsv.profiler import profile_rows
from pallas_kernels.sparse_attention import RESIDUAL_NAME

CONTEXT_STATS = ("requested_blocks", "overflow_blocks", "fallback")

# The selection (kv_index, kv_count: int32, 6.7 MB per block at 64k tokens, 16 heads, 10% kept) is named
# so that a rematerialised block keeps it for its backward (`remat_policy`) instead of running the
# predictor's projections and the top-k a second time (2.7B model: ~2.7 ms of a block's recompute at 64k).
SELECTION_NAME = "dsv_selection"


# jax's cuDNN flash attention (jax.nn.dot_product_attention) binds one of these in its VJP's forward; their
# outputs (o and the softmax statistics) are what its backward reads besides q, k and v.
CUDNN_FORWARD_PRIMITIVES = frozenset({"dot_product_attention_fwd_wrapper", "dot_product_attention_fwd"})


def _cudnn_forward_saveable(prim, *avals, **__) -> bool:
    """cuDNN self- (or joint) attention's forward outputs; not cross attention's, whose few text keys make
    it cheap to recompute while its output is as large as self-attention's (q, k are its first operands)."""
    if prim.name not in CUDNN_FORWARD_PRIMITIVES:
        return False
    q, k = avals[0], avals[1]
    return k.size >= q.size


def remat_policy(keep_attention: bool = False):
    """The jax.checkpoint policy of a transformer block: recompute everything but the DSV selection.

    keep_attention (model.remat_keep_attention): also keep what the flash attention kernels' backward
    reads, the output and softmax statistics of DSV's sparse kernels and of the context-parallel ring
    (`RESIDUAL_NAME`) and of cuDNN's self-attention, so the backward does not run attention's forward
    again; keeps B S H (2 D + 4) bytes per block (bf16), 0.5 GiB per block at 128k tokens and 16 x 128
    heads. Cross attention (few text keys) is recomputed, and XLA's dense attention keeps nothing more
    (its backward would need the whole probability matrix). Measured on an H200 (2.7B, 128k tokens):
    cuDNN's step 19% faster, DSV 0.9's 11% (experiments/results/RESULTS.md, "Keeping attention across the
    remat"); the sparse kernels keep their residuals behind an optimization barrier, without which XLA ran
    their forward twice (pallas_kernels.sparse_attention.name_residuals)."""
    if not keep_attention:
        return jax.checkpoint_policies.save_only_these_names(SELECTION_NAME)
    named = jax.checkpoint_policies.save_only_these_names(SELECTION_NAME, RESIDUAL_NAME)
    return jax.checkpoint_policies.save_from_both_policies(named, _cudnn_forward_saveable)


def plan_selection(q, k, x, ctx, plan, predictor, inputs):
    """The plan's selection (and predictor loss) and the profile statistics of one block's video tokens.

    Returns (selection or None, Geometry or None, aux). `selection` is what the attention should use
    (only when the plan attends sparsely); aux holds predictor loss and profile stats."""
    layout = ctx.layout
    b, d = q.shape[0], q.shape[-1]
    geometry = plan.geometry(layout, b)
    positions = layout.valid_positions[sample_positions(ctx.n_real, plan.query_stride, plan.max_queries)]
    z = true_logits(q, k, positions, layout.valid, d**-0.5) if plan.needs_logits else None
    chosen = plan.selection(q, x, layout, geometry, predictor=predictor, inputs=inputs, logits=z, positions=positions)
    aux = dict(chosen.aux)
    if plan.capture:
        aux.update({"capture/q": q, "capture/k": k})
    if plan.profile:
        if geometry:
            q_tile, kv_block, kv_valid = geometry.q_tile, geometry.kv_block, geometry.kv_valid
        else:
            q_tile, kv_block, kv_valid = 1, 1, None
        aux.update(
            profile_rows(
                z,
                positions,
                ctx.n_real,
                theta=plan.theta,
                percentile=plan.percentile,
                coords=layout.coords,
                selection=chosen.kv,
                q_tile=q_tile,
                kv_block=kv_block,
                lowrank=chosen.lowrank,
                block_reduce=chosen.block_reduce,
                analysis=plan.analysis,
                exact=(q, k) if geometry is not None else None,
                kv_valid=kv_valid,
            )
        )
    attend = chosen.kv if (chosen.kv is not None and plan.sparse) else None
    if attend is not None:
        attend = tuple(checkpoint_name(a, SELECTION_NAME) for a in attend)
    return attend, geometry, aux


def _is_dense(plan) -> bool:
    return not isinstance(plan, AttentionPlan) or plan.plain_dense


def _backend(plan):
    return plan.backend if isinstance(plan, AttentionPlan) else plan


def context_backend(plan):
    """The context-parallel backend a plan runs on (`dsv_jax.parallel.ContextAttention`: it keeps
    activations sharded over the sequence and attends to text per device), or None."""
    backend = _backend(plan)
    return backend if isinstance(backend, ContextBackend) else None


def _attend(q, k, v, plan, aux, **kw):
    """Attention of a non-dense plan: sparse through a selection (kv_index / kv_count in kw) or dense.
    On a context-parallel backend the exchange statistics go into aux as cp/... (every block reports
    the same keys, so blocks with different plans stack)."""
    if context_backend(plan) is not None:
        out, stats = attention(q, k, v, backend=plan.backend, return_stats=True, **kw)
        aux.update({f"cp/{name}": stats[name] for name in CONTEXT_STATS})
        return out
    return attention(q, k, v, backend="dsv" if "kv_index" in kw else plan.backend, **kw)


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
    o = _attend(q, k, v, plan, aux, kv_index=selection[0], kv_count=selection[1], **geometry.sparse_options())
    return o, aux


def joint_attention(video, text, ctx, plan, x=None, predictor=None, inputs=None):
    """MMDiT joint attention over video + text tokens. -> (o_video, o_text, aux).

    Dense: one call over [video, text], the padding of both masked (by length where the video layout
    is unpadded: the valid keys are then a prefix). Sparse: video queries attend to the video keys
    they selected through the sparse kernel and to the text keys densely, both with log-sum-exp,
    merged exactly (`merge_attention`); text queries attend densely to every valid key."""
    backend = _backend(plan)
    aux, selection = {}, None
    if not _is_dense(plan):
        selection, geometry, aux = plan_selection(video[0], video[1], x, ctx, plan, predictor, inputs)
    (qv, kv, vv), (qt, kt, vt) = video, text
    s, lt = qv.shape[1], qt.shape[1]
    if selection is None:
        q, k, v = (jnp.concatenate([a, b], axis=1) for a, b in zip(video, text))
        if not _is_dense(plan):
            o = _attend(q, k, v, plan, aux, **_joint_keys(ctx, s, lt))
        else:
            o = attention(q, k, v, backend=backend, **_joint_keys(ctx, s, lt))
        return o[:, :s], o[:, s:], aux
    o_vv, lse_vv = _attend(
        qv,
        kv,
        vv,
        plan,
        aux,
        kv_index=selection[0],
        kv_count=selection[1],
        return_lse=True,
        **geometry.sparse_options(),
    )
    cp = context_backend(plan)
    if cp is not None:  # video queries sharded over the sequence; text keys on every device
        o_vt, lse_vt = cp.cross_attention(qv, kt, vt, kv_lens=ctx.text_lens, return_lse=True)
    else:
        o_vt, lse_vt = attention(qv, kt, vt, backend=backend, kv_lens=ctx.text_lens, return_lse=True)
    ov = merge_attention(o_vv, lse_vv, o_vt, lse_vt)[0].astype(qv.dtype)
    if cp is None:
        k_all, v_all = jnp.concatenate([kv, kt], axis=1), jnp.concatenate([vv, vt], axis=1)
        return ov, attention(qt, k_all, v_all, backend=backend, **_joint_keys(ctx, s, lt)), aux
    # text queries (on every device) over the sharded video keys: one partial result per device, merged
    # with the text keys' part by log-sum-exp
    o_t, lse_t = attention(qt, kt, vt, backend=cp.backend, kv_lens=ctx.text_lens, return_lse=True)
    o_p, lse_p = cp.partial_attention(qt, kv, vv, kv_mask=jnp.asarray(ctx.layout.valid) if ctx.layout.padded else None)
    for i in range(o_p.shape[0]):
        o_t, lse_t = merge_attention(o_t, lse_t, o_p[i], lse_p[i])
    return ov, o_t.astype(qt.dtype), aux


def _joint_keys(ctx, s: int, lt: int) -> dict:
    """Key masking of the joint [video (s), text (lt)] sequence: a length where the video is unpadded."""
    if not ctx.layout.padded:
        return {"kv_lens": s + ctx.text_lens}
    text_valid = jnp.arange(lt)[None] < ctx.text_lens[:, None]
    video_valid = jnp.broadcast_to(jnp.asarray(ctx.layout.valid), (text_valid.shape[0], s))
    return {"kv_mask": jnp.concatenate([video_valid, text_valid], axis=1)}
