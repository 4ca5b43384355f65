"""Token-level sparse attention in Triton (called through jax-triton): the forward and one backward kernel.

Imported only where `triton` is installed (sparse_attention_token asks first). Parameters are in
jax-triton's order: the call's inputs (arrays and scalars), then its outputs. Layout of every call:
q, k, v, do [B, S, H, D] (a token's row of one head is D contiguous elements, H * D apart); the token
list of query group t of (b, h) is idx[(b * H + h) * T + t, :count], count [B * H * T]; key_valid
[B, S] int32 (0: a padded key, never attended; read only when HAS_VALID); lse2, delta [B, H, S] fp32.
B, S, H are the shard's (the launch runs per device under partitioned_over_batch_and_heads); element
offsets within a batch entry are int32 (sparse_attention_token.supported keeps S * H * D < 2**31).

The gather is what Triton gives and Pallas does not: `tl.load` of a [BN, D] block through a vector of
row pointers, which the compiler software-pipelines with cp.async (num_stages). Each gathered K/V row
(2 x 256 bytes at D = 128, bf16) serves the group's QT queries; a group of 32 runs at 32 FLOP per byte
moved, so these kernels are bound by L2 bandwidth, not by the tensor cores.

Softmax in base 2 (logits pre-multiplied by log2 e): masked scores are MASK_VALUE, the running max
starts at M_FLOOR above it, so a masked key adds exactly 0 and a row with no valid key ends with l = 0
(o = 0, lse2 = +inf, which makes the backward's p = exp2(s - lse2) = 0 there).

The backward walks each group's list once: dq accumulates in registers, dk = ds^T q and dv = p^T do of
the step's BN keys are added into fp32 [B, S, H, D] buffers with atomics (keys are shared by many
groups; a transposed list would cost a sort and a second gather of q, do per key).
"""

from __future__ import annotations

import triton
import triton.language as tl

# Module constants a @triton.jit function reads must be tl.constexpr instances.
MASK_VALUE = tl.constexpr(-1e30)
M_FLOOR = tl.constexpr(-1e29)
NO_KEY = tl.constexpr(float("inf"))  # lse2 of a row with no valid key


@triton.jit
def _gather_offsets(b, h, tok, S: tl.constexpr, H: tl.constexpr, D: tl.constexpr):
    """Element offsets [BN, D] of the rows `tok` of head h, batch b, in a [B, S, H, D] array."""
    dims = tl.arange(0, D)
    return b.to(tl.int64) * S * H * D + (tok * (H * D) + h * D)[:, None] + dims[None, :]


@triton.jit
def _step_tokens(idx_row, count, start, key_valid, b, S: tl.constexpr, BN: tl.constexpr, HAS_VALID: tl.constexpr):
    """The tokens of entries start..start+BN of a list, and which of them are live (< count, and with
    HAS_VALID a valid key: a second dependent gather, so it is compiled in only for padded layouts)."""
    offs = start + tl.arange(0, BN)
    live = offs < count
    tok = tl.load(idx_row + offs, mask=live, other=0)
    tok = tl.minimum(tl.maximum(tok, 0), S - 1)  # an out-of-range id reads row 0 or S-1, never past the array
    if HAS_VALID:
        live = live & (tl.load(key_valid + b.to(tl.int64) * S + tok, mask=live, other=0) != 0)
    return tok, live


@triton.jit
def _walk_length(count_ptr, sel, NSEL: tl.constexpr, FULL_WALK: tl.constexpr):
    """The loop bound of a list: its count, or (FULL_WALK) its capacity NSEL, where the steps past the
    count are exact no-ops (every entry masked). FULL_WALK is for Triton's interpreter, whose loaded
    scalars are 1-element arrays that `range` cannot take under numpy >= 2.4."""
    if FULL_WALK:
        return NSEL
    return tl.load(count_ptr + sel)


