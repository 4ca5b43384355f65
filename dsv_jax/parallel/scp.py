"""Sequence-wise context parallelism (SCP): each device keeps its query shard and gets the keys it needs.

Every function here runs inside shard_map on one device of an SCP group (`axis`, a GroupAxis of n
devices: the whole context axis, or every ph-th device of it in a hybrid); q, k, v [B, S/n, H, D]
are this device's contiguous slice of the group's sequence, and block ids in kv_index are
group-global (block g covers tokens g*kv_block .. (g+1)*kv_block - 1).

- ring: K/V chunks travel around the group (ppermute) while each device merges its partial
  results with an online softmax (log-sum-exp). Hand-written VJP: the backward runs the ring again
  with dK/dV accumulators travelling with their chunk, so no device ever holds all of K/V. Dense
  attention runs as plain-JAX blocks (masks kv_lens / kv_mask); a sparse selection runs the
  block-sparse kernel per visiting chunk, on the selection's ids that fall in it (chunk_selection),
  forward with return_lse and backward with `sparse_attention_backward` under the merged statistics.
- allgather: gather K/V of the whole group, attend locally (cuDNN / the sparse kernel).
- selective: each device requests only the remote KV blocks its query tiles selected: counts and
  block ids first (all-to-all), then the blocks (all-to-all), with a static capacity of `capacity`
  blocks per peer. dK/dV return along the transposed all-to-all (autodiff). A request that does not
  fit is never dropped: every device of the group then takes the all-gather path for this call
  (exact, more bytes), and the overflow is counted in the returned stats.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from dsv_jax.attention import merge_attention
from dsv_jax.dsv.selection import apply_counts
from dsv_jax.parallel import local
from dsv_jax.parallel.groups import GroupAxis
from pallas_kernels.defaults import KV_BLOCK, Q_TILE
from pallas_kernels.lowrank_topk import reduce_block, row_flags, tile_proxies
from pallas_kernels.sparse_attention import name_residuals, row_term, sparse_attention_backward


def _mask_fn(src, s_chunk, kv_lens, kv_mask):
    """Visibility of key chunk `src` (group-global offset src * s_chunk) for query rows [row0, row0 + rows).
    kv_mask: bool [B, S] over the group's whole sequence (valid keys), or None."""
    if kv_lens is None and kv_mask is None:
        return lambda row0, rows: None
    key_pos = src * s_chunk + jnp.arange(s_chunk)

    def fn(row0, rows):
        mask = None
        if kv_lens is not None:
            mask = (key_pos[None, :] < kv_lens[:, None])[:, None, None, :]  # [B, 1, 1, Sk]
        if kv_mask is not None:
            chunk = jnp.take(kv_mask, key_pos, axis=1)[:, None, None, :]
            mask = chunk if mask is None else mask & chunk
        return mask

    return fn


def selection_mask(kv_index, kv_count, n_blocks):
    """kv_index [B, H, T, K] / kv_count [B, H, T] -> bool [B, H, n_blocks]: the blocks any tile of a
    (batch, head) row selected. A scatter, never [.., K, n_blocks]."""
    b, h, _, kk = kv_index.shape
    valid = (jnp.arange(kk) < kv_count[..., None]).astype(jnp.int8)
    bi = jnp.arange(b)[:, None, None, None]
    hi = jnp.arange(h)[None, :, None, None]
    idx = jnp.clip(kv_index, 0, n_blocks - 1)
    return jnp.zeros((b, h, n_blocks), jnp.int8).at[bi, hi, idx].max(valid).astype(bool)


def chunk_selection(kv_index, kv_count, kv_valid, src, nb_loc):
    """A selection of group-global block ids restricted to chunk `src` (blocks src*nb_loc .. +nb_loc):
    (kv_index [B, H, T, K] of chunk-local ids, the live ones first, kv_count [B, H, T], the chunk's
    kv_valid [B, nb_loc] or None). Sorting puts the live ids in ascending order whatever the caller's
    order (the Pallas dK/dV work list folds runs of ascending ids), the rest after them."""
    local_id = kv_index - src * nb_loc
    here = (jnp.arange(kv_index.shape[-1]) < kv_count[..., None]) & (local_id >= 0) & (local_id < nb_loc)
    index = jnp.sort(jnp.where(here, local_id, nb_loc), axis=-1)  # nb_loc: past every local id; never read
    count = jnp.sum(here, axis=-1, dtype=jnp.int32)
    valid = None if kv_valid is None else jax.lax.dynamic_slice_in_dim(kv_valid, src * nb_loc, nb_loc, axis=1)
    return index, count, valid


