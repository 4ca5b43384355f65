"""Hybrid context-parallel planner: per block, the HCP x SCP factorisation with the fastest slowest device.

    plan = plan_attention(Workload(seq_len=..., heads=16, head_dim=128, head_sparsity=s_h),
                          devices=64, hardware=Hardware(), kernels=KernelModel.from_json(path))
    plan.hcp, plan.scp, plan.scp_strategy, plan.time_s

A candidate is (HCP degree d_h, SCP degree d_s = n / d_h, SCP strategy). Its time is the slowest
device's attention compute (its heads, by the measured kernel rate at that work size) plus the
communication of `comm.context_bytes` over the links its groups span. HCP groups are neighbouring
devices (NVLink inside a node); SCP groups stride by d_h and cross nodes (InfiniBand) once
d_h * d_s exceeds a node. The ring overlaps each hop with the previous block; the all-to-alls and
all-gathers do not overlap. Candidates whose attention memory exceeds the cap are dropped.
Everything is a pure function of its inputs (numpy only), cheap to call per block and per step.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field

import numpy as np

from dsv_jax.model.flops import ATTENTION_FWD_BWD
from dsv_jax.parallel.comm import context_bytes
from dsv_jax.parallel.hcp import balance_heads_host
from pallas_kernels.defaults import KV_BLOCK, Q_TILE


@dataclass(frozen=True)
class Hardware:
    """Link bandwidths per GPU and direction (GB/s = 1e9 B/s), achieved fraction, memory.

    Defaults: H200 SXM nodes of 8 GPUs; NVLink 4 is 900 GB/s bidirectional per GPU (450 each way);
    8 x 400 Gb/s InfiniBand NDR per node is 50 GB/s per GPU each way."""

    nvlink_gbps: float = 450.0
    ib_gbps: float = 50.0
    efficiency: float = 0.8  # share of the link rate collectives reach (NCCL bus bandwidth)
    gpus_per_node: int = 8
    memory_bytes: float = 141e9
    hop_latency_s: float = 15e-6  # per collective step


@dataclass(frozen=True)
class KernelModel:
    """Attention kernel rates from measurements, as (seq_len, fwd_ms, fwd_bwd_ms) at `heads` x `head_dim`
    (batch 1) for dense, and (seq_len, sparsity, fwd_ms, fwd_bwd_ms) for the sparse kernel. Work
    between measured sizes interpolates the achieved FLOP rate in log(work); outside, the nearest."""

    heads: int = 16
    head_dim: int = 128
    dense: tuple[tuple[float, float, float], ...] = ()
    sparse: tuple[tuple[float, float, float, float], ...] = ()
    ring_block: tuple[tuple[float, float, float], ...] = ()  # the ring's plain-JAX block with LSE
    dense_tflops: float = 585.0  # used where nothing is measured: cuDNN on the H200 (docs/architecture.md)
    sparse_efficiency: float = 0.6  # sparse kernel FLOP rate over dense, where nothing is measured
    source: str = "modelled"

    @classmethod
    def from_json(cls, path: str) -> "KernelModel":
        with open(path) as f:
            d = json.load(f)
        d = d.get("kernel_model", d)
        fields = {f.name for f in dataclasses.fields(cls)}
        d = {k: tuple(tuple(r) for r in v) if isinstance(v, list) else v for k, v in d.items() if k in fields}
        return cls(**d)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def _rate(self, rows, work, fallback):
        """FLOP/s of fwd+bwd at `work` (= Sq * Sk * heads * D kept) from rows of (work, flops, seconds)."""
        if not rows:
            return fallback
        w = np.array([r[0] for r in rows])
        rate = np.array([r[1] / r[2] for r in rows])
        order = np.argsort(w)
        return float(np.interp(np.log(work), np.log(w[order]), rate[order]))

    def _rows(self, kind):
        out = []
        if kind == "dense":
            for s, _, fb in self.dense:
                work = s * s * self.heads * self.head_dim
                out.append((work, 4 * ATTENTION_FWD_BWD * work, fb * 1e-3))
        elif kind == "ring":
            for s, _, fb in self.ring_block:
                work = s * s * self.heads * self.head_dim
                out.append((work, 4 * ATTENTION_FWD_BWD * work, fb * 1e-3))
        else:
            for s, sp, _, fb in self.sparse:
                work = s * s * self.heads * self.head_dim * (1 - sp)
                out.append((work, 4 * ATTENTION_FWD_BWD * work, fb * 1e-3))
        return out

    def attention_s(self, q_len, k_len, head_keep, head_dim, *, kind="dense", forward_only=False) -> float:
        """Seconds of fwd+bwd (or forward) attention of q_len queries over k_len keys for heads whose
        kept fractions are `head_keep` (1 = dense), as one kernel launch."""
        kept = q_len * k_len * head_dim * float(np.sum(head_keep))
        if kept <= 0:
            return 0.0
        dense_rate = self.dense_tflops * 1e12
        if kind == "sparse":
            fallback = self._rate(self._rows("dense"), kept, dense_rate) * self.sparse_efficiency
            rate = self._rate(self._rows("sparse"), kept, fallback)
        elif kind == "ring":
            rate = self._rate(self._rows("ring"), kept, self._rate(self._rows("dense"), kept, dense_rate))
        else:
            rate = self._rate(self._rows("dense"), kept, dense_rate)
        t = 4 * ATTENTION_FWD_BWD * kept / rate
        return t / ATTENTION_FWD_BWD if forward_only else t


@dataclass(frozen=True)
class Workload:
    """One block's attention. head_sparsity: per-head fraction of skipped KV (None or all 0: dense).

    needed_factor: a device needs min(1, needed_factor * (1 - s_h)) of a peer's KV blocks of head h
    (the union of its query tiles' selections; 1 when neighbouring query tiles share their critical KV).
    recompute_forward: remat recomputes the block's forward (its attention and collectives) in backward."""

    seq_len: int
    heads: int
    head_dim: int
    batch: int = 1
    itemsize: int = 2
    head_sparsity: tuple[float, ...] | None = None
    needed_factor: float = 1.0
    q_tile: int = Q_TILE
    kv_block: int = KV_BLOCK
    top_k: int = 0
    recompute_forward: bool = True

    @property
    def sparse(self) -> bool:
        return self.head_sparsity is not None and any(s > 0 for s in self.head_sparsity)

    @property
    def keep(self) -> np.ndarray:
        if self.head_sparsity is None:
            return np.ones(self.heads)
        s = np.asarray(self.head_sparsity, np.float64)
        if s.shape != (self.heads,):
            raise ValueError(f"head_sparsity has {s.shape[0]} entries for {self.heads} heads")
        return 1.0 - s


@dataclass(frozen=True)
class Cost:
    hcp: int
    scp: int
    scp_strategy: str
    time_s: float
    compute_s: float  # slowest device
    comm_s: float  # exposed communication of the slowest device
    bytes_sent: float  # per device, forward + backward (+ recomputed forward)
    memory_bytes: float  # attention working set per device
    device_loads: tuple[float, ...] = ()
    fits: bool = True
    hcp_slots: int = 0  # head slots per HCP device (heads / hcp: equal heads per device)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Placement:
    """Where one block's attention runs on the context axis: HCP degree x SCP degree and the SCP strategy,
    with the cost that chose it (and the other candidates, for reports)."""

    hcp: int
    scp: int
    scp_strategy: str
    cost: Cost
    candidates: tuple[Cost, ...] = field(default=(), repr=False)

    @property
    def hcp_slots(self) -> int:
        return self.cost.hcp_slots

    @property
    def time_s(self) -> float:
        return self.cost.time_s

    @property
    def strategy(self) -> str:
        """The context_attention strategy that runs this plan."""
        if self.scp == 1:
            return "ulysses"
        return self.scp_strategy if self.hcp == 1 else "hybrid"


def _link_time(nbytes, group: int, stride: int, hw: Hardware, pattern: str) -> float:
    """Seconds to send nbytes per device in a collective over `group` devices spaced `stride` apart."""
    if group <= 1 or nbytes <= 0:
        return 0.0
    nvl, ib = hw.nvlink_gbps * 1e9 * hw.efficiency, hw.ib_gbps * 1e9 * hw.efficiency
    per_node = max(1, hw.gpus_per_node // stride) if stride < hw.gpus_per_node else 1
    if group * stride <= hw.gpus_per_node:
        return nbytes / nvl
    if pattern in ("ring", "allgather"):  # ring-ordered transfers: the node-crossing hop sets the pace
        return nbytes / ib
    on = (min(per_node, group) - 1) / (group - 1)  # all-to-all: peers on the same node go over NVLink
    return max(nbytes * on / nvl, nbytes * (1 - on) / ib)


def candidate_cost(
    w: Workload,
    hcp: int,
    scp: int,
    scp_strategy: str,
    hw: Hardware,
    km: KernelModel,
    *,
    rebalance: bool = True,
    memory_cap: float | None = None,
    slots: int | None = None,
) -> Cost:
    """Cost of one candidate; slots: head slots per HCP device (sparse; default heads / hcp)."""
    keep = w.keep
    sparse = w.sparse
    slots = w.heads // hcp if slots is None else slots
    groups = balance_heads_host(keep, hcp, rebalance, slots if rebalance else None)
    nb = w.seq_len // w.kv_block
    # an empty slot is a zero head selecting one block per tile
    loads = tuple(float(np.sum(keep[g])) + (slots - len(g)) / nb for g in groups)
    q_len = w.seq_len // scp
    passes = 1 + (1 / ATTENTION_FWD_BWD if w.recompute_forward else 0)  # fwd + bwd (+ recomputed fwd)

    # Compute of each HCP group (SCP peers of a group hold the same heads and equal query counts).
    def group_compute(g):
        kg = keep[g]
        # ps blocks of (S/ps x S/ps) costed as dense work, an upper bound for a selection, whose chunks run the
        # sparse kernel: its rate on a chunk's share and the per-chunk costs (ps launches, work lists) are not
        # measured on several GPUs, and costed at the kernel's rate the ring (all of K/V on the wire, hidden
        # behind compute) would displace selective (a tenth of the bytes) on one node by a modelled 7%.
        # So a sparse block takes the ring only where nothing else fits the memory cap.
        if scp > 1 and scp_strategy == "ring":
            return scp * km.attention_s(q_len, w.seq_len // scp, np.ones(len(g)), w.head_dim, kind="ring") * passes
        kind = "sparse" if sparse else "dense"
        if sparse:
            kg = np.concatenate([kg, np.full(slots - len(g), 1 / nb)])
        return km.attention_s(q_len, w.seq_len, kg if sparse else np.ones(len(g)), w.head_dim, kind=kind) * passes

    per_group = [w.batch * group_compute(g) for g in groups]
    compute = max(per_group)

    nb_loc = w.seq_len // scp // w.kv_block
    need = np.minimum(1.0, w.needed_factor * keep)
    capacity = (
        max(int(math.ceil(w.batch * nb_loc * (float(np.sum(need[g])) + (slots - len(g)) / nb))) for g in groups)
        if sparse
        else 0
    )
    b = context_bytes(
        hcp=hcp,
        scp=scp,
        scp_strategy=scp_strategy,
        batch=w.batch,
        seq_len=w.seq_len,
        heads=w.heads,
        head_dim=w.head_dim,
        itemsize=w.itemsize,
        sparse=sparse,
        top_k=w.top_k,
        q_tile=w.q_tile,
        kv_block=w.kv_block,
        capacity=capacity,
        hcp_slots=slots,
    )
    again = 1 if w.recompute_forward else 0
    hcp_bytes = b["hcp_forward"] * (1 + again) + b["hcp_backward"]
    scp_bytes = b["scp_forward"] * (1 + again) + b["scp_backward"]
    t_hcp = _link_time(hcp_bytes, hcp, 1, hw, "all_to_all") + (4 * (1 + again) + 4) * hw.hop_latency_s * (hcp > 1)
    pattern = {"ring": "ring", "allgather": "allgather", "selective": "all_to_all"}[scp_strategy]
    t_scp = _link_time(scp_bytes, scp, hcp, hw, pattern)
    if scp > 1 and scp_strategy == "ring":
        steps = (2 + again) * scp  # ring passes: forward, recomputed forward, backward
        t_scp += steps * hw.hop_latency_s
        exposed = max(0.0, t_scp - compute)  # hops overlap the blocks
        time = compute + t_hcp + exposed
        comm = t_hcp + exposed
    else:
        t_scp += (3 + again) * hw.hop_latency_s * (scp > 1)
        comm = t_hcp + t_scp
        time = compute + comm

    x = w.batch * (w.seq_len // scp) * slots * w.head_dim * w.itemsize  # q/k/v/o per device after HCP
    mem = 8 * x  # q, k, v, o and their gradients
    if scp > 1:
        if scp_strategy == "allgather":
            mem += 4 * x * scp  # gathered K, V and their gradients
        elif scp_strategy == "ring":
            mem += 2 * x + 2 * x * 4 / w.itemsize + 3 * min(q_len, 1024) * q_len * slots * 4 * w.batch
        else:
            mem += 4 * scp * capacity * w.kv_block * w.head_dim * w.itemsize
    fits = memory_cap is None or mem <= memory_cap
    return Cost(hcp, scp, scp_strategy, time, compute, comm, hcp_bytes + scp_bytes, mem, loads, fits, slots)


def factorisations(devices: int, heads: int) -> list[tuple[int, int]]:
    """(HCP, SCP) degree pairs: HCP degree divides both the device count and the head count."""
    return [(h, devices // h) for h in range(1, devices + 1) if devices % h == 0 and heads % h == 0]


def plan_attention(
    w: Workload,
    devices: int,
    hardware: Hardware | None = None,
    kernels: KernelModel | None = None,
    *,
    memory_cap: float | None = None,
    rebalance: bool = True,
    strategies: tuple[str, ...] | None = None,
) -> Placement:
    """The fastest factorisation of `devices` for this block; ties go to fewer bytes, then more HCP."""
    hw, km = hardware or Hardware(), kernels or KernelModel()
    if strategies is None:
        strategies = ("selective", "allgather", "ring") if w.sparse else ("ring", "allgather")
    cands = []
    for ph, ps in factorisations(devices, w.heads):
        equal = w.heads // ph
        # sparse HCP: also uneven head counts (extra slots, up to twice the equal share)
        slot_options = range(equal, min(w.heads, 2 * equal) + 1) if w.sparse and ph > 1 and rebalance else (equal,)
        for s in strategies if ps > 1 else ("allgather",):
            for slots in slot_options:
                cands.append(
                    candidate_cost(w, ph, ps, s, hw, km, rebalance=rebalance, memory_cap=memory_cap, slots=slots)
                )
    fitting = [c for c in cands if c.fits]
    if not fitting:
        least = min(cands, key=lambda c: c.memory_bytes)
        raise ValueError(
            f"no context-parallel plan of {devices} devices fits the memory cap {memory_cap:.3g} B "
            f"for S={w.seq_len}; the smallest needs {least.memory_bytes:.3g} B "
            f"(HCP {least.hcp} x SCP {least.scp} {least.scp_strategy})"
        )
    best = min(fitting, key=lambda c: (round(c.time_s, 12), c.bytes_sent, -c.hcp, c.hcp_slots))
    return Placement(best.hcp, best.scp, best.scp_strategy, best, tuple(cands))


def default_plan(*, seq_len, heads, head_dim, batch, devices, sparse, sparsity=None, dtype_bytes=2):
    """((hcp, scp), scp_strategy) for a call without explicit degrees: default hardware and kernel
    model; sparsity (a float or per-head tuple) defaults to 0.9 for a sparse call."""
    if sparse:
        s = 0.9 if sparsity is None else sparsity
        hs = tuple(float(x) for x in np.broadcast_to(np.asarray(s, np.float64), (heads,)))
    else:
        hs = None
    w = Workload(seq_len=seq_len, heads=heads, head_dim=head_dim, batch=batch, itemsize=dtype_bytes, head_sparsity=hs)
    p = plan_attention(w, devices)
    return (p.hcp, p.scp), p.scp_strategy
