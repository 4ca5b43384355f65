"""Backward of block-sparse attention on Hopper in Pallas Mosaic GPU: a dQ kernel and a dK/dV kernel.

Both recompute P = exp2(S * sm_scale * log2 e - lse2) from the forward's lse2 and use
delta = rowsum(o * do) - dlse (plain JAX, before the kernels); dS = P * (dP - delta).

dQ: CTA (head, pair of 64-row query tiles, batch) as the forward: two consumers hold Q and dO in
  SMEM, the producer streams the selected K and V slices, cfg.dq_step_rows // 64 per step (as the
  forward's steps). Per step S = Q K^T and dP = dO V^T (one wait), dQ += dS K.
dK/dV: CTA (head, two 64-row or one 128-row block of key rows, batch); consumer w owns 64 key rows (K
  and V in SMEM) and walks the query tiles that selected them: the transposed index
  (sparse_index.dkdv_worklist, by counting, no atomics), one list per consumer for 64-token blocks, one
  shared list when a block spans both. CTA c takes the row blocks at places lists * c + i of `blocks`
  (longest list first by default: a CTA's two lists are then almost equally long).
  The producer streams Q, lse2 (group a) and dO, delta (group b) of those tiles. Per step
  S^T = K Q^T with dP^T = V dO^T (one wait), P^T and dS^T, then dV += P^T dO with dK += dS^T Q.
With cfg.dq_programs or cfg.dkdv_programs > 0 that kernel is persistent, as the forward can be
(mgpu_common.WorkItems).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.mgpu_common import (
    CONSUMERS,
    LOG2E,
    ROWS,
    AttentionConfig,
    Ops,
    compiler_params,
    import_plgpu,
    kernel_call,
    load_query_rows,
    producer,
    swizzled,
    transposed_producer,
    walk_for,
)
from pallas_kernels.sparse_index import result_type

_PAIR = CONSUMERS * ROWS


def _barriers(plgpu, lists, stages, ready_arrivals):
    ring = lists * stages
    return (
        plgpu.Barrier(num_arrivals=ready_arrivals, num_barriers=ring),
        plgpu.Barrier(num_arrivals=CONSUMERS // lists, num_barriers=ring),
    )


def dq(q, k, v, do, lse2, delta, index, count, valid, cfg: AttentionConfig):
    """dq [B, S, H, D]. lse2 [B, H, S] with +inf where a row has no valid key (its P is then 0)."""
    plgpu = import_plgpu()
    ops = Ops(plgpu, cfg.interpret)
    b, s, h, d = q.shape
    dtype = q.dtype
    lists, stages = cfg.fwd_lists, cfg.dq_stages
    walk = walk_for(cfg.kv_block, cfg.dq_step_rows)
    sub = walk.sub
    qk_scale = cfg.sm_scale * LOG2E
    masked = cfg.masked

    work = cfg.work("dq", h, s // _PAIR, b)

    def body(refs, scratch):
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, index_ref, count_ref, valid_ref, dq_ref = refs
        (q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem), barriers = scratch
        rows_ready, k_ready, k_free, v_ready, v_free = barriers
        wg = lax.axis_index("wg")

        @pl.when(wg < CONSUMERS)
        def _consume():
            ops.set_registers(cfg.consumer_registers, "increase")
            list_id = wg if lists == 2 else 0
            base = list_id * stages
            my_q, my_do = q_smem.at[wg], do_smem.at[wg]
            ready = rows_ready.at[wg]

            def gradient(i, item, done):
                """One work item; done: steps this consumer's ring carried before it."""
                hi, ci, bi = item
                tile, n_slices, n = walk.list_of(count_ref, item, list_id, lists)
                rows = pl.ds(ci * _PAIR + wg * ROWS, ROWS)
                lse, delta = load_query_rows(
                    plgpu,
                    ops,
                    (q_ref, do_ref, lse_ref, delta_ref),
                    (my_q, my_do, lse_smem.at[wg], delta_smem.at[wg]),
                    (bi, rows, hi),
                    ready,
                    persistent=bool(work.programs),
                )

                def slot_of(step):
                    return base + lax.rem(done + step, stages)

                def valid_keys(step):  # valid keys of each 64-row slice of this step
                    return walk.valid_keys(step, n_slices, (lambda e: valid_ref[bi, hi, tile, e]) if masked else None)

                @pl.when(n > 0)
                def _():
                    plgpu.barrier_wait(k_ready.at[slot_of(0)])

                def step_fn(step, carry, mask):
                    acc, n_valid = carry
                    slot = slot_of(step)
                    plgpu.barrier_wait(v_ready.at[slot])
                    logits, dp = ops.mma(
                        [
                            ((ROWS, cfg.dq_step_rows), my_q, k_smem.at[slot], True),
                            ((ROWS, cfg.dq_step_rows), my_do, v_smem.at[slot], True),
                        ]
                    )
                    plgpu.barrier_arrive(v_free.at[slot])
                    p = jnp.exp2(logits * qk_scale - lax.broadcast_in_dim(lse, logits.shape, [0]))
                    if mask:
                        p = jnp.where(walk.keep(ops, p.shape, n_valid), p, 0.0)
                        n_valid = valid_keys(step + 1)
                    ds = p * (dp - lax.broadcast_in_dim(delta, dp.shape, [0]))

                    def wait_next_k():
                        nxt = step + 1

                        @pl.when(nxt < n)
                        def _():
                            plgpu.barrier_wait(k_ready.at[slot_of(nxt)])

                    (acc,) = ops.mma([(acc, ds.astype(dtype), k_smem.at[slot], False)], after=wait_next_k)
                    plgpu.barrier_arrive(k_free.at[slot])
                    return acc, n_valid

                (acc,) = walk.loop(n_slices, masked, step_fn, (ops.full((ROWS, d), 0.0, ops.wgmma_layout),), valid_keys)
                my_q[...] = (acc * cfg.sm_scale).astype(dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(my_q, dq_ref.at[bi, rows, hi])
                return done + n

            work.loop(gradient, 0)
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == CONSUMERS)
        def _produce():
            producer(
                plgpu,
                ops,
                work,
                lists=lists,
                stages=stages,
                registers=cfg.producer_registers,
                rings=[(k_ready, k_free), (v_ready, v_free)],
                streams=walk.streams(plgpu, index_ref, count_ref, [(k_ref, k_smem), (v_ref, v_smem)], lists, stages),
            )

    def dsv_sparse_dq(*refs):  # the kernel's name in profiles
        if not masked:
            refs = refs[:8] + (None,) + refs[8:]
        ring = lists * stages
        wide = lambda n, rows=ROWS: swizzled(plgpu, (n, rows, d), dtype)
        pl.run_scoped(
            lambda *scratch: body(refs, scratch),
            (
                wide(CONSUMERS),
                wide(CONSUMERS),
                plgpu.SMEM((CONSUMERS, ROWS), jnp.float32),
                plgpu.SMEM((CONSUMERS, ROWS), jnp.float32),
                wide(ring, cfg.dq_step_rows),
                wide(ring, cfg.dq_step_rows),
            ),
            (
                plgpu.Barrier(num_arrivals=4, num_barriers=CONSUMERS),
                *_barriers(plgpu, lists, stages, sub),
                *_barriers(plgpu, lists, stages, sub),
            ),
            collective_axes="wg",
        )

    call = kernel_call(
        plgpu,
        dsv_sparse_dq,
        result_type(q.shape, dtype, q),
        **work.launch(),
        num_threads=CONSUMERS + 1,
        thread_name="wg",
        compiler_params=compiler_params(plgpu),
        interpret=cfg.interpret_params(),
    )
    args = (q, k, v, do, lse2, delta, index, count) + ((valid,) if masked else ())
    return call(*args)


