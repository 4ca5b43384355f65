"""EXPERIMENTAL Hopper forward of block-sparse attention in Pallas Mosaic GPU (wgmma + TMA).

Not used by default. It is written against jax 0.10.2's Mosaic GPU API with shims for the renames
seen later (Layout.WGMMA_ROW, kernel(out_shape=)). Off the GPU it was lowered for CUDA and run in the
GPU interpreter (with plain dots where the interpreter lacks wgmma forms); its first real test is
`experiments/bench_sparse_attention.py` on the H200, which runs `self_check_and_time` in a child
process (a barrier deadlock cannot take the benchmark down) and records success or the error text.
To use it: call `sparse_attention_mgpu(...)` directly, or `verify()` once, after which
`pallas_kernels.sparse_attention` routes supported shapes here. The backward stays the Triton one.

One CTA per (query tile of 64 rows, head, batch) with two warpgroups:
  - memory warpgroup: for step < kv_count[tile], reads block id kv_index[tile, step] (a scalar load
    from global memory) and TMA-copies that K block and V block into slot step % stages of an SMEM
    ring, after the compute warpgroup has released the slot;
  - compute warpgroup: S = Q K^T by wgmma (Q stays in SMEM), online softmax in base 2 in registers,
    O += P V by wgmma, then O and lse = m + log2(l) go back through SMEM by TMA.
Only kv_block a multiple of 64 (contiguous blocks: TMA cannot gather token rows on Hopper),
q_tile = 64, D a multiple of 64 up to 256, bf16 or f16. SMEM scratch has the input dtype (the
float16 scratch of jax's dense example is what broke its bf16 call).
"""

from __future__ import annotations

import functools
import inspect
import math
import time

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import sparse_attention_triton as triton_path
from pallas_kernels.sparse_index import sanitize_index

BLOCK_Q = 64
BLOCK_KV = 64
LOG2E = math.log2(math.e)


def supported(q, q_tile: int, kv_block: int) -> str | None:
    d = q.shape[-1]
    if q_tile != BLOCK_Q:
        return f"q_tile={q_tile} (the Mosaic GPU forward needs 64)"
    if kv_block % BLOCK_KV:
        return f"kv_block={kv_block} (the Mosaic GPU forward needs a multiple of 64)"
    if d % 64 or d > 256:
        return f"head dim {d} (the Mosaic GPU forward needs a multiple of 64 up to 256)"
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        return f"dtype {q.dtype} (the Mosaic GPU forward needs bf16 or f16)"
    return None


def _plgpu():
    import jax.experimental.pallas.mosaic_gpu as plgpu  # noqa: PLC0415 (GPU-only module, imported on use)

    return plgpu


def _row_layout(plgpu):
    layout = plgpu.Layout
    return layout.WGMMA_ROW if hasattr(layout, "WGMMA_ROW") else layout.WGMMA.reduce(1)


def _kernel_call(plgpu, body, out, **kwargs):
    params = inspect.signature(plgpu.kernel).parameters
    key = "out_type" if "out_type" in params else "out_shape"
    return plgpu.kernel(body, **{key: out}, **kwargs)


