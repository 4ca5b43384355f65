"""dK/dV of block-sparse attention over KV blocks of 16 or 32 rows on Hopper, in Pallas Mosaic GPU.

The forward and dQ kernels of these blocks are the 64-row ones (sparse_attention_mgpu_fwd, _bwd) walking
their lists with `mgpu_common.FineWalk`. The transposed side cannot share a 64-row key tile between blocks:
with random selections the four 16-row blocks of 64 keys are selected by nearly disjoint query tiles, and
walking the union of their lists wastes 3.4x the products at 90% sparsity (docs/kernels/mgpu_notes.md,
"Fine KV blocks"). So each consumer warpgroup owns one block of g = kv_block keys and walks its own list,
with products whose small side is g:

    S = Q K_b^T, dP = dO V_b^T                  [64 queries, g]   (wgmma N = g; one wait)
    P = exp2(S * sm_scale * log2 e - lse2), dS = P * (dP - delta)       (one value per query row, as in dQ)
    P^T, dS^T -> SMEM as bf16 [g, 64]         (the transposed register layout: one shuffle)
    dV^T[h] += dO[:, h]^T P, dK^T[h] += Q[:, h]^T dS                     (M = 64 columns h of D, N = g, K = 64)

CTA (head, pair of blocks, batch): consumer w owns the block at place 2 c + w of `blocks` (longest list
first by default, as for 64-row blocks); the producer streams the 64-row halves of the query tiles of both
lists (Q with lse2, dO with delta) through one ring per list. A transposed A operand (dO^T, Q^T) must have
the swizzle of its B operand; P and dS are therefore stored transposed, 64 queries (128 bytes) a row, so that
every operand is swizzled at 128 bytes. (Storing P as [64, g] forced a 2g-byte swizzle on the Q / dO ring, and
its TMA copies then fetch 32-byte rows: at g = 16 the L2 ran request-bound, 98% busy at 52% of its bandwidth;
docs/kernels/mgpu_notes.md.)
The accumulators dK^T, dV^T [64 columns of D, g] are stored transposed the same way, as [g, 64] tiles of
dK, dV [B, S, H, D].
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
    transposed_producer,
)
from pallas_kernels.sparse_index import result_type


def swizzled_at(plgpu, shape, dtype, swizzle: int):
    """SMEM of rows of a 16-bit dtype, tiled (8, swizzle // itemsize) and swizzled at `swizzle` bytes."""
    tiling = plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize))
    return plgpu.SMEM(shape, dtype, transforms=(tiling, plgpu.SwizzleTransform(swizzle)))


def mma(ops: Ops, products):
    """ops.mma with transposable SMEM operands: products (acc, a, b, transpose_a, transpose_b), a @ b with each
    side transposed where asked; issued together, one wait. The GPU interpreter takes plain dots."""
    if ops.interpret:
        outs = []
        for acc, a, b, transpose_a, transpose_b in products:
            a_val, b_val = a[...], b[...]
            a_val, b_val = a_val.T if transpose_a else a_val, b_val.T if transpose_b else b_val
            prod = jnp.dot(a_val, b_val, preferred_element_type=jnp.float32)
            outs.append(prod if isinstance(acc, tuple) else acc + prod)
        return outs
    t = lambda ref, flip: ops.plgpu.transpose_ref(ref, (1, 0)) if flip else ref
    return ops.mma([(acc, t(a, ta), b, tb) for acc, a, b, ta, tb in products])