def dkdv(q, k, v, do, lse2, delta, tiles, starts, blocks, rows_valid, cfg: AttentionConfig):
    """(dk, dv) [B, S, H, D].

    tiles [B, H, N]: query tiles of the transposed index in row-block order; row block j (of
    cfg.dkdv_rows key rows) is tiles[starts[j]:starts[j + 1]], starts [B, H, S // dkdv_rows + 1].
    blocks [B, H, S // dkdv_rows]: a permutation of the row blocks, the order in which CTAs take them.
    rows_valid [B, S // 64] valid keys of each 64 key rows (cfg.masked) or None.
    """
    plgpu = import_plgpu()
    ops = Ops(plgpu, cfg.interpret)
    b, s, h, d = q.shape
    dtype = q.dtype
    lists, stages = cfg.dkdv_lists, cfg.dkdv_stages
    per_tile = cfg.q_tile // ROWS  # steps per query tile of the list
    qk_scale = cfg.sm_scale * LOG2E
    masked = cfg.masked

    work = cfg.work("dkdv", h, s // _PAIR, b)

    def body(refs, scratch):
        (
            q_ref,
            k_ref,
            v_ref,
            do_ref,
            lse_ref,
            delta_ref,
            tiles_ref,
            starts_ref,
            blocks_ref,
            valid_ref,
            dk_ref,
            dv_ref,
        ) = refs
        (k_smem, v_smem, q_ring, do_ring, lse_ring, delta_ring), barriers = scratch
        kv_ready, a_ready, a_free, b_ready, b_free = barriers
        wg = lax.axis_index("wg")

        def block_of(item, list_id):  # the row block (of cfg.dkdv_rows key rows) that list `list_id` walks
            hi, ci, bi = item
            return blocks_ref[bi, hi, ci * lists + list_id]

        @pl.when(wg < CONSUMERS)
        def _consume():
            ops.set_registers(cfg.consumer_registers, "increase")
            list_id = wg if lists == 2 else 0
            base = list_id * stages
            my_k, my_v = k_smem.at[wg], v_smem.at[wg]

            def gradients(i, item, done):
                """One work item; done: steps this consumer's ring carried before it."""
                hi, ci, bi = item
                block = block_of(item, list_id)
                n = (starts_ref[bi, hi, block + 1] - starts_ref[bi, hi, block]) * per_tile
                first_row = block * cfg.dkdv_rows + (wg * ROWS if lists == 1 else 0)  # of this consumer's 64 keys
                rows = pl.ds(first_row, ROWS)
                if work.programs:  # the previous item's dk, dv must have left my_k, my_v
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                plgpu.copy_gmem_to_smem(k_ref.at[bi, rows, hi], my_k, kv_ready.at[wg])
                plgpu.copy_gmem_to_smem(v_ref.at[bi, rows, hi], my_v, kv_ready.at[wg])
                plgpu.barrier_wait(kv_ready.at[wg])

                def step_fn(step, carry):
                    """S^T = K Q^T and dP^T = V dO^T together (one wait), P^T and dS^T in their registers, then
                    dV += P^T dO and dK += dS^T Q together: two waits a step, and at most two fp32 64 x 64 tiles
                    live beside the accumulators. (S^T; dV with dP^T; dK, three waits, kept P^T alive across a
                    product and spilled registers: 2% slower at 64k, docs/kernels/mgpu_notes.md.)"""
                    dk_acc, dv_acc = carry
                    slot = base + lax.rem(done + step, stages)
                    plgpu.barrier_wait(a_ready.at[slot])
                    plgpu.barrier_wait(b_ready.at[slot])
                    logits_t, dp_t = ops.mma(
                        [((ROWS, ROWS), my_k, q_ring.at[slot], True), ((ROWS, ROWS), my_v, do_ring.at[slot], True)]
                    )
                    lse = ops.load(lse_ring.at[slot], ops.col_layout())
                    p_t = jnp.exp2(logits_t * qk_scale - lax.broadcast_in_dim(lse, logits_t.shape, [1]))
                    delta = ops.load(delta_ring.at[slot], ops.col_layout())
                    ds_t = p_t * (dp_t - lax.broadcast_in_dim(delta, dp_t.shape, [1]))
                    dv_acc, dk_acc = ops.mma(
                        [
                            (dv_acc, p_t.astype(dtype), do_ring.at[slot], False),
                            (dk_acc, ds_t.astype(dtype), q_ring.at[slot], False),
                        ]
                    )
                    plgpu.barrier_arrive(b_free.at[slot])
                    plgpu.barrier_arrive(a_free.at[slot])
                    return dk_acc, dv_acc

                zeros = ops.full((ROWS, d), 0.0, ops.wgmma_layout)
                dk_acc, dv_acc = lax.fori_loop(0, n, step_fn, (zeros, zeros))
                dk_acc = dk_acc * cfg.sm_scale
                if masked:  # masked keys get no gradient (their rows of P were not part of the softmax)
                    keep = ops.iota(dk_acc.shape, 0) < valid_ref[bi, lax.div(first_row, ROWS)]
                    dk_acc, dv_acc = jnp.where(keep, dk_acc, 0.0), jnp.where(keep, dv_acc, 0.0)
                my_k[...] = dk_acc.astype(dtype)
                my_v[...] = dv_acc.astype(dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(my_k, dk_ref.at[bi, rows, hi])
                plgpu.copy_smem_to_gmem(my_v, dv_ref.at[bi, rows, hi])
                return done + n

            work.loop(gradients, 0)
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == CONSUMERS)
        def _produce():
            transposed_producer(
                plgpu,
                ops,
                work,
                registers=cfg.producer_registers,
                rings=[(a_ready, a_free), (b_ready, b_free)],
                tiles_ref=tiles_ref,
                starts_ref=starts_ref,
                block_of=block_of,
                per_tile=per_tile,
                q_tile=cfg.q_tile,
                lists=lists,
                stages=stages,
                groups=[[(q_ref, q_ring), (lse_ref, lse_ring)], [(do_ref, do_ring), (delta_ref, delta_ring)]],
            )

    def dsv_sparse_dkdv(*refs):  # the kernel's name in profiles
        if not masked:
            refs = refs[:9] + (None,) + refs[9:]
        ring = lists * stages
        wide = lambda n: swizzled(plgpu, (n, ROWS, d), dtype)
        pl.run_scoped(
            lambda *scratch: body(refs, scratch),
            (
                wide(CONSUMERS),
                wide(CONSUMERS),
                wide(ring),
                wide(ring),
                plgpu.SMEM((ring, ROWS), jnp.float32),
                plgpu.SMEM((ring, ROWS), jnp.float32),
            ),
            (
                plgpu.Barrier(num_arrivals=2, num_barriers=CONSUMERS),
                *_barriers(plgpu, lists, stages, 2),
                *_barriers(plgpu, lists, stages, 2),
            ),
            collective_axes="wg",
        )

    call = kernel_call(
        plgpu,
        dsv_sparse_dkdv,
        [result_type(k.shape, dtype, q), result_type(v.shape, dtype, q)],
        **work.launch(),
        num_threads=CONSUMERS + 1,
        thread_name="wg",
        compiler_params=compiler_params(plgpu),
        interpret=cfg.interpret_params(),
    )
    args = (q, k, v, do, lse2, delta, tiles, starts, blocks) + ((rows_valid,) if masked else ())
    return call(*args)
