"""Token-level sparse attention (kv_block = 1) on a GPU: Triton kernels called through jax-triton.

At token level each query group gathers its own keys one row at a time. Pallas' Mosaic GPU lowering has
no cp.async row gather and its Triton lowering lacks the launch control (docs/kernels/mgpu_notes.md,
"Token level through jax-triton"); a real Triton kernel has both: `tl.load` through a vector of row pointers, pipelined
with cp.async. The kernels are in sparse_attention_token_kernels (imported only where triton is).

    forward   grid (T, B * H): the group's QT queries against its tokens, BN per step, online softmax;
              o and lse (base 2 inside, natural log outside).
    backward  grid (T, B * H): the same walk once: dq in registers, dk and dv added with fp32 atomics.

Needs the `token` extra (`pip install -e ".[cuda,token]"`: jax-triton 0.3.1 and triton >= 3.6); where it
is missing the dispatcher passes to the next path (`available`). jax-triton runs only on a GPU; with
interpret=True the same kernels run in Triton's interpreter on the host (numpy, through jax.pure_callback),
which is how the CPU tests check them (triton installed, no GPU needed). On a GPU, experiments/
bench_sparse_mgpu.py (--rows 1) checks the compiled kernels against the reference before timing.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import triton_call
from pallas_kernels.partitioning import partitioned_over_batch_and_heads
from pallas_kernels.sparse_attention_reference import LOG2E, kernel_lse, lse2_attention_vjp, row_term
from pallas_kernels.tuning import TokenAttentionTuning, token_attention_tuning


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """Static settings of one call (hashable: a nondiff argument of the custom_vjp). The array sizes are
    read from the operands at launch: under sharding over heads a device holds only its own heads."""

    q_tile: int
    sm_scale: float
    tuning: TokenAttentionTuning
    masked: bool = False  # a padded layout: the kernels read key_valid
    interpret: bool = False

    def constants(self, q, index, block_n: int) -> dict:
        """The kernels' compile-time geometry (triton constexprs) for this shard's q [B, S, H, D] and index
        [B, H, T, K]. The interpreter walks each list to its capacity (sparse_attention_token_kernels._walk_length)."""
        _, s, h, d = q.shape
        return dict(
            S=s,
            H=h,
            T=s // self.q_tile,
            NSEL=index.shape[-1],
            QT=self.q_tile,
            D=d,
            BN=block_n,
            FULL_WALK=self.interpret,
            HAS_VALID=self.masked,
        )


def available(device=None) -> str | None:
    """None if this process can run the kernels on `device`, else why not."""
    return triton_call.missing(device)


def supported(q, k, v, *, q_tile: int, kv_block: int) -> str | None:
    """None if the token kernels handle this geometry and these dtypes, else the reason."""
    if kv_block != 1:
        return f"kv_block={kv_block} (the token kernels take kv_block=1)"
    if q_tile not in (16, 32, 64, 128):
        return f"q_tile={q_tile} must be 16, 32, 64 or 128 for the token kernels"
    _, s, h, d = q.shape
    if s * h * d >= 2**31:  # the kernels' element offsets within one batch entry are int32
        return f"S * H * D = {s * h * d} must be < 2**31 for the token kernels"
    if d < 16 or d & (d - 1) or d > 256:
        return f"head dim {d} must be a power of two in 16..256 for the token kernels"
    if not q.dtype == k.dtype == v.dtype or q.dtype not in (jnp.bfloat16, jnp.float16):
        return f"q, k, v must all be bfloat16 or all float16; got {q.dtype}, {k.dtype}, {v.dtype}"
    return None


# ----------------------------------------------------------------------------------------------------
# The launches (jax-triton), sharded over batch and heads (pallas_kernels.partitioning).


def _kernels(launch: LaunchConfig):
    return triton_call.load_kernels("pallas_kernels.sparse_attention_token_kernels", launch.interpret)


def _forward(q, k, v, index, count, key_valid, launch: LaunchConfig):
    b, s, h, _ = q.shape
    tune = launch.tuning
    o, lse2 = triton_call.call(
        q,
        k,
        v,
        index,
        count,
        key_valid,
        np.float32(launch.sm_scale * LOG2E),  # a Python float would be fp64 in the kernel
        kernel=_kernels(launch).token_forward,
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, h, s), jnp.float32)],
        grid=(s // launch.q_tile, b * h),
        warps=tune.fwd_warps,
        stages=tune.fwd_stages,
        interpret=launch.interpret,
        **launch.constants(q, index, tune.fwd_block_n),
    )
    return o, lse2


def _backward(q, k, v, index, count, key_valid, lse2, do, delta, launch: LaunchConfig):
    b, s, h, _ = q.shape
    tune = launch.tuning
    grads = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    dq, dk, dv = triton_call.call(
        q,
        k,
        v,
        do,
        lse2,
        delta,
        index,
        count,
        key_valid,
        np.float32(launch.sm_scale * LOG2E),  # a Python float would be fp64 in the kernel
        np.float32(launch.sm_scale),
        kernel=_kernels(launch).token_backward,
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), grads, grads],
        grid=(s // launch.q_tile, b * h),
        zeroed_outputs=(1, 2),
        warps=tune.bwd_warps,
        stages=tune.bwd_stages,
        interpret=launch.interpret,
        **launch.constants(q, index, tune.bwd_block_n),
    )
    return dq, dk.astype(k.dtype), dv.astype(v.dtype)


_QKV, _SEL, _ROWS, _KEYS = ("bshd",) * 3, ("bhtk", "bht"), "bhs", "bs"
_forward_sharded = partitioned_over_batch_and_heads(_forward, _QKV + _SEL + (_KEYS,), ("bshd", _ROWS))
_backward_sharded = partitioned_over_batch_and_heads(
    _backward, _QKV + _SEL + (_KEYS, _ROWS, "bshd", _ROWS), ("bshd",) * 3
)


def _run_forward(q, k, v, index, count, key_valid, launch: LaunchConfig):
    # The interpreter's jax.pure_callback inside a custom_partitioning op crashes jax 0.10.2's CPU runtime
    # (a segfault at execution on a sharded input), so interpreted calls skip the partitioning.
    return (_forward if launch.interpret else _forward_sharded)(q, k, v, index, count, key_valid, launch)


def _run_backward(q, k, v, index, count, key_valid, lse2, do, delta, launch: LaunchConfig):
    run = _backward if launch.interpret else _backward_sharded
    return run(q, k, v, index, count, key_valid, lse2, do, delta, launch)


# ----------------------------------------------------------------------------------------------------
# custom_vjp. with_lse (static): the result is (o, lse natural log) and the backward takes the lse cotangent.


def _grads(q, k, v, index, count, key_valid, o, lse2, do, dlse, launch: LaunchConfig):
    delta = row_term(o, do, dlse)
    return _run_backward(q, k, v, index, count, key_valid, lse2, do.astype(q.dtype), delta, launch)


_attend = lse2_attention_vjp(_run_forward, _grads)


def _prepare(q, k, v, kv_index, kv_count, kv_valid, *, q_tile, kv_block, sm_scale, tuning, interpret):
    """Checks, the launch config, the index and the key flags of one call. Entries past a list's count are
    never read (the kernels mask them); live ids out of [0, S) are clamped, not trusted."""
    reason = supported(q, k, v, q_tile=q_tile, kv_block=kv_block)
    if reason:
        raise ValueError(reason)
    if interpret and q.dtype == jnp.bfloat16:  # triton 3.6: its dot multiplies bf16's raw 16-bit patterns
        raise ValueError("Triton's interpreter computes bfloat16 dots wrong; interpret the token kernels in float16")
    b, s, _, d = q.shape
    launch = LaunchConfig(
        q_tile=q_tile,
        sm_scale=float(sm_scale),
        tuning=tuning or token_attention_tuning(q_tile, d),
        masked=kv_valid is not None,
        interpret=bool(interpret),
    )
    count = jnp.clip(kv_count.astype(jnp.int32), 0, kv_index.shape[-1])
    # unmasked: a placeholder the kernels never read (HAS_VALID off), one int per batch entry
    key_valid = jnp.ones((b, 1), jnp.int32) if kv_valid is None else (kv_valid > 0).astype(jnp.int32)
    return launch, kv_index.astype(jnp.int32), count, key_valid


def attention(
    q,
    k,
    v,
    kv_index,
    kv_count,
    *,
    q_tile,
    kv_block,
    sm_scale,
    kv_valid=None,
    return_lse=False,
    interpret=False,
    tuning=None,
):
    """The dispatcher's interface (pallas_kernels.sparse_attention.Implementation); inputs already checked."""
    launch, index, count, key_valid = _prepare(
        q,
        k,
        v,
        kv_index,
        kv_count,
        kv_valid,
        q_tile=q_tile,
        kv_block=kv_block,
        sm_scale=sm_scale,
        tuning=tuning,
        interpret=interpret,
    )
    return _attend(q, k, v, index, count, key_valid, launch, bool(return_lse))


def attention_backward(
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
    q_tile,
    kv_block,
    sm_scale,
    kv_valid=None,
    interpret=False,
    tuning=None,
):
    """(dq, dk, dv) of this call's share of the attention whose merged statistics are o, lse (natural log)."""
    launch, index, count, key_valid = _prepare(
        q,
        k,
        v,
        kv_index,
        kv_count,
        kv_valid,
        q_tile=q_tile,
        kv_block=kv_block,
        sm_scale=sm_scale,
        tuning=tuning,
        interpret=interpret,
    )
    return _grads(q, k, v, index, count, key_valid, o, kernel_lse(lse), do, dlse, launch)
