"""Backward of block-sparse attention over KV blocks of 16 or 32 rows on Hopper, by query tile, in Pallas Mosaic
GPU: dQ, dK and dV in one kernel, the dK/dV partials of each query tile added into fp32 arrays by TMA reductions.

Why (docs/kernels/mgpu_notes.md, "The fused backward"): the split backward's fine dK/dV
(sparse_attention_mgpu_fine) reads the Q and dO rows of every query tile once per 16-key block that the tile
selected, 64 KiB per (128-query tile, 16-key block) pair, and runs at the L2's bandwidth. Walked by query tile
instead, a pair costs its K and V rows (8 KiB, as dQ already reads them) and the fp32 reduction of its dK and dV
rows (16 KiB), and the S and dP products are computed once for dQ and dK/dV (five products a pair, not seven).
Measured (one H100, S = 64k): fwd + bwd 1.46x as fast as the split kernels at 16-row blocks and 90% sparsity, 1.05x
at 95%, where its adds miss L2; 0.93x / 0.78x at 32-row blocks. So it is the default at 16 rows only
(pallas_kernels.tuning.mgpu_defaults; tuning `fused_backward` overrides).

CTA (head, 128-row query tile, batch), as dQ's with q_tile 128: consumer w holds Q and dO of its 64 query rows;
the producer streams the tile's selected K and V blocks, 64 // kv_block of them (64 key rows) a step. A step:

    S = Q_w K^T, dP = dO_w V^T                    [64 queries, 64 keys]      (one wait)
    P = exp2(S * sm_scale * log2 e - lse2), dS = P * (dP - delta)            (as in dQ)
    dQ_w += dS K
    P_w, dS_w -> SMEM, shared by the two consumers ([2, 64, 64] bf16 each); both consumers meet
    consumer 0: dV_step = P_0^T dO_0 + P_1^T dO_1,  consumer 1: dK_step = (dS_0^T Q_0 + dS_1^T Q_1) * sm_scale
    -> fp32 SMEM [64 keys, D], one TMA add per kv_block rows into dV / dK: one float32 Ref [2, B, S, H, D], zeroed

The shared P / dS tiles are single-buffered (SMEM holds 225 KiB at D = 128): a consumer writes its half after
both consumers' products of the previous step are done (barrier `shared_free`), and reads both halves after both
are written (`shared_ready`). A partial last step repeats the list's last block with its columns masked (P = 0):
its reduction adds zeros. jax's GPU interpreter has no TMA reduction, so in interpret mode each add is a read,
an add and a write of the block (the interpreter runs CTAs one after another; a CTA's consumers add into
different arrays).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.mgpu_common import (
    CONSUMERS,
    LOG2E,
    ROWS,
    AttentionConfig,
    FineWalk,
    Ops,
    compiler_params,
    import_plgpu,
    load_query_rows,
    producer,
    swizzled,
)

_PAIR = CONSUMERS * ROWS


def transposed_sum(ops: Ops, shape, pairs, after=None):
    """sum_i a_i^T b_i into a fresh fp32 accumulator of `shape` (a_i SMEM [K, M] read transposed, b_i SMEM
    [K, N]), issued together with one wait; `after` runs while the products run."""
    if ops.interpret:
        out = sum(jnp.dot(a[...].T, b[...], preferred_element_type=jnp.float32) for a, b in pairs)
        if after is not None:
            after()
        return out
    plgpu = ops.plgpu

    def issue(acc_ref):
        for a, b in pairs:
            plgpu.wgmma(acc_ref, plgpu.transpose_ref(a, (1, 0)), b)
        if after is not None:
            after()

    return pl.run_state(issue)(plgpu.ACC.init(ops.full(shape, 0.0, ops.wgmma_layout)))


def backward(q, k, v, do, lse2, delta, index, count, valid, cfg: AttentionConfig):
    """(dq, dk, dv) [B, S, H, D] in q's dtype. lse2 [B, H, S] with +inf where a row has no valid key (P = 0);
    index, count: the sanitized selection [B, H, S // 128, K], [B, H, S // 128]; valid: valid keys of each
    selected block [B, H, S // 128, K] (cfg.masked) or None."""
    plgpu = import_plgpu()
    if not cfg.fuses_backward:
        raise ValueError(
            f"sparse_attention_mgpu_fused: config without a fused backward (fused_backward={cfg.fused_backward}, "
            f"q_tile={cfg.q_tile}, kv_block={cfg.kv_block}; it takes 16- or 32-row blocks and 128-row query tiles)"
        )
    ops = Ops(plgpu, cfg.interpret)
    b, s, h, d = q.shape
    dtype = q.dtype
    g = cfg.kv_block
    stages = cfg.dq_stages
    walk = FineWalk(g, ROWS)  # one 64-row stage of 64 // g blocks a step
    sub = walk.sub
    qk_scale = cfg.sm_scale * LOG2E
    masked = cfg.masked
    work = cfg.work("dq", h, s // _PAIR, b)

    def add_rows(stage, target_ref, bi, hi, blocks, scratch):
        """Adds rows [i g, (i + 1) g) of the fp32 stage [64, D] into rows blocks[i] * g.. of target_ref[bi, :, hi]."""
        for i, block in enumerate(blocks):
            src, dst = stage.at[pl.ds(i * g, g)], target_ref.at[bi, pl.ds(block * g, g), hi]
            if not ops.interpret:
                plgpu.copy_smem_to_gmem(src, dst, reduction_op="add")
                continue
            rows, loaded = scratch
            plgpu.copy_gmem_to_smem(dst, rows, loaded)
            plgpu.barrier_wait(loaded)
            rows[...] = rows[...] + src[...]
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(rows, dst)
            plgpu.wait_smem_to_gmem(0)

    def body(refs, scratch):
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, index_ref, count_ref, valid_ref, dvk_ref, dq_ref = refs
        (rows_smem, lse_smem, delta_smem, k_smem, v_smem, shared_smem, stage_smem, *rmw), barriers = scratch
        rows_ready, k_ready, k_free, v_ready, v_free, shared_ready, shared_free, *rmw_loaded = barriers
        wg = lax.axis_index("wg")

        @pl.when(wg < CONSUMERS)
        def _consume():
            ops.set_registers(cfg.consumer_registers, "increase")
            # rows_smem, shared_smem: [kind * 2 + consumer, ...], one dynamic index (an index mixing a constant with
            # wg, as .at[1, wg], becomes state of the wgmma's run_state that jax 0.11's lowering cannot return)
            my_do, my_q, my_stage = rows_smem.at[wg], rows_smem.at[CONSUMERS + wg], stage_smem.at[wg]
            ready = rows_ready.at[wg]
            rmw_scratch = (rmw[0].at[wg], rmw_loaded[0].at[wg]) if ops.interpret else None
            plgpu.barrier_arrive(shared_free)  # the shared tiles start free

            def gradient(i, item, done):
                """One work item; done: steps the ring carried before it."""
                hi, ci, bi = item
                tile, n_slices, n = walk.list_of(count_ref, item, 0, 1)
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
                    return lax.rem(done + step, stages)

                def valid_keys(step):  # valid keys of each block of this step
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
                            ((ROWS, ROWS), my_q, k_smem.at[slot], True),
                            ((ROWS, ROWS), my_do, v_smem.at[slot], True),
                        ]
                    )
                    plgpu.barrier_arrive(v_free.at[slot])
                    p = jnp.exp2(logits * qk_scale - lax.broadcast_in_dim(lse, logits.shape, [0]))
                    if mask:
                        p = jnp.where(walk.keep(ops, p.shape, n_valid), p, 0.0)
                        n_valid = valid_keys(step + 1)
                    ds = p * (dp - lax.broadcast_in_dim(delta, dp.shape, [0]))
                    p, ds = p.astype(dtype), ds.astype(dtype)
                    # dQ's product runs while this consumer waits for the other's products of the last step
                    (acc,) = ops.mma([(acc, ds, k_smem.at[slot], False)], after=lambda: plgpu.barrier_wait(shared_free))
                    plgpu.barrier_arrive(k_free.at[slot])
                    shared_smem.at[wg][...] = p
                    shared_smem.at[CONSUMERS + wg][...] = ds
                    plgpu.commit_smem()  # the stores are visible to the other consumer's wgmma (async proxy)
                    plgpu.barrier_arrive(shared_ready)
                    plgpu.barrier_wait(shared_ready)

                    def wait_next_k():
                        nxt = step + 1

                        @pl.when(nxt < n)
                        def _():
                            plgpu.barrier_wait(k_ready.at[slot_of(nxt)])

                    blocks = [index_ref[bi, hi, tile, jnp.minimum(step * sub + j, n_slices - 1)] for j in range(sub)]

                    # consumer 0: dV = sum_c P_c^T dO_c, consumer 1: dK = sum_c dS_c^T Q_c, chosen by index, so that
                    # both run one code path (operands indexed by a constant alone, as .at[1], fail jax 0.11 as well)
                    pairs = [
                        (shared_smem.at[wg * CONSUMERS + c], rows_smem.at[wg * CONSUMERS + c]) for c in range(CONSUMERS)
                    ]
                    part = transposed_sum(ops, (ROWS, d), pairs, after=wait_next_k)
                    plgpu.barrier_arrive(shared_free)
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last step's adds have read my_stage
                    my_stage[...] = part * jnp.where(wg == 1, jnp.float32(cfg.sm_scale), jnp.float32(1.0))
                    plgpu.commit_smem()
                    add_rows(my_stage, dvk_ref.at[wg], bi, hi, blocks, rmw_scratch)
                    return acc, n_valid

                (acc,) = walk.loop(n_slices, masked, step_fn, (ops.full((ROWS, d), 0.0, ops.wgmma_layout),), valid_keys)
                # The other consumer's last products read my Q and dO: wait for them before dQ takes my_q
                plgpu.barrier_wait(shared_free)
                plgpu.barrier_arrive(shared_free)
                my_q[...] = (acc * cfg.sm_scale).astype(dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(my_q, dq_ref.at[bi, rows, hi])
                return done + n

            work.loop(gradient, 0)
            plgpu.barrier_wait(shared_free)  # observe the last phase
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == CONSUMERS)
        def _produce():
            producer(
                plgpu,
                ops,
                work,
                lists=1,
                stages=stages,
                registers=cfg.producer_registers,
                rings=[(k_ready, k_free), (v_ready, v_free)],
                streams=walk.streams(plgpu, index_ref, count_ref, [(k_ref, k_smem), (v_ref, v_smem)], 1, stages),
            )

    def dsv_sparse_bwd_fused(*refs):  # the kernel's name in profiles
        if not masked:
            refs = refs[:8] + (None,) + refs[8:]
        wide = lambda n, rows=ROWS: swizzled(plgpu, (n, rows, d), dtype)
        if ops.interpret:
            stage = plgpu.SMEM((CONSUMERS, ROWS, d), jnp.float32)
            extra = (plgpu.SMEM((CONSUMERS, g, d), jnp.float32),)  # the block read, added to and written back
            extra_barriers = (plgpu.Barrier(num_arrivals=1, num_barriers=CONSUMERS),)
        else:  # fp32 rows of 128 bytes, swizzled: the stores from wgmma registers spread over the banks
            tiling = plgpu.TilingTransform((8, 32))
            stage = plgpu.SMEM((CONSUMERS, ROWS, d), jnp.float32, transforms=(tiling, plgpu.SwizzleTransform(128)))
            extra, extra_barriers = (), ()
        pl.run_scoped(
            lambda *scratch: body(refs, scratch),
            (
                swizzled(plgpu, (2 * CONSUMERS, ROWS, d), dtype),  # dO, then Q of each consumer's rows
                plgpu.SMEM((CONSUMERS, ROWS), jnp.float32),
                plgpu.SMEM((CONSUMERS, ROWS), jnp.float32),
                wide(stages),
                wide(stages),
                swizzled(plgpu, (2 * CONSUMERS, ROWS, ROWS), dtype),  # P, then dS of each consumer's rows
                stage,
                *extra,
            ),
            (
                plgpu.Barrier(num_arrivals=4, num_barriers=CONSUMERS),
                plgpu.Barrier(num_arrivals=sub, num_barriers=stages),
                plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),
                plgpu.Barrier(num_arrivals=sub, num_barriers=stages),
                plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),
                plgpu.Barrier(num_arrivals=CONSUMERS),
                plgpu.Barrier(num_arrivals=CONSUMERS),
                *extra_barriers,
            ),
            collective_axes="wg",
        )

    launch = work.launch()
    mesh = plgpu.Mesh(grid=launch["grid"], grid_names=launch["grid_names"], num_threads=CONSUMERS + 1, thread_name="wg")
    # pl.kernel, not plgpu.kernel: jax 0.10's plgpu.kernel rejects the Ref operand that dV and dK accumulate in
    call = pl.kernel(
        dsv_sparse_bwd_fused,
        out_type=jax.ShapeDtypeStruct(q.shape, dtype),
        mesh=mesh,
        compiler_params=compiler_params(plgpu),
        interpret=cfg.interpret_params() or False,
        name="dsv_sparse_bwd_fused",
    )

    @jax.jit  # Refs with a memory space exist only under jit (this one also serves eager calls)
    def run(*args):
        dvk = jax.new_ref(jnp.zeros((2, *q.shape), jnp.float32), memory_space=plgpu.GMEM)  # [0]: dV, [1]: dK
        dq = call(*args, dvk)
        dv, dk = dvk[...].astype(dtype)
        return dq, dk, dv

    return run(*(q, k, v, do, lse2, delta, index, count), *(() if valid is None else (valid,)))
