"""`context_attention`: attention over a sequence split across the mesh's `context` axis.

    out = context_attention(q, k, v, mesh=mesh, strategy="hybrid")   # q, k, v [B, S, H, D], S on `context`

Strategies (n = size of the context axis):
  ulysses    HCP: all-to-all to head shards, attention on all S tokens of H/n heads, all-to-all back
  ring       SCP: K/V chunks circulate (ppermute), online-softmax merge (sparse: the kernel per chunk)
  allgather  SCP: all-gather K/V, attend locally
  selective  SCP, sparse: fetch only the KV blocks the local query tiles selected
  hybrid     HCP degree x SCP degree = n (from `degrees` and `scp`, or from the planner)

For a true hybrid (both degrees > 1) the context axis is viewed as a (cp_seq, cp_head) grid with
cp_head the minor axis, so the HCP groups are neighbouring devices (one node's NVLink) and each HCP
all-to-all leaves a device with a contiguous slice of the sequence: the SCP strategies then run on
their cp_seq group exactly as on their own. The grid is only a view (`groups.GroupAxis`): every
strategy runs on the caller's mesh, because a program that holds custom calls tied to devices
(cuDNN, Pallas on the GPU) must use one mesh throughout, and jit rejects a second one.

Sparse attention: pass kv_index / kv_count in the layout of `pallas_kernels.sparse_attention`
(block ids over the whole sequence); the result equals single-device `sparse_attention` with the
same selection. With HCP, heads are balanced across devices by their selected work (`head_perm`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dsv_jax.attention.context import ContextBackend
from dsv_jax.parallel import hcp, local, scp
from dsv_jax.parallel.groups import context_groups
from pallas_kernels.defaults import KV_BLOCK, Q_TILE

log = logging.getLogger("dsv_jax")

STRATEGIES = ("ulysses", "allgather", "ring", "selective", "hybrid")
SCP_STRATEGIES = ("ring", "allgather", "selective")


def _batch_axes(mesh: Mesh) -> tuple[tuple[str, ...], int]:
    """The mesh axes the batch is sharded over (all but `context`) and their device count."""
    axes = tuple(a for a in mesh.axis_names if a != "context")
    return axes, math.prod(mesh.shape[a] for a in axes)


def _batch_spec(mesh: Mesh, batch: int):
    """PartitionSpec entry of the batch dimension: its axes, or None (replicated) when they do not divide it."""
    axes, dp = _batch_axes(mesh)
    return axes if batch % dp == 0 else None


def _explicit(mesh: Mesh) -> bool:
    return any(t == AxisType.Explicit for t in getattr(mesh, "axis_types", ()))


def _as_specs(args: dict, specs: dict, mesh: Mesh) -> dict:
    """`args` laid out as `specs` on `mesh`. On a mesh of Auto axes shard_map moves data itself; on
    Explicit axes (`jax.make_mesh`'s default) it rejects any other layout, e.g. a sequence-only
    P(None, 'context') for a batch spec of P(('data', 'fsdp'), 'context'), so the inputs are resharded
    here (a no-op where they already match)."""
    if not _explicit(mesh):
        return args
    return {name: jax.reshard(x, NamedSharding(mesh, specs[name])) for name, x in args.items()}


def resolve_degrees(strategy: str, n: int, *, degrees=None, scp_strategy=None, plan_fn=None):
    """(hcp_degree, scp_degree, scp_strategy) of a call."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} is not one of {list(STRATEGIES)}")
    if strategy == "ulysses":
        return n, 1, "allgather"
    if strategy in SCP_STRATEGIES:
        return 1, n, strategy
    if degrees is None:
        if plan_fn is None:
            raise ValueError("strategy='hybrid' needs degrees=(hcp, scp) or a planner decision")
        degrees, scp_strategy = plan_fn()
    ph, ps = (int(d) for d in degrees)
    if ph * ps != n:
        raise ValueError(f"hybrid degrees {ph} x {ps} do not multiply to the context axis size {n}")
    scp_strategy = scp_strategy or "ring"
    if scp_strategy not in SCP_STRATEGIES:
        raise ValueError(f"scp={scp_strategy!r} is not one of {list(SCP_STRATEGIES)}")
    return ph, ps, scp_strategy