def dkdv(q, k, v, do, lse2, delta, tiles, starts, blocks, valid, cfg: AttentionConfig):
    """(dk, dv) [B, S, H, D] over KV blocks of g = cfg.kv_block (16 or 32) rows.

    tiles [B, H, N]: query tiles of the transposed index in block order; block j is
    tiles[starts[j]:starts[j + 1]], starts [B, H, S // g + 1]. blocks [B, H, S // g]: a permutation of the
    blocks, the order in which CTAs take them. valid [B, S // g]: valid keys of each block (cfg.masked), in
    0..g, or None. lse2 [B, H, S] with +inf where a row has no valid key (its P is then 0)."""
    plgpu = import_plgpu()
    ops = Ops(plgpu, cfg.interpret)
    b, s, h, d = q.shape
    dtype = q.dtype
    g = cfg.kv_block
    if g >= ROWS or ROWS % g:
        raise ValueError(f"sparse_attention_mgpu_fine.dkdv: kv_block={g} must divide {ROWS} (16 or 32)")
    stages, lists = cfg.dkdv_stages, CONSUMERS
    per_tile = cfg.q_tile // ROWS  # 64-row steps per query tile of a list
    halves = d // ROWS  # 64-column halves of the head dim (M of the transposed products)
    qk_scale = cfg.sm_scale * LOG2E
    masked = cfg.masked

    work = cfg.work("dkdv", h, s // (CONSUMERS * g), b)

    def store_transposed(ref, x):
        """x [64, g] (wgmma layout) into ref [g, 64] as x^T: a register shuffle, then a 128-byte swizzled store."""
        if ops.interpret:
            ref[...] = x.T
        else:
            plgpu.transpose_ref(ref, (1, 0))[...] = plgpu.layout_cast(x, plgpu.Layout.WGMMA_TRANSPOSED)

    def body(refs, scratch):
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, tiles_ref, starts_ref, blocks_ref, valid_ref, *outs = refs
        dk_ref, dv_ref = outs
        (k_smem, v_smem, q_ring, do_ring, lse_ring, delta_ring, pt_smem, dst_smem, out_smem), barriers = scratch
        kv_ready, a_ready, a_free, b_ready, b_free = barriers
        wg = lax.axis_index("wg")

        def block_of(item, list_id):
            hi, ci, bi = item
            return blocks_ref[bi, hi, ci * lists + list_id]

        @pl.when(wg < CONSUMERS)
        def _consume():
            ops.set_registers(cfg.consumer_registers, "increase")
            base = wg * stages
            my_k, my_v, my_pt, my_dst = k_smem.at[wg], v_smem.at[wg], pt_smem.at[wg], dst_smem.at[wg]

            def gradients(i, item, done):
                """One work item; done: steps this consumer's ring carried before it."""
                hi, ci, bi = item
                block = block_of(item, wg)
                n = (starts_ref[bi, hi, block + 1] - starts_ref[bi, hi, block]) * per_tile
                rows = pl.ds(block * g, g)
                if work.programs:  # the previous item's dK, dV tiles must have left out_smem
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                plgpu.copy_gmem_to_smem(k_ref.at[bi, rows, hi], my_k, kv_ready.at[wg])
                plgpu.copy_gmem_to_smem(v_ref.at[bi, rows, hi], my_v, kv_ready.at[wg])
                plgpu.barrier_wait(kv_ready.at[wg])
                n_valid = valid_ref[bi, block] if masked else None

                def step_fn(step, accs):
                    slot = base + lax.rem(done + step, stages)
                    plgpu.barrier_wait(a_ready.at[slot])
                    plgpu.barrier_wait(b_ready.at[slot])
                    logits, dp = mma(
                        ops,
                        [
                            ((ROWS, g), q_ring.at[slot], my_k, False, True),
                            ((ROWS, g), do_ring.at[slot], my_v, False, True),
                        ],
                    )
                    lse = ops.load(lse_ring.at[slot], ops.row_layout())
                    p = jnp.exp2(logits * qk_scale - lax.broadcast_in_dim(lse, logits.shape, [0]))
                    if masked:  # keys past the block's valid ones are not part of any softmax
                        p = jnp.where(ops.iota(p.shape, 1) < n_valid, p, 0.0)
                    delta = ops.load(delta_ring.at[slot], ops.row_layout())
                    ds = p * (dp - lax.broadcast_in_dim(delta, dp.shape, [0]))
                    store_transposed(my_pt, p.astype(dtype))
                    store_transposed(my_dst, ds.astype(dtype))
                    plgpu.commit_smem()  # the stores are visible to the wgmma (async proxy)
                    cols = [pl.ds(j * ROWS, ROWS) for j in range(halves)]
                    accs = mma(
                        ops,
                        [(accs[j], do_ring.at[slot, :, cols[j]], my_pt, True, True) for j in range(halves)]
                        + [(accs[halves + j], q_ring.at[slot, :, cols[j]], my_dst, True, True) for j in range(halves)],
                    )
                    plgpu.barrier_arrive(b_free.at[slot])
                    plgpu.barrier_arrive(a_free.at[slot])
                    return tuple(accs)

                zeros = ops.full((ROWS, g), 0.0, ops.wgmma_layout)
                accs = lax.fori_loop(0, n, step_fn, (zeros,) * (2 * halves))  # dV^T halves, then dK^T halves
                for j in range(halves):  # back to [g, 64] tiles of dK, dV: no transpose left for XLA
                    store_transposed(out_smem.at[wg, 0, j], (accs[halves + j] * cfg.sm_scale).astype(dtype))
                    store_transposed(out_smem.at[wg, 1, j], accs[j].astype(dtype))
                plgpu.commit_smem()
                for j in range(halves):
                    cols = pl.ds(j * ROWS, ROWS)
                    plgpu.copy_smem_to_gmem(out_smem.at[wg, 0, j], dk_ref.at[bi, rows, hi, cols])
                    plgpu.copy_smem_to_gmem(out_smem.at[wg, 1, j], dv_ref.at[bi, rows, hi, cols])
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

    def dsv_sparse_dkdv_fine(*refs):  # the kernel's name in profiles
        if not masked:
            refs = refs[:9] + (None,) + refs[9:]
        ring = lists * stages
        wide = lambda shape: swizzled_at(plgpu, shape, dtype, 128)
        pl.run_scoped(
            lambda *scratch: body(refs, scratch),
            (
                wide((CONSUMERS, g, d)),
                wide((CONSUMERS, g, d)),
                wide((ring, ROWS, d)),
                wide((ring, ROWS, d)),
                plgpu.SMEM((ring, ROWS), jnp.float32),
                plgpu.SMEM((ring, ROWS), jnp.float32),
                wide((CONSUMERS, g, ROWS)),  # P^T, dS^T: 64 queries a row
                wide((CONSUMERS, g, ROWS)),
                wide((CONSUMERS, 2, halves, g, ROWS)),
            ),
            (
                plgpu.Barrier(num_arrivals=2, num_barriers=CONSUMERS),
                plgpu.Barrier(num_arrivals=2, num_barriers=ring),
                plgpu.Barrier(num_arrivals=1, num_barriers=ring),
                plgpu.Barrier(num_arrivals=2, num_barriers=ring),
                plgpu.Barrier(num_arrivals=1, num_barriers=ring),
            ),
            collective_axes="wg",
        )

    call = kernel_call(
        plgpu,
        dsv_sparse_dkdv_fine,
        [result_type(q.shape, dtype, q), result_type(q.shape, dtype, q)],
        **work.launch(),
        num_threads=CONSUMERS + 1,
        thread_name="wg",
        compiler_params=compiler_params(plgpu),
        interpret=cfg.interpret_params(),
    )
    args = (q, k, v, do, lse2, delta, tiles, starts, blocks) + ((valid,) if masked else ())
    return tuple(call(*args))
