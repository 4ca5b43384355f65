"""Context parallelism for any attention policy: every block's attention runs over the `context` axis.

`ContextPolicy` wraps the run's policy (a static one, or the DSV controller) and gives each block's
plan a `ContextAttention` backend:

  - dense attention (a backend name, DSV stage 1, a block the controller keeps dense): the configured
    strategy (`parallel.context_strategy`; hybrid: HCP x SCP from the planner for dense attention);
  - sparse attention (a DSV block in stage 2, the window baseline): a placement of its own from
    `planner.plan_attention` (HCP degree x SCP degree, ring / all-gather / selective) for the block's
    per-head keep ratios (the controller's measurements), with HCP heads rebalanced by selected work
    at run time and selective SCP fetching only the selected KV blocks.

A placement is decided the first time a block's static plan appears (that step compiles anyway) and
then kept for that plan, so placements never add compilations to the controller's rungs. They are
part of the checkpointed policy state: a resumed run compiles the same programs. Every process of a
multi-host run computes the same placements from the same (global) measurements.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax.numpy as jnp
import numpy as np

from dsv_jax.config import ConfigError
from dsv_jax.dsv.plan import AttentionPlan, sparse_modes
from dsv_jax.model.layers import compute_dtype
from dsv_jax.model.tokens import grid_shape, token_layout
from dsv_jax.parallel.comm import context_bytes
from dsv_jax.parallel.context import ContextAttention
from dsv_jax.parallel.planner import Hardware, KernelModel, Workload, candidate_cost, plan_attention

SCP_SPARSE = ("selective", "allgather", "ring")
# Selective SCP reserves this multiple of a block's keep ratio of each peer's KV blocks (the union of a
# device's query tiles' selections); a step that needs more takes the exact all-gather path, counted.
CAPACITY_FACTOR = 2.0


def _key(shape) -> str:
    return "x".join(str(int(v)) for v in shape)


class ContextPolicy:
    """`inner`'s plans, each on a context-parallel backend over `mesh` (see the module docstring).

    batch_size(shape) -> global batch of a bucket (the placements are per device: divided by the
    data-parallel size here)."""

    def __init__(
        self,
        inner,
        cfg,
        mesh,
        batch_size: Callable[[Any], int],
        *,
        hardware: Hardware | None = None,
        kernels: KernelModel | None = None,
    ):
        self.inner, self.cfg, self.mesh = inner, cfg, mesh
        self.n = mesh.shape["context"]
        self.dp = math.prod(mesh.shape[a] for a in mesh.axis_names if a != "context")
        self.batch_size = batch_size
        self.hardware, self.kernels = hardware or Hardware(), kernels or KernelModel()
        self.placements: dict[str, dict[str, Any]] = {}  # "shape|block|plan key" -> placement
        self._events: list[str] = []
        p = cfg.parallel
        strategy = p.context_strategy
        options = ()
        if p.hcp_degree:  # a forced HCP degree: hybrid with those degrees for dense attention too
            strategy, options = "hybrid", (("degrees", (p.hcp_degree, self.n // p.hcp_degree)), ("scp", "ring"))
        elif strategy == "selective":  # selective exchanges selected blocks: dense blocks gather K/V
            strategy = "allgather"
        self.dense_strategy, self.dense_options = strategy, options

    # -- the policy interface ------------------------------------------------------------------------
    def plans(self, shape, *, train: bool = True, profile: bool = False, step: int | None = None):
        plans = self.inner.plans(shape, train=train, profile=profile, step=step)
        inputs = self.inner.inputs(shape, train=False)
        keep = None if inputs is None else np.asarray(inputs.get("keep"), np.float64)
        if isinstance(plans, (list, tuple)):
            return tuple(self._on_context(shape, i, p, None if keep is None else keep[i]) for i, p in enumerate(plans))
        return self._on_context(shape, None, plans, None if keep is None else keep[0])

    def inputs(self, shape, *, train: bool = True, step: int | None = None):
        return self.inner.inputs(shape, train=train, step=step)

    def profile_due(self, step: int, shape) -> bool:
        return self.inner.profile_due(step, shape)

    def before_step(self, step: int) -> list[str]:
        return self.inner.before_step(step) + self._drain()

    def observe(self, step: int, shape, metrics: dict[str, Any]) -> list[str]:
        return self.inner.observe(step, shape, metrics) + self._drain()

    def record(self, shape, *, step: int | None = None, profile: bool = False) -> dict[str, Any]:
        """The inner policy's scalars plus the bytes each device sends per step in attention."""
        rec = dict(self.inner.record(shape, step=step, profile=profile))
        plans = self.inner.plans(shape)
        per_block = isinstance(plans, (list, tuple))
        blocks = plans if per_block else [plans] * self.cfg.model.depth
        rec["cp/bytes_per_step"] = float(
            sum(self._bytes(shape, i if per_block else None, p) for i, p in enumerate(blocks))
        )
        return rec

    def summary(self, shapes) -> dict[str, Any]:
        """Logged once at the start: per bucket, the dense placement and the bytes one device sends in
        one dense attention call (forward + backward)."""
        out = {}
        for shape in shapes:
            (ph, ps, strategy), parts = self._dense_parts(shape)
            out[f"cp/{_key(shape)}/plan"] = f"{ph}x{ps} {strategy if ps > 1 else 'ulysses'}"
            out[f"cp/{_key(shape)}/bytes_per_layer"] = float(parts["total"])
        return {**self.inner.summary(shapes), **out}

    def run_summary(self, costs: dict[str, float] | None = None) -> dict[str, Any]:
        return self.inner.run_summary(costs)

    def state_dict(self) -> dict[str, Any] | None:
        inner = self.inner.state_dict()
        if inner is None and not self.placements:
            return None
        return {**(inner or {}), "context_placements": self.placements}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)
        self.placements = {k: dict(v) for k, v in (state.get("context_placements") or {}).items()}

    # -- placements ----------------------------------------------------------------------------------
    def _dense(self, backend: str = "auto") -> ContextAttention:
        return ContextAttention(self.mesh, self.dense_strategy, backend=backend, options=self.dense_options)

    def _on_context(self, shape, block, plan, keep_heads):
        if isinstance(plan, str):
            return self._dense(plan)
        if not isinstance(plan, AttentionPlan):
            raise TypeError(f"context parallelism got an attention plan of type {type(plan).__name__}")
        dense_name = plan.backend if isinstance(plan.backend, str) else "auto"
        if not plan.sparse:
            return dataclasses.replace(plan, backend=self._dense(dense_name))
        key = _placement_key(shape, block, plan)
        if key not in self.placements:
            self.placements[key] = self._place(shape, plan, keep_heads)
            p = self.placements[key]
            where = "every block" if block is None else f"block {block}"
            self._events.append(
                f"context parallel {_key(shape)} {where}: {p['hcp']}x{p['scp']} {p['scp_strategy']}"
                f" ({p['bytes'] / 1e6:.1f} MB sent per device per step)"
            )
        p = self.placements[key]
        options = (
            ("degrees", (int(p["hcp"]), int(p["scp"]))),
            ("scp", p["scp_strategy"]),
            ("hcp_slots", int(p["slots"])),
            ("capacity", float(p["capacity"])),
        )
        return dataclasses.replace(
            plan, backend=ContextAttention(self.mesh, "hybrid", backend=dense_name, options=options)
        )

    def _place(self, shape, plan, keep_heads) -> dict[str, Any]:
        """The planner's placement of one sparse block (HCP x SCP, SCP strategy, head slots, capacity)."""
        m = self.cfg.model
        layout = token_layout(grid_shape(tuple(shape), m.patch), m.tile)
        load = plan.cp_workload(layout, m.heads, keep_heads)
        keep = load.keep
        w = Workload(
            seq_len=layout.seq_len,
            heads=m.heads,
            head_dim=m.head_dim,
            batch=self._local_batch(shape),
            itemsize=self._itemsize(),
            head_sparsity=tuple(float(1 - k) for k in keep),
            q_tile=load.q_tile,
            kv_block=load.kv_block,
            top_k=load.top_k,
            recompute_forward=m.remat,
            needed_factor=CAPACITY_FACTOR,
        )
        forced = self.cfg.parallel
        if forced.hcp_degree or forced.context_strategy != "hybrid":
            ph = forced.hcp_degree or (self.n if forced.context_strategy == "ulysses" else 1)
            strategies = (forced.context_strategy,) if forced.context_strategy in SCP_SPARSE else SCP_SPARSE
            cands = [candidate_cost(w, ph, self.n // ph, st, self.hardware, self.kernels) for st in strategies]
            best = min(cands, key=lambda c: c.time_s)
        else:
            best = plan_attention(w, self.n, self.hardware, self.kernels).cost
        # of a peer's KV blocks over all rows, as the planner counts it; overflow takes the exact path
        capacity = float(np.mean(np.minimum(1.0, CAPACITY_FACTOR * keep)))
        return {
            "hcp": best.hcp,
            "scp": best.scp,
            "scp_strategy": best.scp_strategy if best.scp > 1 else "ulysses",
            "slots": best.hcp_slots,
            "capacity": capacity,
            "bytes": float(best.bytes_sent),
            "time_s": float(best.time_s),
        }

    def _bytes(self, shape, block, plan) -> float:
        """Bytes one device sends per step in one block's attention (forward, backward, remat forward)."""
        if isinstance(plan, AttentionPlan) and plan.sparse:
            return float(self.placements.get(_placement_key(shape, block, plan), {}).get("bytes", 0.0))
        _, parts = self._dense_parts(shape)
        again = 1 if self.cfg.model.remat else 0
        return float(parts["hcp_forward"] + parts["scp_forward"]) * (1 + again) + float(
            parts["hcp_backward"] + parts["scp_backward"]
        )

    def _dense_parts(self, shape):
        """((hcp, scp, scp_strategy), comm.context_bytes parts) of dense attention on a bucket."""
        m = self.cfg.model
        s, b = self._seq_len(shape), self._local_batch(shape)
        ph, ps, strategy = self._dense().resolve(s, m.heads, m.head_dim, b, self._itemsize())
        parts = context_bytes(
            hcp=ph,
            scp=ps,
            scp_strategy=strategy,
            batch=b,
            seq_len=s,
            heads=m.heads,
            head_dim=m.head_dim,
            itemsize=self._itemsize(),
        )
        return (ph, ps, strategy), parts

    def _seq_len(self, shape) -> int:
        """Tokens a device group attends over densely: dense steps keep raster order, unpadded (dsv.plan.tiled)."""
        m = self.cfg.model
        s = token_layout(grid_shape(tuple(shape), m.patch), (1, 1, 1)).seq_len
        if m.arch == "mmdit":  # joint video + text sequence
            s += self.cfg.text.max_len
        return s + (-s % self.n)

    def _local_batch(self, shape) -> int:
        return max(1, self.batch_size(shape) // self.dp)

    def _itemsize(self) -> int:
        return jnp.dtype(compute_dtype(self.cfg.model)).itemsize

    def _drain(self) -> list[str]:
        out, self._events = self._events, []
        return out


def _placement_key(shape, block, plan: AttentionPlan) -> str:
    """One placement per (bucket, block, static sparse plan): what a compiled variant is keyed by."""
    return f"{_key(shape)}|{'all' if block is None else block}|{plan.placement_tag()}"


def check_context(cfg, mesh, shapes) -> None:
    """Stop before compiling a context-parallel run that cannot work, naming the numbers."""
    n, m = mesh.shape["context"], cfg.model
    d = cfg.parallel.hcp_degree
    if d and (n % d or m.heads % d):
        raise ConfigError(f"parallel.hcp_degree={d} must divide both parallel.context={n} and model.heads={m.heads}")
    sparse = cfg.attention in sparse_modes()
    for shape in shapes:
        layout = token_layout(grid_shape(tuple(shape), m.patch), m.tile)
        s, tile = layout.seq_len, layout.tile_size
        name = "x".join(map(str, shape))
        if s < n:
            raise ConfigError(f"bucket {name}: {s} tokens cannot be split over parallel.context={n} devices")
        if not sparse:
            continue
        if s < n * tile:
            raise ConfigError(
                f"bucket {name}: {s} tokens are fewer than parallel.context={n} x the {tile}-token "
                f"tile (model.tile={tuple(m.tile)}); use fewer context devices or longer clips"
            )
        block = max(tile, cfg.dsv.kv_block)
        if s % (n * block):
            raise ConfigError(
                f"bucket {name}: {s} tokens do not split into whole {block}-token tiles over "
                f"parallel.context={n} devices ({s / (n * block):.2f} tiles each)"
            )