@triton.jit
def token_forward(
    q_ptr,
    k_ptr,
    v_ptr,
    idx_ptr,
    count_ptr,
    valid_ptr,
    scale_log2,
    o_ptr,
    lse2_ptr,
    S: tl.constexpr,
    H: tl.constexpr,
    T: tl.constexpr,
    NSEL: tl.constexpr,
    QT: tl.constexpr,
    D: tl.constexpr,
    BN: tl.constexpr,
    FULL_WALK: tl.constexpr,
    HAS_VALID: tl.constexpr,
):
    """Grid (T, B * H): one program per query group and head."""
    t = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    q_offs = _gather_offsets(b, h, t * QT + tl.arange(0, QT), S, H, D)
    q = tl.load(q_ptr + q_offs)
    sel = bh * T + t
    count = tl.load(count_ptr + sel)
    idx_row = idx_ptr + sel.to(tl.int64) * NSEL

    m = tl.full([QT], M_FLOOR, tl.float32)
    l = tl.zeros([QT], tl.float32)
    acc = tl.zeros([QT, D], tl.float32)
    for start in range(0, _walk_length(count_ptr, sel, NSEL, FULL_WALK), BN):
        tok, live = _step_tokens(idx_row, count, start, valid_ptr, b, S, BN, HAS_VALID)
        kv_offs = _gather_offsets(b, h, tok, S, H, D)
        k = tl.load(k_ptr + kv_offs, mask=live[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale_log2
        s = tl.where(live[None, :], s, MASK_VALUE)
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + kv_offs, mask=live[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new

    some = l > 0.0
    o = acc / tl.where(some, l, 1.0)[:, None]
    tl.store(o_ptr + q_offs, o.to(o_ptr.dtype.element_ty))
    lse2 = tl.where(some, m + tl.log2(tl.where(some, l, 1.0)), NO_KEY)
    tl.store(lse2_ptr + bh.to(tl.int64) * S + t * QT + tl.arange(0, QT), lse2)


@triton.jit
def token_backward(
    q_ptr,
    k_ptr,
    v_ptr,
    do_ptr,
    lse2_ptr,
    delta_ptr,
    idx_ptr,
    count_ptr,
    valid_ptr,
    scale_log2,
    scale,
    dq_ptr,
    dk_ptr,
    dv_ptr,
    S: tl.constexpr,
    H: tl.constexpr,
    T: tl.constexpr,
    NSEL: tl.constexpr,
    QT: tl.constexpr,
    D: tl.constexpr,
    BN: tl.constexpr,
    FULL_WALK: tl.constexpr,
    HAS_VALID: tl.constexpr,
):
    """Grid (T, B * H). dq [B, S, H, D] in q's dtype; dk, dv fp32 [B, S, H, D], zeroed before the launch."""
    t = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    q_offs = _gather_offsets(b, h, t * QT + tl.arange(0, QT), S, H, D)
    q = tl.load(q_ptr + q_offs)
    do = tl.load(do_ptr + q_offs)
    rows = bh.to(tl.int64) * S + t * QT + tl.arange(0, QT)
    lse2 = tl.load(lse2_ptr + rows)
    delta = tl.load(delta_ptr + rows)
    sel = bh * T + t
    count = tl.load(count_ptr + sel)
    idx_row = idx_ptr + sel.to(tl.int64) * NSEL

    dq = tl.zeros([QT, D], tl.float32)
    for start in range(0, _walk_length(count_ptr, sel, NSEL, FULL_WALK), BN):
        tok, live = _step_tokens(idx_row, count, start, valid_ptr, b, S, BN, HAS_VALID)
        kv_offs = _gather_offsets(b, h, tok, S, H, D)
        k = tl.load(k_ptr + kv_offs, mask=live[:, None], other=0.0)
        v = tl.load(v_ptr + kv_offs, mask=live[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale_log2
        p = tl.where(live[None, :], tl.exp2(s - lse2[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k)
        dk = tl.dot(tl.trans(ds.to(q.dtype)), q) * scale
        dv = tl.dot(tl.trans(p.to(do.dtype)), do)
        tl.atomic_add(dk_ptr + kv_offs, dk, mask=live[:, None], sem="relaxed")
        tl.atomic_add(dv_ptr + kv_offs, dv, mask=live[:, None], sem="relaxed")
    tl.store(dq_ptr + q_offs, (dq * scale).to(dq_ptr.dtype.element_ty))