def _check(q, k, v, n, ph, ps, scp_strategy, kv_index, kv_count, kv_lens, kv_mask, q_tile, kv_block):
    if q.ndim != 4 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(
            f"context_attention expects q, k, v of one shape [B, S, H, D]; got {q.shape}, {k.shape}, {v.shape}"
        )
    b, s, h, _ = q.shape
    if s % n:
        raise ValueError(f"sequence length {s} is not divisible by the context axis size {n}")
    hcp.check_heads(h, ph)
    sparse = kv_index is not None
    if (kv_count is None) != (kv_index is None):
        raise ValueError("pass kv_index and kv_count together (a sparse selection) or neither (dense)")
    if scp_strategy == "selective" and ps > 1 and not sparse:
        raise ValueError("strategy 'selective' exchanges selected KV blocks: it needs kv_index and kv_count")
    if sparse:
        if kv_lens is not None or kv_mask is not None:
            raise ValueError("kv_lens / kv_mask with a sparse selection: mask padded keys with kv_valid instead")
        if (s // n) % q_tile or (s // ps) % kv_block:
            raise ValueError(
                f"sequence {s} over context {n}: each device's {s // n} tokens must be whole query "
                f"tiles of {q_tile}, and each SCP slice ({s // ps}) whole KV blocks of {kv_block}"
            )
        tiles = s // q_tile
        if kv_index.ndim != 4 or kv_index.shape[:3] != (b, h, tiles) or kv_count.shape != (b, h, tiles):
            raise ValueError(
                f"kv_index must be [B, H, S // q_tile, K] = [{b}, {h}, {tiles}, K] and kv_count "
                f"[{b}, {h}, {tiles}]; got {kv_index.shape}, {kv_count.shape}"
            )


def context_attention(
    q,
    k,
    v,
    *,
    mesh: Mesh,
    strategy: str,
    kv_lens=None,
    kv_mask=None,
    sm_scale: float | None = None,
    kv_index=None,
    kv_count=None,
    q_tile: int = Q_TILE,
    kv_block: int = KV_BLOCK,
    head_perm: Any = "auto",
    hcp_slots: int | None = None,
    degrees: tuple[int, int] | None = None,
    scp: str | None = None,
    capacity: int | float | None = None,
    sparsity: Any = None,
    backend: str = "auto",
    impl: str = "auto",
    q_chunk: int | None = 1024,
    kv_valid=None,
    return_lse: bool = False,
    return_stats: bool = False,
):
    """softmax(q k^T * sm_scale) v with the sequence of q, k, v [B, S, H, D] split over `context`.

    mesh: from `dsv_jax.parallel.make_mesh`; batch stays on (data, fsdp), sequence on context.
    strategy: "ulysses" | "ring" | "allgather" | "selective" | "hybrid".
    kv_lens: [B] valid key prefix; kv_mask: bool [B, S] or [S], the valid keys (dense only).
    kv_index / kv_count: a block-sparse selection.
    head_perm: HCP head assignment: "auto" (balance the selected work, sparse only), None (heads in
        order) or an int array [d * slots] from `hcp.balance_heads` (device j runs heads
        perm[j*slots:(j+1)*slots], an entry H is an empty slot); a runtime input: no recompilation.
    hcp_slots: head slots per HCP device (static; default H/d). More slots let a device holding a
        dense head take fewer heads (sparse only: empty slots cost a kernel almost nothing, but the
        all-to-alls move d * slots / H times the bytes).
    degrees, scp: for "hybrid", (HCP degree, SCP degree) and the SCP strategy; without them the
        planner decides from the shapes and `sparsity` (a float or per-head tuple; a hint only).
    capacity: "selective": KV blocks each device may request per peer (an int, or a float fraction of
        the peer's blocks); default: everything (never overflows). Overflow takes the exact all-gather path.
    backend: dense per-device attention backend (the attention entry point); impl: the sparse kernel's.
    q_chunk: query rows per block in the dense ring's plain-JAX inner attention (bounds its memory).
    kv_valid: int32 [B, S // kv_block], the valid keys of each KV block (sparse; padded token layouts).
    return_lse: return (o, lse [B, H, S] fp32, natural log) so partial results merge exactly
        (`dsv_jax.attention.merge_attention`); differentiable in both.
    return_stats: also return {"requested_blocks", "overflow_blocks", "fallback", "max_head_load",
        "mean_head_load"} as arrays.
    """
    if "context" not in mesh.shape:
        raise ValueError(f"mesh axes {tuple(mesh.axis_names)} have no 'context' axis; build it with make_mesh")
    if q.ndim != 4:
        raise ValueError(f"context_attention expects q, k, v [B, S, H, D]; got q {q.shape}")
    n = mesh.shape["context"]
    b, s, h, d = q.shape
    sparse = kv_index is not None

    def plan_fn():
        from dsv_jax.parallel.planner import default_plan

        return default_plan(
            seq_len=s,
            heads=h,
            head_dim=d,
            batch=b,
            devices=n,
            sparse=sparse,
            sparsity=sparsity,
            dtype_bytes=jnp.dtype(q.dtype).itemsize,
        )

    ph, ps, scp_strategy = resolve_degrees(strategy, n, degrees=degrees, scp_strategy=scp, plan_fn=plan_fn)
    _check(q, k, v, n, ph, ps, scp_strategy, kv_index, kv_count, kv_lens, kv_mask, q_tile, kv_block)
    scale = d**-0.5 if sm_scale is None else float(sm_scale)

    dp = _batch_axes(mesh)[1]
    bspec = _batch_spec(mesh, b)
    seq_group, head_group = context_groups(n, ph, ps)

    # Device i of `context` holds sequence shard i and is member i % ph of its HCP group (neighbours):
    # the HCP all-to-all joins ph neighbouring shards into one contiguous slice of the sequence.
    args = {"q": q, "k": k, "v": v}
    specs = {"q": P(bspec, "context"), "k": P(bspec, "context"), "v": P(bspec, "context")}
    if kv_lens is not None:
        args["kv_lens"] = jnp.broadcast_to(jnp.asarray(kv_lens, jnp.int32), (b,))
        specs["kv_lens"] = P(bspec)
    if kv_mask is not None:  # gathered whole on every device inside (one bool per key: cheap)
        args["kv_mask"] = jnp.broadcast_to(jnp.asarray(kv_mask, bool), (b, s))
        specs["kv_mask"] = P(bspec, "context")
    if sparse:
        args["kv_index"], args["kv_count"] = kv_index.astype(jnp.int32), kv_count.astype(jnp.int32)
        specs["kv_index"] = specs["kv_count"] = P(bspec, None, "context")
        if kv_valid is not None:  # one count per block of the whole sequence, on every device (small)
            args["kv_valid"] = jnp.broadcast_to(jnp.asarray(kv_valid, jnp.int32), (b, s // kv_block))
            specs["kv_valid"] = P(bspec)
    head_loads = None
    slots = h // ph if hcp_slots is None else int(hcp_slots)
    if slots != h // ph and not (sparse and ph > 1 and h // ph < slots <= h):
        raise ValueError(
            f"hcp_slots={hcp_slots}: extra head slots need a sparse selection and HCP degree > 1, "
            f"and lie in {h // ph}..{h} (H / HCP degree .. H)"
        )
    if ph > 1:
        if isinstance(head_perm, str):
            if head_perm != "auto":
                raise ValueError(f"head_perm={head_perm!r}: use 'auto', None or an int array from balance_heads")
            if sparse:
                head_loads = hcp.head_loads_from_counts(kv_count)
                head_perm = hcp.balance_heads(head_loads, ph, slots)
            else:
                head_perm = None
        if head_perm is None and slots != h // ph:
            raise ValueError("hcp_slots needs a head assignment (head_perm='auto' or an array)")
        if head_perm is not None:
            head_perm = jnp.asarray(head_perm, jnp.int32)
            if head_perm.shape != (ph * slots,):
                raise ValueError(
                    f"head_perm must hold HCP degree x slots = {ph} x {slots} head ids (H = {h} marks "
                    f"an empty slot); got shape {head_perm.shape}"
                )
            args["perm"] = head_perm
            specs["perm"] = P()
    if capacity is None or isinstance(capacity, float):
        rows = (b // dp if bspec else b) * slots * (s // ps // kv_block)  # all of one peer's blocks
        capacity = rows if capacity is None else max(1, math.ceil(capacity * rows))

    body = functools.partial(
        _device_attention,
        ph=ph,
        ps=ps,
        scp_strategy=scp_strategy,
        sm_scale=scale,
        q_tile=q_tile,
        kv_block=kv_block,
        capacity=int(capacity),
        backend=backend,
        impl=impl,
        q_chunk=q_chunk,
        stat_axes=tuple(mesh.axis_names),
        seq_group=seq_group,
        head_group=head_group,
        return_lse=return_lse,
    )
    o_spec = (P(bspec, "context"), P(bspec, None, "context")) if return_lse else P(bspec, "context")
    out, stats = jax.shard_map(body, mesh=mesh, in_specs=(specs,), out_specs=(o_spec, P()), check_vma=False)(
        _as_specs(args, specs, mesh)
    )
    if _explicit(mesh):  # the output in the layout q came in (its type under explicit sharding)
        sharding = jax.typeof(q).sharding
        out = (jax.reshard(out[0], sharding), out[1]) if return_lse else jax.reshard(out, sharding)
    if scp_strategy == "selective" and ps > 1 and not return_stats:  # else the caller reports it
        jax.debug.callback(_report_overflow, stats["overflow_blocks"], stats["fallback"])
    if not return_stats:
        return out
    if head_loads is None and sparse:
        head_loads = hcp.head_loads_from_counts(kv_count)
    if head_loads is not None:
        perm = args.get("perm", jnp.arange(h))
        per_dev = jnp.concatenate([head_loads, jnp.zeros(1)])[perm].reshape(ph, -1).sum(axis=1)
        stats["max_head_load"], stats["mean_head_load"] = jnp.max(per_dev), jnp.mean(per_dev)
    return out, stats


def select_kv_blocks(
    q_lr,
    k_lr,
    top_k,
    *,
    mesh: Mesh,
    q_tile: int = Q_TILE,
    kv_block: int = KV_BLOCK,
    block_reduce="mean",
    keep=None,
    kv_valid=None,
):
    """Block selection of every query tile with q_lr, k_lr [B, S, H, r] sharded over `context`:
    each device all-gathers the low-rank keys (rank r: cheap) and selects for its own query tiles.
    Returns (kv_index [B, H, S // q_tile, K], kv_count) sharded over the tiles, ready for
    context_attention; equal to `dsv_jax.dsv.selection.select_kv` on one device (top_k an int, or one
    per head; keep: runtime per-head keep ratios [H] or [B, H] with an int top_k, as select_kv; kv_valid:
    int32 [B, S // kv_block] of a padded layout, as select_kv)."""
    n = mesh.shape["context"]
    b, s, h, _ = q_lr.shape
    if k_lr.shape != q_lr.shape or (s // n) % q_tile or s % kv_block:
        raise ValueError(
            f"q_lr {q_lr.shape} / k_lr {k_lr.shape}: need one shape [B, S, H, r] with S / context "
            f"({s} / {n}) whole query tiles of {q_tile} and S whole KV blocks of {kv_block}"
        )
    bspec = _batch_spec(mesh, b)
    top_k = tuple(int(t) for t in top_k) if isinstance(top_k, (tuple, list, np.ndarray)) else int(top_k)

    def body(a):
        k_all = jax.lax.all_gather(a["k_lr"], "context", axis=1, tiled=True)
        row0 = jax.lax.axis_index("context") * a["q_lr"].shape[1]
        return scp.local_selection(
            a["q_lr"],
            k_all,
            top_k,
            q_tile=q_tile,
            kv_block=kv_block,
            block_reduce=block_reduce,
            keep=a.get("keep"),
            kv_valid=a.get("kv_valid"),
            row0=row0,
        )

    spec_in = P(bspec, "context")
    spec_out = P(bspec, None, "context")
    args, specs = {"q_lr": q_lr, "k_lr": k_lr}, {"q_lr": spec_in, "k_lr": spec_in}
    if keep is not None:
        args["keep"] = jnp.asarray(keep, jnp.float32)
        specs["keep"] = P(bspec) if args["keep"].ndim == 2 else P()
    if kv_valid is not None:
        args["kv_valid"], specs["kv_valid"] = jnp.asarray(kv_valid, jnp.int32), P(bspec)
    return jax.shard_map(body, mesh=mesh, in_specs=(specs,), out_specs=(spec_out, spec_out), check_vma=False)(args)


def _report_overflow(blocks, fallback):
    if int(fallback):
        log.warning(
            "selective context attention: %d requested KV blocks over capacity; took the all-gather path", int(blocks)
        )


def _extend(x, fill, axis):
    """x with one more entry of value `fill` along `axis` (the empty head slot)."""
    return jnp.concatenate([x, jnp.full_like(jnp.take(x, jnp.array([0]), axis=axis), fill)], axis)


def _selection_to_heads(kv_index, kv_count, perm, head_group):
    """HCP of a selection (inside shard_map): into head slots, then tiles of all S for the local slots."""
    if perm is not None:
        kv_index = jnp.take(_extend(kv_index, 0, 1), perm, axis=1)
        kv_count = jnp.take(_extend(kv_count, 1, 1), perm, axis=1)
    return (
        hcp.seq_to_heads(kv_index, head_group, head_axis=1, seq_axis=2),
        hcp.seq_to_heads(kv_count, head_group, head_axis=1, seq_axis=2),
    )


def selective_capacity(
    kv_index,
    kv_count,
    *,
    mesh: Mesh,
    degrees: tuple[int, int] | None = None,
    head_perm: Any = "auto",
    hcp_slots: int | None = None,
    q_tile: int = Q_TILE,
    kv_block: int = KV_BLOCK,
) -> jax.Array:
    """The per-peer capacity `selective` needs for this selection without overflow: the largest
    number of remote KV blocks any device requests from one peer (int32 scalar), under the head
    assignment context_attention would use (same head_perm / hcp_slots). Selection bookkeeping
    only, no K/V moves: cheap enough to size the capacity before the first step."""
    n = mesh.shape["context"]
    ph, ps = degrees if degrees is not None else (1, n)
    if ph * ps != n:
        raise ValueError(f"degrees {ph} x {ps} do not multiply to the context axis size {n}")
    b, h, tiles, _ = kv_index.shape
    hcp.check_heads(h, ph)
    slots = h // ph if hcp_slots is None else int(hcp_slots)
    if isinstance(head_perm, str):
        head_perm = hcp.balance_heads(hcp.head_loads_from_counts(kv_count), ph, slots) if ph > 1 else None
    if head_perm is None:
        head_perm = jnp.arange(h, dtype=jnp.int32)
    nb_loc = tiles * q_tile // kv_block // ps  # KV blocks of one SCP device
    bspec = _batch_spec(mesh, b)
    seq_group, head_group = context_groups(n, ph, ps)

    def body(kv_index, kv_count, perm):
        if ph > 1:
            kv_index, kv_count = _selection_to_heads(kv_index, kv_count, perm, head_group)
        _, requested = scp.peer_requests(kv_index, kv_count, axis=seq_group, nb_loc=nb_loc)
        return jax.lax.pmax(jnp.max(requested), tuple(mesh.axis_names))

    spec = P(bspec, None, "context")
    return jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, P()), out_specs=P(), check_vma=False)(
        kv_index.astype(jnp.int32), kv_count.astype(jnp.int32), jnp.asarray(head_perm, jnp.int32)
    )


def _device_attention(
    args,
    *,
    ph,
    ps,
    scp_strategy,
    sm_scale,
    q_tile,
    kv_block,
    capacity,
    backend,
    impl,
    q_chunk,
    stat_axes,
    seq_group,
    head_group,
    return_lse=False,
):
    q, k, v = args["q"], args["k"], args["v"]
    heads = q.shape[2]
    kv_lens, perm = args.get("kv_lens"), args.get("perm")
    kv_mask = args.get("kv_mask")
    if kv_mask is not None:  # the whole sequence's key mask, indexed by group-global key position
        kv_mask = jax.lax.all_gather(kv_mask, "context", axis=1, tiled=True)
    kv_index, kv_count, kv_valid = args.get("kv_index"), args.get("kv_count"), args.get("kv_valid")
    sparse = kv_index is not None
    lse = None
    stats = {
        "requested_blocks": jnp.zeros((), jnp.int32),
        "overflow_blocks": jnp.zeros((), jnp.int32),
        "fallback": jnp.zeros((), jnp.int32),
    }

    if ph > 1:  # HCP: sequence shards -> head shards (heads gathered into their device's slots first)
        if perm is not None:  # head id H: an empty slot, a zero head selecting one block
            q, k, v = (jnp.take(_extend(x, 0, 2), perm, axis=2) for x in (q, k, v))
        q, k, v = (hcp.seq_to_heads(x, head_group) for x in (q, k, v))
        if sparse:
            kv_index, kv_count = _selection_to_heads(kv_index, kv_count, perm, head_group)

    if ps == 1:
        if sparse:
            out = local.sparse_local(
                q,
                k,
                v,
                kv_index,
                kv_count,
                q_tile=q_tile,
                kv_block=kv_block,
                sm_scale=sm_scale,
                impl=impl,
                kv_valid=kv_valid,
                return_lse=return_lse,
            )
        else:
            out = local.dense_local(
                q, k, v, kv_lens=kv_lens, sm_scale=sm_scale, backend=backend, kv_mask=kv_mask, return_lse=return_lse
            )
    elif scp_strategy == "allgather":
        out = scp.allgather_attention(
            q,
            k,
            v,
            axis=seq_group,
            kv_lens=kv_lens,
            kv_mask=kv_mask,
            sm_scale=sm_scale,
            backend=backend,
            kv_index=kv_index,
            kv_count=kv_count,
            q_tile=q_tile,
            kv_block=kv_block,
            impl=impl,
            kv_valid=kv_valid,
            return_lse=return_lse,
        )
    elif scp_strategy == "ring":
        out = scp.ring_attention(
            q,
            k,
            v,
            axis=seq_group,
            sm_scale=sm_scale,
            kv_lens=kv_lens,
            kv_mask=kv_mask,
            kv_index=kv_index,
            kv_count=kv_count,
            kv_valid=kv_valid,
            q_chunk=q_chunk,
            q_tile=q_tile,
            kv_block=kv_block,
            impl=impl,
        )
        out = out if return_lse else out[0]
    else:
        out, st = scp.selective_attention(
            q,
            k,
            v,
            kv_index,
            kv_count,
            axis=seq_group,
            capacity=capacity,
            sm_scale=sm_scale,
            q_tile=q_tile,
            kv_block=kv_block,
            impl=impl,
            kv_valid=kv_valid,
            return_lse=return_lse,
        )
        stats.update(st)
    if return_lse:
        out, lse = out

    if ph > 1:
        out = hcp.heads_to_seq(out, head_group)
        order = None if perm is None else jnp.argsort(perm, stable=True)[:heads]
        if order is not None:  # each head's slot (real heads occur once; empty slots sort last)
            out = jnp.take(out, order, axis=2)
        if lse is not None:
            lse = hcp.heads_to_seq(lse, head_group, head_axis=1, seq_axis=2)
            lse = lse if order is None else jnp.take(lse, order, axis=1)
    if scp_strategy == "selective" and ps > 1:  # totals over the mesh (other strategies: constant zeros)
        stats = {
            "requested_blocks": jax.lax.psum(stats["requested_blocks"], stat_axes),
            "overflow_blocks": jax.lax.psum(stats["overflow_blocks"], stat_axes),
            "fallback": jax.lax.pmax(stats["fallback"], stat_axes),
        }
    return ((out, lse) if return_lse else out), stats


@dataclasses.dataclass(frozen=True)
class ContextAttention(ContextBackend):
    """Context-parallel attention as an attention backend (a `dsv_jax.attention.context.ContextBackend`):
    pass it wherever a backend name goes (`attention(q, k, v, backend=...)`, an `AttentionPlan`'s
    `backend`, `VideoDiT(..., attention=...)`); hashable, so it is a static argument of jit / remat like a
    backend name. The trainer's `dsv_jax.parallel.policy.ContextPolicy` builds one per block when
    `parallel.context > 1`.

    Dense calls run `strategy`; a call with a selection (kv_index, kv_count) runs the sparse strategies,
    and `select_kv` computes that selection where the queries live. A dense sequence that does not divide
    over the context axis (e.g. MMDiT's joint video + text tokens) is padded at the end with keys masked
    by kv_lens, and the padded query rows are dropped."""

    mesh: Mesh
    strategy: str = "hybrid"
    backend: str = "auto"  # per-device dense attention backend
    options: tuple[tuple[str, Any], ...] = ()  # more context_attention keywords, e.g. (("degrees", (2, 4)),)

    def __call__(self, q, k, v, *, kv_lens=None, sm_scale=None, **options):
        n = self.mesh.shape["context"]
        s = q.shape[1]
        pad = -s % n
        if pad and "kv_index" not in options:
            widen = lambda x: jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0)))
            q, k, v = widen(q), widen(k), widen(v)
            kv_lens = s if kv_lens is None else jnp.minimum(jnp.asarray(kv_lens, jnp.int32), s)
            if options.get("kv_mask") is not None:
                mask = jnp.asarray(options["kv_mask"], bool)
                options["kv_mask"] = jnp.pad(mask, [(0, 0)] * (mask.ndim - 1) + [(0, pad)])
        out = context_attention(
            q,
            k,
            v,
            mesh=self.mesh,
            strategy=self.strategy,
            kv_lens=kv_lens,
            sm_scale=sm_scale,
            backend=self.backend,
            **{**dict(self.options), **options},
        )
        if not pad:
            return out
        stats = options.get("return_stats")
        result, rest = (out[0], out[1:]) if stats else (out, ())
        if options.get("return_lse"):
            result = (result[0][:, :s], result[1][:, :, :s])
        else:
            result = result[:, :s]
        return (result, *rest) if stats else result

    @property
    def token_multiple(self) -> int:
        """Token layouts pad their tile count to a multiple of this: every device holds whole tiles."""
        return self.mesh.shape["context"]

    def select_kv(self, q_lr, k_lr, top_k, keep=None, *, q_tile, kv_block, block_reduce="mean", kv_valid=None):
        """The DSV selection (as `dsv_jax.dsv.selection.select_kv`) computed where the query tiles live."""
        return select_kv_blocks(
            q_lr,
            k_lr,
            top_k,
            mesh=self.mesh,
            q_tile=q_tile,
            kv_block=kv_block,
            block_reduce=block_reduce,
            keep=keep,
            kv_valid=kv_valid,
        )

    def cross_attention(self, q, k, v, *, kv_lens=None, return_lse=False):
        """Queries sharded over `context` attending to keys every device holds (DiT's text tokens): no
        communication, so each device attends with its own queries, inside shard_map: cuDNN's
        partitioner refuses an operand sharded along the sequence. -> o (and lse [B, H, S])."""
        b, s = q.shape[:2]
        if s % self.mesh.shape["context"]:  # uneven split: let XLA partition it
            return local.dense_local(q, k, v, kv_lens=kv_lens, sm_scale=None, backend="xla", return_lse=return_lse)
        bspec = _batch_spec(self.mesh, b)
        lens = (
            jnp.full((b,), k.shape[1], jnp.int32)
            if kv_lens is None
            else jnp.broadcast_to(jnp.asarray(kv_lens, jnp.int32), (b,))
        )
        body = lambda q, k, v, lens: local.dense_local(
            q, k, v, kv_lens=lens, sm_scale=None, backend=self.backend, return_lse=return_lse
        )
        out_specs = (P(bspec, "context"), P(bspec, None, "context")) if return_lse else P(bspec, "context")
        return jax.shard_map(
            body,
            mesh=self.mesh,
            in_specs=(P(bspec, "context"), P(bspec), P(bspec), P(bspec)),
            out_specs=out_specs,
            check_vma=False,
        )(q, k, v, lens)

    def partial_attention(self, q, k, v, *, kv_mask=None):
        """Queries every device holds (MMDiT's text tokens) attending to keys sharded over `context`:
        each device attends to its own keys. -> (o [n, B, Sq, H, D], lse [n, B, H, Sq]): one partial
        result per context device, to merge by log-sum-exp (`dsv_jax.attention.merge_attention`); no
        K/V moves, only these small partials."""
        n = self.mesh.shape["context"]
        b, sk = k.shape[:2]
        if sk % n:
            raise ValueError(f"keys of length {sk} do not split over the {n} context devices")
        bspec = _batch_spec(self.mesh, b)
        mask = jnp.ones((b, sk), bool) if kv_mask is None else jnp.broadcast_to(jnp.asarray(kv_mask, bool), (b, sk))

        def body(q, k, v, mask):
            o, lse = local.dense_local(
                q, k, v, kv_lens=None, sm_scale=None, backend=self.backend, kv_mask=mask, return_lse=True
            )
            return o[None], lse[None]

        return jax.shard_map(
            body,
            mesh=self.mesh,
            in_specs=(P(bspec), P(bspec, "context"), P(bspec, "context"), P(bspec, "context")),
            out_specs=(P("context", bspec), P("context", bspec)),
            check_vma=False,
        )(q, k, v, mask)

    def constrain(self, x):
        """Keep a [B, S, ...] activation sharded as the attention wants it: batch over (data, fsdp), sequence
        over context."""
        axes, dp = _batch_axes(self.mesh)
        if x.shape[1] % self.mesh.shape["context"] or x.shape[0] % dp:
            return x
        spec = P(axes, "context", *([None] * (x.ndim - 2)))
        return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(self.mesh, spec))

    # -- metrics --------------------------------------------------------------------------------
    def resolve(self, seq_len: int, heads: int, head_dim: int, batch: int, itemsize: int = 2):
        """(hcp, scp, scp_strategy) this plan runs for a (dense) call of this shape."""
        opts = dict(self.options)
        n = self.mesh.shape["context"]

        def plan_fn():
            from dsv_jax.parallel.planner import default_plan

            return default_plan(
                seq_len=seq_len,
                heads=heads,
                head_dim=head_dim,
                batch=batch,
                devices=n,
                sparse=False,
                sparsity=opts.get("sparsity"),
                dtype_bytes=itemsize,
            )

        return resolve_degrees(
            self.strategy, n, degrees=opts.get("degrees"), scp_strategy=opts.get("scp"), plan_fn=plan_fn
        )


ContextPlan = ContextAttention  # the earlier name (issue text, user code)
