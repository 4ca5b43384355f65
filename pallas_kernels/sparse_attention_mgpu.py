"""Block-sparse attention on Hopper (sm90) in Pallas Mosaic GPU: public entry, custom VJP, sharding.

Same function as pallas_kernels.sparse_attention_reference (see there), on kernels that use what the Triton
lowering cannot reach: wgmma, TMA, warp specialisation (sparse_attention_mgpu_fwd, _bwd):

    o[tile] = softmax(q[tile] k[sel]^T * sm_scale) v[sel],   sel = blocks kv_index[b, h, tile, :kv_count[b, h, tile]]

kv_valid (optional, int32 [B, S // kv_block]) gives the valid keys of each KV block, valid ones first;
the others are masked out. return_lse adds lse [B, H, S] (natural log of the softmax denominator),
whose cotangent enters the backward as delta = rowsum(o * do) - dlse. A row that sees no valid key
gets o = 0, lse = -inf and zero gradients.

Geometry: q_tile 64 or 128, kv_block 16, 32 or a multiple of 64 (16 and 32: sparse_attention_mgpu_fine's
dK/dV, the forward and dQ with 16- or 32-row TMA copies per block), head dim 64 or 128, S a multiple of 128, one
dtype (bf16 or f16) for q, k, v. `supported` says why a call does not fit; `available` why this
machine cannot run the path (no Mosaic GPU in jax, no Hopper GPU).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels import mgpu_common
from pallas_kernels import sparse_attention_mgpu_bwd as bwd_kernels
from pallas_kernels import sparse_attention_mgpu_fine as fine_kernels
from pallas_kernels import sparse_attention_mgpu_fused as fused_kernels
from pallas_kernels import sparse_attention_mgpu_fwd as fwd_kernels
from pallas_kernels.mgpu_common import FINE_BLOCKS, LN2, ROWS, AttentionConfig
from pallas_kernels.partitioning import partitioned_over_batch_and_heads
from pallas_kernels.sparse_attention_reference import check_sparse_inputs, lse2_attention_vjp
from pallas_kernels.sparse_index import dkdv_worklist, longest_first, sanitize_index
from pallas_kernels.tuning import MGPU_TUNABLE, mgpu_defaults

SMEM_LIMIT = 227 * 1024  # bytes of SMEM a CTA may use on sm90
KERNELS = {"fwd": "forward", "dq": "dQ", "dkdv": "dK/dV", "fused": "fused backward"}


def available(device=None) -> str | None:
    """None if this process can run the Mosaic GPU kernels on `device` (default: the first), else why."""
    try:
        mgpu_common.import_plgpu()
    except ImportError as e:
        return str(e)
    device = device or jax.devices()[0]
    if device.platform != "gpu":
        return f"device {device.device_kind!r} is not a GPU"
    capability = getattr(device, "compute_capability", None)
    if capability is not None and str(capability) != "9.0":
        return f"device {device.device_kind!r} has compute capability {capability} (the kernels are for sm90)"
    return None


def supported(q, k, v, *, q_tile: int, kv_block: int) -> str | None:
    """None if the kernels handle this geometry and dtype, else the reason."""
    s, d = q.shape[1], q.shape[-1]
    if q_tile not in (64, 128):
        return f"q_tile={q_tile} (the Mosaic GPU kernels take 64 or 128)"
    if kv_block % ROWS and kv_block not in FINE_BLOCKS:
        return f"kv_block={kv_block} (the Mosaic GPU kernels take 16, 32 or a multiple of 64)"
    if d not in (64, 128):
        return f"head dim {d} (the Mosaic GPU kernels take 64 or 128)"
    if s % (2 * ROWS):
        return f"sequence length {s} (the Mosaic GPU kernels take a multiple of 128)"
    if not q.dtype == k.dtype == v.dtype or q.dtype not in (jnp.bfloat16, jnp.float16):
        return f"dtypes {q.dtype}, {k.dtype}, {v.dtype} (the Mosaic GPU kernels take one of bf16, f16)"
    return None


def default_config(
    q_tile, kv_block, head_dim, sm_scale, *, masked=False, interpret=False, tuning=None
) -> AttentionConfig:
    """The launch config of one call: `tuning`'s fields over this device's defaults (pallas_kernels.tuning:
    MGPU_TUNABLE, mgpu_defaults), with the forward's ring as deep as fits in SMEM (up to the default's
    stages) unless tuning sets it (1 KiB left for barriers and alignment).
    With 128-row query tiles (one list per CTA) the forward and dQ step over 128 KV rows: the forward
    measured 13% faster, dQ 0-1.5% (H200, S = 64k, docs/kernels/mgpu_notes.md, "Two KV blocks per step").
    The forward is persistent, one CTA per SM: 2.5-4% faster than one CTA per work item at 32k and 64k
    tokens, where the persistent dQ measured the same and the persistent dK/dV 6-15% slower (register
    spills), so those two stay one CTA per item (docs/kernels/mgpu_notes.md, "Which CTAs run together")."""
    tuning = dict(tuning or {})
    unknown = set(tuning) - MGPU_TUNABLE
    if unknown:
        raise ValueError(f"sparse_attention_mgpu: unknown tuning keys {sorted(unknown)}; known: {sorted(MGPU_TUNABLE)}")
    cfg = AttentionConfig(
        q_tile=q_tile,
        kv_block=kv_block,
        head_dim=head_dim,
        sm_scale=float(sm_scale),
        masked=masked,
        interpret=interpret,
        **{**mgpu_defaults(q_tile, kv_block), **tuning},
    )
    while "fwd_stages" not in tuning and cfg.fwd_stages > 2 and cfg.smem_bytes("fwd") + 1024 > SMEM_LIMIT:
        cfg = dataclasses.replace(cfg, fwd_stages=cfg.fwd_stages - 1)
    return cfg


def check_smem(cfg: AttentionConfig, itemsize: int = 2):
    """A ValueError naming the kernel and its rings if a tuning asks for more SMEM than a CTA may have."""
    backward = ("fused",) if cfg.fuses_backward else ("dq", "dkdv")
    for kernel in ("fwd", *backward):
        name = KERNELS[kernel]
        need = cfg.smem_bytes(kernel, itemsize) + 1024
        if need > SMEM_LIMIT:
            raise ValueError(
                f"sparse_attention_mgpu: the {name} kernel would need {need // 1024} KiB of SMEM with "
                f"fwd_stages={cfg.fwd_stages}, dq_stages={cfg.dq_stages}, dkdv_stages={cfg.dkdv_stages}, "
                f"fwd_step_rows={cfg.fwd_step_rows}, dq_step_rows={cfg.dq_step_rows} "
                f"(q_tile={cfg.q_tile}, kv_block={cfg.kv_block}, head dim {cfg.head_dim}); "
                f"a CTA may have {SMEM_LIMIT // 1024} KiB"
            )


# ----------------------------------------------------------------------------------------------------
# Kernel calls over sanitized inputs, partitioned over batch and heads


def _forward(*arrays):
    *arrays, cfg = arrays
    q, k, v, index, count = arrays[:5]
    valid = arrays[5] if cfg.masked else None
    return fwd_kernels.forward(q, k, v, index, count, valid, cfg)


def dkdv_schedule(index, count, cfg: AttentionConfig, seq_len: int):
    """The dK/dV kernel's work: (tiles [B, H, N] of the transposed index, starts [B, H, R + 1] of each row
    block's range in it, blocks [B, H, R]: the order in which the kernel's programs take the row blocks,
    longest list first with cfg.dkdv_longest_first, else ascending)."""
    order, starts, _, pairs_per_tile = dkdv_worklist(
        index, count, kv_block=cfg.kv_block, rows=cfg.dkdv_rows, seq_len=seq_len
    )
    if cfg.dkdv_longest_first:
        blocks = longest_first(starts)
    else:
        blocks = jnp.broadcast_to(jnp.arange(starts.shape[-1] - 1, dtype=jnp.int32), starts[..., 1:].shape)
    return order // pairs_per_tile, starts, blocks


def _backward(*arrays):
    *arrays, cfg = arrays
    if cfg.masked:
        q, k, v, index, count, valid, rows_valid, o, lse2, do, dlse = arrays
    else:
        (q, k, v, index, count, o, lse2, do, dlse), valid, rows_valid = arrays, None, None
    s = q.shape[1]
    delta = jnp.einsum("bshd,bshd->bhs", o.astype(jnp.float32), do.astype(jnp.float32)) - dlse
    lse2 = jnp.where(lse2 == -jnp.inf, jnp.inf, lse2)  # rows without valid keys: P = 0
    if cfg.fuses_backward:
        return fused_kernels.backward(q, k, v, do, lse2, delta, index, count, valid, cfg)
    dq = bwd_kernels.dq(q, k, v, do, lse2, delta, index, count, valid, cfg)
    tiles, starts, blocks = dkdv_schedule(index, count, cfg, s)
    dkdv = fine_kernels.dkdv if cfg.kv_block < ROWS else bwd_kernels.dkdv  # one block per consumer below 64 rows
    dk, dv = dkdv(q, k, v, do, lse2, delta, tiles, starts, blocks, rows_valid, cfg)
    return dq, dk, dv


@functools.cache
def _sharded(masked: bool, interpret: bool):
    if interpret:  # the GPU interpreter's callbacks cannot sit inside custom_partitioning (nor need to)
        return _forward, _backward
    extra = ("bhtk", "bn") if masked else ()
    fwd = partitioned_over_batch_and_heads(
        _forward, ("bshd", "bshd", "bshd", "bhtk", "bht") + extra[:1], ("bshd", "bhs")
    )
    bwd = partitioned_over_batch_and_heads(
        _backward,
        ("bshd", "bshd", "bshd", "bhtk", "bht") + extra + ("bshd", "bhs", "bshd", "bhs"),
        ("bshd", "bshd", "bshd"),
    )
    return fwd, bwd


def _masks(valid):
    return () if valid is None else valid


def _run_forward(q, k, v, index, count, valid, cfg: AttentionConfig):
    fwd, _ = _sharded(cfg.masked, cfg.interpret)
    return fwd(q, k, v, index, count, *_masks(valid)[:1], cfg)


def _grads(q, k, v, index, count, valid, o, lse2, do, dlse, cfg):
    """dq, dk, dv of this call's keys' share of an attention with softmax statistics (o, lse2 base 2, -inf:
    no key; dlse None: 0): o's own forward (the VJP) or a larger merged one (sparse_attention_mgpu_backward).
    The backward kernels take delta = rowsum(o * do) - dlse from these, so either works unchanged."""
    _, bwd = _sharded(cfg.masked, cfg.interpret)
    dlse = jnp.zeros(lse2.shape, jnp.float32) if dlse is None else dlse.astype(jnp.float32)
    return bwd(q, k, v, index, count, *_masks(valid), o, lse2, do.astype(q.dtype), dlse, cfg)


# The custom VJP the other kernel families share (their lse2 marks "no key" +inf, these kernels' -inf: both
# read as a natural lse of -inf); `valid` (the key masks, or None) gets no cotangent.
_attend = lse2_attention_vjp(_run_forward, _grads)


def prepare_masks(index, kv_valid, kv_block: int, seq_len: int):
    """(valid keys of each selected block [B, H, T, K], valid keys of each dK/dV list's key rows: of each 64
    rows [B, S // 64], or of each block [B, S // kv_block] below 64 rows)."""
    blocks = jnp.clip(kv_valid.astype(jnp.int32), 0, kv_block)
    batch = jnp.arange(index.shape[0])[:, None, None, None]
    per_entry = blocks[batch, index]
    if kv_block < ROWS:
        return per_entry, blocks
    first_row = jnp.arange(seq_len // ROWS, dtype=jnp.int32) * ROWS
    per_rows = jnp.clip(blocks[:, first_row // kv_block] - first_row % kv_block, 0, ROWS)
    return per_entry, per_rows


def _prepare(q, k, v, kv_index, kv_count, kv_valid, *, q_tile, kv_block, sm_scale, tuning, interpret):
    """Checks, the kernel config, the sanitized index and the key masks of one call."""
    check_sparse_inputs(q, k, v, kv_index, kv_count, q_tile, kv_block, kv_valid)
    reason = supported(q, k, v, q_tile=q_tile, kv_block=kv_block)
    if reason:
        raise ValueError(f"sparse_attention_mgpu: unsupported {reason}")
    _, s, _, d = q.shape
    scale = d**-0.5 if sm_scale is None else sm_scale
    cfg = default_config(q_tile, kv_block, d, scale, masked=kv_valid is not None, interpret=interpret, tuning=tuning)
    check_smem(cfg, jnp.dtype(q.dtype).itemsize)
    index, count = sanitize_index(kv_index, kv_count, s // kv_block)
    valid = None if kv_valid is None else prepare_masks(index, kv_valid, kv_block, s)
    return cfg, index, count, valid


def sparse_attention_mgpu(
    q,
    k,
    v,
    kv_index,
    kv_count,
    *,
    q_tile,
    kv_block,
    sm_scale=None,
    kv_valid=None,
    return_lse=False,
    tuning=None,
    interpret=False,
):
    """Block-sparse attention on the Mosaic GPU kernels (see the module). Returns o [B, S, H, D] in q's
    dtype, or (o, lse [B, H, S] float32) with return_lse. tuning: overrides of the launch fields
    (pallas_kernels.tuning.MGPU_DEFAULTS names them, e.g. {"fwd_stages": 2, "fwd_programs": 0}; their
    meanings: mgpu_common.AttentionConfig). interpret=True simulates the kernels on a CPU (jax's GPU
    interpreter: slow, for tests; its products are plain dots)."""
    cfg, index, count, valid = _prepare(
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
    return _attend(q, k, v, index, count, valid, cfg, return_lse)


def sparse_attention_mgpu_backward(
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
    sm_scale=None,
    kv_valid=None,
    tuning=None,
    interpret=False,
):
    """(dq, dk, dv) in q's dtype of this call's share of an attention whose merged output o [B, S, H, D] and
    log-sum-exp lse [B, H, S] (natural log, -inf: no key) are given, for cotangents do and dlse (None: 0):
    pallas_kernels.sparse_attention.sparse_attention_backward on the Mosaic GPU kernels."""
    cfg, index, count, valid = _prepare(
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
    lse2 = lse.astype(jnp.float32) / LN2  # -inf stays -inf: the backward's own "no key" value
    return _grads(q, k, v, index, count, valid, o, lse2, do, dlse, cfg)


# The dispatcher's interface (pallas_kernels.sparse_attention.Implementation).
attention = sparse_attention_mgpu
attention_backward = sparse_attention_mgpu_backward