def _forward(q, k, v, index, count, *, sm_scale: float, kv_block: int, stages: int, interpret=None):
    """o [B, S, H, D] and lse [B, H, S] (base 2, as the Triton kernels) for sanitized index/count."""
    plgpu = _plgpu()
    b, s, h, d = q.shape
    tiles = s // BLOCK_Q
    steps_per_block = kv_block // BLOCK_KV
    dtype = q.dtype
    qk_scale = sm_scale * LOG2E
    row = _row_layout(plgpu)
    # Layout hints and register reallocation only mean something to the compiler, not the interpreter.
    cast = plgpu.layout_cast if interpret is None else (lambda x, layout: x)
    set_registers = plgpu.set_max_registers if interpret is None else (lambda n, action: None)

    def body(q_ref, k_ref, v_ref, index_ref, count_ref, o_ref, lse_ref, scoped):
        (q_smem, k_smem, v_smem, lse_smem), (q_ready, k_ready, v_ready), (k_free, v_free) = scoped
        bi, hi, ti = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("tiles")
        wg = lax.axis_index("wg")
        n_steps = count_ref[bi, hi, ti] * steps_per_block

        def kv_rows(step):
            block = index_ref[bi, hi, ti, lax.div(step, steps_per_block)]
            return pl.ds(block * kv_block + lax.rem(step, steps_per_block) * BLOCK_KV, BLOCK_KV)

        @pl.when(wg == 0)
        def _compute():
            set_registers(232, action="increase")
            q_rows = pl.ds(ti * BLOCK_Q, BLOCK_Q)
            plgpu.copy_gmem_to_smem(q_ref.at[bi, q_rows, hi], q_smem, q_ready.at[0])
            plgpu.barrier_wait(q_ready.at[0])
            m_i = cast(jnp.full((BLOCK_Q,), -jnp.inf, jnp.float32), row)
            l_i = cast(jnp.full((BLOCK_Q,), 0.0, jnp.float32), row)
            acc = cast(jnp.full((BLOCK_Q, d), 0.0, jnp.float32), plgpu.Layout.WGMMA)

            @pl.when(n_steps > 0)
            def _():
                plgpu.barrier_wait(k_ready.at[0])

            def step_fn(step, carry):
                acc, m_i, l_i = carry
                slot = lax.rem(step, stages)

                def qk(acc_ref):
                    plgpu.wgmma(acc_ref, q_smem, plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
                    return acc_ref[...]

                if interpret is None:
                    logits = pl.run_scoped(qk, plgpu.ACC((BLOCK_Q, BLOCK_KV), jnp.float32))
                else:  # the GPU interpreter cannot transpose a wgmma operand: the same product outside wgmma
                    logits = jnp.dot(q_smem[...], k_smem.at[slot][...].T, preferred_element_type=jnp.float32)
                plgpu.barrier_arrive(k_free.at[slot])
                logits = logits * qk_scale
                m_new = jnp.maximum(m_i, logits.max(axis=1))
                alpha = jnp.exp2(m_i - m_new)
                p = jnp.exp2(logits - lax.broadcast_in_dim(m_new, logits.shape, [0]))
                l_new = l_i * alpha + p.sum(axis=1)
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                plgpu.barrier_wait(v_ready.at[slot])

                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p.astype(dtype), v_smem.at[slot])
                    nxt = step + 1

                    @pl.when(nxt < n_steps)
                    def _():
                        plgpu.barrier_wait(k_ready.at[lax.rem(nxt, stages)])

                if interpret is None:  # accumulate into the carried registers (as jax's dense kernel does)
                    acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                else:  # nor a register operand: the same product and wait, outside wgmma
                    acc = acc + jnp.dot(p.astype(dtype), v_smem.at[slot][...], preferred_element_type=jnp.float32)

                    @pl.when(step + 1 < n_steps)
                    def _():
                        plgpu.barrier_wait(k_ready.at[lax.rem(step + 1, stages)])
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_new, l_new

            acc, m_i, l_i = lax.fori_loop(0, n_steps, step_fn, (acc, m_i, l_i))
            acc = acc / lax.broadcast_in_dim(l_i, acc.shape, [0])
            q_smem[...] = acc.astype(dtype)
            lse_smem[...] = m_i + jnp.log(l_i) * (1.0 / math.log(2.0))
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_smem, o_ref.at[bi, q_rows, hi])
            plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[bi, hi, q_rows])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 1)
        def _memory():
            set_registers(40, action="decrease")
            for i in range(stages):  # fill the ring

                @pl.when(i < n_steps)
                def _(i=i):
                    rows = kv_rows(i)
                    plgpu.copy_gmem_to_smem(k_ref.at[bi, rows, hi], k_smem.at[i], k_ready.at[i])
                    plgpu.copy_gmem_to_smem(v_ref.at[bi, rows, hi], v_smem.at[i], v_ready.at[i])

            def refill(step, _):
                nxt = step + stages
                slot = lax.rem(step, stages)
                rows = kv_rows(nxt)
                plgpu.barrier_wait(k_free.at[slot])
                plgpu.copy_gmem_to_smem(k_ref.at[bi, rows, hi], k_smem.at[slot], k_ready.at[slot])
                plgpu.barrier_wait(v_free.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[bi, rows, hi], v_smem.at[slot], v_ready.at[slot])
                return _

            lax.fori_loop(0, jnp.maximum(n_steps - stages, 0), refill, None)
            for j in range(stages):  # drain: wait until the last reads of every slot are done

                @pl.when(n_steps - stages + j >= 0)
                def _(j=j):
                    slot = lax.rem(n_steps - stages + j, stages)
                    plgpu.barrier_wait(k_free.at[slot])
                    plgpu.barrier_wait(v_free.at[slot])

    def entry(q_ref, k_ref, v_ref, index_ref, count_ref, o_ref, lse_ref):
        swizzle = 128
        tiling = plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize))
        transforms = (tiling, plgpu.SwizzleTransform(swizzle))
        pl.run_scoped(
            lambda *scoped: body(q_ref, k_ref, v_ref, index_ref, count_ref, o_ref, lse_ref, scoped),
            (plgpu.SMEM((BLOCK_Q, d), dtype, transforms=transforms),
             plgpu.SMEM((stages, BLOCK_KV, d), dtype, transforms=transforms),
             plgpu.SMEM((stages, BLOCK_KV, d), dtype, transforms=transforms),
             plgpu.SMEM((BLOCK_Q,), jnp.float32)),
            (plgpu.Barrier(num_barriers=1), plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages)),
            (plgpu.Barrier(num_arrivals=1, num_barriers=stages), plgpu.Barrier(num_arrivals=1, num_barriers=stages)),
            collective_axes="wg",
        )

    call = _kernel_call(
        plgpu, entry,
        [jax.ShapeDtypeStruct(q.shape, dtype), jax.ShapeDtypeStruct((b, h, s), jnp.float32)],
        grid=(h, tiles, b), grid_names=("heads", "tiles", "batch"), num_threads=2, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True), interpret=interpret,
    )
    return call(q, k, v, index, count)


