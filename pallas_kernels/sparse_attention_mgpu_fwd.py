"""Forward of block-sparse attention on Hopper in Pallas Mosaic GPU (wgmma, TMA, warp specialisation).

CTA (head, pair of 64-row query tiles, batch), three warpgroups:
  consumers 0 and 1: 64 query rows each, Q resident in SMEM. Per step: S = Q K^T by wgmma, online
    softmax in base 2 in registers, O += P V by wgmma with P from registers. A schedule barrier
    staggers the two (one's softmax runs while the other's products hold the tensor cores).
  producer: streams the 64-row K and V slices of the selected blocks, kv_index[tile, entry] for
    kv_count[tile] blocks, into a ring of SMEM stages (mgpu_common.producer), cfg.fwd_step_rows // 64
    slices per stage: with 128-row steps S is [64, 128] and a step costs one rescale of O, one wait and
    two wgmma issues for twice the keys. An odd slice count ends in a half step whose second slice
    repeats the first (finite data) and is masked.
With q_tile = 128 both consumers walk the tile's one list and share the ring; with q_tile = 64 each
walks its own tile's list through its own ring. With cfg.fwd_programs > 0 a CTA is persistent and runs
several work items in turn (mgpu_common.WorkItems): the rings continue from one item to the next, and an
item's output store is waited for only before its SMEM takes the next item's Q.

Outputs o [B, S, H, D] and lse2 [B, H, S] = log2 of the softmax denominator of the logits scaled by
sm_scale * log2(e) (-inf for a row that selected no valid key; its o is 0).
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
    producer,
    schedule_round,
    swizzled,
    walk_for,
)
from pallas_kernels.sparse_index import result_type


def forward(q, k, v, index, count, valid, cfg: AttentionConfig):
    """index [B, H, T, K] sanitized, count [B, H, T]; valid [B, H, T, K] valid keys of each selected
    block (cfg.masked) or None. Returns (o, lse2)."""
    plgpu = import_plgpu()
    ops = Ops(plgpu, cfg.interpret)
    b, s, h, d = q.shape
    dtype = q.dtype
    lists, stages = cfg.fwd_lists, cfg.fwd_stages
    walk = walk_for(cfg.kv_block, cfg.fwd_step_rows)
    sub = walk.sub
    qk_scale = cfg.sm_scale * LOG2E
    masked = cfg.masked

    work = cfg.work("fwd", h, s // (CONSUMERS * ROWS), b)

    def body(q_ref, k_ref, v_ref, index_ref, count_ref, valid_ref, o_ref, lse_ref, scratch):
        (q_smem, k_smem, v_smem, lse_smem), (q_ready, k_ready, v_ready, k_free, v_free, sched) = scratch
        wg = lax.axis_index("wg")

        @pl.when(wg < CONSUMERS)
        def _consume():
            ops.set_registers(cfg.consumer_registers, "increase")
            list_id = wg if lists == 2 else 0
            base = list_id * stages
            my_q, my_lse = q_smem.at[wg], lse_smem.at[wg]

            def attend(i, item, done):
                """One work item; done: steps this consumer's ring carried before it."""
                hi, ci, bi = item
                _, _, steps = walk.lists(count_ref, item, lists)
                tile, n_slices, n = walk.list_of(count_ref, item, list_id, lists)
                longest = steps[0] if lists == 1 else jnp.maximum(steps[0], steps[1])
                rows = pl.ds(ci * (CONSUMERS * ROWS) + wg * ROWS, ROWS)
                if work.programs:  # the previous item's output must have left my_q, my_lse
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                plgpu.copy_gmem_to_smem(q_ref.at[bi, rows, hi], my_q, q_ready.at[wg])
                plgpu.barrier_wait(q_ready.at[wg])

                def slot_of(step):
                    return base + lax.rem(done + step, stages)

                def valid_keys(step):  # valid keys of each 64-row slice of this step
                    return walk.valid_keys(step, n_slices, (lambda e: valid_ref[bi, hi, tile, e]) if masked else None)

                @pl.when(n > 0)
                def _():
                    plgpu.barrier_wait(k_ready.at[slot_of(0)])

                pl.when(wg == 1)(lambda: schedule_round(plgpu, sched))

                def step_fn(step, carry, mask):
                    acc, m_i, l_i, n_valid = carry
                    slot = slot_of(step)
                    (logits,) = ops.mma(
                        [((ROWS, cfg.fwd_step_rows), my_q, k_smem.at[slot], True)],
                        after=lambda: schedule_round(plgpu, sched),
                    )
                    plgpu.barrier_arrive(k_free.at[slot])
                    if mask:
                        logits = jnp.where(walk.keep(ops, logits.shape, n_valid), logits, -jnp.inf)
                        n_valid = valid_keys(step + 1)
                    m_new = jnp.maximum(m_i, logits.max(axis=1) * qk_scale)
                    # A row whose keys so far are all masked keeps m = -inf; exponents then use 0.
                    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new) if mask else m_new
                    alpha = jnp.exp2(m_i - m_use)
                    p = jnp.exp2(logits * qk_scale - lax.broadcast_in_dim(m_use, logits.shape, [0]))
                    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                    l_i = l_i * alpha + p.sum(axis=1)
                    p16 = p.astype(dtype)
                    acc, l_i, m_new, p16 = lax.optimization_barrier((acc, l_i, m_new, p16))
                    plgpu.barrier_arrive(sched)  # softmax done: the other consumer may issue
                    plgpu.barrier_wait(v_ready.at[slot])
                    plgpu.barrier_wait(sched)  # the tensor cores are ours again

                    def wait_next_k():
                        nxt = step + 1

                        @pl.when(nxt < n)
                        def _():
                            plgpu.barrier_wait(k_ready.at[slot_of(nxt)])

                    (acc,) = ops.mma([(acc, p16, v_smem.at[slot], False)], after=wait_next_k)
                    plgpu.barrier_arrive(v_free.at[slot])
                    return acc, m_new, l_i, n_valid

                init = (
                    ops.full((ROWS, d), 0.0, ops.wgmma_layout),
                    ops.full((ROWS,), -jnp.inf, ops.row_layout()),
                    ops.full((ROWS,), 0.0, ops.row_layout()),
                )
                acc, m_i, l_i = walk.loop(n_slices, masked, step_fn, init, valid_keys)
                if lists == 2:  # keep the schedule barrier's rounds matched while the other list runs on

                    @pl.loop(n, longest)
                    def _pad(_):
                        schedule_round(plgpu, sched)
                        schedule_round(plgpu, sched)

                pl.when(wg == 0)(lambda: schedule_round(plgpu, sched))

                empty = l_i == 0.0
                inv = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, l_i))
                my_q[...] = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(dtype)
                my_lse[...] = jnp.where(empty, -jnp.inf, m_i + jnp.log(jnp.where(empty, 1.0, l_i)) * LOG2E)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(my_q, o_ref.at[bi, rows, hi])
                plgpu.copy_smem_to_gmem(my_lse, lse_ref.at[bi, hi, rows])
                return done + n

            work.loop(attend, 0)
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

    def dsv_sparse_fwd(*refs):  # the kernel's name in profiles
        if masked:
            q_ref, k_ref, v_ref, index_ref, count_ref, valid_ref, o_ref, lse_ref = refs
        else:
            (q_ref, k_ref, v_ref, index_ref, count_ref, o_ref, lse_ref), valid_ref = refs, None
        ring = lists * stages
        pl.run_scoped(
            lambda *scratch: body(q_ref, k_ref, v_ref, index_ref, count_ref, valid_ref, o_ref, lse_ref, scratch),
            (
                swizzled(plgpu, (CONSUMERS, ROWS, d), dtype),
                swizzled(plgpu, (ring, cfg.fwd_step_rows, d), dtype),
                swizzled(plgpu, (ring, cfg.fwd_step_rows, d), dtype),
                plgpu.SMEM((CONSUMERS, ROWS), jnp.float32),
            ),
            (
                plgpu.Barrier(num_barriers=CONSUMERS),
                plgpu.Barrier(num_arrivals=sub, num_barriers=ring),
                plgpu.Barrier(num_arrivals=sub, num_barriers=ring),
                plgpu.Barrier(num_arrivals=CONSUMERS // lists, num_barriers=ring),
                plgpu.Barrier(num_arrivals=CONSUMERS // lists, num_barriers=ring),
                plgpu.Barrier(num_arrivals=CONSUMERS),
            ),
            collective_axes="wg",
        )

    call = kernel_call(
        plgpu,
        dsv_sparse_fwd,
        [result_type(q.shape, dtype, q), result_type((b, h, s), jnp.float32, q)],
        **work.launch(),
        num_threads=CONSUMERS + 1,
        thread_name="wg",
        compiler_params=compiler_params(plgpu),
        interpret=cfg.interpret_params(),
    )
    args = (q, k, v, index, count) + ((valid,) if masked else ())
    return call(*args)