@dataclasses.dataclass(frozen=True)
class RingSteps:
    """Static choice of the ring's per-chunk attention: dense (plain JAX, masks kv_lens / kv_mask, `q_chunk`
    query rows at a time) or sparse (the block-sparse kernel on each visiting chunk's share of the selection)."""

    sparse: bool
    sm_scale: float
    q_chunk: int | None
    q_tile: int
    kv_block: int
    impl: str

    def _selection(self, masks, src, s_chunk):
        kv_index, kv_count, kv_valid = masks
        return chunk_selection(kv_index, kv_count, kv_valid, src, s_chunk // self.kv_block)

    def attend(self, q, masks):
        """attend(src, k_chunk, v_chunk) -> (o [B, S_local, H, D], lse [B, H, S_local] fp32, local.NEG where
        a row sees no key) of the local queries against the group's key chunk src."""
        if self.sparse:

            def sparse_block(src, k, v):
                index, count, valid = self._selection(masks, src, k.shape[1])
                o, lse = local.sparse_local(
                    q,
                    k,
                    v,
                    index,
                    count,
                    q_tile=self.q_tile,
                    kv_block=self.kv_block,
                    sm_scale=self.sm_scale,
                    impl=self.impl,
                    kv_valid=valid,
                    return_lse=True,
                )
                return o, jnp.maximum(lse, local.NEG)  # the kernel's -inf as the ring's finite "no key"

            return sparse_block
        kv_lens, kv_mask = masks
        return lambda src, k, v: local.block_lse(
            q, k, v, _mask_fn(src, k.shape[1], kv_lens, kv_mask), sm_scale=self.sm_scale, q_chunk=self.q_chunk
        )

    def grads(self, q, masks, o, lse, do, dlse):
        """grads(src, k_chunk, v_chunk) -> (dq, dk, dv) of chunk src's share of the attention whose merged
        output o and lse (local.NEG where no key) are given, for cotangents do and dlse."""
        if self.sparse:
            visible = jnp.where(lse > local.NEG / 2, lse, -jnp.inf)  # the kernels' "no key" (p = 0)

            def sparse_grads(src, k, v):
                index, count, valid = self._selection(masks, src, k.shape[1])
                return sparse_attention_backward(
                    q,
                    k,
                    v,
                    index,
                    count,
                    o,
                    visible,
                    do,
                    dlse,
                    q_tile=self.q_tile,
                    kv_block=self.kv_block,
                    sm_scale=self.sm_scale,
                    kv_valid=valid,
                    impl=self.impl,
                )

            return sparse_grads
        kv_lens, kv_mask = masks
        delta = row_term(o, do, dlse)
        return lambda src, k, v: local.block_grads(
            q,
            k,
            v,
            do,
            lse,
            delta,
            _mask_fn(src, k.shape[1], kv_lens, kv_mask),
            sm_scale=self.sm_scale,
            q_chunk=self.q_chunk,
        )


def ring_attention(
    q,
    k,
    v,
    *,
    axis: GroupAxis,
    sm_scale,
    kv_lens=None,
    kv_mask=None,
    kv_index=None,
    kv_count=None,
    kv_valid=None,
    q_chunk=None,
    q_tile=Q_TILE,
    kv_block=KV_BLOCK,
    impl="auto",
):
    """Attention of the local queries over the whole group's keys, dense or block-sparse.
    -> (o, lse [B, H, S_local] fp32, -inf for a query that sees no key); differentiable in both.

    Dense: kv_lens [B] (group-global valid key prefix) and kv_mask [B, S_group] (valid keys) are optional
    masks; q_chunk bounds the plain-JAX block's memory. Sparse: kv_index / kv_count (group-global block
    ids, see the module) and kv_valid [B, S_group // kv_block]; the kernel `impl` runs on each chunk."""
    sparse = kv_index is not None
    masks = (kv_index, kv_count, kv_valid) if sparse else (kv_lens, kv_mask)
    steps = RingSteps(sparse, float(sm_scale), q_chunk, q_tile, kv_block, impl)
    return _ring(q, k, v, masks, axis, steps)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _ring(q, k, v, masks, axis: GroupAxis, steps: RingSteps):
    return _ring_fwd(q, k, v, masks, axis, steps)[0]


def _ring_fwd(q, k, v, masks, axis, steps):
    me, n = axis.index(), axis.size
    attend = steps.attend(q, masks)

    def step(r, carry, send=True):
        o, lse, k_cur, v_cur = carry
        # Issue the send of this chunk before using it, so the transfer can overlap the block.
        k_next = axis.shift(k_cur) if send else k_cur
        v_next = axis.shift(v_cur) if send else v_cur
        o_b, lse_b = attend((me - r) % n, k_cur, v_cur)
        o, lse = merge_attention(o, lse, o_b, lse_b)
        return o, lse, k_next, v_next

    b, s, h, d = q.shape
    carry = (jnp.zeros((b, s, h, d), jnp.float32), jnp.full((b, h, s), local.NEG, jnp.float32), k, v)
    carry = jax.lax.fori_loop(0, n - 1, step, carry)
    o, lse, _, _ = step(n - 1, carry, send=False)
    out, lse = name_residuals(o.astype(q.dtype), lse)  # what model.remat_keep_attention keeps
    visible = jnp.where(lse > local.NEG / 2, lse, -jnp.inf)
    return (out, visible), (q, k, v, masks, out, lse)


def _ring_bwd(axis, steps, res, cotangents):
    q, k, v, masks, o, lse = res
    do, dlse = cotangents
    me, n = axis.index(), axis.size
    grads = steps.grads(q, masks, o, lse, do, dlse)

    def step(r, carry, send=True):
        dq, k_cur, v_cur, dk, dv = carry
        k_next = axis.shift(k_cur) if send else k_cur
        v_next = axis.shift(v_cur) if send else v_cur
        dq_b, dk_b, dv_b = grads((me - r) % n, k_cur, v_cur)
        # dK/dV of chunk src travel with it; after the last block one more hop brings them home.
        dk, dv = axis.shift(dk + dk_b), axis.shift(dv + dv_b)
        return dq + dq_b, k_next, v_next, dk, dv

    zeros = jnp.zeros(k.shape, jnp.float32)
    carry = (jnp.zeros(q.shape, jnp.float32), k, v, zeros, zeros)
    carry = jax.lax.fori_loop(0, n - 1, step, carry)
    dq, _, _, dk, dv = step(n - 1, carry, send=False)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_ring.defvjp(_ring_fwd, _ring_bwd)


def gather_kv(k, v, axis: GroupAxis):
    return axis.all_gather(k, 1), axis.all_gather(v, 1)


def allgather_attention(
    q,
    k,
    v,
    *,
    axis,
    kv_lens,
    sm_scale,
    backend="auto",
    kv_index=None,
    kv_count=None,
    q_tile=Q_TILE,
    kv_block=KV_BLOCK,
    impl="auto",
    kv_mask=None,
    kv_valid=None,
    return_lse=False,
):
    k_all, v_all = gather_kv(k, v, axis)
    if kv_index is None:
        return local.dense_local(
            q, k_all, v_all, kv_lens=kv_lens, sm_scale=sm_scale, backend=backend, kv_mask=kv_mask, return_lse=return_lse
        )
    return local.sparse_local(
        q,
        k_all,
        v_all,
        kv_index,
        kv_count,
        q_tile=q_tile,
        kv_block=kv_block,
        sm_scale=sm_scale,
        impl=impl,
        kv_valid=kv_valid,
        return_lse=return_lse,
    )


def _compact(mask, capacity):
    """Ids of the True entries of each row of mask [R, N], first `capacity` of them, -1 padded -> [R, C]."""
    pos = jnp.cumsum(mask, axis=-1) - 1
    slot = jnp.where(mask & (pos < capacity), pos, capacity)  # overflow and unselected land in a spill slot
    ids = jnp.broadcast_to(jnp.arange(mask.shape[-1], dtype=jnp.int32), mask.shape)
    out = jnp.full((mask.shape[0], capacity + 1), -1, jnp.int32)
    out = out.at[jnp.arange(mask.shape[0])[:, None], slot].set(ids)
    return out[:, :capacity]


def peer_requests(kv_index, kv_count, *, axis: GroupAxis, nb_loc):
    """need [n, B*H*nb_loc] (row p: which of peer p's blocks my query tiles selected, flat over
    (batch, head, block); my own row is empty) and its row counts requested [n]."""
    b, h = kv_count.shape[:2]
    n = axis.size
    need = selection_mask(kv_index, kv_count, n * nb_loc).reshape(b * h, n, nb_loc)
    need = jnp.swapaxes(need, 0, 1).reshape(n, b * h * nb_loc)
    need = need & (jnp.arange(n) != axis.index())[:, None]  # my own blocks are already here
    return need, jnp.sum(need, axis=1, dtype=jnp.int32)


def selective_attention(
    q,
    k,
    v,
    kv_index,
    kv_count,
    *,
    axis: GroupAxis,
    capacity,
    sm_scale,
    q_tile=Q_TILE,
    kv_block=KV_BLOCK,
    impl="auto",
    kv_valid=None,
    return_lse=False,
):
    """Sparse attention fetching only the selected remote KV blocks. Returns (out, stats), out being
    o or (o, lse [B, H, S_local]) with return_lse.

    capacity: KV blocks this device may request from each peer (over all its batch rows and heads).
    kv_valid: int32 [B, nb] of the group's whole sequence (padded layouts); every device has it, so the
    valid counts of received blocks need no exchange.
    stats: requested remote blocks, the overflow beyond capacity, and whether this call fell back
    to the all-gather path."""
    b, s_loc, h, d = q.shape
    n = axis.size
    nb_loc = s_loc // kv_block
    nb = n * nb_loc
    me = axis.index()
    bh = b * h

    # 1. Which blocks of each peer do my query tiles need?  need [n, B*H*nb_loc] (row p = peer p).
    need, requested = peer_requests(kv_index, kv_count, axis=axis, nb_loc=nb_loc)
    overflow = jnp.sum(jnp.maximum(requested - capacity, 0))
    # Decided over the whole mesh axis, not just the group: every group takes the same branch, with
    # a native all-reduce. It costs no time: in a hybrid the HCP all-to-all after attention waits
    # for the slowest group anyway.
    axis_overflow = jax.lax.psum(overflow, axis.name)

    def exchange(q, k, v):
        req = _compact(need, capacity)  # [n, C] flat ids (bh * nb_loc + block) in peer p's local blocks
        # 2. Tell each peer which of its blocks I want; learn which of mine each peer wants.
        wanted = axis.all_to_all(req, 0, 0)  # [n, C]: row p = peer p's request
        # 3. Send those blocks; receive mine, in my request order.
        k_blocks = jnp.swapaxes(k, 1, 2).reshape(bh * nb_loc, kv_block, d)
        v_blocks = jnp.swapaxes(v, 1, 2).reshape(bh * nb_loc, kv_block, d)
        take = lambda x: jnp.where((wanted >= 0)[..., None, None], jnp.take(x, jnp.maximum(wanted, 0), axis=0), 0)
        k_recv = axis.all_to_all(take(k_blocks), 0, 0)  # [n, C, kv_block, D]
        v_recv = axis.all_to_all(take(v_blocks), 0, 0)
        # 4. One flat buffer: my blocks (row bh, block j at bh * nb_loc + j), then peer p's slot c at
        #    bh * nb_loc + p * C + c; padded to whole query tiles.
        n_buf = bh * nb_loc + n * capacity
        pad = -n_buf % (q_tile // math.gcd(q_tile, kv_block))  # whole query tiles
        # The padding is appended only where there is some. An empty (0-row) piece would go into the
        # gradient's shard_map as a residual of size 0; XLA replaces such values by constants before
        # Shardy runs, which leaves that shard_map with an input its body never reads, and jax
        # 0.11.2's Shardy segfaults removing it (ManualComputationUnusedInputsPattern).
        padding = lambda x: [jnp.zeros((pad, *x.shape[1:]), x.dtype)] if pad else []
        k_buf = jnp.concatenate([k_blocks, k_recv.reshape(-1, kv_block, d), *padding(k_blocks)])
        v_buf = jnp.concatenate([v_blocks, v_recv.reshape(-1, kv_block, d), *padding(v_blocks)])
        # 5. Where each (row, group-global block) lives in the buffer.
        rows = jnp.arange(bh)[:, None]
        where = jnp.zeros((bh, nb), jnp.int32)
        where = where.at[rows, me * nb_loc + jnp.arange(nb_loc)[None]].set(rows * nb_loc + jnp.arange(nb_loc)[None])
        slot_id = bh * nb_loc + jnp.arange(n)[:, None] * capacity + jnp.arange(capacity)[None]  # [n, C]
        peer = jnp.broadcast_to(jnp.arange(n)[:, None], req.shape)
        ok = req >= 0
        r_row = jnp.where(ok, req // nb_loc, bh)  # spill row bh for empty slots
        r_blk = peer * nb_loc + jnp.where(ok, req % nb_loc, 0)
        where = jnp.concatenate([where, jnp.zeros((1, nb), jnp.int32)]).at[r_row, r_blk].set(slot_id)[:bh]
        # 6. Queries of all (batch, head) rows as one sequence of tiles over the buffer.
        idx = jnp.take_along_axis(where, jnp.clip(kv_index, 0, nb - 1).reshape(bh, -1), axis=1)
        idx = idx.reshape(1, 1, -1, kv_index.shape[-1])
        buf_valid = None
        if kv_valid is not None:  # valid keys of every buffer block: mine, then each received slot
            row_batch = jnp.arange(bh) // h
            own = kv_valid[row_batch[:, None], me * nb_loc + jnp.arange(nb_loc)[None]].reshape(-1)
            recv = kv_valid[jnp.where(ok, r_row, 0) // h, r_blk] * ok  # [n, C]; empty slots count 0
            buf_valid = jnp.concatenate([own, recv.reshape(-1), *padding(own)])[None]
        q_flat = jnp.swapaxes(q, 1, 2).reshape(1, bh * s_loc, 1, d)
        out = local.sparse_local(
            q_flat,
            k_buf.reshape(1, -1, 1, d),
            v_buf.reshape(1, -1, 1, d),
            idx,
            kv_count.reshape(1, 1, -1),
            q_tile=q_tile,
            kv_block=kv_block,
            sm_scale=sm_scale,
            impl=impl,
            kv_valid=buf_valid,
            return_lse=return_lse,
        )
        o = out[0] if return_lse else out
        o = jnp.swapaxes(o.reshape(b, h, s_loc, d), 1, 2)
        return (o, out[1].reshape(b, h, s_loc)) if return_lse else o

    def fallback(q, k, v):
        return allgather_attention(
            q,
            k,
            v,
            axis=axis,
            kv_lens=None,
            sm_scale=sm_scale,
            kv_index=kv_index,
            kv_count=kv_count,
            q_tile=q_tile,
            kv_block=kv_block,
            impl=impl,
            kv_valid=kv_valid,
            return_lse=return_lse,
        )

    out = jax.lax.cond(axis_overflow > 0, fallback, exchange, q, k, v)
    stats = {
        "requested_blocks": jnp.sum(requested),
        "overflow_blocks": overflow,
        "fallback": (axis_overflow > 0).astype(jnp.int32),
    }
    return out, stats


def local_selection(q_lr, k_lr_all, top_k, *, q_tile, kv_block, block_reduce="mean", keep=None, kv_valid=None, row0=0):
    """Selection of this device's query tiles against the whole sequence's low-rank keys.

    q_lr [B, S_local, H, r] (the sequence's rows row0 .. row0 + S_local), k_lr_all [B, S, H, r] ->
    kv_index [B, H, T_local, K], kv_count [B, H, T_local]: what `dsv_jax.dsv.selection.select_kv` picks
    for these tiles (same proxies, block scores, padding rule and counts), with the block scores of the
    local tiles materialised ([B, H, T_local, S / kv_block]: small once the queries are split).
    top_k: an int, or one int per head (K = max; head h keeps its top_k[h] best, so kv_count carries
    heterogeneous per-head sparsity). keep: per-head keep ratios [H] or [B, H] (runtime, as select_kv
    takes them; with an int top_k only). kv_valid: int32 [B, S // kv_block] of the whole sequence."""
    b, s_loc, h, r = q_lr.shape
    nb = k_lr_all.shape[1] // kv_block
    q_rows = None
    if kv_valid is not None:
        q_rows = jax.lax.dynamic_slice_in_dim(row_flags(kv_valid, kv_block), row0, s_loc, axis=1)
    proxy = tile_proxies(q_lr, q_tile, q_rows)  # [B, T_local, H, r]
    scores = jnp.einsum("bthr,bshr->bhts", proxy, k_lr_all.astype(jnp.float32))
    scores = reduce_block(
        scores.reshape(b, h, s_loc // q_tile, nb, kv_block),
        block_reduce,
        None if kv_valid is None else kv_valid.astype(jnp.int32)[:, None, None, :],
    )
    if isinstance(top_k, (tuple, list)):  # one count per head (no keep ratios, no padding)
        k_max = int(max(top_k))
        per_head = jnp.asarray(top_k, jnp.int32)
        _, idx = jax.lax.top_k(scores, k_max)  # best first
        live = jnp.arange(k_max) < per_head[None, :, None, None]
        idx = jnp.sort(jnp.where(live, idx, jnp.iinfo(jnp.int32).max), axis=-1)  # kept ids ascending, then the rest
        idx = jnp.where(idx == jnp.iinfo(jnp.int32).max, 0, idx).astype(jnp.int32)
        return idx, jnp.broadcast_to(per_head[None, :, None], idx.shape[:3])
    _, idx = jax.lax.top_k(scores, int(top_k))
    idx = jnp.sort(idx, axis=-1).astype(jnp.int32)
    return apply_counts(idx, int(top_k), keep, nb, kv_valid, lambda: jnp.take_along_axis(scores, idx, axis=-1))