def _forward_static(q, k, v, index, count, static):
    sm_scale, kv_block, stages = static
    return _forward(q, k, v, index, count, sm_scale=sm_scale, kv_block=kv_block, stages=stages)


_forward_sharded = triton_path.partitioned_over_batch_and_heads(
    _forward_static, ("bshd", "bshd", "bshd", "bhtk", "bht"), ("bshd", "bhs"))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _attend(q, k, v, index, count, plan: triton_path.Plan, stages: int):
    return _forward_sharded(q, k, v, index, count, (plan.sm_scale, plan.kv_block, stages))[0]


def _attend_fwd(q, k, v, index, count, plan, stages):
    o, lse = _forward_sharded(q, k, v, index, count, (plan.sm_scale, plan.kv_block, stages))
    return o, (q, k, v, index, count, o, lse)


def _attend_bwd(plan, stages, res, do):
    q, k, v, index, count, o, lse = res
    dq, dk, dv = triton_path._backward_sharded(q, k, v, index, count, o, lse, do, plan)  # noqa: SLF001
    return dq, dk, dv, None, None


_attend.defvjp(_attend_fwd, _attend_bwd)


def sparse_attention_mgpu(q, k, v, kv_index, kv_count, *, q_tile=64, kv_block=64, sm_scale=None, stages=3,
                          tuning=None):
    """Same contract as pallas_kernels.sparse_attention (checked inputs); Mosaic GPU forward, Triton backward."""
    reason = supported(q, q_tile, kv_block)
    if reason:
        raise ValueError(f"unsupported by the Mosaic GPU forward: {reason}")
    from pallas_kernels.tuning import for_device  # noqa: PLC0415

    scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    plan = triton_path.Plan(q_tile=q_tile, kv_block=kv_block, seq_len=q.shape[1], head_dim=q.shape[-1],
                            sm_scale=float(scale), tuning=tuning or for_device()[0], interpret=False)
    index, count = triton_path.prepare_index(kv_index, kv_count, plan, q.shape[1])
    return _attend(q, k, v, index, count, plan, stages)


def forward_with_lse(q, k, v, kv_index, kv_count, *, kv_block=64, sm_scale=None, stages=3, interpret=None):
    """(o, lse) of the Mosaic GPU forward; interpret=InterpretGPUParams() simulates it on a CPU."""
    scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    index, count = sanitize_index(kv_index, kv_count, q.shape[1] // kv_block)
    return _forward(q, k, v, index, count, sm_scale=float(scale), kv_block=kv_block, stages=stages,
                    interpret=interpret)


# ----------------------------------------------------------------------------------------------------
# Runtime verification: the path is used only after it matched the Triton forward on this machine.

_VERIFIED: dict[tuple, dict] = {}


def _key(dtype, head_dim: int, kv_block: int) -> tuple:
    return jnp.dtype(dtype).name, head_dim, kv_block


def _compare(q, k, v, kv_index, kv_count, *, q_tile, kv_block, stages=3):
    """Runs both forwards; returns (result dict, mosaic fn, triton fn, prepared index, count)."""
    from experiments import harness  # noqa: PLC0415
    from pallas_kernels.tuning import for_device  # noqa: PLC0415

    scale = q.shape[-1] ** -0.5
    plan = triton_path.Plan(q_tile=q_tile, kv_block=kv_block, seq_len=q.shape[1], head_dim=q.shape[-1],
                            sm_scale=scale, tuning=for_device()[0], interpret=False)
    index, count = triton_path.prepare_index(kv_index, kv_count, plan, q.shape[1])
    t0 = time.perf_counter()
    mgpu = jax.jit(functools.partial(_forward, sm_scale=scale, kv_block=kv_block, stages=stages))
    o_m, lse_m = jax.block_until_ready(mgpu(q, k, v, index, count))
    compile_s = time.perf_counter() - t0
    triton = jax.jit(functools.partial(triton_path._forward, plan=plan))  # noqa: SLF001
    o_t, lse_t = triton(q, k, v, index, count)
    o_err, lse_err = harness.rel_error(o_m, o_t), harness.rel_error(lse_m, lse_t)
    result = {"ok": bool(o_err < 1e-2 and lse_err < 1e-3), "o_rel_err_vs_triton": o_err,
              "lse_rel_err_vs_triton": lse_err, "compile_s": compile_s}
    return result, mgpu, triton, index, count


def verify(*, dtype=jnp.bfloat16, head_dim=128, kv_block=64, seq_len=4096, heads=2) -> dict:
    """Checks the Mosaic GPU forward against the Triton one on random inputs; if it matches,
    pallas_kernels.sparse_attention uses it (on a GPU, for this dtype / head_dim / kv_block) from then
    on. Returns {"ok": bool, ...errors or error text}. Runs in this process: a kernel that deadlocks
    hangs the caller (the benchmark therefore checks it in a child process first)."""
    try:
        ks = jax.random.split(jax.random.key(0), 4)
        q, k, v = (jax.random.normal(kk, (1, seq_len, heads, head_dim), dtype) for kk in ks[:3])
        blocks, tiles = seq_len // kv_block, seq_len // BLOCK_Q
        index = jnp.sort(jax.lax.top_k(jax.random.uniform(ks[3], (1, heads, tiles, blocks)), max(1, blocks // 4))[1],
                         axis=-1).astype(jnp.int32)
        count = jnp.full((1, heads, tiles), index.shape[-1], jnp.int32)
        result = _compare(q, k, v, index, count, q_tile=BLOCK_Q, kv_block=kv_block)[0]
    except Exception as e:  # noqa: BLE001 (the answer is the error)
        result = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}
    _VERIFIED[_key(dtype, head_dim, kv_block)] = result
    return result


def verified(q, q_tile: int, kv_block: int) -> bool:
    """Whether verify() passed for q's dtype / head dim and this geometry."""
    if supported(q, q_tile, kv_block):
        return False
    return bool(_VERIFIED.get(_key(q.dtype, q.shape[-1], kv_block), {}).get("ok", False))


def self_check_and_time(q, k, v, kv_index, kv_count, *, q_tile=64, kv_block=64, iters=5):
    """The benchmark's check: both forwards on the given inputs, then both timed if they agree."""
    from experiments import harness  # noqa: PLC0415

    reason = supported(q, q_tile, kv_block)
    if reason:
        return {"ok": False, "error": f"unsupported: {reason}"}
    result, mgpu, triton, index, count = _compare(q, k, v, kv_index, kv_count, q_tile=q_tile, kv_block=kv_block)
    if result["ok"]:
        result["mgpu_fwd_ms"] = harness.time_fn(mgpu, q, k, v, index, count, warmup=1, iters=iters)["median_ms"]
        result["triton_fwd_ms"] = harness.time_fn(triton, q, k, v, index, count, warmup=1, iters=iters)["median_ms"]
        kept = float(jnp.mean(count.astype(jnp.float32))) * kv_block
        flops = 4.0 * q.shape[0] * q.shape[1] * q.shape[2] * q.shape[3] * kept
        result["mgpu_fwd_tflops"] = flops / result["mgpu_fwd_ms"] / 1e9
        result["triton_fwd_tflops"] = flops / result["triton_fwd_ms"] / 1e9
    return result
